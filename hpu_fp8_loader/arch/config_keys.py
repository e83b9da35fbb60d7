"""Reading the config.json keys both architectures share, with errors that name the key."""

from __future__ import annotations

from ..errors import ConfigError

__all__ = ["common_sizes", "head_dim", "required_int"]


def required_int(config: dict, key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.json: '{key}' must be a positive integer, got {value!r}")
    return value


def head_dim(config: dict) -> int:
    """head_dim from config when present and not null, else hidden_size / num_attention_heads."""
    if config.get("head_dim") is not None:
        return required_int(config, "head_dim")
    hidden, heads = required_int(config, "hidden_size"), required_int(config, "num_attention_heads")
    if hidden % heads:
        raise ConfigError(f"config.json: hidden_size {hidden} is not divisible by num_attention_heads {heads}; set head_dim")
    return hidden // heads


def common_sizes(config: dict) -> dict:
    """The shape-defining keys every supported architecture has."""
    heads = required_int(config, "num_attention_heads")
    kv_heads = int(config.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ConfigError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    return {
        "hidden_size": required_int(config, "hidden_size"),
        "num_layers": required_int(config, "num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "vocab_size": required_int(config, "vocab_size"),
        "intermediate_size": required_int(config, "intermediate_size"),
    }

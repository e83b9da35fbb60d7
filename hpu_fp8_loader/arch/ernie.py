"""ERNIE-4.5: the MoE models (ernie4_5_moe) and the dense ones (ernie4_5)."""

from __future__ import annotations

from ..errors import ConfigError
from .base import ModelDescriptor, MoeConfig
from .config_keys import common_sizes, head_dim, required_int

__all__ = ["ernie_dense", "ernie_moe"]


def _moe(config: dict, num_layers: int) -> MoeConfig:
    experts = required_int(config, "moe_num_experts")
    end = config.get("moe_layer_end_index", num_layers - 1)
    end = num_layers - 1 if end in (None, -1) else int(end)
    interval = int(config.get("moe_layer_interval", 1))
    if interval < 1:
        raise ConfigError(f"config.json: moe_layer_interval {interval} must be >= 1")
    return MoeConfig(
        num_experts=experts,
        top_k=required_int(config, "moe_k"),
        intermediate_size=required_int(config, "moe_intermediate_size"),
        num_shared_experts=int(config.get("moe_num_shared_experts") or 0),
        start=int(config.get("moe_layer_start_index", 1)),
        end=end,
        interval=interval,
        correction_bias=bool(config.get("moe_use_aux_free", True)),
    )


def _ernie(config: dict, model_type: str, architecture: str, moe: bool) -> ModelDescriptor:
    if config.get("use_bias"):
        raise ConfigError("config.json: use_bias=true ERNIE models are not supported (no released model uses it)")
    common = common_sizes(config)
    return ModelDescriptor(
        model_type=model_type,
        architecture=architecture,
        prefix="ernie",
        head_dim=head_dim(config),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        qkv_bias=False,
        moe=_moe(config, common["num_layers"]) if moe else None,
        **common,
    )


def ernie_moe(config: dict) -> ModelDescriptor:
    return _ernie(config, "ernie4_5_moe", "Ernie4_5_MoeForCausalLM", moe=True)


def ernie_dense(config: dict) -> ModelDescriptor:
    return _ernie(config, "ernie4_5", "Ernie4_5ForCausalLM", moe=False)

"""Tensor and module names of the spec, and FastDeploy's measurement keys for the same points.

Everything else asks this module for a name ("the act_amax tensor of this module") instead of
building strings itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "ACT_AMAX",
    "ACT_SCALE",
    "ATTENTION_POINTS",
    "BIAS",
    "COPIED_SOURCE_FILES",
    "DOWN",
    "MODULE_PATTERN",
    "PLAIN_NUMBER",
    "UP_GATE",
    "WEIGHT",
    "WEIGHT_SCALE",
    "LayerNames",
    "attention_point",
    "attention_point_of",
    "embedding",
    "expert",
    "expert_of",
    "expert_tokens_key",
    "fastdeploy_key_from_module",
    "final_norm",
    "is_act_module",
    "layer",
    "layer_names",
    "module_from_fastdeploy_key",
    "scale_name",
    "shared_expert_input",
    "tensor",
]

WEIGHT = "weight"
WEIGHT_SCALE = "weight_scale"
ACT_SCALE = "act_scale"
ACT_AMAX = "act_amax"
BIAS = "bias"

# Spec point name -> FastDeploy measurement-mode module name (docs/fastdeploy.md section 10, "Measurement mode").
# The source files a checkpoint carries over unchanged (docs/spec.md section 1): tokenizer and generation
# files, by name. Nothing else is copied: no pickle (pytorch_model.bin, training_args.bin, optimizer.pt),
# no notes or scripts, nothing that only a link from the source reaches.
COPIED_SOURCE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "generation_config.json", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
ATTENTION_POINTS = {"cache_k": "cachek_matmul", "cache_v": "cachev_matmul", "q": "q_matmul", "s": "s_matmul"}
_FASTDEPLOY_POINTS = {fd: spec for spec, fd in ATTENTION_POINTS.items()}
_FASTDEPLOY_SUFFIX = ".activation_scale"


def tensor(module: str, suffix: str) -> str:
    """``module.suffix``: the one way a tensor name is formed from a module name."""
    return f"{module}.{suffix}"


def scale_name(name: str) -> str:
    """The ``X.weight_scale`` beside an FP8 ``X.weight``: the spec's name, and compressed-tensors' too."""
    return name.removesuffix("weight") + "weight_scale"


UP_GATE = "up_gate_proj"  # the fused gate|up projection of an MLP or expert
DOWN = "down_proj"


def embedding(prefix: str) -> str:
    return f"{prefix}.embed_tokens"


def final_norm(prefix: str) -> str:
    return f"{prefix}.norm"


def layer(prefix: str, index: int) -> str:
    return f"{prefix}.layers.{index}"


@dataclass(frozen=True)
class LayerNames:
    """The module paths inside one decoder layer: the one place a layer's inside is spelled.

    ERNIE-4.5, Qwen2 and Qwen3 share these paths in the spec's (Paddle) layout (Qwen3 adds ``q_norm`` and
    ``k_norm``); the descriptor, the reference engine, the emulation and the FastDeploy mapping all ask here.

    Example:
        >>> layer_names("qwen2", 0).qkv
        'qwen2.layers.0.self_attn.qkv_proj'
        >>> layer_names("ernie", 3).expert(7)
        'ernie.layers.3.mlp.experts.7'
    """

    base: str

    @property
    def input_norm(self) -> str:
        return f"{self.base}.input_layernorm"

    @property
    def post_attention_norm(self) -> str:
        return f"{self.base}.post_attention_layernorm"

    @property
    def qkv(self) -> str:
        return f"{self.base}.self_attn.qkv_proj"

    @property
    def o_proj(self) -> str:
        return f"{self.base}.self_attn.o_proj"

    @property
    def q_norm(self) -> str:
        """Qwen3's RMSNorm over each query head (weight ``[head_dim]``), applied before RoPE."""
        return f"{self.base}.self_attn.q_norm"

    @property
    def k_norm(self) -> str:
        """Qwen3's RMSNorm over each key head (weight ``[head_dim]``), applied before RoPE."""
        return f"{self.base}.self_attn.k_norm"

    def attention_point(self, point: str) -> str:
        """Activation point of the attention: ``cache_k``, ``cache_v``, ``q`` or ``s``."""
        if point not in ATTENTION_POINTS:
            raise ValueError(f"unknown attention point {point!r}")
        return f"{self.base}.self_attn.{point}"

    @property
    def mlp(self) -> str:
        return f"{self.base}.mlp"

    @property
    def router(self) -> str:
        return f"{self.base}.mlp.gate"

    @property
    def score_bias(self) -> str:
        """ERNIE's aux-free routing bias (a tensor, not a module)."""
        return f"{self.base}.mlp.moe_statics.e_score_correction_bias"

    @property
    def experts(self) -> str:
        return f"{self.base}.mlp.experts"

    def expert(self, expert_id: int) -> str:
        return f"{self.experts}.{expert_id}"

    @property
    def shared_experts(self) -> str:
        return f"{self.base}.mlp.shared_experts"


def layer_names(prefix: str, index: int) -> LayerNames:
    return LayerNames(layer(prefix, index))


def attention_point(prefix: str, index: int, point: str) -> str:
    """Activation point of the attention (``cache_k``, ``cache_v``, ``q``, ``s``) of a layer."""
    return layer_names(prefix, index).attention_point(point)


def expert(prefix: str, index: int, expert_id: int, projection: str) -> str:
    return f"{layer_names(prefix, index).expert(expert_id)}.{projection}"


def shared_expert_input(prefix: str, index: int) -> str:
    """The one input point all routed experts of a layer share (their up_gate act scale)."""
    return f"{layer_names(prefix, index).experts}.{UP_GATE}"


def expert_tokens_key(prefix: str, index: int, expert_id: int) -> str:
    return layer_names(prefix, index).expert(expert_id)


# A layer or expert number in a name: plain ASCII decimal, so that "01" or a non-ASCII digit can never
# name the same layer as "1" (int() reads all three alike).
PLAIN_NUMBER = r"(?:0|[1-9][0-9]*)"
# Module names that carry an act_amax / act_scale.
MODULE_PATTERN = re.compile(
    rf"^(?P<prefix>[a-z0-9_]+)\.layers\.(?P<layer>{PLAIN_NUMBER})\."
    r"(?:self_attn\.(?:qkv_proj|o_proj|cache_k|cache_v|q|s)"
    r"|mlp\.(?:up_gate_proj|down_proj|shared_experts\.(?:up_gate_proj|down_proj)"
    rf"|experts\.up_gate_proj|experts\.(?P<expert>{PLAIN_NUMBER})\.down_proj))$"
)


def is_act_module(name: str) -> bool:
    return MODULE_PATTERN.match(name) is not None


def attention_point_of(module: str) -> str | None:
    """The attention point (``cache_k``, ``cache_v``, ``q``, ``s``) a module name is, or None.

    Example:
        >>> attention_point_of("qwen2.layers.0.self_attn.s"), attention_point_of("qwen2.layers.0.self_attn.o_proj")
        ('s', None)
    """
    head, _, last = module.rpartition(".")
    return last if head.endswith(".self_attn") and last in ATTENTION_POINTS else None


_EXPERT = re.compile(rf"^[a-z0-9_]+\.layers\.(?P<layer>{PLAIN_NUMBER})\.mlp\.experts\.(?P<expert>{PLAIN_NUMBER})(?:\.|$)")


def expert_of(name: str) -> tuple[int, int] | None:
    """(layer, expert) of a routed expert's module, tensor or expert-tokens key; None for anything else.

    Example:
        >>> expert_of("ernie.layers.3.mlp.experts.7.down_proj"), expert_of("ernie.layers.3.mlp.experts.up_gate_proj")
        ((3, 7), None)
    """
    match = _EXPERT.match(name)
    return (int(match.group("layer")), int(match.group("expert"))) if match else None


def module_from_fastdeploy_key(key: str) -> str:
    """Spec module for a FastDeploy measurement-mode key (docs/fastdeploy.md section 10, "Measurement mode").

    ``P.self_attn.cachek_matmul.activation_scale`` -> ``P.self_attn.cache_k``; linears keep their
    module name. The optional per-expert up_gate keys (``P.mlp.experts.{e}.up_gate_proj``, written
    only for w4a8-style checkpoints) map to the shared input ``P.mlp.experts.up_gate_proj``, where
    the converter merges them by max. Raises ValueError for any other key.
    """
    if not key.endswith(_FASTDEPLOY_SUFFIX):
        raise ValueError(f"{key!r} does not end in {_FASTDEPLOY_SUFFIX}")
    module = key[: -len(_FASTDEPLOY_SUFFIX)]
    head, _, last = module.rpartition(".")
    if head.endswith(".self_attn") and last in _FASTDEPLOY_POINTS:
        module = f"{head}.{_FASTDEPLOY_POINTS[last]}"
    per_expert_input = re.match(rf"^(.*\.mlp\.experts)\.{PLAIN_NUMBER}\.up_gate_proj$", module)
    if per_expert_input:
        module = f"{per_expert_input.group(1)}.up_gate_proj"
    if not is_act_module(module):
        raise ValueError(f"{key!r} is not a FastDeploy measurement key this format knows")
    return module


def fastdeploy_key_from_module(module: str) -> str:
    """Inverse of :func:`module_from_fastdeploy_key` for spec modules."""
    if not is_act_module(module):
        raise ValueError(f"{module!r} is not a spec activation module")
    head, _, last = module.rpartition(".")
    if head.endswith(".self_attn") and last in ATTENTION_POINTS:
        module = f"{head}.{ATTENTION_POINTS[last]}"
    return module + _FASTDEPLOY_SUFFIX

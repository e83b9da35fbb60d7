"""Tensor and module names of the spec, and FastDeploy's measurement keys for the same points.

Everything else asks this module for a name ("the act_amax tensor of this module") instead of
building strings itself.
"""

from __future__ import annotations

import re

__all__ = [
    "ACT_AMAX",
    "ACT_SCALE",
    "ATTENTION_POINTS",
    "BIAS",
    "COPIED_SOURCE_FILES",
    "MODULE_PATTERN",
    "PLAIN_NUMBER",
    "WEIGHT",
    "WEIGHT_SCALE",
    "attention_point",
    "expert",
    "expert_tokens_key",
    "fastdeploy_key_from_module",
    "is_act_module",
    "layer",
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


def layer(prefix: str, index: int) -> str:
    return f"{prefix}.layers.{index}"


def attention_point(prefix: str, index: int, point: str) -> str:
    """Activation point of the attention (``cache_k``, ``cache_v``, ``q``, ``s``) of a layer."""
    if point not in ATTENTION_POINTS:
        raise ValueError(f"unknown attention point {point!r}")
    return f"{layer(prefix, index)}.self_attn.{point}"


def expert(prefix: str, index: int, expert_id: int, projection: str) -> str:
    return f"{layer(prefix, index)}.mlp.experts.{expert_id}.{projection}"


def shared_expert_input(prefix: str, index: int) -> str:
    """The one input point all routed experts of a layer share (their up_gate act scale)."""
    return f"{layer(prefix, index)}.mlp.experts.up_gate_proj"


def expert_tokens_key(prefix: str, index: int, expert_id: int) -> str:
    return f"{layer(prefix, index)}.mlp.experts.{expert_id}"


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

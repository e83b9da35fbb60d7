"""The format's enumerations: target, KV-cache scheme, scale rounding, amax provenance, dead-expert policy, BF16 groups.

Plain enums without pydantic, so that the command line can offer their values as choices without
importing the config schema (:mod:`hpu_fp8_loader.spec.config` builds on them).
"""

from __future__ import annotations

import re
from enum import Enum

__all__ = [
    "AmaxSourceKind",
    "Bf16Group",
    "DeadExpertPolicy",
    "KvCacheScheme",
    "Rebalance",
    "ScaleRounding",
    "Target",
    "unservable_bf16_choice",
]


class Target(str, Enum):
    """The Gaudi generation a checkpoint is made for, which fixes its FP8 range (FP8_MAX_BY_TARGET).

    ``gaudi2`` stores FP8 at ±240, the range Gaudi2 saturates at and the only one FastDeploy's HPU path serves
    today; ``gaudi3`` at ±448 (the OCP e4m3fn range). A plain string works wherever a Target is taken.

    Attributes:
        GAUDI2: ``"gaudi2"``, fp8_max 240 (the default).
        GAUDI3: ``"gaudi3"``, fp8_max 448.

    Example:
        >>> from hpu_fp8_loader import ConvertOptions, Target
        >>> Target("gaudi2") is Target.GAUDI2
        True
        >>> ConvertOptions(target="gaudi3").fp8_max
        448.0
    """

    GAUDI2 = "gaudi2"
    GAUDI3 = "gaudi3"


class Rebalance(str, Enum):
    """Where convert rebalances a point's channels before quantizing (docs/guide.md, "FP8 range"): exact
    power-of-two folds of the activation's large channels into the next linear's rows (the model computes the
    same), chosen from a calibration's per-channel amax (:mod:`~hpu_fp8_loader.quality.rebalance`).

    Attributes:
        OFF: ``"off"``, no folds (the default until a benefit is shown on held-out text).
        FLAGGED: ``"flagged"``, only at fold sites whose point's amax / median |x| exceeds what E4M3 at ±240 holds.
        ALL: ``"all"``, at every fold site (for measuring what the folds do where no range fails).
    """

    OFF = "off"
    FLAGGED = "flagged"
    ALL = "all"


class KvCacheScheme(str, Enum):
    """How attention and the KV cache run: FP8 (FastDeploy's ``cache_fp8_sdpa_fp8``, four more amax per layer) or BF16.

    ``none`` is the choice when FP8 attention costs far more accuracy than FP8 linears (``evaluate`` warns
    then); the linears stay FP8 either way. A plain string works wherever a KvCacheScheme is taken.

    Attributes:
        FP8: ``"fp8"``, FP8 KV cache and FP8 attention (the default); act_amax for cache_k, cache_v, q and s.
        NONE: ``"none"``, attention and KV cache stay BF16.

    Example:
        >>> from hpu_fp8_loader import ConvertOptions, KvCacheScheme
        >>> ConvertOptions(kv_cache="none").kv_cache is KvCacheScheme.NONE  # attention and KV cache stay BF16
        True
    """

    FP8 = "fp8"  # fp8 KV cache and fp8 SDPA: FastDeploy's cache_fp8_sdpa_fp8
    NONE = "none"  # attention and KV cache stay BF16


class ScaleRounding(str, Enum):
    """How stored scales are rounded: not at all, or up to a power of two (then weights are quantized with it)."""

    NONE = "none"
    POW2 = "pow2"  # rounded up to a power of two; weights quantized with the rounded scale


class AmaxSourceKind(str, Enum):
    """Where a checkpoint's activation amax came from, recorded per source in ``calibration.sources``."""

    FASTDEPLOY_MEASUREMENT = "fastdeploy-measurement"
    REFERENCE_ENGINE = "reference-engine"
    IMPORTED_INPUT_SCALE = "imported-input-scale"
    LEGACY_CHECKPOINT = "legacy-checkpoint"
    SYNTHETIC = "synthetic"  # made up by `hpu-fp8 synth` for tests and demos; never for a model you serve


class DeadExpertPolicy(str, Enum):
    """What to do with routed experts no calibration token reached: refuse and list them, or give each its layer's sibling max."""

    ERROR = "error"
    SIBLING_MAX = "sibling-max"


class Bf16Group(str, Enum):
    """A group of linears FastDeploy builds in FP8 or in BF16 as one: the only units a checkpoint can keep in BF16.

    FastDeploy's ``mix_quant`` picks one quantization per kind of layer, never per module: ``dense_quant_type``
    for every linear outside the routed experts and ``moe_quant_type`` for every fused MoE layer; a type left
    out builds that group in BF16 (docs/fastdeploy.md section 3, "Keeping linears in BF16"). A plain string
    works wherever a Bf16Group is taken.

    Attributes:
        DENSE: ``"dense"``: attention's qkv_proj and o_proj, the dense MLPs and the shared experts, in every layer.
        EXPERTS: ``"experts"``: every routed expert of every MoE layer (MoE models only).

    Example:
        >>> from hpu_fp8_loader import ConvertOptions
        >>> ConvertOptions(keep_bf16=["experts"]).keep_bf16
        frozenset({<Bf16Group.EXPERTS: 'experts'>})
    """

    DENSE = "dense"
    EXPERTS = "experts"


def unservable_bf16_choice(choice: str) -> str:
    """Why keeping ``choice`` (anything but a :class:`Bf16Group` value) in BF16 is no choice FastDeploy can serve.

    Read from the name alone, so that the command line says why before any file is read.
    """
    groups = " or ".join(repr(g.value) for g in Bf16Group)
    if re.search(r"(^|\.)experts\.\d+(\.|$)", choice) or re.fullmatch(r"(.*\.)?layers\.\d+\.mlp\.experts", choice):
        why = (
            "FastDeploy builds the routed experts of every MoE layer with one method (mix_quant's moe_quant_type): "
            "all of them in FP8 or all in BF16, never one expert or one layer"
        )
    elif re.search(r"(^|[._])(lm_head|embed_tokens|embedding|norm|layernorm|gate|router)(\.weight)?$", choice):
        why = "it is never quantized: the embedding, norms, router and lm_head stay in their source dtype"
    elif re.search(r"(^|\.)(attn|attention|kv|kv_cache|cache_k|cache_v|q|s|softmax)$", choice):
        why = "attention's FP8 (the KV cache, q and the softmax) is chosen with --kv-cache none, not kept per module"
    elif re.search(r"(^|\.)(self_attn|mlp|shared_experts|qkv_proj|o_proj|up_gate_proj|down_proj)(\.|$)", choice):
        why = (
            "FastDeploy builds every linear outside the routed experts with one method (mix_quant's "
            "dense_quant_type; skip_quant is fixed in its model code, for the router only): all in FP8 or all in BF16"
        )
    else:
        why = "it names no group FastDeploy quantizes as one"
    return f"{choice!r} cannot be kept in BF16: {why}; choose {groups}"

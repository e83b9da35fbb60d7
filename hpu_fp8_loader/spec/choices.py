"""The format's enumerations: target, KV-cache scheme, scale rounding, amax provenance, dead-expert policy.

Plain enums without pydantic, so that the command line can offer their values as choices without
importing the config schema (:mod:`hpu_fp8_loader.spec.config` builds on them).
"""

from __future__ import annotations

from enum import Enum

__all__ = ["AmaxSourceKind", "DeadExpertPolicy", "KvCacheScheme", "ScaleRounding", "Target"]


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

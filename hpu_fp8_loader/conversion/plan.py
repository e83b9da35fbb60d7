"""The conversion's plan, fixed before any weight is read: its options, every output tensor, the output config.

Everything here is a function of the descriptor, the options and the activation amax, so that the
plan can be checked (and a resumed run recognised) before a byte of output is written.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpu_fp8_loader import __version__
from hpu_fp8_loader.arch import ModelDescriptor
from hpu_fp8_loader.arch.contents import bf16_modules, check_keep_bf16, expected_tensors
from hpu_fp8_loader.errors import ConfigError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.io.safetensors_file import BLOCK_ELEMENTS
from hpu_fp8_loader.io.writer import PlannedTensor
from hpu_fp8_loader.spec.choices import Rebalance, unservable_bf16_choice
from hpu_fp8_loader.spec.config import (
    FP8_MAX_BY_TARGET,
    Bf16Group,
    Calibration,
    CalibrationSource,
    DeadExpertPolicy,
    DeadExperts,
    ExpertRef,
    KvCacheScheme,
    MoePolicy,
    Producer,
    QuantizationConfig,
    Rebalancing,
    ScaleRounding,
    Target,
    is_hpu_fp8,
)

__all__ = [
    "ConvertOptions",
    "output_config",
    "planned_tensors",
    "quantization_config_for",
    "refuse_hpu_fp8_source",
]


@dataclass(frozen=True)
class ConvertOptions:
    """How :func:`~hpu_fp8_loader.convert` makes a checkpoint: FP8 range, KV cache, scales, output and workers.

    Frozen. The enum fields also take their plain string values (``"gaudi3"``, ``"none"``, ``"pow2"``,
    ``"sibling-max"``), as the command line passes them.

    Attributes:
        target: the Gaudi generation: ``gaudi2`` (±240, what FastDeploy serves today) or ``gaudi3`` (±448).
        kv_cache: ``fp8`` (FP8 KV cache and attention) or ``none`` (attention and KV cache stay BF16).
        scale_rounding: ``none``, or ``pow2`` to round every scale up to a power of two (weights are then
            quantized with the rounded scale).
        max_shard_bytes: the largest output shard (a bigger tensor gets a shard of its own).
        force: replace an existing output (only a checkpoint this tool wrote, or an empty directory).
        workers: worker processes converting tensors; at least 1.
        dead_experts: for routed experts no calibration token reached: ``error`` (refuse and list them) or
            ``sibling-max`` (each gets the largest amax of its layer's other experts).
        block_elements: elements per row block when a tensor is streamed (bounds a worker's memory).
        whole_tensor_bytes: a source tensor of at most this many bytes (each element counted as at least 2, BF16's
            size) is read whole (fast path for fused experts).
        kept_tensor_bytes: a larger tensor, read in row blocks for its amax, keeps those blocks for its quantization
            when they take at most this many bytes, so its source is read once; a bigger one is read a second time.
            Default (``None``): 2 GiB, or a third of :func:`~hpu_fp8_loader.memory.memory_budget` per worker when
            that is less (every linear of ERNIE-4.5-300B-A47B, and its embedding, fit 2 GiB).
        keep_bf16: the groups of linears kept in BF16, as FastDeploy can serve them: ``"dense"`` (attention, dense
            MLPs and shared experts) and ``"experts"`` (every routed expert); empty by default.
        rebalance: ``off`` (the default), ``flagged`` or ``all``: exact power-of-two channel folds before quantizing
            (:mod:`~hpu_fp8_loader.quality.rebalance`), where a point's range fails or everywhere; chosen from a
            calibration's per-channel amax, so only :func:`~hpu_fp8_loader.quantize` (``convert --calibrate``) applies
            it.
        fp8_max: the FP8 range of ``target`` (read-only): 240.0 or 448.0.

    Raises:
        ValueError: a string that is no value of its enum, or ``workers`` below 1.
        ConfigError: a ``keep_bf16`` entry that is no group FastDeploy can serve in BF16 (a single expert, one
            layer, lm_head ...), saying why.

    Example:
        >>> from hpu_fp8_loader import ConvertOptions, convert
        >>> options = ConvertOptions(kv_cache="none", workers=4)
        >>> options.kv_cache, options.fp8_max
        (<KvCacheScheme.NONE: 'none'>, 240.0)
        >>> result = convert("qwen2-bf16", "qwen2-fp8", [measurements], options)
    """

    target: Target = Target.GAUDI2
    kv_cache: KvCacheScheme = KvCacheScheme.FP8
    scale_rounding: ScaleRounding = ScaleRounding.NONE
    max_shard_bytes: int = 5 * 10**9
    force: bool = False
    workers: int = 1
    dead_experts: DeadExpertPolicy = DeadExpertPolicy.ERROR
    block_elements: int = BLOCK_ELEMENTS  # elements per row block when a tensor is streamed
    # Tensors whose source is at most this many bytes (an element counted as at least 2) are read whole.
    whole_tensor_bytes: int = 64 << 20
    kept_tensor_bytes: int | None = None  # streamed tensors up to this size are read once (None: from memory)
    keep_bf16: frozenset[Bf16Group] = frozenset()
    rebalance: Rebalance = Rebalance.OFF

    def __post_init__(self) -> None:
        # Accept the plain strings the CLI and Python callers pass ("gaudi2", "fp8", "pow2").
        object.__setattr__(self, "target", Target(self.target))
        object.__setattr__(self, "kv_cache", KvCacheScheme(self.kv_cache))
        object.__setattr__(self, "scale_rounding", ScaleRounding(self.scale_rounding))
        object.__setattr__(self, "dead_experts", DeadExpertPolicy(self.dead_experts))
        object.__setattr__(self, "rebalance", Rebalance(self.rebalance))
        if isinstance(self.keep_bf16, str):
            raise ConfigError(f"keep_bf16 takes a collection of groups, not the string {self.keep_bf16!r}")
        unservable = [c for c in self.keep_bf16 if c not in set(Bf16Group)]
        if unservable:
            raise ConfigError(unservable_bf16_choice(str(unservable[0])))
        object.__setattr__(self, "keep_bf16", frozenset(Bf16Group(c) for c in self.keep_bf16))
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")

    @property
    def fp8_max(self) -> float:
        return FP8_MAX_BY_TARGET[self.target]


def planned_tensors(descriptor: ModelDescriptor, qc: QuantizationConfig) -> list[PlannedTensor]:
    """Every output tensor of the spec checkpoint, in the order shards are filled (:func:`expected_tensors`)."""
    return [PlannedTensor(name, dtype, shape) for name, (dtype, shape) in expected_tensors(descriptor, qc).items()]


def refuse_hpu_fp8_source(checkpoint: Checkpoint) -> None:
    """An hpu-fp8 checkpoint is an output, not a source: say so once, instead of one complaint per scale tensor."""
    if is_hpu_fp8(checkpoint.config):
        raise ConfigError(
            f"{checkpoint.root}: already an hpu-fp8 checkpoint; convert reads the BF16 (or compressed-tensors) model, "
            "and `hpu-fp8 retarget` changes an hpu-fp8 checkpoint's target"
        )


def quantization_config_for(
    descriptor: ModelDescriptor,
    options: ConvertOptions,
    act: dict[str, float],
    origin: dict[str, str],
    sources: list[CalibrationSource],
    filled: list[ExpertRef],
    rebalancing: Rebalancing | None = None,
) -> QuantizationConfig:
    """The quantization_config of a checkpoint made with ``options`` from these activation sources (and, when any
    fold moved a channel, the ``rebalancing`` record).

    Raises:
        ConfigError: ``options.keep_bf16`` is not servable for this model (experts of a model without them, or
            no linear left in FP8).
    """
    attention_fp8 = options.kv_cache is KvCacheScheme.FP8
    default = sources[0].id
    kept = options.keep_bf16
    check_keep_bf16(descriptor, kept)
    return QuantizationConfig(
        dense_quant_type=None if Bf16Group.DENSE in kept else "tensor_wise_fp8",
        moe_quant_type=None if Bf16Group.EXPERTS in kept else "tensor_wise_fp8",
        kv_cache_quant_type="float8_e4m3" if attention_fp8 else None,
        fp8_max=options.fp8_max,
        target=options.target,
        kv_cache_scheme=options.kv_cache,
        scale_rounding=options.scale_rounding,
        ignore=bf16_modules(descriptor, kept),
        moe=MoePolicy(dead_experts=DeadExperts(policy=options.dead_experts, filled=filled)) if descriptor.moe else None,
        calibration=Calibration(
            sources=sources, default_source=default, overrides={m: origin[m] for m in act if origin.get(m, default) != default}
        ),
        rebalancing=rebalancing,
        producer=Producer(name="hpu-fp8-loader", version=__version__),
    )


def output_config(source_config: dict, descriptor: ModelDescriptor, qc: QuantizationConfig) -> dict:
    config = {k: v for k, v in source_config.items() if k not in ("torch_dtype", "transformers_version", "quantization_config")}
    config["architectures"] = [descriptor.architecture]
    config["dtype"] = "bfloat16"
    # keys whose absence FastDeploy reads with other defaults than the model's own (docs/fastdeploy.md section 3)
    config["tie_word_embeddings"] = descriptor.tie_word_embeddings
    # FastDeploy derives head_dim only where the key is absent: a null (as in some copies of ERNIE-4.5-21B-A3B's
    # config.json) reaches its rotary table as None and fails before any weight is loaded
    config["head_dim"] = descriptor.head_dim
    if descriptor.moe is not None:
        config["moe_layer_start_index"] = descriptor.moe.start
        config["moe_use_aux_free"] = descriptor.moe.correction_bias
    config["quantization_config"] = qc.model_dump(mode="json", exclude_none=True)
    return config

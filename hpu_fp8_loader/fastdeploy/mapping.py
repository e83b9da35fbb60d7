"""An hpu-fp8 checkpoint -> the exact parameters of FastDeploy's HPU FP8 layers, per parallel rank.

Pure: no FastDeploy, no Paddle, no HPU. The plugin hands these arrays to FastDeploy; the FP8
emulation runs on the same arrays; ``hpu-fp8 map`` writes them to a file for review. This module is
the only place FastDeploy's *multipliers* (240 / amax) are made: the spec stores descales only.

Parameter names, shapes, dtypes and formulas follow docs/fastdeploy.md: linear layers section 5
("Linear layers"), MoE section 5 ("MoE", "Two MoE layouts"), attention section 6 ("Attention scales"),
tensor/expert-parallel splits section 5 ("Tensor-parallel splits", "MoE"), every parameter path
section 11 ("What the hook fills, parameter by parameter"), Qwen3 and Qwen3-MoE section 14 ("Qwen3 and
Qwen3-MoE"): the same rules under the ``model.`` prefix, the per-head ``q_norm`` / ``k_norm`` weights whole on
every rank (norms are never split), and Qwen3-MoE's experts as ERNIE's without correction bias or shared experts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpu_fp8_loader.arch import ModelDescriptor, Role, WeightTensor
from hpu_fp8_loader.arch.contents import bf16_problems
from hpu_fp8_loader.checks.validate import check_values
from hpu_fp8_loader.errors import ConfigError, HpuFp8Error
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.io.safetensors_file import SafetensorsFile, TensorInfo, row_blocks
from hpu_fp8_loader.numerics import e4m3
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import Bf16Group, KvCacheScheme, QuantizationConfig, ScaleRounding
from hpu_fp8_loader.spec.fp8 import GAUDI2_FP8_MAX, act_amax_problem

__all__ = [
    "ACT_SCALE_INV_PARAMETER",
    "ACT_SCALE_PARAMETER",
    "EXPERT_PARAMETERS",
    "FASTDEPLOY_FP8_MAX",
    "LM_HEAD_PARAMETER",
    "NUMPY",
    "QK_NORMS",
    "QK_NORM_HOLDER",
    "ROUTER_BIAS_PARAMETER",
    "WEIGHT_SCALE_PARAMETER",
    "Arithmetic",
    "MappedPiece",
    "Parallelism",
    "ParameterSpec",
    "activation_scale_value",
    "attention_parameter",
    "check_parallelism",
    "embedding_parameter",
    "expert_parameter",
    "fastdeploy_name",
    "held_qk_norm_parameter",
    "holds_raw_amax",
    "local_experts",
    "map_rank",
    "parameter_specs",
    "rank_share",
    "scale_share",
    "share_shape",
    "valid_tp_sizes",
]

FASTDEPLOY_FP8_MAX = GAUDI2_FP8_MAX  # FastDeploy writes it as the Python float 240.0: see Arithmetic
ATTENTION_SCALES = (
    "cache_k_scale", "cache_k_out_scale", "cache_v_scale", "cache_v_out_scale", "q_scale", "q_out_scale",
    "q_scaling_scale", "q_scaling_out_scale", "s_scale", "s_out_scale",
)  # fmt: skip
# FastDeploy always builds a column-parallel lm_head; tied, it holds the rank's embedding rows transposed.
LM_HEAD_PARAMETER = "lm_head.linear.weight"
# FastDeploy's parameter names where they differ from the spec's (docs/fastdeploy.md section 11): spelled only here.
# An FP8 linear's scales beside its weight: the bf16 descale of the weight, the multiplier and its inverse.
WEIGHT_SCALE_PARAMETER, ACT_SCALE_PARAMETER, ACT_SCALE_INV_PARAMETER = "weight_scale", "act_scale", "act_scale_inv"
# The stacked parameters of a layer's routed experts, under ``<layer>.mlp.experts``.
EXPERT_PARAMETERS = (
    "up_gate_proj_weight", "down_proj_weight", "up_gate_proj_weight_scale", "down_proj_weight_scale",
    "up_gate_proj_in_scale", "down_proj_in_scale",
)  # fmt: skip
ROUTER_BIAS_PARAMETER = "gate_correction_bias"  # under ``<layer>.mlp.experts``
# From 2533836d (FastDeploy PR 5880, in releases 2.5 and 2.6) Qwen3's attention holds its two per-head RMSNorms in
# a QKRMSNorm of this name: the spec's (and FastDeploy's checkpoint key) ``<layer>.self_attn.q_norm.weight`` is then
# the parameter ``<layer>.self_attn.qk_norm.q_norm.weight``, k likewise (docs/fastdeploy.md section 14).
QK_NORM_HOLDER = "qk_norm"
QK_NORMS = ("q_norm", "k_norm")


def embedding_parameter(prefix: str) -> str:
    """FastDeploy's embedding parameter (its VocabParallelEmbedding nests an ``embeddings`` layer)."""
    return names.tensor(f"{names.embedding(prefix)}.embeddings", names.WEIGHT)


def attention_parameter(prefix: str, layer: int, scale: str) -> str:
    """One of a layer's ATTENTION_SCALES, on FastDeploy's attention module ``self_attn.attn``."""
    return f"{names.layer(prefix, layer)}.self_attn.attn.{scale}"


def expert_parameter(prefix: str, layer: int, parameter: str) -> str:
    """One of a layer's EXPERT_PARAMETERS (or ROUTER_BIAS_PARAMETER), on its fused MoE module."""
    return f"{names.layer_names(prefix, layer).experts}.{parameter}"


def held_qk_norm_parameter(name: str) -> str | None:
    """A Qwen3 q/k norm weight's parameter where FastDeploy holds the norms in ``QK_NORM_HOLDER``; None for any other."""
    attention, _, norm = name.removesuffix("." + names.WEIGHT).rpartition(".")
    if not name.endswith("." + names.WEIGHT) or norm not in QK_NORMS or not attention.endswith(".self_attn"):
        return None
    return f"{attention}.{QK_NORM_HOLDER}.{norm}.{names.WEIGHT}"


# Tensors up to this size are read through the memory map instead of pread.
_SMALL_BYTES = 1 << 16


@dataclass(frozen=True)
class Parallelism:
    """One rank of a FastDeploy deployment: its tensor-parallel and expert-parallel size and rank.

    Which sizes a model can be served at is checked where the model is known (:func:`check_parallelism`:
    every width split evenly, at least one KV head a rank, experts divided evenly); here only that each rank lies
    in ``0..size - 1``.

    Attributes:
        tp_size: tensor-parallel ranks.
        tp_rank: this rank's tensor-parallel index.
        ep_size: expert-parallel ranks (MoE models only).
        ep_rank: this rank's expert-parallel index.

    Raises:
        ConfigError: a size below 1, or a rank outside ``0..size - 1``.

    Example:
        >>> from hpu_fp8_loader import Parallelism, rank_parameters
        >>> rank0 = Parallelism(tp_size=2, tp_rank=0)
        >>> names = [piece.name for piece in rank_parameters("qwen2-fp8", rank0)]
    """

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    def __post_init__(self) -> None:
        for size, rank, what in ((self.tp_size, self.tp_rank, "tensor"), (self.ep_size, self.ep_rank, "expert")):
            if size < 1 or not 0 <= rank < size:
                raise ConfigError(f"{what}-parallel rank {rank} is not in 0..{size - 1}")


@dataclass(frozen=True)
class ParameterSpec:
    dtype: str  # safetensors code: F8_E4M3, BF16 or F32
    shape: tuple[int, ...]


@dataclass(frozen=True)
class MappedPiece:
    """A parameter's value, or (``expert`` set) the slice ``[expert]`` of a stacked MoE parameter.

    What :func:`~hpu_fp8_loader.rank_parameters` yields: exactly what the loader hook sets on FastDeploy's
    parameter, under its name, in its final dtype and rank-local shape.

    Attributes:
        name: FastDeploy's parameter path, such as ``"qwen2.layers.0.self_attn.qkv_proj.weight"``.
        array: the value: float8_e4m3fn weights, bfloat16 or float32 scales and kept tensors.
        expert: for a stacked MoE parameter, the local expert index this slice fills; None otherwise.

    Example:
        >>> from hpu_fp8_loader import Parallelism, rank_parameters
        >>> piece = next(iter(rank_parameters("qwen2-fp8", Parallelism(tp_size=2, tp_rank=0))))
        >>> piece.name, piece.array.dtype, piece.array.shape, piece.expert
        ('qwen2.embed_tokens.embeddings.weight', dtype(bfloat16), (128, 128), None)
    """

    name: str
    array: np.ndarray
    expert: int | None = None


def valid_tp_sizes(descriptor: ModelDescriptor, limit: int = 64) -> list[int]:
    """Tensor-parallel sizes FastDeploy's HPU runner can serve: every width split evenly, at least one KV head a rank.

    The HPU runner gives each rank ``num_key_value_heads // tp`` KV heads (docs/fastdeploy.md, "KV heads
    per rank"): a TP larger than the KV head count would leave a rank with none, so KV heads are never
    replicated here, unlike FastDeploy's GPU path (Qwen3Attention's ``num_kv_heads_replicas`` sizes its q|k|v
    split for replicated heads, but the HPU attention backend and its KV cache still get ``nkv // tp`` heads).
    """
    sizes = []
    for tp in range(1, limit + 1):
        widths = [descriptor.num_heads, descriptor.num_kv_heads, descriptor.intermediate_size, descriptor.vocab_size]
        if descriptor.moe:
            widths.append(descriptor.moe.intermediate_size)
        if all(w % tp == 0 for w in widths):
            sizes.append(tp)
    return sizes


def check_parallelism(descriptor: ModelDescriptor, par: Parallelism) -> None:
    valid = valid_tp_sizes(descriptor)
    if par.tp_size not in valid:
        why = (
            f"FastDeploy's HPU runner gives each rank num_key_value_heads // tp = {descriptor.num_kv_heads // par.tp_size} KV heads"
            if par.tp_size > descriptor.num_kv_heads
            else f"it does not split this model's heads and widths evenly ({descriptor.num_heads} heads, "
            f"{descriptor.num_kv_heads} KV heads)"
        )
        raise ConfigError(
            f"tensor parallelism {par.tp_size} cannot serve this {descriptor.model_type} model: {why}; "
            f"valid: {', '.join(map(str, valid))}"
        )
    if descriptor.moe is not None and descriptor.model_type == "ernie4_5_moe":
        built = [i for i in range(descriptor.num_layers) if i >= descriptor.moe.start]
        if built != descriptor.moe_layers():
            raise ConfigError(
                f"FastDeploy's ERNIE builds an MoE layer at every layer from moe_layer_start_index "
                f"{descriptor.moe.start} on ({_ranges(built)}); this model's MoE layers are {_ranges(descriptor.moe_layers())} "
                "(moe_layer_end_index / moe_layer_interval), which FastDeploy cannot serve"
            )
    if par.ep_size > 1:
        if descriptor.moe is None:
            raise ConfigError("expert parallelism needs an MoE model")
        if descriptor.moe.num_experts % par.ep_size:
            raise ConfigError(f"expert parallelism {par.ep_size} does not divide {descriptor.moe.num_experts} experts")


def _ranges(layers: list[int]) -> str:
    return (
        f"layers {layers[0]}-{layers[-1]}" if layers and layers == list(range(layers[0], layers[-1] + 1)) else f"layers {layers}"
    )


def local_experts(descriptor: ModelDescriptor, par: Parallelism) -> range:
    assert descriptor.moe is not None, "local_experts needs an MoE model"
    experts = descriptor.moe.num_experts
    if par.ep_size == 1:
        return range(experts)
    per_rank = experts // par.ep_size
    return range(par.ep_rank * per_rank, (par.ep_rank + 1) * per_rank)


def _expert_tp(par: Parallelism) -> int:
    """Experts are split by tensor parallelism only without expert parallelism (docs/fastdeploy.md section 5, "MoE")."""
    return par.tp_size if par.ep_size == 1 else 1


# ----------------------------------------------------------------------------- column selections


Columns = tuple[tuple[int, int], ...]  # a selection of columns as contiguous [start, stop) runs


def _width(columns: Columns) -> int:
    return sum(stop - start for start, stop in columns)


def _take(array: np.ndarray, columns: Columns) -> np.ndarray:
    """The selected columns (last axis), copied run by run: slices, not a gather."""
    return np.concatenate([array[..., start:stop] for start, stop in columns], axis=-1)


def _qkv_columns(d: ModelDescriptor, par: Parallelism) -> Columns:
    """This rank's q heads, then its k and v heads, as columns of the fused q|k|v output."""
    hd, tp, r = d.head_dim, par.tp_size, par.tp_rank
    q_heads, kv_heads = d.num_heads // tp, d.num_kv_heads // tp
    q = (r * q_heads * hd, (r + 1) * q_heads * hd)
    kv = (r * kv_heads * hd, (r + 1) * kv_heads * hd)
    k = (d.q_width + kv[0], d.q_width + kv[1])
    v = (d.q_width + d.kv_width + kv[0], d.q_width + d.kv_width + kv[1])
    return (q, k, v)


def _paired_columns(width: int, tp: int, rank: int) -> Columns:
    """gate_r | up_r of a gate|up output of ``width`` columns: each half split on its own (PairFused)."""
    half = width // 2
    part = half // tp
    return ((rank * part, (rank + 1) * part), (half + rank * part, half + (rank + 1) * part))


def _split(length: int, tp: int, rank: int) -> slice:
    part = length // tp
    return slice(rank * part, (rank + 1) * part)


# ----------------------------------------------------------------------------- specs


def _linear_modules(d: ModelDescriptor) -> list[WeightTensor]:
    return [w for w in d.weights() if w.is_linear and w.role not in (Role.EXPERT_UP_GATE, Role.EXPERT_DOWN)]


def share_shape(d: ModelDescriptor, w: WeightTensor, par: Parallelism) -> tuple[int, ...]:
    """The shape of this rank's share of a spec weight (spec layout, before any stacking)."""
    tp = par.tp_size
    if w.role is Role.EXPERT_UP_GATE:
        return (w.shape[0], w.shape[1] // _expert_tp(par))
    if w.role is Role.EXPERT_DOWN:
        return (w.shape[0] // _expert_tp(par), w.shape[1])
    if w.role in (Role.ATTN_QKV, Role.ATTN_QKV_BIAS):
        return (*w.shape[:-1], _width(_qkv_columns(d, par)))
    if w.role in (Role.MLP_UP_GATE, Role.SHARED_UP_GATE):
        return (w.shape[0], w.shape[1] // tp)
    if w.role in (Role.ATTN_O, Role.MLP_DOWN, Role.SHARED_DOWN, Role.EMBEDDING):
        return (w.shape[0] // tp, w.shape[1])
    if w.role is Role.LM_HEAD:
        return (w.shape[0], w.shape[1] // tp)
    return w.shape


def fastdeploy_name(d: ModelDescriptor, w: WeightTensor) -> str:
    """FastDeploy's parameter path of an unquantized weight (docs/fastdeploy.md section 11)."""
    if w.role is Role.EMBEDDING:
        return embedding_parameter(d.prefix)
    if w.role is Role.LM_HEAD:
        return LM_HEAD_PARAMETER
    if w.role is Role.ROUTER_BIAS:
        assert w.layer is not None  # a router bias belongs to a layer
        return expert_parameter(d.prefix, w.layer, ROUTER_BIAS_PARAMETER)
    return w.name


def parameter_specs(
    d: ModelDescriptor, kv_cache: KvCacheScheme, par: Parallelism, kept_bf16: frozenset[Bf16Group] = frozenset()
) -> dict[str, ParameterSpec]:
    """Every parameter FastDeploy's HPU FP8 model has on this rank, with dtype and shape.

    The linears of ``kept_bf16`` are FastDeploy's unquantized layers: a BF16 ``weight`` and no scales, and for
    the routed experts the two stacked BF16 weights alone (docs/fastdeploy.md section 3, "Keeping linears in BF16").
    """
    check_parallelism(d, par)
    specs: dict[str, ParameterSpec] = {}
    for w in d.weights():
        if w.role in (Role.EXPERT_UP_GATE, Role.EXPERT_DOWN):
            continue
        shape = share_shape(d, w, par)
        if w.quantized(kept_bf16):
            specs[w.name] = ParameterSpec("F8_E4M3", shape)
            for suffix in (WEIGHT_SCALE_PARAMETER, ACT_SCALE_PARAMETER, ACT_SCALE_INV_PARAMETER):
                specs[names.tensor(w.module, suffix)] = ParameterSpec("BF16", (1,))
        else:
            specs[fastdeploy_name(d, w)] = ParameterSpec(w.source_dtype, shape)
            if w.role is Role.EMBEDDING and d.tie_word_embeddings:
                specs[LM_HEAD_PARAMETER] = ParameterSpec(w.source_dtype, shape[::-1])
    for layer in d.moe_layers():
        assert d.moe is not None  # moe_layers() is empty without an MoE config
        e = len(local_experts(d, par))
        inter = d.moe.intermediate_size // _expert_tp(par)
        h = d.hidden_size
        weight = "BF16" if Bf16Group.EXPERTS in kept_bf16 else "F8_E4M3"
        shapes: list[tuple[str, tuple[int, ...]]] = [
            (weight, (e, h, 2 * inter)), (weight, (e, inter, h)), ("BF16", (e, 2 * inter)), ("BF16", (e, h)),
            ("BF16", (1,)), ("BF16", (e, 1)),
        ]  # fmt: skip
        parameters = EXPERT_PARAMETERS[:2] if weight == "BF16" else EXPERT_PARAMETERS
        for parameter, (dtype, shape) in zip(parameters, shapes, strict=False):
            specs[expert_parameter(d.prefix, layer, parameter)] = ParameterSpec(dtype, shape)
    if kv_cache is KvCacheScheme.FP8:
        for layer in range(d.num_layers):
            for scale in ATTENTION_SCALES:
                specs[attention_parameter(d.prefix, layer, scale)] = ParameterSpec("F32", (1,))
    return specs


# ----------------------------------------------------------------------------- values


def _bf16(values) -> np.ndarray:
    return np.asarray(values, np.float32).astype(e4m3.BF16_DTYPE)


def _checked_rows(shard: SafetensorsFile, info: TensorInfo, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a tensor, by pread, after the value check."""
    values = shard.read_rows(info.name, start, stop)
    check_values(info, values, start, FASTDEPLOY_FP8_MAX)
    return values


def _read(checkpoint: Checkpoint, name: str, rows: slice | None = None, columns: Columns | None = None) -> np.ndarray:
    """A rank's share of a spec tensor, read by pread in row blocks: never the whole tensor at once.

    Every row read is value-checked (validate.check_values) before anything is taken from it, so no
    NaN code or NaN/inf kept value reaches FastDeploy, a rank file or the emulator.
    """
    info = checkpoint.tensors[name]
    shard = checkpoint.files[info.file]
    if not info.shape or info.nbytes <= _SMALL_BYTES:  # scales and amax: a view of the map costs no syscall
        whole = shard.get(name)
        check_values(info, whole, 0, FASTDEPLOY_FP8_MAX)
        whole = whole if rows is None else whole[rows]
        return whole.copy() if columns is None else _take(whole, columns)
    start, stop = (rows.start, rows.stop) if rows is not None else (0, info.shape[0])
    if columns is None:
        return _checked_rows(shard, info, start, stop)
    if len(info.shape) == 1:
        return _take(_checked_rows(shard, info, 0, info.shape[0]), columns)
    blocks = [
        _take(_checked_rows(shard, info, first, last), columns) for first, last in row_blocks(stop, info.shape[1], start=start)
    ]
    return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)


def _scalar(checkpoint: Checkpoint, name: str) -> np.float32:
    return np.float32(checkpoint.get(name).reshape(-1)[0])


# ----------------------------------------------------------------------------- FastDeploy's scale arithmetic


@dataclass(frozen=True)
class Arithmetic:
    """Where FastDeploy's scale formulas are evaluated.

    FastDeploy derives its activation and attention scales from the legacy ``activation_scale``
    values with paddle in float32, then casts (docs/fastdeploy.md section 5, "Linear layers"; section
    6, "Attention scales"). The formulas below are written once, with Python operators and float
    constants as FastDeploy writes them, so they evaluate alike on numpy float32 scalars
    (:data:`NUMPY`: true division) and on tensors of FastDeploy's own paddle (the hook), whose
    ``tensor / 240.0`` multiplies by float32(1/240) in the paddle versions FastDeploy runs (3.1.1,
    3.3.0): the hook's values then match FastDeploy's own loading to the bit, whatever its paddle.
    """

    operand: Callable[[np.float32], Any]  # a float32 value -> an operand of the formulas
    array: Callable[[Any, str], np.ndarray]  # a result -> a [1] array of safetensors dtype "BF16" or "F32"


def _numpy_array(value, dtype: str) -> np.ndarray:
    return np.array([value], np.float32).astype(e4m3.BF16_DTYPE if dtype == "BF16" else np.float32)


NUMPY = Arithmetic(np.float32, _numpy_array)


def holds_raw_amax(key: str) -> bool:
    """FastDeploy's rule for a legacy ``activation_scale``: the raw amax for ``self_attn`` keys, amax / 240 elsewhere."""
    return "self_attn" in key


def _legacy_form(amax: float | np.float32, raw: bool) -> np.float32:
    return np.float32(amax) if raw else np.float32(amax) / np.float32(FASTDEPLOY_FP8_MAX)


def activation_scale_value(key: str, amax: float) -> np.float32:
    """The float32 value FastDeploy's legacy ``activation_scale`` under ``key`` stands for, before bf16 storage."""
    return _legacy_form(amax, holds_raw_amax(key))


def _activation_scale(checkpoint: Checkpoint, module: str, qc: QuantizationConfig) -> tuple[np.float32, bool]:
    """(legacy-form value, holds the raw amax) of an act module, at full float32 precision.

    The stored amax is checked first: outside the spec's range (zero, a denormal, inf, nan) FastDeploy's formulas
    would divide by zero or overflow, so such a checkpoint is refused here, naming the tensor, before any formula.
    """
    raw = holds_raw_amax(names.fastdeploy_key_from_module(module))
    amax_name = names.tensor(module, names.ACT_AMAX)
    amax = _scalar(checkpoint, amax_name)
    problem = act_amax_problem(float(amax))
    if problem:
        raise HpuFp8Error(
            f"{amax_name}: {problem}, and FastDeploy's scale formulas divide by it; this checkpoint is not valid "
            "(`hpu-fp8 validate` lists every such tensor)"
        )
    if qc.scale_rounding is ScaleRounding.POW2:
        scale = _scalar(checkpoint, names.tensor(module, names.ACT_SCALE))
        return (scale * np.float32(FASTDEPLOY_FP8_MAX) if raw else scale), raw
    return _legacy_form(amax, raw), raw


def _linear_act_scales(s, raw: bool):
    """(act_scale, act_scale_inv): HpuTensorWiseFP8LinearMethod.process_prequanted_weights' operations."""
    return (FASTDEPLOY_FP8_MAX / s, s / FASTDEPLOY_FP8_MAX) if raw else (1.0 / s, s)


def _attention_scales(k, v, q, s, head_dim: int) -> dict:
    """The ten scalars from the raw amax of K, V, Q and S: HPUKVCacheMethodBase.load_scale's operations."""
    b, softmax_scale = FASTDEPLOY_FP8_MAX, head_dim**-0.5
    return {
        "cache_k_scale": b / k, "cache_k_out_scale": k / b, "cache_v_scale": b / v, "cache_v_out_scale": v / b,
        "q_scale": b / q, "q_out_scale": q / b, "s_scale": b / s, "s_out_scale": s / b,
        "q_scaling_scale": b / (q * softmax_scale), "q_scaling_out_scale": (q * softmax_scale) / b,
    }  # fmt: skip


def _expert_rank(par: Parallelism) -> int:
    return par.tp_rank if par.ep_size == 1 else 0


def rank_share(checkpoint: Checkpoint, d: ModelDescriptor, w: WeightTensor, par: Parallelism) -> np.ndarray:
    """This rank's share of a spec weight, in the spec's dtype and layout.

    Split as docs/fastdeploy.md section 5 ("Tensor-parallel splits") describes.
    """
    tp, r = par.tp_size, par.tp_rank
    if w.role is Role.EXPERT_UP_GATE:
        return _read(checkpoint, w.name, columns=_paired_columns(w.shape[1], _expert_tp(par), _expert_rank(par)))
    if w.role is Role.EXPERT_DOWN:
        return _read(checkpoint, w.name, rows=_split(w.shape[0], _expert_tp(par), _expert_rank(par)))
    if w.role in (Role.ATTN_QKV, Role.ATTN_QKV_BIAS):
        return _read(checkpoint, w.name, columns=_qkv_columns(d, par))
    if w.role in (Role.MLP_UP_GATE, Role.SHARED_UP_GATE):
        return _read(checkpoint, w.name, columns=_paired_columns(w.shape[1], tp, r))
    if w.role in (Role.ATTN_O, Role.MLP_DOWN, Role.SHARED_DOWN, Role.EMBEDDING):
        return _read(checkpoint, w.name, rows=_split(w.shape[0], tp, r))
    if w.role is Role.LM_HEAD:
        part = _split(w.shape[1], tp, r)
        return _read(checkpoint, w.name, columns=((part.start, part.stop),))
    return _read(checkpoint, w.name)


def scale_share(checkpoint: Checkpoint, d: ModelDescriptor, w: WeightTensor, par: Parallelism) -> np.ndarray:
    """This rank's share of a linear's weight_scale: an expert up_gate's channels split gate|up-paired."""
    name = names.tensor(w.module, names.WEIGHT_SCALE)
    # paired, unlike the contiguous rule of 404cf0ec (docs/fastdeploy.md section 5, "Tensor-parallel splits")
    if w.role is Role.EXPERT_UP_GATE:
        return _read(checkpoint, name, columns=_paired_columns(w.shape[1], _expert_tp(par), _expert_rank(par)))
    return _read(checkpoint, name)


def _moe_pieces(
    checkpoint: Checkpoint,
    d: ModelDescriptor,
    qc: QuantizationConfig,
    layer: int,
    experts: dict[tuple[int, Role], WeightTensor],
    par: Parallelism,
    arithmetic: Arithmetic,
):
    """The stacked expert parameters of one MoE layer, from its experts' weights keyed by (expert, role): every local
    expert's, or (the emulation, one expert at a time) those of the local experts given, stacked alone."""
    up_weight, down_weight, up_scale, down_scale, up_in, down_in_scale = (
        expert_parameter(d.prefix, layer, parameter) for parameter in EXPERT_PARAMETERS
    )
    given = {e for e, _ in experts}
    local = [e for e in local_experts(d, par) if e in given]
    if not local:
        return  # none of them on this rank
    down_in = []
    for i, e in enumerate(local):
        up, down = experts[(e, Role.EXPERT_UP_GATE)], experts[(e, Role.EXPERT_DOWN)]
        yield MappedPiece(up_weight, rank_share(checkpoint, d, up, par), i)
        yield MappedPiece(down_weight, rank_share(checkpoint, d, down, par), i)
        if Bf16Group.EXPERTS in qc.kept_bf16:
            continue  # FastDeploy's unquantized MoE method holds the two stacked BF16 weights only
        yield MappedPiece(up_scale, _bf16(scale_share(checkpoint, d, up, par)), i)
        yield MappedPiece(down_scale, _bf16(scale_share(checkpoint, d, down, par)), i)
        # the stored amax / 240 as it is, a descale (docs/fastdeploy.md section 5, "MoE")
        down_in.append(arithmetic.array(arithmetic.operand(_activation_scale(checkpoint, down.module, qc)[0]), "BF16"))
    if Bf16Group.EXPERTS in qc.kept_bf16:
        return
    s, _ = _activation_scale(checkpoint, names.shared_expert_input(d.prefix, layer), qc)
    yield MappedPiece(up_in, arithmetic.array(1.0 / arithmetic.operand(s), "BF16"))
    yield MappedPiece(down_in_scale, np.stack(down_in))


def _attention_pieces(checkpoint: Checkpoint, d: ModelDescriptor, qc: QuantizationConfig, layer: int, arithmetic: Arithmetic):
    """The ten float32 scalars of docs/fastdeploy.md section 6 ("Attention scales")."""
    raw = {
        point: arithmetic.operand(_activation_scale(checkpoint, names.attention_point(d.prefix, layer, point), qc)[0])
        for point in ("cache_k", "cache_v", "q", "s")
    }
    values = _attention_scales(raw["cache_k"], raw["cache_v"], raw["q"], raw["s"], d.head_dim)
    for scale in ATTENTION_SCALES:
        yield MappedPiece(attention_parameter(d.prefix, layer, scale), arithmetic.array(values[scale], "F32"))


def _checked_scale(piece: MappedPiece) -> MappedPiece:
    """``piece`` if it is no scale, or a finite, positive one: no inf or zero scale ever reaches FastDeploy or a file.

    A valid checkpoint's amax range keeps every derived value normal (docs/spec.md section 3.3); this is the
    last guard for the formulas' float32 and bf16 results all the same.
    """
    if "scale" not in piece.name.rsplit(".", 1)[-1]:
        return piece
    values = np.asarray(piece.array, np.float32)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise HpuFp8Error(
            f"{piece.name}: FastDeploy's formula gives {float(values.min()):g}..{float(values.max()):g} from this "
            "checkpoint's scales; a scale must be finite and > 0 (`hpu-fp8 validate` checks every scale and amax)"
        )
    return piece


def map_rank(
    checkpoint: Checkpoint,
    qc: QuantizationConfig,
    d: ModelDescriptor,
    par: Parallelism,
    arithmetic: Arithmetic = NUMPY,
    weights: Iterable[WeightTensor] | None = None,
) -> Iterator[MappedPiece]:
    """Every parameter value of one rank, in model order; stacked MoE parameters come one expert at a time.

    ``arithmetic`` evaluates FastDeploy's scale formulas (numpy here; the hook passes FastDeploy's paddle).
    Every scale is checked finite and positive on its way out. ``weights``: only the parameters made from these
    descriptor weights, and nothing else read (default: the whole model). Given one layer's weights (every expert
    of an MoE layer among them), the pieces are that layer's, attention scales included; given the weights of no
    layer, the embedding, final norm and lm_head: what lets the emulation map a model one layer at a time. Given
    some experts of a layer (both weights of each), the stacked parameters hold only those of them this rank holds,
    with the layer's shared input scale: what lets it map one expert at a time.
    """
    return map(_checked_scale, _pieces(checkpoint, qc, d, par, arithmetic, weights))


def _pieces(
    checkpoint: Checkpoint,
    qc: QuantizationConfig,
    d: ModelDescriptor,
    par: Parallelism,
    arithmetic: Arithmetic,
    selected: Iterable[WeightTensor] | None,
) -> Iterator[MappedPiece]:
    """map_rank's pieces, before the scale check."""
    if qc.fp8_max != FASTDEPLOY_FP8_MAX:
        raise HpuFp8Error(
            f"fp8_max is {qc.fp8_max:g}, but FastDeploy's HPU path assumes 240 in every formula; "
            "make a 240 checkpoint with `hpu-fp8 retarget --target gaudi2`"
        )
    problems = bf16_problems(d, qc)
    if problems:
        raise HpuFp8Error(f"quantization_config.ignore: {problems[0]}")
    check_parallelism(d, par)
    kept = qc.kept_bf16
    # built once: a large MoE model has tens of thousands of expert weights
    weights = d.weights() if selected is None else list(selected)
    experts: dict[int, dict[tuple[int, Role], WeightTensor]] = {}
    for w in weights:
        if w.expert is not None:
            assert w.layer is not None  # an expert's weights belong to an MoE layer
            experts.setdefault(w.layer, {})[(w.expert, w.role)] = w
    for w in weights:
        if w.expert is not None:
            if w.layer in experts:
                yield from _moe_pieces(checkpoint, d, qc, w.layer, experts.pop(w.layer), par, arithmetic)
            continue
        if not w.quantized(kept):  # kept in BF16 (a linear of a kept group too: FastDeploy's unquantized layer)
            value = rank_share(checkpoint, d, w, par)
            value = value if w.source_dtype == "F32" else value.astype(e4m3.BF16_DTYPE, copy=False)
            yield MappedPiece(fastdeploy_name(d, w), value)
            if w.role is Role.EMBEDDING and d.tie_word_embeddings:
                yield MappedPiece(LM_HEAD_PARAMETER, np.ascontiguousarray(value.T))
        else:
            yield MappedPiece(w.name, rank_share(checkpoint, d, w, par))
            yield MappedPiece(names.tensor(w.module, WEIGHT_SCALE_PARAMETER), _bf16(scale_share(checkpoint, d, w, par)))
            s, raw = _activation_scale(checkpoint, w.module, qc)
            multiplier, descale = _linear_act_scales(arithmetic.operand(s), raw)
            yield MappedPiece(names.tensor(w.module, ACT_SCALE_PARAMETER), arithmetic.array(multiplier, "BF16"))
            yield MappedPiece(names.tensor(w.module, ACT_SCALE_INV_PARAMETER), arithmetic.array(descale, "BF16"))
        # FastDeploy's FP8 KV cache method does not depend on qkv_proj's: its scales follow the weight either way
        if w.role is Role.ATTN_QKV and qc.kv_cache_scheme is KvCacheScheme.FP8:
            assert w.layer is not None  # every linear weight belongs to a decoder layer
            yield from _attention_pieces(checkpoint, d, qc, w.layer, arithmetic)

"""hpu-fp8 v1 -> a standard compressed-tensors FP8 checkpoint (what vLLM and transformers read).

One calibration then serves FastDeploy (the hpu-fp8 checkpoint) and every engine that reads llm-compressor's
output. The export is the inverse of docs/spec.md section 4.4, driven by the architecture descriptor
(``WeightTensor.source_parts(Layout.TORCH)``), so it holds for every architecture the descriptor knows:

* Hugging Face layout: ``model.`` prefix, ``[out, in]``, q/k/v and gate/up split back out of the fused
  ``[in, out]`` tensors (the columns of each part, transposed; no value changes);
* weights: static per-tensor for every linear but the routed experts, which keep the spec's per-output-channel
  scales (``channel`` strategy in a second config group: exact, where a tensor-wise expert scale would
  requantize every expert); the parts of a fused group share its scale, repeated;
* activations: static per-tensor ``input_scale = act_amax / fp8_max``, the same for the parts that share an
  input (q/k/v, gate/up, and every expert's gate/up: the spec's shared MoE input); ``k_scale`` / ``v_scale``
  and a ``kv_cache_scheme`` when the checkpoint has an FP8 KV cache (its q and s scales have no place in the
  format and are dropped);
* range: ±448 by default, the OCP range every GPU engine assumes: each FP8 weight is dequantized to float32
  (exact) and requantized once with ``amax / 448`` rounded up to bf16, which is where the values round (the
  e4m3 codes, at most half a code step each); ``fp8_max=240`` keeps the checkpoint's own codes and scales bit for
  bit, for a consumer that rescales for Gaudi2 itself, and says so in ``quantization_config.hpu_fp8``;
* linears kept in BF16 stay BF16 and are listed in ``ignore`` (with ``lm_head`` and the MoE router).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpu_fp8_loader import __version__
from hpu_fp8_loader.arch import Layout, ModelDescriptor, Role, WeightTensor
from hpu_fp8_loader.checks.validate import check_values, open_validated
from hpu_fp8_loader.errors import HpuFp8Error
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.io.writer import CheckpointWriter, PlannedTensor
from hpu_fp8_loader.numerics import e4m3, scales
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import KvCacheScheme, QuantizationConfig
from hpu_fp8_loader.spec.fp8 import E4M3FN_MAX

__all__ = ["CT_EXPORT_KEY", "CompressedTensorsExportResult", "ExportProgress", "export_compressed_tensors"]

# The key of quantization_config that records where the export came from and its range; compressed-tensors'
# QuantizationConfig ignores keys it does not know (``extra="ignore"``), so every reader accepts it.
CT_EXPORT_KEY = "hpu_fp8"
_FP8_MAX_CHOICES = (240.0, 448.0)
_DENSE_ROLES = (Role.ATTN_QKV, Role.ATTN_O, Role.MLP_UP_GATE, Role.MLP_DOWN, Role.SHARED_UP_GATE, Role.SHARED_DOWN)


@dataclass
class CompressedTensorsExportResult:
    """What :func:`export_compressed_tensors` wrote.

    Attributes:
        out: the published compressed-tensors checkpoint directory.
        fp8_max: the range its FP8 values and scales use (448: OCP; 240: the hpu-fp8 codes kept).
        tensors: tensors written.
        requantized: FP8 spec tensors whose codes were requantized to ``fp8_max`` (0 when the range was kept).
        ignored: the ``ignore`` list written (Hugging Face module names kept unquantized).
        warnings: what the format cannot carry, such as the q and s attention scales of an FP8 KV cache.

    Example:
        >>> from hpu_fp8_loader import export_compressed_tensors
        >>> result = export_compressed_tensors("qwen2-fp8", "qwen2-fp8-ct")
        >>> result.fp8_max, result.ignored
        (448.0, ['lm_head'])
    """

    out: Path
    fp8_max: float
    tensors: int
    requantized: int
    ignored: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ExportProgress:
    """Where an export is: spec weights done of their total, and bytes of them read."""

    weights_done: int
    weights_total: int
    bytes_done: int
    bytes_total: int


def _quantization_args(strategy: str, dynamic: bool = False) -> dict:
    """compressed-tensors' QuantizationArgs for static symmetric FP8 with ``strategy``, written in full as
    llm-compressor does (so that no reader has to fill a default)."""
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": strategy,
        "dynamic": dynamic,
        "group_size": None,
        "block_structure": None,
        "actorder": None,
        "observer": None,
        "observer_kwargs": {},
    }


def _target(d: ModelDescriptor, roles: tuple[Role, ...]) -> str | None:
    """A ``re:`` target matching exactly the Hugging Face modules of ``roles`` in every layer (None when the model
    has none), such as ``re:^model\\.layers\\.\\d+\\.(mlp\\.down_proj|...)$``."""
    stems = {
        re.sub(r"\.experts\.\d+\.", ".experts.EXPERT.", p.name.removesuffix("." + names.WEIGHT).split(".", 3)[3])
        for w in d.weights()
        if w.role in roles
        for p in w.source_parts(Layout.TORCH, d.prefix)
    }
    if not stems:
        return None
    pattern = "|".join(re.escape(stem).replace("EXPERT", r"\d+") for stem in sorted(stems))
    return rf"re:^model\.layers\.\d+\.({pattern})$"


def _config_groups(d: ModelDescriptor, qc: QuantizationConfig) -> dict:
    """One group for the tensor-wise linears, one for the channel-wise routed experts; disjoint targets, so that
    no module matches two schemes."""
    groups = {}
    for name, roles, strategy, quantized in (
        ("group_0", _DENSE_ROLES, "tensor", qc.dense_quant_type is not None),
        ("group_1", (Role.EXPERT_UP_GATE, Role.EXPERT_DOWN), "channel", qc.moe_quant_type is not None),
    ):
        target = _target(d, roles) if quantized else None
        if target is not None:
            groups[name] = {
                "targets": [target],
                "weights": _quantization_args(strategy),
                "input_activations": _quantization_args("tensor"),
                "output_activations": None,
                "format": "float-quantized",
            }
    return groups


def _ignore(d: ModelDescriptor, qc: QuantizationConfig) -> list[str]:
    """Hugging Face module names left unquantized: lm_head (always, as llm-compressor does; a tied model's too,
    since transformers builds it as a Linear), the MoE router, and every part of a linear kept in BF16."""
    ignored = ["lm_head"]
    for w in d.weights():
        if w.role is Role.ROUTER or (w.is_linear and w.module in qc.ignore):
            ignored += [p.name.removesuffix("." + names.WEIGHT) for p in w.source_parts(Layout.TORCH, d.prefix)]
    return ignored


def _kv_cache_scheme(qc: QuantizationConfig) -> dict | None:
    return _quantization_args("tensor") if qc.kv_cache_scheme is KvCacheScheme.FP8 else None


def _quantization_config(d: ModelDescriptor, qc: QuantizationConfig, fp8_max: float, source: Path) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": _config_groups(d, qc),
        "ignore": _ignore(d, qc),
        "kv_cache_scheme": _kv_cache_scheme(qc),
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
        CT_EXPORT_KEY: {
            "fp8_max": fp8_max,
            "exported_from": {"format_version": qc.format_version, "fp8_max": qc.fp8_max, "directory": source.name},
            "producer": {"name": "hpu-fp8-loader", "version": __version__},
        },
    }


def _amax(checkpoint: Checkpoint, module: str) -> float:
    return float(np.asarray(checkpoint.get(names.tensor(module, names.ACT_AMAX)), np.float32)[0])


def _input_scale(amax: float, fp8_max: float) -> np.ndarray:
    """``[1]`` float32 ``amax / fp8_max`` (the raw scale, never the pow2 round-up a Gaudi loader may apply), moved by
    at most one float32 step to the value whose product with ``fp8_max`` rounds back to ``amax`` where one exists:
    ``input_scale x fp8_max`` is how a reader (``hpu-fp8 import``, vllm-gaudi) recovers the amax."""
    first = scales.scale_from_amax(amax, fp8_max)
    for candidate in (first, np.nextafter(first, np.float32(np.inf)), np.nextafter(first, np.float32(0))):
        if np.float32(float(candidate) * fp8_max) == np.float32(amax):
            return np.asarray(candidate, np.float32).reshape(1)
    return first.reshape(1)


def _act_module(d: ModelDescriptor, w: WeightTensor) -> str:
    """The spec module whose act_amax is ``w``'s input: the shared MoE input for every expert's gate|up."""
    assert w.layer is not None  # every linear belongs to a decoder layer
    return names.shared_expert_input(d.prefix, w.layer) if w.role is Role.EXPERT_UP_GATE else w.module


def _fp8_weight(checkpoint: Checkpoint, w: WeightTensor, qc: QuantizationConfig, fp8_max: float) -> tuple[np.ndarray, np.ndarray]:
    """(codes ``[in, out]``, scale ``[1]`` or ``[out]``) at ``fp8_max``: the checkpoint's own when the range is
    kept, else dequantized (exact in float32) and requantized once with a bf16-rounded-up ``amax / fp8_max``."""
    codes = checkpoint.get(w.name)
    check_values(checkpoint.tensors[w.name], codes, 0, qc.fp8_max)
    scale = np.asarray(checkpoint.get(names.tensor(w.module, names.WEIGHT_SCALE)), np.float32)
    if fp8_max == qc.fp8_max:
        return codes, scale
    values = e4m3.dequantize(codes, scale if w.channel_wise else scale.reshape(()))
    amax = e4m3.channel_abs_max(values, w.name) if w.channel_wise else e4m3.abs_max(values, w.name)
    new_scale = np.atleast_1d(scales.weight_scale_from_amax(amax, fp8_max))
    return e4m3.quantize(values, new_scale if w.channel_wise else new_scale.reshape(()), fp8_max, w.name), new_scale


def _plan(d: ModelDescriptor, checkpoint: Checkpoint, qc: QuantizationConfig) -> list[PlannedTensor]:
    planned = []
    for w in d.weights():
        parts = w.source_parts(Layout.TORCH, d.prefix)
        fp8 = w.is_linear and w.module not in qc.ignore
        dtype = "F8_E4M3" if fp8 else checkpoint.tensors[w.name].dtype
        for p in parts:
            planned.append(PlannedTensor(p.name, dtype, p.shape))
            if fp8:
                stem = p.name.removesuffix(names.WEIGHT)
                planned.append(PlannedTensor(stem + names.WEIGHT_SCALE, "F32", (p.shape[0], 1) if w.channel_wise else (1,)))
                planned.append(PlannedTensor(stem + "input_scale", "F32", (1,)))
        if w.role is Role.ATTN_QKV and qc.kv_cache_scheme is KvCacheScheme.FP8:
            attention = parts[0].name.rsplit(".", 2)[0]
            planned += [PlannedTensor(f"{attention}.{kv}_scale", "F32", (1,)) for kv in "kv"]
    return planned


def _write_weight(
    writer: CheckpointWriter, checkpoint: Checkpoint, d: ModelDescriptor, w: WeightTensor, qc: QuantizationConfig, fp8_max: float
) -> bool:
    """Write ``w``'s Hugging Face parts; True when its FP8 codes were requantized."""
    parts = w.source_parts(Layout.TORCH, d.prefix)
    fp8 = w.is_linear and w.module not in qc.ignore
    if fp8:
        values, scale = _fp8_weight(checkpoint, w, qc, fp8_max)
    else:
        values = checkpoint.get(w.name)
        check_values(checkpoint.tensors[w.name], values, 0, qc.fp8_max)
    edges = np.cumsum([0] + [p.shape[0] if p.transpose else p.shape[-1] for p in parts])
    for p, start, stop in zip(parts, edges[:-1], edges[1:], strict=True):
        piece = values[..., start:stop] if len(parts) > 1 else values
        writer.write(p.name, np.ascontiguousarray(piece.T if p.transpose else piece))
        if fp8:
            stem = p.name.removesuffix(names.WEIGHT)
            part_scale = scale[start:stop].reshape(-1, 1) if w.channel_wise else scale.reshape(1)
            writer.write(stem + names.WEIGHT_SCALE, np.ascontiguousarray(part_scale, np.float32))
            writer.write(stem + "input_scale", _input_scale(_amax(checkpoint, _act_module(d, w)), fp8_max))
    if w.role is Role.ATTN_QKV and qc.kv_cache_scheme is KvCacheScheme.FP8:
        assert w.layer is not None  # q|k|v belongs to a decoder layer
        attention = parts[0].name.rsplit(".", 2)[0]
        for kv, point in (("k", "cache_k"), ("v", "cache_v")):
            amax = _amax(checkpoint, names.attention_point(d.prefix, w.layer, point))
            writer.write(f"{attention}.{kv}_scale", _input_scale(amax, fp8_max))
    return fp8 and fp8_max != qc.fp8_max


def _hf_config(config: dict, quantization: dict) -> dict:
    """The spec's config.json with a compressed-tensors quantization_config instead of the hpu-fp8 one."""
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    out["quantization_config"] = quantization
    return out


def export_compressed_tensors(
    src: str | Path,
    out: str | Path,
    fp8_max: float = E4M3FN_MAX,
    max_shard_bytes: int = 5 * 10**9,
    force: bool = False,
    progress: Callable[[ExportProgress], None] | None = None,
) -> CompressedTensorsExportResult:
    """hpu-fp8 v1 -> a compressed-tensors FP8 checkpoint (static per-tensor scales) that vLLM and transformers read.

    Args:
        src: the hpu-fp8 checkpoint directory (either range).
        out: the directory to write; published by a rename only when complete.
        fp8_max: 448 (the OCP range; weights requantized once, see the module docstring) or 240 (the checkpoint's
            own codes and scales, for a consumer that handles Gaudi2's range itself).
        max_shard_bytes: the largest output shard.
        force: replace an existing ``out`` (only a checkpoint this tool wrote, or an empty directory).
        progress: called after each spec weight with an :class:`ExportProgress`.

    Returns:
        A :class:`~hpu_fp8_loader.CompressedTensorsExportResult`.

    Raises:
        HpuFp8Error: ``fp8_max`` is neither 240 nor 448; ``src`` fails the quick validation.
        NonFiniteError: a value read holds a NaN code, a value beyond the checkpoint's range or a NaN/inf kept value.
        CheckpointNotFoundError: ``src`` is not a directory.
        NotHpuFp8CheckpointError: ``src`` is not an hpu-fp8 checkpoint.
        UnsupportedFormatVersionError: ``src`` declares another format_version.
        OutputExistsError: ``out`` exists and ``force`` is false.
        OutputLockedError: another run is writing ``out``.
        UnsafePathError: ``out`` is, lies inside or contains ``src``, or ``OUT.partial`` is not this tool's (a link, a file, a user's directory).
        WriteFailedError: writing failed (no space left, an I/O error).

    Example:
        >>> from hpu_fp8_loader import export_compressed_tensors
        >>> export_compressed_tensors("ernie-fp8", "ernie-fp8-ct").out  # then: vllm serve ernie-fp8-ct
        PosixPath('ernie-fp8-ct')
    """
    if float(fp8_max) not in _FP8_MAX_CHOICES:
        raise HpuFp8Error(f"fp8_max {fp8_max:g}: choose 448 (OCP, what GPU engines assume) or 240 (Gaudi2's range, kept)")
    fp8_max = float(fp8_max)
    opened = open_validated(src)
    checkpoint, qc, d = opened.checkpoint, opened.qc, opened.descriptor
    planned = _plan(d, checkpoint, qc)
    writer = CheckpointWriter(out, planned, max_shard_bytes, force, {"format": "pt"}, [src])
    weights = d.weights()
    sizes = [checkpoint.tensors[w.name].nbytes for w in weights]
    requantized = 0
    for i, w in enumerate(weights):
        requantized += _write_weight(writer, checkpoint, d, w, qc, fp8_max)
        if progress is not None:
            progress(ExportProgress(i + 1, len(weights), sum(sizes[: i + 1]), sum(sizes)))
    quantization = _quantization_config(d, qc, fp8_max, Path(src))
    writer.finish(_hf_config(checkpoint.config, quantization), copy_from=Path(src))
    result = CompressedTensorsExportResult(Path(out), fp8_max, len(planned), requantized, quantization["ignore"])
    if qc.kv_cache_scheme is KvCacheScheme.FP8:
        result.warnings.append(
            "FP8 KV cache: k_scale and v_scale exported; the query and attention-probability scales of FastDeploy's "
            "FP8 attention have no place in compressed-tensors and were left out"
        )
    return result

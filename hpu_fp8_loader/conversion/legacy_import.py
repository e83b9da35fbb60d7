"""FastDeploy's legacy HPU FP8 layout -> hpu-fp8 v1: the layout's rules live in :mod:`hpu_fp8_loader.fastdeploy.legacy`.

Each ``activation_scale`` is resolved to an amax by its key's meaning, each ``quant_weight`` read back as
e4m3fn codes times its ``weight_scale`` and, where the spec's scale differs (fused groups, channel-wise
experts), requantized once; the error that adds is reported per tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpu_fp8_loader.arch import Layout, ModelDescriptor, WeightTensor, describe
from hpu_fp8_loader.conversion.activations import merge_measurements, resolve_act_amax
from hpu_fp8_loader.conversion.plan import ConvertOptions, output_config, planned_tensors, quantization_config_for
from hpu_fp8_loader.errors import ConfigError, HpuFp8Error, MeasurementError, NotHpuFp8CheckpointError
from hpu_fp8_loader.fastdeploy.legacy import ACTIVATION_SCALE, QUANT_WEIGHT, amax_from_legacy, legacy_key
from hpu_fp8_loader.fastdeploy.mapping import (
    FASTDEPLOY_FP8_MAX,
)
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.io.writer import CheckpointWriter
from hpu_fp8_loader.numerics import e4m3, scales
from hpu_fp8_loader.numerics.fusion import fuse_columns
from hpu_fp8_loader.sources.block_fp8 import block_size
from hpu_fp8_loader.sources.source_tensors import read_scale
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import AmaxSourceKind, DeadExpertPolicy, ExpertRef, KvCacheScheme, is_hpu_fp8
from hpu_fp8_loader.spec.fp8 import act_amax_problem
from hpu_fp8_loader.spec.measurements import MeasurementProvenance, Measurements

__all__ = ["LegacyImportResult", "import_legacy"]


@dataclass
class LegacyImportResult:
    """What :func:`import_legacy` found in the legacy checkpoint and wrote.

    Attributes:
        out: the published hpu-fp8 v1 checkpoint directory.
        layout: the legacy checkpoint's key layout: ``Layout.PADDLE`` or ``Layout.TORCH`` (Hugging Face names).
        expert_scales: how its routed experts' weight scales were stored: ``"channel-wise"``,
            ``"tensor-wise (older converter)"`` or ``"none"`` (a dense model).
        kv_cache: ``KvCacheScheme.FP8`` when the legacy checkpoint carries attention scales, else ``NONE``.
        requantized: ``(tensor, relative RMSE added)`` for each fused linear whose parts had different weight scales
            and was requantized once under one scale.
        filled_experts: dead experts whose amax came from their siblings (``dead_experts="sibling-max"``).
        warnings: what changed on the way, such as a legacy s_matmul amax other than 1.0 (the spec fixes it at 1.0).

    Example:
        >>> from hpu_fp8_loader import import_legacy
        >>> result = import_legacy("ernie-legacy-fp8", "ernie-fp8")
        >>> result.expert_scales, result.kv_cache
        ('channel-wise', <KvCacheScheme.FP8: 'fp8'>)
    """

    out: Path
    layout: Layout
    expert_scales: str  # "channel-wise", "tensor-wise (older converter)" or "none"
    kv_cache: KvCacheScheme
    requantized: list[tuple[str, float]] = field(default_factory=list)  # (tensor, relative RMSE added)
    filled_experts: list[ExpertRef] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _legacy_layout(checkpoint: Checkpoint, descriptor: ModelDescriptor) -> Layout:
    qkv = next(w for w in descriptor.weights() if w.is_linear)
    for layout in Layout:
        if all(legacy_key(p.name, QUANT_WEIGHT) in checkpoint.tensors for p in qkv.source_parts(layout, descriptor.prefix)):
            return layout
    raise ConfigError(
        f"{checkpoint.root}: no '{legacy_key(qkv.name, QUANT_WEIGHT)}' (nor its Hugging Face-named parts); "
        "is this a checkpoint of FastDeploy's legacy converter?"
    )


def _legacy_measurements(checkpoint: Checkpoint) -> tuple[Measurements, float | None]:
    """Every ``activation_scale`` of the checkpoint as amax (both meanings resolved); also the legacy s."""
    amax: dict[str, float] = {}
    unknown = []
    s_values = []
    for key in checkpoint.tensors:
        if not key.endswith("." + ACTIVATION_SCALE):
            continue
        try:
            module = names.module_from_fastdeploy_key(key)
        except ValueError:
            unknown.append(key)
            continue
        value = float(read_scale(checkpoint, key).reshape(-1)[0])
        if names.attention_point_of(module) == "s":
            s_values.append(value)
        resolved = amax_from_legacy(key, value)
        problem = act_amax_problem(resolved) if resolved != 0 else None  # zero: a dead expert, or an error later
        if problem:
            raise ConfigError(f"{checkpoint.root}: '{key}' holds {value:g}, so the {module} {problem}")
        amax[module] = max(amax.get(module, 0.0), resolved)
    if unknown:
        raise ConfigError(f"{checkpoint.root}: activation_scale keys of no known point: {', '.join(sorted(unknown)[:5])}")
    provenance = MeasurementProvenance(kind=AmaxSourceKind.LEGACY_CHECKPOINT, files=[checkpoint.root.name])
    return Measurements(provenance=provenance, model=None, amax=amax), (max(s_values) if s_values else None)


def _codes(checkpoint: Checkpoint, key: str, shape: tuple[int, ...]) -> np.ndarray:
    info = checkpoint.tensors.get(key)
    if info is None:
        raise ConfigError(f"{checkpoint.root}: '{key}' is missing (the legacy converter drops non-bf16 weights)")
    if info.dtype not in ("I8", "U8", "F8_E4M3") or info.shape != shape:
        raise ConfigError(f"{checkpoint.root}: '{key}' is {info.dtype}{list(info.shape)}, expected int8 bytes {list(shape)}")
    codes = np.asarray(checkpoint.get(key)).view(np.uint8)
    if (np.bitwise_and(codes, 0x7F) > scales.max_code(FASTDEPLOY_FP8_MAX)).any():
        raise ConfigError(f"{checkpoint.root}: '{key}' holds NaN codes or values beyond ±240; not a Gaudi2 FP8 tensor")
    return codes.view(e4m3.FP8_DTYPE)


def _weight_scale(checkpoint: Checkpoint, key: str, channels: int, channel_wise: bool) -> np.ndarray:
    info = checkpoint.tensors.get(key)
    if info is None:
        raise ConfigError(f"{checkpoint.root}: '{key}' is missing")
    values = read_scale(checkpoint, key).reshape(-1)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ConfigError(
            f"{checkpoint.root}: '{key}' holds {values.min()}..{values.max()}; weight scales must be finite and > 0"
        )
    if not scales.is_bf16_exact(values).all():
        raise ConfigError(f"{checkpoint.root}: '{key}' is not bf16-representable; the legacy layout stores bf16 weight scales")
    if values.size == 1 and channel_wise:
        return np.full(channels, values[0], np.float32)  # the older converter's tensor-wise expert scale, exactly
    if values.size != (channels if channel_wise else 1):
        raise ConfigError(f"{checkpoint.root}: '{key}' has {values.size} values, expected {channels if channel_wise else 1}")
    return values


def _import_linear(
    checkpoint: Checkpoint, w: WeightTensor, layout: Layout, prefix: str, report: LegacyImportResult
) -> tuple[np.ndarray, np.ndarray]:
    """(fp8 weight, weight scale) in the spec layout; fusing parts with different scales requantizes once."""
    parts = w.source_parts(layout, prefix)
    pieces, part_scales = [], []
    for p in parts:
        codes = _codes(checkpoint, legacy_key(p.name, QUANT_WEIGHT), p.shape)
        width = p.shape[0] if p.transpose else p.shape[-1]
        scale = _weight_scale(checkpoint, legacy_key(p.name, "weight_scale"), width, w.channel_wise)
        pieces.append(codes)
        part_scales.append(scale)
    transpose = [p.transpose for p in parts]
    if len(parts) == 1 or w.channel_wise or all(np.array_equal(s, part_scales[0]) for s in part_scales):
        scale = np.concatenate(part_scales) if w.channel_wise else part_scales[0]
        return fuse_columns(pieces, transpose), scale
    values = fuse_columns([e4m3.dequantize(q, s[0]) for q, s in zip(pieces, part_scales, strict=True)], transpose)
    scale = scales.weight_scale_from_amax(e4m3.abs_max(values, w.name), FASTDEPLOY_FP8_MAX).reshape(1)
    requantized = e4m3.quantize(values, scale[0], FASTDEPLOY_FP8_MAX, w.name)
    norm = np.linalg.norm(values)
    error = np.linalg.norm(e4m3.dequantize(requantized, scale[0]) - values) / (norm if norm > 1e-30 else 1e-30)
    report.requantized.append((w.name, float(error)))
    return requantized, scale


def _import_kept(checkpoint: Checkpoint, w: WeightTensor, layout: Layout, prefix: str) -> np.ndarray:
    arrays = []
    parts = w.source_parts(layout, prefix)
    for p in parts:
        info = checkpoint.tensors.get(p.name)
        if info is None or info.shape != p.shape:
            raise ConfigError(f"{checkpoint.root}: '{p.name}' is missing or not {list(p.shape)}")
        a = np.asarray(checkpoint.get(p.name))
        e4m3.abs_max(a, p.name)  # refuses NaN/inf by name
        arrays.append(a)
    values = fuse_columns(arrays, [p.transpose for p in parts])
    return values.astype(np.float32 if w.source_dtype == "F32" else e4m3.BF16_DTYPE)


def import_legacy(
    src: str | Path,
    out: str | Path,
    measurements: Sequence[Measurements] = (),
    dead_experts: DeadExpertPolicy = DeadExpertPolicy.ERROR,
    max_shard_bytes: int = 5 * 10**9,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> LegacyImportResult:
    """A legacy FastDeploy FP8 checkpoint -> hpu-fp8 v1, one tensor at a time.

    The legacy layout is what PaddleCustomDevice's ``Model_convert.py`` writes (``quant_weight``, ``weight_scale``,
    ``activation_scale`` keys; docs/fastdeploy.md section 9). Each ``activation_scale`` is resolved to an amax by
    its key's meaning (raw amax for ``self_attn`` keys, amax / 240 otherwise); each weight is kept as its FP8 codes
    and scale, and requantized once only where the spec's scale differs (fused parts with different scales).
    ``measurements`` supply points the legacy checkpoint lacks (FastDeploy never measures Qwen2's
    MLP, docs/fastdeploy.md section 10); where both have a point, the larger amax wins.

    Args:
        src: the legacy checkpoint directory (config.json with a ``mix_quant`` quantization_config).
        out: the checkpoint directory to write.
        measurements: activation measurements for the points the legacy checkpoint lacks.
        dead_experts: ``DeadExpertPolicy.ERROR`` (``"error"``: refuse experts without a positive amax) or
            ``"sibling-max"`` (give each the largest amax of its layer's other experts).
        max_shard_bytes: the largest output shard.
        force: replace an existing ``out`` (only a checkpoint this tool wrote, or an empty directory).
        progress: called after each write with the bytes written and the total (e.g. ``Progress.show``).

    Returns:
        A :class:`~hpu_fp8_loader.LegacyImportResult`: the layout and expert scales found, the KV cache scheme,
        requantization errors and warnings.

    Raises:
        NotHpuFp8CheckpointError: config.json has no ``mix_quant`` quantization_config (a BF16 checkpoint is
            converted with :func:`~hpu_fp8_loader.convert`).
        HpuFp8Error: ``src`` is already an hpu-fp8 checkpoint.
        ConfigError: ``src`` is a block-wise FP8 checkpoint (``hpu-fp8 import`` reads those).
        ConfigError: a quant_weight, weight_scale or kept tensor is missing or of the wrong dtype or shape, holds
            NaN codes or values beyond ±240, a weight scale is not finite, positive and bf16-exact, an
            activation_scale key names no known point or gives an amax out of range, or a torch-layout MoE
            checkpoint (unsupported); also config.json errors.
        MeasurementError: points lack an amax even with ``measurements`` (the message says to pass them), dead
            experts under ``"error"``, or measurements of another model.
        NonFiniteError: a kept (BF16) tensor holds NaN or inf.
        UnknownArchitectureError: config.json's model_type is not supported.
        CheckpointNotFoundError: ``src`` is not a directory, or a shard is missing.
        OutputExistsError: ``out`` exists and ``force`` is false.
        OutputLockedError: another run is writing ``out``.
        UnsafePathError: ``out`` is, lies inside or contains ``src``, or ``OUT.partial`` is not this tool's (a link, a file, a user's directory).
        WriteFailedError: writing failed (no space left, an I/O error).

    Example:
        >>> from hpu_fp8_loader import import_legacy, read_measurements
        >>> # FastDeploy never measures Qwen2's MLP: a calibration supplies those points
        >>> result = import_legacy("qwen2-legacy-fp8", "qwen2-fp8", [read_measurements("measurements.json")])
        >>> result.kv_cache, result.warnings
        (<KvCacheScheme.FP8: 'fp8'>, [])
    """
    checkpoint = Checkpoint.open(src)
    qc_raw = checkpoint.config.get("quantization_config")
    if not isinstance(qc_raw, dict) or qc_raw.get("quantization") != "mix_quant":
        raise NotHpuFp8CheckpointError(
            f"{src}: config.json has no mix_quant quantization_config; not a legacy FastDeploy FP8 checkpoint "
            "(a BF16 checkpoint is converted with `hpu-fp8 convert`)"
        )
    if is_hpu_fp8(checkpoint.config):
        raise HpuFp8Error(f"{src}: already an hpu-fp8 checkpoint; nothing to import")
    if block_size(checkpoint.config, Path(src)) is not None:
        raise ConfigError(f"{src}: a block-wise FP8 checkpoint (block_wise_fp8), not a legacy one; use `hpu-fp8 import`")
    descriptor = describe(checkpoint.config)
    layout = _legacy_layout(checkpoint, descriptor)
    legacy, legacy_s = _legacy_measurements(checkpoint)
    attention = names.attention_point(descriptor.prefix, 0, "cache_k") in legacy.amax
    kv = KvCacheScheme.FP8 if attention else KvCacheScheme.NONE
    amax, origin, sources = merge_measurements([legacy, *measurements], descriptor)
    try:
        act, filled = resolve_act_amax(descriptor.act_modules(attention), amax, DeadExpertPolicy(dead_experts))
    except MeasurementError as exc:
        raise MeasurementError(f"{src}: {exc} (pass --measurements for points the legacy checkpoint lacks)") from None
    experts = [w for w in descriptor.weights() if w.channel_wise]
    report = LegacyImportResult(Path(out), layout, "none", kv, filled_experts=filled)
    if experts:
        if layout is Layout.TORCH:
            raise ConfigError(
                f"{src}: a torch-layout legacy MoE checkpoint is not supported: the legacy channel-wise rule assumes [in, out]"
            )
        first = checkpoint.tensors.get(legacy_key(experts[0].name, "weight_scale"))
        report.expert_scales = (
            "tensor-wise (older converter)" if first is not None and first.shape in ((1,), ()) else "channel-wise"
        )
    if legacy_s is not None and legacy_s != 1.0:
        report.warnings.append(
            f"s_matmul amax was {legacy_s:g} in the legacy checkpoint; the spec fixes it at 1.0 (decode exp scores peak at 1)"
        )
    options = ConvertOptions(kv_cache=kv, dead_experts=dead_experts, max_shard_bytes=max_shard_bytes)
    qc = quantization_config_for(descriptor, options, act, origin, sources, filled)
    writer = CheckpointWriter(out, planned_tensors(descriptor, qc), max_shard_bytes, force, {"format": "pd"}, [src], progress)
    for w in descriptor.weights():
        if w.is_linear:
            weight, scale = _import_linear(checkpoint, w, layout, descriptor.prefix, report)
            writer.write(w.name, weight)
            writer.write(names.tensor(w.module, names.WEIGHT_SCALE), scale.astype(np.float32))
        else:
            writer.write(w.name, _import_kept(checkpoint, w, layout, descriptor.prefix))
    for module, value in act.items():
        writer.write(names.tensor(module, names.ACT_SCALE), scales.act_scale_from_amax(value, FASTDEPLOY_FP8_MAX).reshape(1))
        writer.write(names.tensor(module, names.ACT_AMAX), np.array([value], np.float32))
    writer.finish(output_config(checkpoint.config, descriptor, qc), copy_from=Path(src))
    return report


# ----------------------------------------------------------------------------- export

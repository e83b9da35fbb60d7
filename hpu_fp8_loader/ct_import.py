"""compressed-tensors FP8 checkpoints (llm-compressor's output, what vLLM reads) -> hpu-fp8 v1.

Such a checkpoint (formats-and-anchors.md section A) stores each linear of the Hugging Face torch
layout as an F8_E4M3 ``weight`` (OCP range ±448) with a ``weight_scale`` (``[1]`` tensor-wise or
``[out, 1]`` per channel, in bf16 or float32), a static ``input_scale`` when activations are static,
and optional ``k_scale`` / ``v_scale``. Gaudi2 and the spec want q|k|v and gate|up fused under one
tensor-wise scale in ``[in, out]`` at ±240, so every fused group is dequantized to float32 from the
source's own FP8 values and requantized exactly once (never from a lossy intermediate); the error
that adds is measured per tensor. Activation amax comes from ``input_scale`` x 448 where the source
has it (provenance ``imported-input-scale``), the rest from measurements or a calibration of the
dequantized model.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import numerics, scales
from .activations import merge_measurements, resolve_act_amax
from .arch import Layout, ModelDescriptor, Role, WeightTensor, describe
from .convert import ConvertOptions, output_config, plan_tensors, quantization_config_for
from .errors import ConfigError, MeasurementError
from .io.checkpoint import Checkpoint
from .io.writer import CheckpointWriter, PlannedTensor
from .spec import names
from .spec.config import AmaxSourceKind, KvCacheScheme
from .spec.measurements import MeasurementProvenance, Measurements

__all__ = ["ImportResult", "import_compressed_tensors"]

OCP_FP8_MAX = 448.0


@dataclass
class ImportResult:
    out: Path
    scheme: str
    errors: list[tuple[str, float]] = field(default_factory=list)  # (spec tensor, relative RMSE added to the source's)
    warnings: list[str] = field(default_factory=list)


def _check_scheme(src: Path, qc: dict) -> str:
    """The FP8 scheme found, or a refusal naming what was found instead."""
    if qc.get("quant_method") != "compressed-tensors":
        raise ConfigError(f"{src}: quant_method is {qc.get('quant_method')!r}, not 'compressed-tensors'")
    described = []
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        found = f"{weights.get('type')}{weights.get('num_bits')} {weights.get('strategy')}"
        if (
            group.get("format", qc.get("format")) != "float-quantized"
            or weights.get("type") != "float"
            or weights.get("num_bits") != 8
        ):
            raise ConfigError(
                f"{src}: config group {name!r} is {found} ({group.get('format', qc.get('format'))}); only FP8 "
                "(float, 8 bits, float-quantized) imports"
            )
        if weights.get("block_structure") or weights.get("group_size") or weights.get("strategy") not in ("tensor", "channel"):
            raise ConfigError(
                f"{src}: config group {name!r} uses {weights.get('strategy')} weight scales "
                f"(block {weights.get('block_structure')}, group {weights.get('group_size')}); only tensor or channel import"
            )
        inputs = group.get("input_activations") or {}
        activation = "none" if not inputs else ("dynamic" if inputs.get("dynamic") else f"static {inputs.get('strategy')}")
        if inputs and not inputs.get("dynamic") and inputs.get("strategy") != "tensor":
            raise ConfigError(
                f"{src}: config group {name!r} has {activation} activation scales; only tensor-wise static ones import"
            )
        described.append(f"FP8 weights per {weights['strategy']}, activations {activation}")
    if not described:
        raise ConfigError(f"{src}: compressed-tensors config without config_groups")
    return "; ".join(sorted(set(described)))


def _dequantized(checkpoint: Checkpoint, name: str) -> np.ndarray:
    """The source's real values of one tensor: FP8 x weight_scale, or the tensor itself when unquantized."""
    info = checkpoint.tensors[name]
    if info.dtype != "F8_E4M3":
        return np.asarray(checkpoint.get(name)).astype(np.float32)
    scale_name = name.removesuffix("weight") + "weight_scale"
    if scale_name not in checkpoint.tensors:
        raise ConfigError(f"{checkpoint.root}: '{name}' is FP8 but '{scale_name}' is missing")
    scale = np.asarray(checkpoint.get(scale_name)).astype(np.float32)
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        raise ConfigError(f"{checkpoint.root}: '{scale_name}' holds {scale.min()}..{scale.max()}; scales must be finite and > 0")
    if scale.size not in (1, info.shape[0]):
        raise ConfigError(f"{checkpoint.root}: '{scale_name}' has {scale.size} values for {info.shape[0]} rows")
    values = checkpoint.get(name).astype(np.float32)
    return values * (scale.reshape(-1, 1) if scale.size > 1 else scale.reshape(()))


def _spec_values(checkpoint: Checkpoint, w: WeightTensor, prefix: str) -> np.ndarray:
    parts = w.source_parts(Layout.TORCH, prefix)
    arrays = []
    for p in parts:
        if p.name not in checkpoint.tensors:
            raise ConfigError(f"{checkpoint.root}: tensor '{p.name}' is missing")
        values = _dequantized(checkpoint, p.name)
        if values.shape != p.shape:
            raise ConfigError(
                f"{checkpoint.root}: tensor '{p.name}' has shape {list(values.shape)}, config.json implies {list(p.shape)}"
            )
        arrays.append(values.T if p.transpose else values)
    return np.ascontiguousarray(arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=-1))


def _imported_amax(checkpoint: Checkpoint, d: ModelDescriptor) -> dict[str, float]:
    """input_scale x 448 per act module (max over the parts that share the input), k/v scales likewise."""
    amax: dict[str, float] = {}

    def add(module: str, tensor: str) -> None:
        value = float(np.asarray(checkpoint.get(tensor)).astype(np.float32).reshape(-1).max())
        if not np.isfinite(value) or value <= 0:
            raise ConfigError(f"{checkpoint.root}: '{tensor}' is {value}; an input scale must be finite and > 0")
        amax[module] = max(amax.get(module, 0.0), value * OCP_FP8_MAX)

    for w in d.weights():
        if not w.is_linear:
            continue
        module = names.shared_expert_input(d.prefix, w.layer) if w.role is Role.EXPERT_UP_GATE else w.module
        for p in w.source_parts(Layout.TORCH, d.prefix):
            tensor = p.name.removesuffix("weight") + "input_scale"
            if tensor in checkpoint.tensors:
                add(module, tensor)
        if w.role is Role.ATTN_QKV:
            base = w.source_parts(Layout.TORCH, d.prefix)[0].name.rsplit(".", 2)[0]
            for point, stem in (("cache_k", "k"), ("cache_v", "v")):
                for tensor in (f"{base}.{stem}_scale", f"{base}.{stem}_proj.output_scale"):
                    if tensor in checkpoint.tensors:
                        add(names.attention_point(d.prefix, w.layer, point), tensor)
    return amax


def _calibrated(checkpoint: Checkpoint, d: ModelDescriptor, work: Path) -> Measurements:
    """Calibrate the dequantized model: written once as a BF16 torch-layout checkpoint, then measured."""
    from .calibrate import calibrate

    planned, arrays = [], {}
    for name, info in checkpoint.tensors.items():
        if name.endswith(("weight_scale", "input_scale", "k_scale", "v_scale", "output_scale")):
            continue
        arrays[name] = (
            _dequantized(checkpoint, name).astype(numerics.BF16_DTYPE)
            if info.dtype == "F8_E4M3"
            else np.asarray(checkpoint.get(name))
        )
        planned.append(PlannedTensor(name, "BF16" if info.dtype == "F8_E4M3" else info.dtype, info.shape))
    writer = CheckpointWriter(work / "dequantized", planned, 5 * 10**9)
    for name, array in arrays.items():
        writer.write(name, array)
    config = {k: v for k, v in checkpoint.config.items() if k != "quantization_config"}
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        if (checkpoint.root / extra).is_file():
            shutil.copyfile(checkpoint.root / extra, writer.staging / extra)
    return calibrate(writer.finish(config)).measurements


def import_compressed_tensors(
    src: str | Path,
    out: str | Path,
    options: ConvertOptions | None = None,
    measurements: Sequence[Measurements] = (),
    calibrate: bool = False,
) -> ImportResult:
    """A compressed-tensors FP8 checkpoint -> hpu-fp8 v1 at ``options.fp8_max`` (±240 for Gaudi2)."""
    options = options or ConvertOptions()
    checkpoint = Checkpoint.open(src)
    raw = checkpoint.config.get("quantization_config") or {}
    scheme = _check_scheme(Path(src), raw)
    d = describe(checkpoint.config)
    result = ImportResult(Path(out), scheme)
    imported = _imported_amax(checkpoint, d)
    sources = []
    if imported:
        sources.append(
            Measurements(
                provenance=MeasurementProvenance(kind=AmaxSourceKind.IMPORTED_INPUT_SCALE, files=[Path(src).name]), amax=imported
            )
        )
    extra = list(measurements)
    if calibrate:
        with tempfile.TemporaryDirectory(prefix="hpu-fp8-import-") as work:
            extra.append(_calibrated(checkpoint, d, Path(work)))
    for m in extra:  # the source's own static scales take precedence; the rest fill the gaps
        sources.append(m.model_copy(update={"amax": {k: v for k, v in m.amax.items() if k not in imported}}))
    if not sources:
        raise MeasurementError(f"{src}: dynamic activations carry no statistics; pass --measurements or --calibrate")
    attention = options.kv_cache is KvCacheScheme.FP8
    amax, origin, calibration_sources = merge_measurements(sources, d)
    act, filled = resolve_act_amax(d.act_modules(attention), amax, options.dead_experts)
    qc = quantization_config_for(d, options, act, origin, calibration_sources, filled)
    writer = CheckpointWriter(out, plan_tensors(d, list(act)), options.max_shard_bytes, options.force, {"format": "pd"})
    ignored = [p for p in (raw.get("ignore") or []) if isinstance(p, str)]
    for w in d.weights():
        values = _spec_values(checkpoint, w, d.prefix)
        if not w.is_linear:
            if w.role in (Role.ROUTER, Role.ROUTER_BIAS) and any(
                checkpoint.tensors[p.name].dtype == "F8_E4M3" for p in w.source_parts(Layout.TORCH, d.prefix)
            ):
                result.warnings.append(
                    f"{w.name}: quantized in the source (its ignore list {ignored} misses the router); "
                    "dequantized to float32, as FastDeploy keeps the router unquantized"
                )
            writer.write(w.name, values.astype(np.float32 if w.source_dtype == "F32" else numerics.BF16_DTYPE))
            continue
        amax_w = numerics.channel_abs_max(values, w.name) if w.channel_wise else numerics.abs_max(values, w.name)
        scale = scales.weight_scale_from_amax(amax_w, options.fp8_max, options.scale_rounding.value).reshape(-1)
        quantized = numerics.quantize(values, scale if w.channel_wise else scale[0], options.fp8_max, w.name)
        back = numerics.dequantize(quantized, scale if w.channel_wise else scale[0])
        result.errors.append((w.name, float(np.linalg.norm(back - values) / max(np.linalg.norm(values), 1e-30))))
        writer.write(w.name, quantized)
        writer.write(names.tensor(w.module, names.WEIGHT_SCALE), scale.astype(np.float32))
    for module, value in act.items():
        writer.write(
            names.tensor(module, names.ACT_SCALE),
            scales.act_scale_from_amax(value, options.fp8_max, options.scale_rounding.value).reshape(1),
        )
        writer.write(names.tensor(module, names.ACT_AMAX), np.array([value], np.float32))
    writer.finish(output_config(checkpoint.config, d, qc), copy_from=Path(src))
    result.errors.sort(key=lambda item: -item[1])
    return result

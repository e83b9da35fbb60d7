"""BF16 source checkpoint + activation amax -> hpu-fp8 v1 checkpoint, one tensor at a time.

The plan (every output tensor's name, dtype and shape) is known from the descriptor before any
weight is read, so shards are written as a stream and never held in memory; output goes to
``OUT.partial`` and is renamed only once the index and the manifest are written.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import __version__, numerics
from .arch import Layout, ModelDescriptor, WeightTensor, describe
from .errors import ConfigError, HpuFp8Error, MeasurementError
from .io.checkpoint import CONFIG_FILE, INDEX_FILE, Checkpoint
from .io.manifest import MANIFEST_FILE, write_manifest
from .io.writer import PlannedTensor, ShardWriter, atomic_output_dir, plan_shards, write_index
from .spec import names
from .spec.config import (
    FP8_MAX_BY_TARGET,
    Calibration,
    CalibrationSource,
    KvCacheScheme,
    MoePolicy,
    Producer,
    QuantizationConfig,
    ScaleRounding,
    Target,
)
from .spec.measurements import Measurements

__all__ = ["ConvertOptions", "convert", "detect_layout", "merge_measurements"]

_NOT_COPIED = {CONFIG_FILE, INDEX_FILE, MANIFEST_FILE}


@dataclass(frozen=True)
class ConvertOptions:
    target: Target = Target.GAUDI2
    kv_cache: KvCacheScheme = KvCacheScheme.FP8
    scale_rounding: ScaleRounding = ScaleRounding.NONE
    max_shard_bytes: int = 5 * 10**9
    force: bool = False

    def __post_init__(self) -> None:
        # Accept the plain strings the CLI and Python callers pass ("gaudi2", "fp8", "pow2").
        object.__setattr__(self, "target", Target(self.target))
        object.__setattr__(self, "kv_cache", KvCacheScheme(self.kv_cache))
        object.__setattr__(self, "scale_rounding", ScaleRounding(self.scale_rounding))

    @property
    def fp8_max(self) -> float:
        return FP8_MAX_BY_TARGET[self.target]


def detect_layout(checkpoint: Checkpoint, descriptor: ModelDescriptor) -> Layout:
    """Paddle or torch layout, from which names of the first layer's attention exist."""
    probe = descriptor.weights()[1:3]
    for layout in Layout:
        if all(p.name in checkpoint.tensors for w in probe for p in w.source_parts(layout, descriptor.prefix)):
            return layout
    raise ConfigError(
        f"{checkpoint.root}: neither Paddle names ({probe[1].name}) nor torch names "
        f"({probe[1].source_parts(Layout.TORCH, descriptor.prefix)[0].name}) found; is this a {descriptor.model_type} checkpoint?"
    )


def _assemble(checkpoint: Checkpoint, weight: WeightTensor, layout: Layout, prefix: str) -> np.ndarray:
    """The spec-layout source tensor: transposes and fusions applied, dtype as on disk."""
    arrays = []
    for part in weight.source_parts(layout, prefix):
        info = checkpoint.tensors.get(part.name)
        if info is None:
            raise ConfigError(f"{checkpoint.root}: tensor '{part.name}' is missing")
        if info.shape != part.shape:
            raise ConfigError(
                f"{checkpoint.root}: tensor '{part.name}' has shape {list(info.shape)}, config.json implies {list(part.shape)}"
            )
        if info.dtype not in ("BF16", "F16", "F32"):
            raise ConfigError(f"{checkpoint.root}: tensor '{part.name}' has dtype {info.dtype}; expected BF16, F16 or F32")
        array = checkpoint.get(part.name)
        arrays.append(array.T if part.transpose else array)
    if len(arrays) == 1:
        return arrays[0]
    common = np.result_type(*[a.dtype for a in arrays]) if len({a.dtype for a in arrays}) > 1 else arrays[0].dtype
    return np.concatenate([a.astype(common, copy=False) for a in arrays], axis=-1)


def merge_measurements(
    measurements: Sequence[Measurements], descriptor: ModelDescriptor
) -> tuple[dict[str, float], dict[str, str], list[CalibrationSource]]:
    """Max-merge several measurement files: (amax per module, source id per module, sources)."""
    if not measurements:
        raise MeasurementError("no measurements given; pass --measurements")
    amax: dict[str, float] = {}
    origin: dict[str, str] = {}
    sources = []
    experts = descriptor.moe.num_experts if descriptor.moe else 0
    for i, m in enumerate(measurements):
        ident = m.model
        if (ident.model_type, ident.num_hidden_layers, ident.moe_num_experts) != (
            descriptor.model_type,
            descriptor.num_layers,
            experts,
        ):
            raise MeasurementError(
                f"measurements #{i + 1} were taken on {ident.model_type} with {ident.num_hidden_layers} layers and "
                f"{ident.moe_num_experts} experts; this model is {descriptor.model_type} with {descriptor.num_layers} "
                f"layers and {experts} experts"
            )
        source_id = f"{m.provenance.kind.value}-{i + 1}"
        sources.append(CalibrationSource(id=source_id, **m.provenance.model_dump()))
        for module, value in m.amax.items():
            if module not in amax or value > amax[module]:
                amax[module], origin[module] = value, source_id
    return amax, origin, sources


def _act_amax(descriptor: ModelDescriptor, modules: list[str], amax: dict[str, float]) -> dict[str, float]:
    """amax of every act module, with ``s`` fixed at 1.0; refuses missing and zero values by name."""
    out, missing, zero = {}, [], []
    for module in modules:
        if module.endswith(".self_attn.s"):
            out[module] = 1.0  # FastDeploy's decode path quantizes exp scores peaking at exactly 1
        elif module not in amax:
            missing.append(module)
        elif amax[module] <= 0:
            zero.append(module)
        else:
            out[module] = amax[module]
    if missing:
        raise MeasurementError(f"measurements lack {len(missing)} module(s): {', '.join(missing[:20])}")
    if zero:
        raise MeasurementError(
            f"amax is zero for {len(zero)} module(s) (dead experts or an uncalibrated path): {', '.join(zero[:20])}"
        )
    return out


def _plan(descriptor: ModelDescriptor, act_modules: list[str]) -> list[PlannedTensor]:
    planned = []
    for w in descriptor.weights():
        if w.is_linear:
            planned.append(PlannedTensor(w.name, "F8_E4M3", w.shape))
            scale_shape = (w.shape[-1],) if w.channel_wise else (1,)
            planned.append(PlannedTensor(names.tensor(w.module, names.WEIGHT_SCALE), "F32", scale_shape))
        else:
            planned.append(PlannedTensor(w.name, w.source_dtype, w.shape))
    for module in act_modules:
        planned.append(PlannedTensor(names.tensor(module, names.ACT_SCALE), "F32", (1,)))
        planned.append(PlannedTensor(names.tensor(module, names.ACT_AMAX), "F32", (1,)))
    return planned


def _output_tensors(
    checkpoint: Checkpoint, descriptor: ModelDescriptor, layout: Layout, options: ConvertOptions, act: dict[str, float]
) -> Iterator[tuple[str, np.ndarray]]:
    rounding = options.scale_rounding.value
    for w in descriptor.weights():
        source = _assemble(checkpoint, w, layout, descriptor.prefix)
        if w.is_linear:
            amax = numerics.channel_abs_max(source, w.name) if w.channel_wise else numerics.abs_max(source, w.name)
            scale = numerics.weight_scale_from_amax(amax, options.fp8_max, rounding).reshape(-1)
            yield w.name, numerics.quantize(source, scale if w.channel_wise else scale[0], options.fp8_max, w.name)
            yield names.tensor(w.module, names.WEIGHT_SCALE), scale
        else:
            numerics.abs_max(source, w.name)  # refuses NaN/inf in kept tensors too
            dtype = np.float32 if w.source_dtype == "F32" else numerics.BF16_DTYPE
            yield w.name, np.ascontiguousarray(source.astype(dtype))
    for module, value in act.items():
        yield names.tensor(module, names.ACT_SCALE), numerics.act_scale_from_amax(value, options.fp8_max, rounding).reshape(1)
        yield names.tensor(module, names.ACT_AMAX), np.array([value], np.float32)


def _output_config(source_config: dict, descriptor: ModelDescriptor, qc: QuantizationConfig) -> dict:
    config = {k: v for k, v in source_config.items() if k not in ("torch_dtype", "transformers_version", "quantization_config")}
    config["architectures"] = [descriptor.architecture]
    config["dtype"] = "bfloat16"
    config["quantization_config"] = qc.model_dump(mode="json", exclude_none=True)
    return config


def convert(
    src: str | Path,
    out: str | Path,
    measurements: Sequence[Measurements],
    options: ConvertOptions = ConvertOptions(),
    progress=None,
) -> Path:
    """Convert ``src`` into an hpu-fp8 v1 checkpoint at ``out``; returns ``out``.

    ``progress`` (optional) is called with each output tensor's byte count.
    """
    src, out = Path(src), Path(out)
    if src.resolve() == out.resolve():
        raise HpuFp8Error(f"{out}: output and source are the same directory; the source is never modified")
    checkpoint = Checkpoint.open(src)
    descriptor = describe(checkpoint.config)
    layout = detect_layout(checkpoint, descriptor)
    attention_fp8 = options.kv_cache is KvCacheScheme.FP8
    modules = descriptor.act_modules(attention_fp8)
    amax, origin, sources = merge_measurements(measurements, descriptor)
    act = _act_amax(descriptor, modules, amax)
    default = sources[0].id
    qc = QuantizationConfig(
        kv_cache_quant_type="float8_e4m3" if attention_fp8 else None,
        fp8_max=options.fp8_max,
        target=options.target,
        kv_cache_scheme=options.kv_cache,
        scale_rounding=options.scale_rounding,
        moe=MoePolicy() if descriptor.moe else None,
        calibration=Calibration(
            sources=sources,
            default_source=default,
            overrides={m: origin[m] for m in act if origin.get(m, default) != default},
        ),
        producer=Producer(name="hpu-fp8-loader", version=__version__),
    )
    shards = plan_shards(_plan(descriptor, list(act)), options.max_shard_bytes)
    with atomic_output_dir(out, force=options.force) as staging:
        tensors = _output_tensors(checkpoint, descriptor, layout, options, act)
        digests = {}
        for shard in shards:
            writer = ShardWriter(staging, shard, metadata={"format": "pd", "producer": f"hpu-fp8-loader {__version__}"})
            for _ in shard.tensors:
                name, array = next(tensors)
                writer.add(name, array)
                if progress:
                    progress(array.nbytes)
            digests[shard.file_name] = writer.close()
        write_index(staging, shards)
        (staging / CONFIG_FILE).write_text(json.dumps(_output_config(checkpoint.config, descriptor, qc), indent=2) + "\n")
        for extra in sorted(src.iterdir()):
            if (
                extra.is_file()
                and extra.suffix != ".safetensors"
                and extra.name not in _NOT_COPIED
                and not extra.name.startswith(".")
            ):
                shutil.copyfile(extra, staging / extra.name)
        write_manifest(staging, digests)
    return out

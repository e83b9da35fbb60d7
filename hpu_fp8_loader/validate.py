"""Check a directory against every rule of docs/spec.md and list each violation.

A checkpoint that cannot be interpreted as hpu-fp8 v1 at all (no directory, config.json missing or
not JSON, not an hpu-fp8 checkpoint, another format_version) raises a typed error: "unreadable".
Everything else is collected, so one run shows every problem.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import numerics
from .arch import ModelDescriptor, describe
from .errors import CheckpointNotFoundError, HpuFp8Error
from .io.checkpoint import INDEX_FILE, read_config, read_index, safe_member
from .io.manifest import check_manifest
from .io.safetensors_file import SafetensorsFile, TensorInfo
from .spec import names
from .spec.config import KvCacheScheme, QuantizationConfig, ScaleRounding, fastdeploy_config_problems, parse_quantization_config

__all__ = ["ValidationReport", "Violation", "expected_tensors", "validate"]

# Elements of an fp8 weight checked per step of the full scan.
_SCAN_CHUNK = 1 << 24


@dataclass(frozen=True)
class Violation:
    rule: str  # the rule's id in docs/spec.md
    where: str  # file, tensor or key
    message: str


@dataclass
class ValidationReport:
    root: str
    mode: str
    violations: list[Violation] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    tensors: int = 0
    weight_bytes_scanned: int = 0

    @property
    def valid(self) -> bool:
        return not self.violations

    def add(self, rule: str, where: str, message: str) -> None:
        self.violations.append(Violation(rule, where, message))

    def to_dict(self) -> dict:
        return {"root": self.root, "mode": self.mode, "valid": self.valid, **asdict(self)}


def expected_tensors(descriptor: ModelDescriptor, qc: QuantizationConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor an hpu-fp8 v1 checkpoint of this model must hold."""
    ignore = frozenset(qc.ignore)
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}
    for w in descriptor.weights():
        if w.is_linear and w.module not in ignore:
            expected[w.name] = ("F8_E4M3", w.shape)
            expected[names.tensor(w.module, names.WEIGHT_SCALE)] = ("F32", (w.shape[-1],) if w.channel_wise else (1,))
        else:
            expected[w.name] = (w.source_dtype, w.shape)
    for module in descriptor.act_modules(qc.kv_cache_scheme is KvCacheScheme.FP8, ignore):
        expected[names.tensor(module, names.ACT_SCALE)] = ("F32", (1,))
        expected[names.tensor(module, names.ACT_AMAX)] = ("F32", (1,))
    return expected


def _read_shards(root: Path, report: ValidationReport) -> dict[str, TensorInfo]:
    """Index and headers, each defect recorded; returns the tensors of every readable shard."""
    try:
        weight_map, metadata = read_index(root)
    except HpuFp8Error as exc:
        report.add("container.index", INDEX_FILE, str(exc))
        return {}
    tensors: dict[str, TensorInfo] = {}
    for relative in sorted(set(weight_map.values())):
        try:
            path = safe_member(root, relative)
            if not path.is_file():
                raise CheckpointNotFoundError(f"shard {relative} named by the index is missing")
            for name, info in SafetensorsFile(path).tensors.items():
                if name in tensors:
                    report.add("container.index", name, f"tensor appears in {relative} and {tensors[name].file.name}")
                tensors[name] = info
        except (HpuFp8Error, OSError) as exc:
            report.add("container.shard", relative, str(exc))
    for name, relative in weight_map.items():
        info = tensors.get(name)
        if info is not None and info.file.name != Path(relative).name:
            report.add("container.index", name, f"index says {relative}, tensor is in {info.file.name}")
    readable = {info.file.name for info in tensors.values()}
    for name in sorted(set(tensors) - set(weight_map)):
        report.add("container.index", name, f"in shard {tensors[name].file.name} but not in the index")
    for name in sorted(set(weight_map) - set(tensors)):
        if Path(weight_map[name]).name in readable:
            report.add("container.index", name, f"index names it in {weight_map[name]}, which does not hold it")
    total = metadata.get("total_size")
    actual = sum(t.nbytes for t in tensors.values())
    if total is not None and not report.violations and total != actual:
        report.add("container.index", INDEX_FILE, f"metadata.total_size {total} != {actual} bytes of tensors")
    return tensors


def _scalar(files: dict[Path, SafetensorsFile], info: TensorInfo) -> np.ndarray:
    return np.asarray(files[info.file].get(info.name), np.float32)


def _check_scales(
    tensors: dict[str, TensorInfo],
    files: dict[Path, SafetensorsFile],
    qc: QuantizationConfig,
    descriptor: ModelDescriptor,
    report: ValidationReport,
) -> None:
    for name, info in tensors.items():
        if info.dtype != "F32" or not name.endswith((names.WEIGHT_SCALE, names.ACT_SCALE, names.ACT_AMAX)):
            continue
        values = _scalar(files, info)
        if not (np.isfinite(values).all() and (values > 0).all()):
            report.add(
                "scales.finite-positive", name, f"holds {values.min()}..{values.max()}; scales and amax must be finite and > 0"
            )
            continue
        if name.endswith(names.WEIGHT_SCALE) and not numerics.is_bf16_exact(values).all():
            report.add(
                "scales.weight-bf16",
                name,
                "weight scale is not bf16-representable; FastDeploy would dequantize with another value",
            )
        if (
            name.endswith(names.WEIGHT_SCALE)
            and qc.scale_rounding is ScaleRounding.POW2
            and not np.array_equal(values, numerics.round_up_to_pow2(values))
        ):
            report.add("scales.pow2", name, "scale_rounding is pow2 but the weight scale is not a power of two")
    for module in descriptor.act_modules(qc.kv_cache_scheme is KvCacheScheme.FP8, frozenset(qc.ignore)):
        scale_info = tensors.get(names.tensor(module, names.ACT_SCALE))
        amax_info = tensors.get(names.tensor(module, names.ACT_AMAX))
        if scale_info is None or amax_info is None or scale_info.shape != (1,) or amax_info.shape != (1,):
            continue
        amax, scale = _scalar(files, amax_info), _scalar(files, scale_info)
        want = numerics.act_scale_from_amax(amax, qc.fp8_max, qc.scale_rounding.value)
        if np.isfinite(amax).all() and not np.array_equal(scale, want):
            report.add(
                "scales.act-consistent",
                scale_info.name,
                f"act_scale {scale[0]!r} != act_amax / fp8_max = {want[0]!r} ({qc.scale_rounding.value} rounding)",
            )
        if module.endswith(".self_attn.s") and amax[0] != 1.0:
            report.add(
                "scales.s-amax-one",
                amax_info.name,
                f"s.act_amax is {amax[0]!r}; it must be 1.0 (decode quantizes exp scores peaking at 1)",
            )


def _scan_weights(
    tensors: dict[str, TensorInfo],
    files: dict[Path, SafetensorsFile],
    qc: QuantizationConfig,
    report: ValidationReport,
    progress: Callable[[int], None] | None,
) -> None:
    limit = numerics.max_code(qc.fp8_max)
    for name, info in tensors.items():
        if info.dtype != "F8_E4M3":
            continue
        codes = files[info.file].get(name).reshape(-1).view(np.uint8)
        work = np.empty(min(_SCAN_CHUNK, codes.size), np.uint8)
        for start in range(0, codes.size, _SCAN_CHUNK):
            chunk = codes[start : start + _SCAN_CHUNK]
            magnitude = np.bitwise_and(chunk, 0x7F, out=work[: chunk.size])
            if magnitude.max() > limit:
                bad = np.flatnonzero(magnitude > limit)
                kind = "NaN codes" if (magnitude[bad] == 0x7F).any() else f"values beyond ±{qc.fp8_max:g}"
                report.add("weights.fp8-codes", name, f"{bad.size}+ {kind}, first at flat index {start + int(bad[0])}")
                break
        report.weight_bytes_scanned += info.nbytes
        if progress:
            progress(info.nbytes)


def _check_config(config: dict, qc: QuantizationConfig, descriptor: ModelDescriptor, report: ValidationReport) -> None:
    for problem in fastdeploy_config_problems(config):
        report.add("config.fastdeploy", "config.json", problem)
    if not qc.servable_by_fastdeploy:
        report.warnings.append(
            f"fp8_max is {qc.fp8_max:g}: valid on Gaudi3, but FastDeploy's HPU path assumes 240 everywhere, so FastDeploy "
            "cannot serve it today; `hpu-fp8 retarget --target gaudi2` makes a 240 checkpoint"
        )
    if (descriptor.moe is None) != (qc.moe is None):
        report.add("config.moe-policy", "quantization_config.moe", "must be present exactly for MoE models")
    if qc.moe is not None and descriptor.moe is not None:
        for ref in qc.moe.dead_experts.filled:
            if not descriptor.is_moe_layer(ref.layer) or ref.expert >= descriptor.moe.num_experts:
                report.add(
                    "config.moe-policy",
                    "quantization_config.moe.dead_experts",
                    f"layer {ref.layer} expert {ref.expert} does not exist",
                )
    linear_modules = {w.module for w in descriptor.weights() if w.is_linear}
    for module in qc.ignore:
        if module not in linear_modules:
            report.add("config.ignore", "quantization_config.ignore", f"{module!r} is not a linear module of this model")
    act = set(descriptor.act_modules(qc.kv_cache_scheme is KvCacheScheme.FP8, frozenset(qc.ignore)))
    for module in qc.calibration.overrides:
        if module not in act:
            report.add(
                "config.calibration",
                "quantization_config.calibration.overrides",
                f"{module!r} is not an act module of this checkpoint",
            )


def validate(root: str | Path, full: bool = True, progress: Callable[[int], None] | None = None) -> ValidationReport:
    """Check ``root``; ``full`` also scans every fp8 weight and every file's sha256.

    Raises :class:`~hpu_fp8_loader.errors.HpuFp8Error` subclasses when the directory cannot be read
    as an hpu-fp8 v1 checkpoint at all.
    """
    root = Path(root)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{root}: no such checkpoint directory")
    config = read_config(root)
    qc = parse_quantization_config(config, str(root / "config.json"))
    descriptor = describe(config)
    report = ValidationReport(str(root), "full" if full else "quick")
    _check_config(config, qc, descriptor, report)
    tensors = _read_shards(root, report)
    report.tensors = len(tensors)
    for problem in check_manifest(root, hashes=full):
        report.add("container.manifest", "hpu_fp8_manifest.json", problem)
    expected = expected_tensors(descriptor, qc)
    missing = [n for n in expected if n not in tensors]
    unexpected = [n for n in tensors if n not in expected]
    if tensors and missing:
        report.add("tensors.expected", "checkpoint", f"{len(missing)} tensor(s) missing: {', '.join(missing[:10])}")
    if unexpected:
        report.add("tensors.expected", "checkpoint", f"{len(unexpected)} unexpected tensor(s): {', '.join(unexpected[:10])}")
    for name, (dtype, shape) in expected.items():
        info = tensors.get(name)
        if info is not None and (info.dtype, info.shape) != (dtype, shape):
            report.add("tensors.dtype-shape", name, f"is {info.dtype}{list(info.shape)}, expected {dtype}{list(shape)}")
    files = {info.file: None for info in tensors.values()}
    opened = {path: SafetensorsFile(path) for path in files}
    _check_scales(tensors, opened, qc, descriptor, report)
    if full:
        _scan_weights(tensors, opened, qc, report, progress)
    return report

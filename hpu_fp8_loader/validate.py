"""Check a directory against every rule of docs/spec.md and list each violation.

A checkpoint that cannot be interpreted as hpu-fp8 v1 at all (no directory, config.json missing or
not JSON, not an hpu-fp8 checkpoint, another format_version) raises a typed error: "unreadable".
Everything else is collected, so one run shows every problem.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import scales
from .arch import ModelDescriptor, describe
from .errors import CheckpointNotFoundError, HpuFp8Error
from .io.checkpoint import INDEX_FILE, read_config, read_index, safe_member
from .io.manifest import check_manifest
from .io.safetensors_file import SafetensorsFile, TensorInfo
from .spec import names
from .spec.config import KvCacheScheme, QuantizationConfig, ScaleRounding, fastdeploy_config_problems, parse_quantization_config

__all__ = ["ValidationReport", "Violation", "expected_tensors", "validate"]

# Bytes read per step of the full scan, and files scanned at once.
_SCAN_BLOCK = 8 << 20
_SCAN_THREADS = 2


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


def _read_shards(root: Path, report: ValidationReport) -> tuple[dict[str, TensorInfo], dict[Path, SafetensorsFile]]:
    """Index and headers, each defect recorded; returns the tensors of every readable shard and the
    opened shards themselves, so later checks read scales without parsing a header again."""
    try:
        weight_map, metadata = read_index(root)
    except HpuFp8Error as exc:
        report.add("container.index", INDEX_FILE, str(exc))
        return {}, {}
    tensors: dict[str, TensorInfo] = {}
    files: dict[Path, SafetensorsFile] = {}
    for relative in sorted(set(weight_map.values())):
        try:
            path = safe_member(root, relative)
            if not path.is_file():
                raise CheckpointNotFoundError(f"shard {relative} named by the index is missing")
            shard = files[path] = SafetensorsFile(path)
            for name, info in shard.tensors.items():
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
    return tensors, files


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
        if name.endswith(names.WEIGHT_SCALE) and not scales.is_bf16_exact(values).all():
            report.add(
                "scales.weight-bf16",
                name,
                "weight scale is not bf16-representable; FastDeploy would dequantize with another value",
            )
        if (
            name.endswith(names.WEIGHT_SCALE)
            and qc.scale_rounding is ScaleRounding.POW2
            and not np.array_equal(values, scales.round_up_to_pow2(values))
        ):
            report.add("scales.pow2", name, "scale_rounding is pow2 but the weight scale is not a power of two")
    for module in descriptor.act_modules(qc.kv_cache_scheme is KvCacheScheme.FP8, frozenset(qc.ignore)):
        scale_info = tensors.get(names.tensor(module, names.ACT_SCALE))
        amax_info = tensors.get(names.tensor(module, names.ACT_AMAX))
        if scale_info is None or amax_info is None or scale_info.shape != (1,) or amax_info.shape != (1,):
            continue
        amax, scale = _scalar(files, amax_info), _scalar(files, scale_info)
        want = scales.act_scale_from_amax(amax, qc.fp8_max, qc.scale_rounding.value)
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


def _check_codes(codes: np.ndarray, info: TensorInfo, first: int, fp8_max: float, work: np.ndarray) -> Violation | None:
    """A violation if a block of ``info``'s codes (starting at element ``first``) holds NaN or out-of-range codes."""
    magnitude = np.bitwise_and(codes, 0x7F, out=work[: codes.size])
    limit = scales.max_code(fp8_max)
    if magnitude.max() <= limit:
        return None
    bad = np.flatnonzero(magnitude > limit)
    kind = "NaN codes" if (magnitude[bad] == 0x7F).any() else f"values beyond ±{fp8_max:g}"
    return Violation("weights.fp8-codes", info.name, f"{bad.size}+ {kind}, first at flat index {first + int(bad[0])}")


def _scan_file(
    path: Path, fp8: list[TensorInfo], fp8_max: float, hashes: bool, progress: Callable[[int], None] | None
) -> tuple[str | None, list[Violation]]:
    """Check every fp8 tensor of a shard; with ``hashes``, in one sequential read that also hashes the file."""
    buffer = bytearray(_SCAN_BLOCK)
    work = np.empty(_SCAN_BLOCK, np.uint8)
    flagged: dict[str, Violation] = {}
    sha = hashlib.sha256() if hashes else None
    with open(path, "rb", buffering=0) as f:
        if sha is None:  # only the fp8 regions need reading
            for t in fp8:
                for start in range(t.begin, t.end, _SCAN_BLOCK):
                    n = os.preadv(f.fileno(), [memoryview(buffer)[: min(_SCAN_BLOCK, t.end - start)]], start)
                    violation = _check_codes(np.frombuffer(buffer, np.uint8, n), t, start - t.begin, fp8_max, work)
                    if progress:
                        progress(n)
                    if violation:
                        flagged[t.name] = violation
                        break
            return None, list(flagged.values())
        fp8 = sorted(fp8, key=lambda t: t.begin)
        position = 0
        while n := f.readinto(buffer):
            view = memoryview(buffer)[:n]
            sha.update(view)
            codes = np.frombuffer(view, np.uint8)
            for t in fp8:
                if t.end <= position or t.name in flagged:
                    continue
                if t.begin >= position + n:
                    break
                lo, hi = max(t.begin, position) - position, min(t.end, position + n) - position
                violation = _check_codes(codes[lo:hi], t, position + lo - t.begin, fp8_max, work)
                if violation:
                    flagged[t.name] = violation
            position += n
            if progress:
                progress(n)
    return sha.hexdigest(), list(flagged.values())


def _scan_files(
    root: Path,
    tensors: dict[str, TensorInfo],
    qc: QuantizationConfig,
    hashes: bool,
    report: ValidationReport,
    progress: Callable[[int], None] | None,
) -> dict[str, str]:
    """The fp8 code check of every shard (and its sha256 when ``hashes``), two files at a time."""
    by_file: dict[Path, list[TensorInfo]] = {}
    for info in tensors.values():
        by_file.setdefault(info.file, []).append(info)
    with ThreadPoolExecutor(_SCAN_THREADS) as pool:  # hashlib and numpy release the GIL on large buffers
        results = {
            path: pool.submit(_scan_file, path, [t for t in infos if t.dtype == "F8_E4M3"], qc.fp8_max, hashes, progress)
            for path, infos in by_file.items()
        }
        digests = {}
        for path, future in results.items():
            digest, violations = future.result()
            if digest is not None:
                digests[Path(path).relative_to(Path(root).absolute()).as_posix()] = digest
            report.violations.extend(violations)
            report.weight_bytes_scanned += sum(t.nbytes for t in by_file[path] if t.dtype == "F8_E4M3")
    return digests


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


def validate(
    root: str | Path, full: bool = True, hashes: bool = False, progress: Callable[[int], None] | None = None
) -> ValidationReport:
    """Check ``root``; ``full`` also scans every fp8 weight; ``hashes`` also checks every sha256.

    sha256 guards transport, not the format: ``pull``, ``push`` and a resumed ``convert`` always
    check it; here it is asked for, since hashing costs more than the rest of a full check.

    Raises :class:`~hpu_fp8_loader.errors.HpuFp8Error` subclasses when the directory cannot be read
    as an hpu-fp8 v1 checkpoint at all.
    """
    root = Path(root)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{root}: no such checkpoint directory")
    config = read_config(root)
    qc = parse_quantization_config(config, str(root / "config.json"))
    descriptor = describe(config)
    report = ValidationReport(str(root), ("full" if full else "quick") + (" + sha256" if hashes else ""))
    _check_config(config, qc, descriptor, report)
    tensors, files = _read_shards(root, report)
    report.tensors = len(tensors)
    digests = _scan_files(root, tensors, qc, hashes, report, progress) if full or hashes else {}
    for problem in check_manifest(root, hashes=hashes, known=digests):
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
    _check_scales(tensors, files, qc, descriptor, report)
    return report

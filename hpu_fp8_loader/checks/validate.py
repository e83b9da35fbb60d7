"""Check a directory against every rule of docs/spec.md and list each violation.

A checkpoint that cannot be interpreted as hpu-fp8 v1 at all (no directory, config.json missing or
not JSON, not an hpu-fp8 checkpoint, another format_version) raises a typed error: "unreadable".
Everything else is collected, so one run shows every problem.

Every command that reads an hpu-fp8 checkpoint opens it with :func:`open_validated` (the quick check)
and checks the values it reads with :func:`check_values` (the full check's value rules, on bytes it
reads anyway): a checkpoint validate rejects is never mapped, exported, retargeted or evaluated.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hpu_fp8_loader.arch import ModelDescriptor, describe
from hpu_fp8_loader.arch.contents import bf16_problems, expected_tensors
from hpu_fp8_loader.errors import CheckpointNotFoundError, HpuFp8Error, NonFiniteError
from hpu_fp8_loader.io.checkpoint import INDEX_FILE, Checkpoint, read_config, read_index, safe_member
from hpu_fp8_loader.io.manifest import check_manifest
from hpu_fp8_loader.io.safetensors_file import SafetensorsFile, TensorInfo
from hpu_fp8_loader.numerics import scales
from hpu_fp8_loader.sources.resolve import SPEC_PATTERNS, local_or_hub
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import (
    FASTDEPLOY_EXCLUSION_KEYS,
    KvCacheScheme,
    QuantizationConfig,
    ScaleRounding,
    fastdeploy_config_problems,
    parse_quantization_config,
)
from hpu_fp8_loader.spec.fp8 import ACT_AMAX_RANGE, SCALE_RANGE

__all__ = [
    "ValidatedCheckpoint",
    "ValidationReport",
    "Violation",
    "check_values",
    "open_validated",
    "validate",
]

# Bytes read per step of the full scan, and files scanned at once.
_SCAN_BLOCK = 8 << 20
_SCAN_THREADS = 2
# Bits that are all set exactly in the inf and NaN encodings of each float dtype a checkpoint may hold.
_EXPONENT_BITS: dict[str, np.uint16 | np.uint32] = {
    "BF16": np.uint16(0x7F80),
    "F16": np.uint16(0x7C00),
    "F32": np.uint32(0x7F800000),
}
_SCALE_SUFFIXES = (names.WEIGHT_SCALE, names.ACT_SCALE, names.ACT_AMAX)


@dataclass(frozen=True)
class Violation:
    """One broken rule of docs/spec.md: the rule's id (such as ``"scales.range"``), where, and what is wrong."""

    rule: str  # the rule's id in docs/spec.md
    where: str  # file, tensor or key
    message: str


@dataclass
class ValidationReport:
    """Every violation :func:`validate` found in a checkpoint (all of them, not the first), and its warnings.

    Attributes:
        root: the checkpoint directory checked.
        mode: ``"quick"`` or ``"full"``, with ``" + sha256"`` when the hashes were checked.
        violations: each broken rule as a ``Violation`` (``rule``: its id in docs/spec.md, such as
            ``"scales.range"``; ``where``: the file, tensor or key; ``message``).
        warnings: what is valid but worth knowing, such as an fp8_max of 448 FastDeploy cannot serve today.
        tensors: tensors found in the readable shards.
        weight_bytes_scanned: bytes of weights whose values were checked (0 in the quick mode without hashes).
        valid: whether there is no violation (read-only).

    Example:
        >>> from hpu_fp8_loader import validate
        >>> report = validate("qwen2-fp8")
        >>> report.valid, report.mode, report.tensors
        (True, 'full', 57)
        >>> for violation in report.violations:
        ...     print(f"[{violation.rule}] {violation.where}: {violation.message}")
        >>> report.to_dict()["valid"]  # the JSON `hpu-fp8 validate --json` prints
        True
    """

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
                what = "is not a regular file" if os.path.lexists(path) else "is missing"
                raise CheckpointNotFoundError(f"shard {relative} named by the index {what}")
            shard = files[path] = SafetensorsFile(path)
            for name, info in shard.tensors.items():
                if name in tensors:
                    report.add("container.index", name, f"tensor appears in {relative} and {tensors[name].file.name}")
                tensors[name] = info
        except HpuFp8Error as exc:  # an OSError (permissions, I/O) is not a defect of the checkpoint: unreadable
            report.add("container.shard", relative, str(exc))
    for name, relative in weight_map.items():
        found = tensors.get(name)
        if found is not None and found.file.name != Path(relative).name:
            report.add("container.index", name, f"index says {relative}, tensor is in {found.file.name}")
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


def _span(values: np.ndarray) -> str:
    """The values of a scale tensor for a message: one number, or the smallest and largest."""
    low, high = float(values.min()), float(values.max())
    return f"{low:.9g}" if low == high else f"{low:.9g}..{high:.9g}"


def _range_violation(name: str, values: np.ndarray) -> Violation | None:
    """A violation if a finite, positive scale or amax lies outside the range the spec allows it (section 3.3)."""
    low, high = ACT_AMAX_RANGE if name.endswith(names.ACT_AMAX) else SCALE_RANGE
    if ((values >= low) & (values <= high)).all():
        return None
    what = "an act_amax" if name.endswith(names.ACT_AMAX) else "a scale"
    return Violation("scales.range", name, f"holds {_span(values)}; {what} must lie in [{low:g}, {high:g}]")


def _check_scales(
    tensors: dict[str, TensorInfo],
    files: dict[Path, SafetensorsFile],
    qc: QuantizationConfig,
    descriptor: ModelDescriptor,
    report: ValidationReport,
) -> None:
    for name, info in tensors.items():
        if info.dtype != "F32" or not name.endswith(_SCALE_SUFFIXES):
            continue
        values = _scalar(files, info)
        if not (np.isfinite(values).all() and (values > 0).all()):
            report.add("scales.finite-positive", name, f"holds {_span(values)}; scales and amax must be finite and > 0")
            continue
        out_of_range = _range_violation(name, values)
        if out_of_range:
            report.violations.append(out_of_range)
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
                f"act_scale {scale[0]:.9g} != act_amax / fp8_max = {want[0]:.9g} ({qc.scale_rounding.value} rounding)",
            )
        if names.attention_point_of(module) == "s" and amax[0] != 1.0:
            report.add(
                "scales.s-amax-one",
                amax_info.name,
                f"s.act_amax is {amax[0]:.9g}; it must be 1.0 (decode quantizes exp scores peaking at 1)",
            )


def _value_violation(info: TensorInfo, raw: np.ndarray, first: int, fp8_max: float, work: np.ndarray) -> Violation | None:
    """A violation if a block of ``info``'s elements (its bytes ``raw``, whole elements from element ``first``)
    holds a value the spec forbids: a NaN or out-of-range fp8 code, or a NaN or inf in a kept tensor.

    Bit tests only (no float conversion, no ml_dtypes): the fast path is one AND and one max per block.
    """
    if info.dtype == "F8_E4M3":
        magnitude = np.bitwise_and(raw, 0x7F, out=work[: raw.size])
        limit = scales.max_code(fp8_max)
        if magnitude.max(initial=0) <= limit:
            return None
        bad = np.flatnonzero(magnitude > limit)
        kind = "NaN codes" if (magnitude[bad] == 0x7F).any() else f"values beyond ±{fp8_max:g}"
        return Violation("weights.fp8-codes", info.name, f"{bad.size}+ {kind}, first at flat index {first + int(bad[0])}")
    exponent_bits = _EXPONENT_BITS.get(info.dtype)
    if exponent_bits is None:
        return None
    bits = raw.view(exponent_bits.dtype)
    exponent = np.bitwise_and(bits, exponent_bits, out=work.view(exponent_bits.dtype)[: bits.size])
    if exponent.max(initial=0) < exponent_bits:  # the field is all ones exactly for inf and NaN
        return None
    bad = np.flatnonzero(exponent == exponent_bits)
    return Violation("weights.finite", info.name, f"{bad.size}+ NaN or inf values, first at flat index {first + int(bad[0])}")


def _scanned(info: TensorInfo) -> bool:
    """Whether the full check reads a tensor's values: fp8 weights and kept tensors (scales are checked on their own)."""
    return info.dtype == "F8_E4M3" or (info.dtype in _EXPONENT_BITS and not info.name.endswith(_SCALE_SUFFIXES))


def _scan_tensor(fd: int, t: TensorInfo, fp8_max: float, buffer: bytearray, work: np.ndarray, progress) -> Violation | None:
    """The value check of one tensor, read by pread in blocks of whole elements."""
    itemsize = 1 if t.dtype == "F8_E4M3" else _EXPONENT_BITS[t.dtype].dtype.itemsize  # _SCAN_BLOCK is a multiple of each
    for start in range(t.begin, t.end, _SCAN_BLOCK):
        want = min(_SCAN_BLOCK, t.end - start)
        n = os.preadv(fd, [memoryview(buffer)[:want]], start)
        if n != want:
            return Violation("container.shard", t.file.name, f"file ended while reading tensor '{t.name}' (truncated?)")
        violation = _value_violation(t, np.frombuffer(buffer, np.uint8, n), (start - t.begin) // itemsize, fp8_max, work)
        if progress:
            progress(n)
        if violation:
            return violation
    return None


def _scan_file(
    path: Path, checked: list[TensorInfo], fp8_max: float, hashes: bool, progress: Callable[[int], object] | None
) -> tuple[str | None, list[Violation]]:
    """Check the values of ``checked`` tensors of a shard; with ``hashes``, also hash the file in one
    sequential read that checks its fp8 codes on the way (kept tensors, a few per cent, are read again)."""
    buffer = bytearray(_SCAN_BLOCK)
    work = np.empty(_SCAN_BLOCK, np.uint8)
    flagged: dict[str, Violation] = {}
    sha = hashlib.sha256() if hashes else None
    with open(path, "rb", buffering=0) as f:
        if sha is not None:
            fp8 = sorted((t for t in checked if t.dtype == "F8_E4M3"), key=lambda t: t.begin)
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
                    violation = _value_violation(t, codes[lo:hi], position + lo - t.begin, fp8_max, work)
                    if violation:
                        flagged[t.name] = violation
                position += n
                if progress:
                    progress(n)
        for t in checked:
            if sha is None or t.dtype != "F8_E4M3":
                violation = _scan_tensor(f.fileno(), t, fp8_max, buffer, work, None if sha else progress)
                if violation:
                    flagged[t.name] = violation
    return (sha.hexdigest() if sha else None), list(flagged.values())


def _scan_files(
    root: Path,
    tensors: dict[str, TensorInfo],
    qc: QuantizationConfig,
    hashes: bool,
    report: ValidationReport,
    progress: Callable[[int], object] | None,
) -> dict[str, str]:
    """The value check of every shard (and its sha256 when ``hashes``), two files at a time."""
    by_file: dict[Path, list[TensorInfo]] = {}
    for info in tensors.values():
        by_file.setdefault(info.file, []).append(info)
    with ThreadPoolExecutor(_SCAN_THREADS) as pool:  # hashlib and numpy release the GIL on large buffers
        results = {
            path: pool.submit(_scan_file, path, [t for t in infos if _scanned(t)], qc.fp8_max, hashes, progress)
            for path, infos in by_file.items()
        }
        digests = {}
        for path, future in results.items():
            digest, violations = future.result()
            if digest is not None:
                digests[Path(path).relative_to(Path(root).absolute()).as_posix()] = digest
            report.violations.extend(violations)
            report.weight_bytes_scanned += sum(t.nbytes for t in by_file[path] if _scanned(t))
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
            report.add(
                "config.ignore", "quantization_config.ignore",
                f"{module!r} is not a linear module of this model ({FASTDEPLOY_EXCLUSION_KEYS}, as a glob and with "
                "'model.' read as the model's own prefix: an entry that is not a linear's name may keep others in BF16)",
            )  # fmt: skip
    if set(qc.ignore) <= linear_modules:  # otherwise the entries above are the problem
        for problem in bf16_problems(descriptor, qc):
            report.add("config.ignore", "quantization_config.ignore", problem)
    act = set(descriptor.act_modules(qc.kv_cache_scheme is KvCacheScheme.FP8, frozenset(qc.ignore)))
    for module in qc.calibration.overrides:
        if module not in act:
            report.add(
                "config.calibration",
                "quantization_config.calibration.overrides",
                f"{module!r} is not an act module of this checkpoint",
            )


def _check(
    root: str | Path, full: bool, hashes: bool, progress: Callable[[int], object] | None
) -> tuple[ValidationReport, Checkpoint, QuantizationConfig, ModelDescriptor]:
    """The report, and the checkpoint as the checks opened it (shard headers parsed once)."""
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
    return report, Checkpoint(root, config, files, tensors), qc, descriptor


def validate(
    root: str | Path,
    full: bool = True,
    hashes: bool = False,
    progress: Callable[[int], object] | None = None,
    revision: str | None = None,
) -> ValidationReport:
    """Check ``root`` against every rule of docs/spec.md; ``full`` also scans every fp8 weight and kept tensor;
    ``hashes`` also checks every sha256.

    Every violation is collected, so one run shows every problem; only a directory that cannot be read as an
    hpu-fp8 v1 checkpoint at all raises. The quick check reads config.json, the index, every shard header, the
    manifest (file sizes), the expected tensors and every scale. sha256 guards transport, not the format:
    ``pull``, ``push`` and a resumed ``convert`` always check it; here it is asked for, since hashing costs more
    than the rest of a full check.

    Args:
        root: the hpu-fp8 checkpoint directory, or a Hub repo id (``ORG/NAME``) when no such local path exists: its
            whole snapshot is downloaded (even the quick check reads every scale inside the shards), or found in the
            cache offline; the report's ``root`` is then the snapshot.
        full: also check the values of every fp8 weight (no NaN code, nothing beyond ±fp8_max) and kept tensor
            (no NaN or inf).
        hashes: also check every file's sha256 against the manifest (with ``full``, in the same read).
        progress: called with the byte count of each block read by the value scan or hashing.
        revision: the Hub branch, tag or commit when ``root`` is a repo id (``main`` by default).

    Returns:
        A :class:`~hpu_fp8_loader.ValidationReport`; ``report.valid`` is true when there is no violation.

    Raises:
        CheckpointNotFoundError: ``root`` is not a directory; as a repo id: missing, gated or private on the Hub, a
            revision that does not exist, or offline and not in the cache.
        HubError: the Hub cannot be reached or refused the request.
        ConfigError: config.json is missing or not strict JSON, its quantization_config breaks the schema, or the
            model keys are invalid.
        NotHpuFp8CheckpointError: config.json has no hpu-fp8 quantization_config (a BF16 source, a legacy
            FastDeploy checkpoint).
        UnsupportedFormatVersionError: the checkpoint declares a format_version this reader does not implement.
        UnknownArchitectureError: config.json's model_type is not supported.
        OSError: a file cannot be read at all (permissions, an I/O error), which is no defect of the checkpoint.

    Example:
        >>> from hpu_fp8_loader import validate
        >>> report = validate("qwen2-fp8", full=True)
        >>> report.valid
        True
        >>> validate("qwen2-fp8", full=False, hashes=True).mode  # after a copy or a download
        'quick + sha256'
    """
    return _check(local_or_hub(root, revision, SPEC_PATTERNS), full, hashes, progress)[0]


@dataclass(frozen=True)
class ValidatedCheckpoint:
    """An hpu-fp8 checkpoint that passed the quick check, opened for reading."""

    checkpoint: Checkpoint
    qc: QuantizationConfig
    descriptor: ModelDescriptor


def open_validated(root: str | Path) -> ValidatedCheckpoint:
    """Open an hpu-fp8 checkpoint for reading: the one entry point of map, export-legacy, retarget and eval.

    Runs the quick check first (config, index, headers, manifest, expected tensors, every scale), so a
    command never builds output from a checkpoint validate rejects, and never meets a missing tensor
    halfway. The values are checked as the command reads them (:func:`check_values`): no second pass.
    Raises :class:`HpuFp8Error` with the first violations in one line.
    """
    report, checkpoint, qc, descriptor = _check(root, full=False, hashes=False, progress=None)
    if not report.valid:
        shown = "; ".join(f"[{v.rule}] {v.where}: {v.message}" for v in report.violations[:3])
        more = len(report.violations) - 3
        raise HpuFp8Error(
            f"{root}: not a valid hpu-fp8 checkpoint, refusing to read it: {shown}"
            + (f" (and {more} more)" if more > 0 else "")
            + f"; `hpu-fp8 validate {root}` lists every violation"
        )
    return ValidatedCheckpoint(checkpoint, qc, descriptor)


def check_values(info: TensorInfo, values: np.ndarray, first_row: int, fp8_max: float) -> None:
    """Refuse rows ``first_row``.. of tensor ``info`` as a command reads them: a NaN or out-of-range fp8
    code, or a NaN or inf in a kept tensor (the full check's value rules, on bytes read anyway)."""
    raw = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
    first = first_row * math.prod(info.shape[1:])
    violation = _value_violation(info, raw, first, fp8_max, np.empty(raw.size, np.uint8))
    if violation is not None:
        raise NonFiniteError(
            f"{info.file}: tensor '{info.name}': {violation.message}; not a valid hpu-fp8 checkpoint [{violation.rule}]"
        )

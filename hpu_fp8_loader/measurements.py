"""Activation statistics from files: our JSON format, and FastDeploy's measurement-mode text files.

FastDeploy writes ``key<TAB>float`` lines of raw amax to ``model_measurement.txt``, or to
``model_measurement_{rank}.txt`` per tensor-parallel rank (docs/fastdeploy.md section 10). Each rank records
its own shard of the sharded activations, so rank files are merged by max, after checking that the
rank set is complete. No real FastDeploy file has been seen: the format is read from the code
([inferred]), and the tests use synthetic files.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .errors import MeasurementError
from .spec import names
from .spec.config import AmaxSourceKind
from .spec.measurements import MeasurementProvenance, Measurements, read_measurements

__all__ = ["LoadedMeasurements", "fastdeploy_rank_files", "load_measurements", "read_fastdeploy_file"]

_RANK_FILE = re.compile(r"^(?P<stem>.+)_(?P<rank>\d+)(?P<suffix>\.txt)$")


@dataclass
class LoadedMeasurements:
    measurements: Measurements
    warnings: list[str] = field(default_factory=list)


def read_fastdeploy_file(path: Path) -> dict[str, float]:
    """Spec module -> raw amax from one FastDeploy measurement file; errors name the file and line."""
    amax: dict[str, float] = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise MeasurementError(f"{path}: not a UTF-8 text file; expected FastDeploy's 'key<TAB>float' lines") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        key, tab, value = line.partition("\t")
        try:
            if not tab:
                raise ValueError("no TAB")
            amax_value = float(value)
            module = names.module_from_fastdeploy_key(key.strip())
        except ValueError as exc:
            raise MeasurementError(
                f"{path}:{number}: expected 'key<TAB>float' with a FastDeploy measurement key, got {line[:120]!r} ({exc})"
            ) from None
        if not math.isfinite(amax_value) or amax_value < 0:
            raise MeasurementError(f"{path}:{number}: amax {value.strip()} for {key.strip()} must be finite and >= 0")
        amax[module] = max(amax.get(module, 0.0), amax_value)
    if not amax:
        raise MeasurementError(f"{path}: holds no measurement lines")
    return amax


def fastdeploy_rank_files(path: Path) -> list[Path]:
    """The files of one FastDeploy measurement: the file itself, or its complete ``_{rank}`` set.

    ``path`` may be a directory (its ``model_measurement*.txt``), ``model_measurement.txt`` (which
    may exist only as rank files), or one rank file (its siblings are taken too).
    """
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("model_measurement*.txt"))
        if not found:
            raise MeasurementError(f"{path}: no model_measurement*.txt files in this directory")
        path = found[0]
    match = _RANK_FILE.match(path.name)
    stem, suffix = (match.group("stem"), match.group("suffix")) if match else (path.stem, path.suffix)
    ranks = {}
    for candidate in path.parent.glob(f"{stem}_*{suffix}"):
        m = _RANK_FILE.match(candidate.name)
        if m and m.group("stem") == stem:
            ranks[int(m.group("rank"))] = candidate
    if not ranks:
        if not path.is_file():
            raise MeasurementError(f"{path}: no such measurement file (nor {stem}_<rank>{suffix} files beside it)")
        return [path]
    missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
    if missing:
        raise MeasurementError(
            f"{path.parent}: tensor-parallel measurement files for rank(s) {missing} are missing "
            f"(found {stem}_{{{','.join(str(r) for r in sorted(ranks))}}}{suffix}); every rank records its own shard"
        )
    if path.is_file() and not match:
        raise MeasurementError(f"{path.parent}: both {path.name} and rank files {stem}_N{suffix} exist; pass one of them")
    return [ranks[r] for r in sorted(ranks)]


def _fastdeploy_warnings(amax: dict[str, float], label: str) -> list[str]:
    """Signs of a stale or dummy file: s far from 1, one value repeated across every layer."""
    warnings = []
    s_values = [v for m, v in amax.items() if m.endswith(".self_attn.s")]
    if s_values and (max(s_values) < 0.5 or max(s_values) > 1.001):
        warnings.append(
            f"{label}: attention-probability (s_matmul) amax is {max(s_values):g}, expected about 1; a stale or odd file?"
        )
    by_point: dict[str, dict[int, float]] = defaultdict(dict)
    for module, value in amax.items():
        match = names.MODULE_PATTERN.match(module)
        if match:
            point = module[match.end("layer") :]
            by_point[point][int(match.group("layer"))] = value
    for point, values in by_point.items():
        if point.endswith(".self_attn.s"):
            continue
        if len(values) >= 3 and len(set(values.values())) == 1:
            warnings.append(
                f"{label}: '{point.lstrip('.')}' is {next(iter(values.values())):g} in all {len(values)} layers; a dummy or stale file?"
            )
    return warnings


def load_measurements(path: str | Path) -> LoadedMeasurements:
    """Measurements from our JSON file, or from FastDeploy's text file(s) (rank files merged by max)."""
    path = Path(path)
    if path.suffix == ".json" and path.is_file():
        return LoadedMeasurements(read_measurements(path))
    files = fastdeploy_rank_files(path)
    merged: dict[str, float] = {}
    for file in files:
        for module, value in read_fastdeploy_file(file).items():
            merged[module] = max(merged.get(module, 0.0), value)
    label = (
        str(files[0]) if len(files) == 1 else f"{files[0].parent}/{files[0].name.rsplit('_', 1)[0]}_*.txt ({len(files)} ranks)"
    )
    provenance = MeasurementProvenance(
        kind=AmaxSourceKind.FASTDEPLOY_MEASUREMENT,
        tool="FastDeploy FD_HPU_MEASUREMENT_MODE=1",
        files=[f.name for f in files],
    )
    return LoadedMeasurements(Measurements(provenance=provenance, model=None, amax=merged), _fastdeploy_warnings(merged, label))

"""Activation statistics from files: our JSON format, and FastDeploy's measurement-mode text files.

FastDeploy writes ``key<TAB>float`` lines of raw amax to ``model_measurement.txt``, or to
``model_measurement_{rank}.txt`` per tensor-parallel rank (docs/fastdeploy.md section 10). Each rank records
its own shard of the sharded activations, so rank files are merged by max, after checking that the
rank set is complete. No real FastDeploy file has been seen: the format is read from the code
([inferred]), and the tests use synthetic files.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from hpu_fp8_loader.errors import MeasurementError
from hpu_fp8_loader.io.file_output import write_text_atomically
from hpu_fp8_loader.io.jsonfile import read_json_object
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import AmaxSourceKind
from hpu_fp8_loader.spec.fp8 import act_amax_problem
from hpu_fp8_loader.spec.measurements import FORMAT, MeasurementProvenance, Measurements, check_module_numbers

__all__ = [
    "LoadedMeasurements",
    "fastdeploy_rank_files",
    "load_measurement_sets",
    "load_measurements",
    "read_fastdeploy_file",
    "read_measurements",
    "write_measurements",
]

_RANK_TAIL = re.compile(r"^(?P<stem>.+?)(?P<tail>(?:_\d+)+)$")  # \d: any Unicode digit, to refuse, never to read
_PLAIN_RANK = re.compile(rf"_{names.PLAIN_NUMBER}")
_AMAX = re.compile(r"[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?")  # Python float text, ASCII
_JSON_START = (b"{", b"[")
_FASTDEPLOY_FILE = "model_measurement.txt"


def _first_error(exc: ValidationError) -> str:
    """Pydantic's first error as ``where: what``, in the file's own terms (JSON values, no "Value error," prefix)."""
    first = exc.errors()[0]
    where = "".join(f"[{json.dumps(p)}]" if i else str(p) for i, p in enumerate(first["loc"]))
    if first["type"] == "value_error":
        return f"{where}: {first['ctx']['error']}"
    if first["type"] == "missing":
        return f"{where}: missing"
    return f"{where}: {first['msg'].lower()}, got {json.dumps(first['input'])[:80]}"


def read_measurements(path: str | Path) -> Measurements:
    """A measurement file, validated strictly: a number written as a string or a boolean is an error, not a value.

    ``read_json_object`` names the file for every way it can fail to be one JSON object; the fields are
    then checked in pydantic's strict JSON mode, where ``"3.5"`` and ``true`` are not numbers. Only our JSON
    format is read here; :func:`load_measurements` also reads FastDeploy's text files.

    Args:
        path: a JSON file as :func:`write_measurements` (or ``hpu-fp8 calibrate -o``) writes it.

    Returns:
        The file's :class:`~hpu_fp8_loader.Measurements`.

    Raises:
        MeasurementError: the file is missing or unreadable, is not one strict JSON object, its ``format`` is not
            ``"hpu-fp8-measurements"`` or its ``version`` not 1, a field breaks the schema (the message names
            the key), or an amax is outside the range an activation amax may take (2^-100 to 2^100; zero is allowed).

    Example:
        >>> from hpu_fp8_loader import read_measurements
        >>> measurements = read_measurements("measurements.json")
        >>> measurements.provenance.tool
        'hpu-fp8 calibrate'
    """
    path = Path(path)
    data = read_json_object(path, MeasurementError, "no such measurement file")
    if data.get("format") != FORMAT:
        raise MeasurementError(f"{path}: 'format' is not {FORMAT!r}")
    version = data.get("version")
    if type(version) is not int or version != 1:
        raise MeasurementError(f"{path}: version {json.dumps(version)}; this reader implements version 1")
    try:
        measurements = Measurements.model_validate_json(json.dumps(data), strict=True)
    except ValidationError as exc:
        raise MeasurementError(f"{path}: {_first_error(exc)}") from None
    for module, amax in measurements.amax.items():  # here, where the file can be named; zero is a dead point
        problem = act_amax_problem(amax) if amax else None
        if problem:
            raise MeasurementError(f"{path}: amax[{json.dumps(module)}]: {problem}")
    return measurements


def write_measurements(path: str | Path, measurements: Measurements, force: bool = False) -> None:
    """Write ``measurements`` as a JSON measurement file, atomically (see :func:`write_text_atomically`).

    ``path`` holds either what it held before or the whole new file, never a part, even after a crash; the file
    is what :func:`read_measurements` and ``hpu-fp8 convert --measurements`` read.

    Args:
        path: the file to write; its directory must exist.
        measurements: the measurements to write, such as ``calibrate(...).measurements``.
        force: replace an existing file; without it, a file at ``path`` (even one created while this ran) is
            refused, as ``hpu-fp8 calibrate -o`` refuses one without ``--force``.

    Returns:
        None.

    Raises:
        OutputExistsError: ``path`` exists and ``force`` is false.
        WriteFailedError: the file cannot be created or written (a missing or read-only directory, no space left).

    Example:
        >>> from hpu_fp8_loader import TINY_MODELS, calibrate, write_measurements
        >>> calibration = calibrate(TINY_MODELS["qwen2-bytes"], samples=8, seq_len=64)
        >>> write_measurements("measurements.json", calibration.measurements)
    """
    write_text_atomically(path, measurements.model_dump_json(indent=2, exclude_none=True) + "\n", force)


@dataclass
class LoadedMeasurements:
    """What :func:`load_measurements` read: the measurements, and warnings about them.

    Attributes:
        measurements: the measurements (FastDeploy's rank files merged by max).
        warnings: signs of a stale or dummy FastDeploy file (an attention-probability amax far from 1, one value
            repeated in every layer); always empty for our JSON files.
    """

    measurements: Measurements
    warnings: list[str] = field(default_factory=list)


def _parse_line(line: str) -> tuple[str, str, float]:
    """(FastDeploy key, spec module, amax) of one ``key<TAB>float`` line; ValueError says what is wrong.

    ``float()`` alone would also take ``1_0``, non-ASCII digits, ``nan`` and padding; the amax must be
    plain ASCII float text, and the module's layer and expert numbers plainly written.
    """
    key, tab, value = line.partition("\t")
    if not tab:
        raise ValueError("no TAB between key and value")
    key, value = key.strip(), value.strip()
    check_module_numbers(key)  # first: its message says what is wrong with the number
    module = names.module_from_fastdeploy_key(key)
    if not _AMAX.fullmatch(value) or not math.isfinite(float(value)):
        raise ValueError(f"amax {value[:40]!r} for {key} is not a finite decimal number >= 0")
    return key, module, float(value)


def read_fastdeploy_file(path: Path) -> dict[str, float]:
    """Spec module -> raw amax from one FastDeploy measurement file; errors name the file and line.

    FastDeploy writes a dict, one line per key: a repeated key means two runs or a hand edit were mixed
    into one file, and is refused rather than resolved. Different keys of one module (the per-expert
    up_gate inputs) are merged by max.
    """
    amax: dict[str, float] = {}
    seen: dict[str, int] = {}
    if not Path(path).is_file():  # a FIFO would block, a device never end
        raise MeasurementError(f"{path}: not a regular file")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise MeasurementError(f"{path}: not a UTF-8 text file; expected FastDeploy's 'key<TAB>float' lines") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            key, module, value = _parse_line(line)
        except ValueError as exc:
            raise MeasurementError(
                f"{path}:{number}: expected 'key<TAB>float' with a FastDeploy measurement key, got {line[:120]!r} ({exc})"
            ) from None
        if key in seen:
            raise MeasurementError(f"{path}:{number}: key {key} repeats line {seen[key]}; one file holds each key once")
        seen[key] = number
        amax[module] = max(amax.get(module, 0.0), value)
    if not amax:
        raise MeasurementError(f"{path}: holds no measurement lines")
    return amax


def _rank(path: Path) -> tuple[str, int | None]:
    """(stem, rank) of ``stem_rank.txt``, or (stem, None) for a file without a rank.

    A name ending in digits after ``_`` that are not one plain decimal rank (``_01``, ``_1_0``,
    ``_١``) is refused: read as an int it would collide with another rank file, or guess a rank.
    """
    match = _RANK_TAIL.match(path.stem)
    if not match:
        return path.stem, None
    if not _PLAIN_RANK.fullmatch(match["tail"]):
        raise MeasurementError(
            f"{path}: '{match['tail']}' is not one tensor-parallel rank; FastDeploy names rank files "
            f"{match['stem']}_0{path.suffix}, {match['stem']}_1{path.suffix}, ... (plain decimal numbers); rename it"
        )
    return match["stem"], int(match["tail"][1:])


def _ranks_text(ranks: list[int]) -> str:
    """A rank list short enough for a one-line message."""
    shown = ",".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def fastdeploy_rank_files(path: Path) -> list[Path]:
    """The files of one FastDeploy measurement: the file itself, or its complete ``_{rank}`` set.

    ``path`` may be a directory (its ``model_measurement.txt`` or ``model_measurement_{rank}.txt``
    set), ``model_measurement.txt`` (which may exist only as rank files), or one rank file (its
    siblings are taken too). Every sibling whose name ends in a number must be a plainly numbered rank.
    """
    path = Path(path)
    directory = path if path.is_dir() else None
    if directory is not None:
        path = directory / _FASTDEPLOY_FILE
    stem, own_rank = _rank(path)
    ranks: dict[int, Path] = {}
    for candidate in path.parent.glob(f"{glob.escape(stem)}_*{glob.escape(path.suffix)}"):
        match = _RANK_TAIL.match(candidate.stem)
        if match and match["stem"] == stem:
            rank = _rank(candidate)[1]
            assert rank is not None  # its name matched _RANK_TAIL, so _rank read a rank (or refused the name)
            ranks[rank] = candidate
    if not ranks:
        if os.path.lexists(path):
            return [path]
        if directory is not None:
            raise MeasurementError(f"{directory}: no {_FASTDEPLOY_FILE} nor {stem}_<rank>{path.suffix} files in this directory")
        raise MeasurementError(f"{path}: no such measurement file (nor {stem}_<rank>{path.suffix} files beside it)")
    missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
    if missing:
        raise MeasurementError(
            f"{path.parent}: tensor-parallel measurement files for rank(s) [{_ranks_text(missing)}] are missing "
            f"(found {stem}_{{{_ranks_text(sorted(ranks))}}}{path.suffix}); every rank records its own shard"
        )
    if path.is_file() and own_rank is None:
        raise MeasurementError(f"{path.parent}: both {path.name} and rank files {stem}_N{path.suffix} exist; pass one of them")
    return [ranks[r] for r in sorted(ranks)]


def _fastdeploy_warnings(amax: dict[str, float], label: str) -> list[str]:
    """Signs of a stale or dummy file: s far from 1, one value repeated across every layer."""
    warnings = []
    s_values = [v for m, v in amax.items() if names.attention_point_of(m) == "s"]
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
        if names.attention_point_of(point) == "s":
            continue
        if len(values) >= 3 and len(set(values.values())) == 1:
            warnings.append(
                f"{label}: '{point.lstrip('.')}' is {next(iter(values.values())):g} in all {len(values)} layers; a dummy or stale file?"
            )
    return warnings


def _is_json(path: Path) -> bool:
    """Whether a file is ours (JSON) rather than FastDeploy's text: by its first character, so a JSON file
    named ``m.txt`` (or ``m``) is read as JSON; a ``.json`` name always is (FastDeploy writes ``.txt``)."""
    if path.suffix == ".json":
        return True
    with open(path, "rb") as file:
        return file.read(4096).lstrip().startswith(_JSON_START)


def _read_ours(path: Path) -> LoadedMeasurements:
    """Our JSON file, its name recorded as the provenance's source file when it names none: convert's refusals
    (measurements of another model) and config.json's calibration sources then say which file it was."""
    measurements = read_measurements(path)
    if not measurements.provenance.files:
        provenance = measurements.provenance.model_copy(update={"files": [path.name]})
        measurements = measurements.model_copy(update={"provenance": provenance})
    return LoadedMeasurements(measurements)


def _directory_files(directory: Path) -> tuple[list[Path], list[Path]]:
    """(our JSON files, FastDeploy text files) of a directory, sorted by name; refused when it holds both or neither.

    Hidden files and files that are neither (no JSON start, no ``.txt`` name) are not measurements and are passed
    over; a mix would combine sets of unknown relation, so it is refused rather than guessed at.
    """
    files = sorted(p for p in directory.iterdir() if not p.name.startswith(".") and p.is_file())
    ours = [p for p in files if _is_json(p)]
    text = [p for p in files if p.suffix == ".txt" and p not in ours]
    if ours and text:
        raise MeasurementError(
            f"{directory}: holds both hpu-fp8 JSON measurement files ({ours[0].name}, ...) and FastDeploy text files "
            f"({text[0].name}, ...); put them in separate directories and pass --measurements for each"
        )
    if not ours and not text:
        raise MeasurementError(
            f"{directory}: no measurement files in this directory (hpu-fp8 JSON files, or FastDeploy's {_FASTDEPLOY_FILE} "
            "or its per-rank set)"
        )
    return ours, text


def load_measurements(path: str | Path) -> LoadedMeasurements:
    """Measurements from our JSON file, or from FastDeploy's text file(s) (rank files merged by max).

    FastDeploy's measurement mode writes ``key<TAB>float`` lines of raw amax to ``model_measurement.txt``, or one
    ``model_measurement_{rank}.txt`` per tensor-parallel rank; each rank records its own shard of the sharded
    activations, so the rank set must be complete, and the files are merged by max. A file is read as JSON when
    its name ends in ``.json`` or its text starts with ``{`` or ``[``, whatever its name. A directory of our JSON
    files holds several sets: :func:`load_measurement_sets` reads it.

    Args:
        path: our JSON file; a FastDeploy text file (one rank file brings its siblings); or a directory holding
            ``model_measurement.txt`` or its ``model_measurement_{rank}.txt`` set.

    Returns:
        A ``LoadedMeasurements``: ``.measurements`` (:class:`~hpu_fp8_loader.Measurements`; for FastDeploy's
        files, provenance kind ``fastdeploy-measurement`` and no ``model``; for ours, the file's name among the
        provenance's ``files`` when it names none) and ``.warnings`` (signs of a stale or dummy FastDeploy file: an
        attention-probability amax far from 1, one value repeated in every layer).

    Raises:
        MeasurementError: no such file (nor rank files), a rank file missing from the set, both a plain file and
            rank files, a rank suffix that is not a plain decimal number, a file that is not UTF-8 or holds a line
            that is not ``key<TAB>float`` with a FastDeploy measurement key, a key repeated in one file, a file
            with no lines; a directory holding JSON files (several sets), both kinds, or neither; for JSON,
            everything :func:`read_measurements` refuses.

    Example:
        >>> from hpu_fp8_loader import load_measurements
        >>> loaded = load_measurements("fastdeploy_run/")  # model_measurement_0.txt, model_measurement_1.txt
        >>> loaded.measurements.provenance.files, loaded.warnings
        (['model_measurement_0.txt', 'model_measurement_1.txt'], [])
    """
    path = Path(path)
    if path.is_file() and _is_json(path):
        return _read_ours(path)
    if path.is_dir() and _directory_files(path)[0]:
        raise MeasurementError(
            f"{path}: a directory of hpu-fp8 JSON measurement files, one set per file; name each file "
            "(load_measurement_sets reads such a directory)"
        )
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


def load_measurement_sets(path: str | Path) -> list[LoadedMeasurements]:
    """Every measurement set one ``--measurements PATH`` names: a directory of our JSON files gives one set per file,
    in sorted name order (as if each were passed with its own ``--measurements``); anything else one set.

    Why separate sets rather than one merged: each keeps its own provenance, so config.json records which file each
    act_amax came from, exactly as when the files are named one by one.

    Args:
        path: what :func:`load_measurements` reads, or a directory of hpu-fp8 JSON measurement files (``calibrate -o``
            outputs); hidden files and files of neither kind are passed over.

    Returns:
        One :class:`LoadedMeasurements` per set, to merge by max (``convert(..., [s.measurements for s in sets])``).

    Raises:
        MeasurementError: a directory holding both JSON and FastDeploy text files, or neither (named); everything
            :func:`load_measurements` refuses, naming the file.

    Example:
        >>> from hpu_fp8_loader import load_measurement_sets
        >>> [s.measurements.provenance.files for s in load_measurement_sets("measurements/")]
        [['attention.json'], ['mlp.json']]
    """
    path = Path(path)
    if path.is_dir():
        ours, _ = _directory_files(path)
        if ours:
            return [_read_ours(file) for file in ours]
    return [load_measurements(path)]

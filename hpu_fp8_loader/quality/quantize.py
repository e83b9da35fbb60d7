"""One step from a BF16 model to a local hpu-fp8 checkpoint: calibrate, then convert, resumable as convert is.

``OUT`` is refused (and ``OUT.partial`` locked) before the calibration runs, so that minutes of calibration are
never spent on an output that cannot be written. The calibration's measurements wait in
``OUT.partial/.hpu_fp8_calibration.json`` under a key of the source files and the calibration options: a
re-run after an interruption reuses them instead of calibrating again, and the conversion resumes from its
own journal. The published checkpoint holds them as ``hpu_fp8_measurements.json`` (convert writes every
measurement set it was made from), so it records where its scales came from.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import ValidationError

from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.arch.contents import check_keep_bf16
from hpu_fp8_loader.conversion.convert import ConvertProgress, ConvertResult, convert, refuse_fp8_folds
from hpu_fp8_loader.conversion.folds import ChosenFolds, FoldSite, fold_points, fold_sites
from hpu_fp8_loader.conversion.journal import CALIBRATION
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.engine.layer_major import LayerProgress
from hpu_fp8_loader.engine.weights import open_weights
from hpu_fp8_loader.io.checkpoint import CONFIG_FILE, Checkpoint, read_config
from hpu_fp8_loader.io.fingerprint import file_fingerprint
from hpu_fp8_loader.io.jsonfile import parse_json
from hpu_fp8_loader.io.own_files import read_own, write_new
from hpu_fp8_loader.io.writer import check_apart, prepare_output_dir
from hpu_fp8_loader.quality.calibrate import CalibrationOptions, CalibrationResult
from hpu_fp8_loader.quality.rebalance import MIGRATION, choose_rebalancing
from hpu_fp8_loader.spec.choices import Rebalance
from hpu_fp8_loader.spec.measurements import Measurements

if TYPE_CHECKING:
    from hpu_fp8_loader.quality.report import Report

__all__ = ["QuantizeResult", "quantize"]

log = logging.getLogger(__name__)
# The most a kept calibration of ours holds (its key and one measurement set; a 300B MoE's is a few MB).
_CALIBRATION_BYTES = 1 << 28


@dataclass
class QuantizeResult:
    """What :func:`quantize` did: the calibration (None when an interrupted run's was reused) and the conversion.

    Attributes:
        conversion: the :class:`~hpu_fp8_loader.ConvertResult`; ``conversion.out`` is the published checkpoint.
        calibration: the :class:`~hpu_fp8_loader.CalibrationResult`, or None when the measurements an interrupted
            run of the same calibration left in ``OUT.partial`` were reused.
        measurements: the activation statistics the checkpoint was made from (also its ``hpu_fp8_measurements.json``):
            with ``rebalance``, the amax of the folded model.
        folds: the channel folds ``options.rebalance`` chose (none when it is ``off``).

    Example:
        >>> from hpu_fp8_loader import TINY_MODELS, CalibrationOptions, quantize
        >>> result = quantize(TINY_MODELS["qwen2-bytes"], "qwen2-fp8", CalibrationOptions(samples=8, seq_len=64))
        >>> result.conversion.out, result.calibration.tokens
        (PosixPath('qwen2-fp8'), 512)
    """

    conversion: ConvertResult
    calibration: CalibrationResult | None
    measurements: Measurements
    folds: ChosenFolds


def quantize(
    src: str | Path,
    out: str | Path,
    calibration: CalibrationOptions | None = None,
    options: ConvertOptions | None = None,
    progress: Callable[[ConvertProgress], None] | None = None,
    calibration_progress: Callable[[LayerProgress], object] | None = None,
    report: Report | None = None,
) -> QuantizeResult:
    """Calibrate ``src`` with the reference engine, then convert it into an hpu-fp8 v1 checkpoint at ``out``.

    What ``hpu-fp8 convert SRC OUT --calibrate`` runs. ``out`` is checked and locked first; the calibration's
    measurements are kept in ``out.partial`` until the checkpoint is published, so the same call after an
    interruption (even during the conversion) reuses them and resumes the conversion. The checkpoint holds them
    as ``hpu_fp8_measurements.json``.

    Args:
        src: the BF16 source checkpoint directory (Paddle or Hugging Face torch layout); resolve a Hub repo id
            first (``hpu-fp8 convert`` does).
        out: the checkpoint directory to write; staged in ``out.partial`` and renamed when complete.
        calibration: how to calibrate (dataset, samples, sequence length, ...); default ``CalibrationOptions()``:
            32 windows of 256 tokens of the built-in text.
        options: the conversion's options (:class:`~hpu_fp8_loader.ConvertOptions`), ``force`` and ``keep_bf16``
            included.
        progress: called after each converted tensor with a ``ConvertProgress``.
        calibration_progress: called after each calibration step with a ``LayerProgress``.
        report: a :class:`~hpu_fp8_loader.Report` the calibration fills (see :func:`~hpu_fp8_loader.calibrate`);
            left empty when an interrupted run's calibration is reused.

    Returns:
        A :class:`~hpu_fp8_loader.QuantizeResult`.

    Raises:
        OutputExistsError: ``out`` exists and ``options.force`` is false (before the calibration runs).
        OutputLockedError: another run is writing ``out``.
        UnsafePathError: ``out`` is, lies inside or contains ``src``, or ``out.partial`` is not this tool's (a link, a file, a user's directory).
        ConfigError: ``src``'s config.json is missing or invalid, or its tensors do not fit it; ``options.keep_bf16``
            is not servable for this model.
        DatasetError: the dataset cannot be read or holds no text.
        TokenizerError: the model has no usable tokenizer.
        MeasurementError: the calibration left experts without tokens and ``options.dead_experts`` is ``error``.
        HpuFp8Error: everything :func:`~hpu_fp8_loader.calibrate` and :func:`~hpu_fp8_loader.convert` raise.

    Example:
        >>> from hpu_fp8_loader import CalibrationOptions, ConvertOptions, quantize
        >>> result = quantize("ERNIE-4.5-21B-A3B-PT", "ernie-fp8", CalibrationOptions(samples=64, seq_len=512),
        ...                   ConvertOptions(keep_bf16={"experts"}))
        >>> result.conversion.out
        PosixPath('ernie-fp8')
    """
    calibration = calibration or CalibrationOptions()
    options = options or ConvertOptions()
    src, out = Path(src), Path(out)
    check_apart(out, [src])
    # what can be refused from config.json and OUT is, before minutes of calibration
    descriptor = describe(read_config(src), str(src / CONFIG_FILE))
    check_keep_bf16(descriptor, options.keep_bf16)
    source = Checkpoint.open(src)  # once: its dtypes for --rebalance, its files for the calibration's key
    if options.rebalance is not Rebalance.OFF:
        refuse_fp8_folds(source)
    staging = prepare_output_dir(out, options.force, [src])
    key = _calibration_key(source, calibration, options.rebalance)
    cached = _cached(staging / CALIBRATION, key, fold_sites(descriptor))
    result = None
    rebalancing = options.rebalance is not Rebalance.OFF
    if cached is None:
        points = fold_points(descriptor) if rebalancing else frozenset()
        result = calibration.run(src, progress=calibration_progress, scratch_dir=staging, report=report, channel_points=points)
        measurements, folds = result.measurements, ChosenFolds(options.rebalance, MIGRATION, {})
        if rebalancing:
            folds = choose_rebalancing(open_weights(src, cache_bytes=0), result.channel_amax, result.ranges, options.rebalance)
            if folds.exponents:
                measurements = folds.rebalanced(measurements, result.channel_amax, descriptor)
        _keep(staging / CALIBRATION, key, measurements, folds)
    else:
        log.info("%s: the calibration an interrupted run left in %s is reused", src, staging)
        measurements, folds = cached
    if rebalancing:
        log.info("%s: --rebalance %s moves channels at %d fold site(s)", src, options.rebalance.value, len(folds.exponents))
    conversion = convert(src, out, [measurements], options, progress, folds=folds if rebalancing else None)
    return QuantizeResult(conversion, result, measurements, folds)


def _calibration_key(source: Checkpoint, calibration: CalibrationOptions, rebalance: Rebalance) -> dict:
    """What the measurements and folds depend on: the source files' content (as a conversion's resume sees it), the
    options (not ``threads``: another number can move an amax only by BLAS's own rounding, and the kept measurements
    are reused whole, never mixed with new ones) and the rebalancing mode."""
    files = sorted((p.name, file_fingerprint(p)) for p in source.files)
    options = dataclasses.asdict(calibration)
    del options["threads"]
    return {"source": files, "options": options, "rebalance": rebalance.value}


def _cached(path: Path, key: dict, sites: list[FoldSite]) -> tuple[Measurements, ChosenFolds] | None:
    """The measurements and folds kept under ``key``; None when there are none, or of another source or other options,
    or when ``path`` is not a regular file of ours (a link or FIFO planted in OUT.partial is never read:
    io/own_files.py)."""
    data = read_own(path, _CALIBRATION_BYTES)
    if data is None:
        return None
    try:
        kept = parse_json(data)
        if not isinstance(kept, dict) or kept.get("key") != json.loads(json.dumps(key)):
            return None
        by_name = {site.name: site for site in sites}
        exponents = {by_name[name]: np.asarray(e, np.int32) for name, e in kept["folds"]["exponents"].items()}
        if any(e.shape != (site.channels,) for site, e in exponents.items()):
            return None
        folds = ChosenFolds(Rebalance(kept["folds"]["mode"]), float(kept["folds"]["migration"]), exponents)
        return Measurements.model_validate(kept["measurements"]), folds
    except (ValueError, KeyError, TypeError, ValidationError):
        return None  # damaged: calibrate again


def _keep(path: Path, key: dict, measurements: Measurements, folds: ChosenFolds) -> None:
    """Written whole or not at all (a new file renamed over the name, never through a planted link): a run killed
    while writing leaves no half file to trust."""
    kept_folds = {
        "mode": folds.mode.value,
        "migration": folds.migration,
        "exponents": {site.name: e.tolist() for site, e in folds.exponents.items()},
    }
    write_new(path, json.dumps({"key": key, "measurements": measurements.model_dump(mode="json"), "folds": kept_folds}).encode())

"""The embedded default job: a tiny model trained here, taken through the whole pipeline on CPU.

calibrate (reference engine, built-in text) -> convert -> validate -> eval (emulated Gaudi FP8
against the BF16 model on held-out text) -> the accuracy table. The tiny models (ERNIE-4.5 MoE, Qwen2, Qwen3,
Qwen3-MoE) ship with the package (``tiny_models/``, made by scripts/train_tiny.py); nothing is downloaded or trained.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from hpu_fp8_loader.checks.validate import ValidationReport, validate
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.errors import OutputExistsError, UnsafePathError
from hpu_fp8_loader.io.own_files import read_own, write_new
from hpu_fp8_loader.io.writer import check_apart
from hpu_fp8_loader.quality.calibrate import calibrate
from hpu_fp8_loader.quality.evaluate import EvaluationResult, evaluate
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS
from hpu_fp8_loader.spec.choices import DeadExpertPolicy, KvCacheScheme

__all__ = ["DemoResult", "run_demo"]

_MARKER = ".hpu-fp8-demo"
# What the marker holds: only a regular file with exactly this (never a link, whatever it points to) is ours.
_MARKER_TEXT = b"made by hpu-fp8 demo; replaced on each run\n"
_PACKAGE = Path(__file__).parents[1]  # the shipped models live inside it


@dataclass
class DemoResult:
    source: Path
    measurements: Path
    checkpoint: Path
    report: ValidationReport
    evaluation: EvaluationResult


def _replace_work_dir(work_dir: Path) -> None:
    """A fresh ``work_dir``: one the demo made before (it carries the marker) is replaced, an empty or absent one made,
    and anything else refused, so that a mistyped ``--out`` never deletes a user's directory (there is no ``--force``
    for the demo: the directory it replaces is always its own)."""
    if work_dir.is_symlink() or (work_dir.exists() and not work_dir.is_dir()):
        raise OutputExistsError(f"{work_dir}: exists and is not a directory; choose another --out")
    check_apart(work_dir, [_PACKAGE])  # the shipped models live there: never deleted, whatever the marker says
    for what, place in (("the current directory", Path.cwd()), ("your home directory", Path.home())):
        if work_dir.exists() and place.resolve().is_relative_to(work_dir.resolve()):
            raise UnsafePathError(f"{work_dir}: it holds {what}; --out must be a directory of its own")
    ours = read_own(work_dir / _MARKER, len(_MARKER_TEXT)) == _MARKER_TEXT
    if work_dir.exists() and any(work_dir.iterdir()) and not ours:
        raise OutputExistsError(
            f"{work_dir}: exists and was not made by the demo (no {_MARKER} of its own); nothing was removed: "
            "choose another --out, or remove it yourself if it should go"
        )
    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir(parents=True)
    write_new(work_dir / _MARKER, _MARKER_TEXT)


def run_demo(
    work_dir: str | Path,
    model: str = "ernie-moe-bytes",
    kv_cache: KvCacheScheme = KvCacheScheme.FP8,
    say=print,
) -> DemoResult:
    """Run the default pipeline in ``work_dir`` (replaced if the demo made it, made if absent or empty; any other
    directory is refused)."""
    work_dir = Path(work_dir)
    _replace_work_dir(work_dir)
    source = TINY_MODELS[model]
    say(f"1/4 model: {source} (trained here on Python's documentation; BF16, Hugging Face torch layout)")
    calibration = calibrate(source, samples=32, seq_len=128)
    measurements = work_dir / "measurements.json"
    write_measurements(measurements, calibration.measurements)
    say(f"2/4 calibrated with the reference engine ({calibration.tokens:,} tokens of built-in text) -> {measurements}")
    dead_experts = DeadExpertPolicy.SIBLING_MAX if calibration.dead_experts else DeadExpertPolicy.ERROR
    options = ConvertOptions(kv_cache=kv_cache, dead_experts=dead_experts)
    checkpoint = convert(source, work_dir / "fp8", [calibration.measurements], options).out
    report = validate(checkpoint)
    say(
        f"3/4 converted to hpu-fp8 v1 (gaudi2, ±240, KV cache {kv_cache.value}) -> {checkpoint}: "
        f"{'valid' if report.valid else 'INVALID'} ({report.tensors} tensors)"
    )
    evaluation = evaluate(source, checkpoint, samples=16, seq_len=128)
    say("4/4 emulated Gaudi FP8 (FastDeploy's parameters) vs BF16 on held-out text:")
    return DemoResult(source, measurements, checkpoint, report, evaluation)

"""The embedded default job: a small model the project builds itself, taken through the pipeline.

Today: synthesize -> calibrate (the float32 reference engine) -> convert -> validate -> inspect; the
accuracy evaluation joins when the FP8 emulation lands.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from .arch import Layout
from .calibrate import calibrate
from .convert import ConvertOptions, convert
from .inspection import Inspection, inspect_checkpoint
from .spec.measurements import write_measurements
from .synth import preset_config, synthesize
from .validate import ValidationReport, validate

__all__ = ["DemoResult", "run_demo"]


@dataclass
class DemoResult:
    source: Path
    measurements: Path
    checkpoint: Path
    report: ValidationReport
    inspection: Inspection


def run_demo(work_dir: str | Path, preset: str = "ernie-moe-tiny", say=print) -> DemoResult:
    """Run the default pipeline in ``work_dir`` (replaced if it exists; it belongs to the demo)."""
    work_dir = Path(work_dir)
    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir(parents=True)
    config = preset_config(preset)
    source = synthesize(work_dir / "bf16", config, Layout.TORCH, seed=0)
    say(f"1/4 synthesized {preset} (Hugging Face torch layout, BF16) -> {source}")
    measurements = work_dir / "measurements.json"
    calibration = calibrate(source, samples=16, seq_len=128)
    write_measurements(measurements, calibration.measurements)
    say(f"2/4 calibrated with the reference engine on built-in text ({calibration.tokens:,} tokens) -> {measurements}")
    options = ConvertOptions(dead_experts="sibling-max" if calibration.dead_experts else "error")
    checkpoint = convert(source, work_dir / "fp8", [calibration.measurements], options).out
    say(f"3/4 converted to hpu-fp8 v1 (gaudi2, ±240, fp8 KV cache) -> {checkpoint}")
    report = validate(checkpoint)
    say(f"4/4 validated: {'valid' if report.valid else 'INVALID'} ({report.tensors} tensors, full scan)")
    return DemoResult(source, measurements, checkpoint, report, inspect_checkpoint(checkpoint))

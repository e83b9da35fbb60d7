"""Stress models: a trained model reparametrised so that chosen quantization points hold outliers as wide as real
LLMs show, its function unchanged to the bit.

The tiny models shipped here keep every point's amax within a few hundred times its median |x|, where static
per-tensor FP8 does well; real models reach 10^4 to 10^5 at ``down_proj`` inputs and in sink tokens, where it
collapses. No one trained a model here with such outliers: instead one channel of each chosen point is grown by a
power of two through an exact channel fold (:mod:`~hpu_fp8_loader.conversion.folds`) and the next linear's rows
shrunk by the same power, so the BF16 model computes exactly what it computed, and FP8 meets the range the dial
asks for. The channel grown is the one whose max |x| is already the largest: real outlier channels are the
systematically large ones. By construction every outlier here sits in one channel of every token; the sink-token
outliers of real models (a few tokens, every channel) cannot be made this way, and a fold cannot remove them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hpu_fp8_loader import __version__
from hpu_fp8_loader.arch import Layout
from hpu_fp8_loader.conversion.folds import Fold, FoldSite, fold_sites, site_channel_amax, weight_scalings
from hpu_fp8_loader.engine.weights import EngineWeights, open_weights
from hpu_fp8_loader.errors import ConfigError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.io.own_files import write_new
from hpu_fp8_loader.io.safetensors_file import numpy_dtype
from hpu_fp8_loader.io.writer import CheckpointWriter, PlannedTensor
from hpu_fp8_loader.quality.calibrate import CalibrationOptions
from hpu_fp8_loader.sources.synth import source_arrays

__all__ = ["STRESS_FILE", "StressResult", "StressedSite", "stress_model"]

STRESS_FILE = "hpu_fp8_stress.json"
# What a fold moves exactly: the stored formats whose values a power of two scales without rounding.
_EXACT_DTYPES = ("BF16", "F32")


@dataclass(frozen=True)
class StressedSite:
    """One site a stress model grew: which channel, by what power of two, and the ratio before and after.

    ``ratio_before`` is the point's amax / median |x| on the calibration text; ``ratio_after`` what it becomes,
    the grown channel's max times ``2^growth`` over the same median. Growing one channel moves the median a little
    (by 11% in a tiny expert of 32 channels): a calibration of the stress model reads the ratio it has.
    """

    fold: str
    name: str
    point: str
    channel: int
    growth: int
    ratio_before: float
    ratio_after: float


@dataclass(frozen=True)
class StressResult:
    """What :func:`stress_model` wrote: the stress model's directory and every site it grew.

    Example:
        >>> from hpu_fp8_loader import TINY_MODELS, Fold, stress_model
        >>> result = stress_model(TINY_MODELS["qwen2-bytes"], "qwen2-stress", {Fold.DOWN: 1e6})
        >>> [site.point for site in result.sites]
        ['qwen2.layers.0.mlp.down_proj', 'qwen2.layers.1.mlp.down_proj']
    """

    out: Path
    sites: list[StressedSite]


def _check_exact(checkpoint: Checkpoint) -> None:
    """Refuse a source a power of two does not scale exactly, naming its first such tensor."""
    for name, info in checkpoint.tensors.items():
        if info.dtype not in _EXACT_DTYPES:
            raise ConfigError(
                f"{checkpoint.root}: {name} is {info.dtype}; a power of two scales only "
                f"{' or '.join(_EXACT_DTYPES)} values exactly"
            )


def _writer(weights: EngineWeights, out: str | Path, force: bool) -> CheckpointWriter:
    """The copy's writer, every source tensor planned as it is stored: ``OUT`` checked and ``OUT.partial`` locked."""
    checkpoint = weights.checkpoint
    _check_exact(checkpoint)
    planned = [PlannedTensor(name, info.dtype, info.shape) for name, info in checkpoint.tensors.items()]
    metadata = {"format": "pt" if weights.layout is Layout.TORCH else "pd"}
    return CheckpointWriter(out, planned, 5 * 10**9, force, metadata, [checkpoint.root])


def _write(
    weights: EngineWeights, writer: CheckpointWriter, exponents: Mapping[FoldSite, np.ndarray], files: Mapping[str, bytes]
) -> Path:
    d, checkpoint, layout = weights.descriptor, weights.checkpoint, weights.layout
    scalings = weight_scalings(d, exponents)
    described = {p.name for w in d.weights() for p in w.source_parts(layout, d.prefix)}
    for w in d.weights():
        values = weights.get(w)
        if w.name in scalings:
            values = scalings[w.name].apply(values, w.name)
        dtype = numpy_dtype(checkpoint.tensors[w.source_parts(layout, d.prefix)[0].name].dtype)
        for name, array in source_arrays(w, values, layout, d.prefix, dtype):
            writer.write(name, array)
    for name in sorted(checkpoint.tensors.keys() - described):  # what the engine does not read, carried unchanged
        writer.write(name, np.asarray(checkpoint.get(name)))
    for name, data in files.items():
        write_new(writer.staging / name, data)
    return writer.finish(checkpoint.config, copy_from=checkpoint.root)


def write_folded(
    weights: EngineWeights,
    out: str | Path,
    exponents: Mapping[FoldSite, np.ndarray],
    files: Mapping[str, bytes] | None = None,
    force: bool = False,
) -> Path:
    """A copy of the source ``weights`` read from, with the channel folds of ``exponents`` applied
    (:func:`~hpu_fp8_loader.conversion.folds.weight_scalings`): same layout, dtypes, tensors and tokenizer files, plus
    ``files`` (name -> content). Written like every checkpoint here (``OUT.partial``, renamed when complete).

    Raises:
        ConfigError: a source tensor is stored in a format a power of two does not scale exactly (FP16, FP8), or a
            fold would leave float32's normal range.
        OutputExistsError: ``out`` exists and ``force`` is false (or it is not a checkpoint this tool wrote).
    """
    return _write(weights, _writer(weights, out, force), exponents, files or {})


def stress_model(
    source: str | Path,
    out: str | Path,
    targets: Mapping[Fold, float],
    calibration: CalibrationOptions | None = None,
    force: bool = False,
) -> StressResult:
    """Write a copy of ``source`` whose fold sites of each kind in ``targets`` reach that amax / median |x| ratio.

    Each site's point is measured on ``calibration``'s text (default 16 windows of 128 tokens of the built-in
    calibration text); its largest channel is grown by the power of two that brings the point's ratio nearest the
    target (within a factor of sqrt(2)), and the folds' consumers shrunk by it. A site already at or beyond its
    target is left alone. Written like every checkpoint here (``OUT.partial``, renamed when complete), in the
    source's layout and dtypes, with ``hpu_fp8_stress.json`` recording each grown site.

    Args:
        source: a BF16 (or F32) source checkpoint directory, in either layout.
        out: the directory to write.
        targets: fold kind -> the amax / median ratio to reach at each of its sites (at least 1).
        calibration: how to measure the points (dataset, samples, sequence length).
        force: replace an existing ``out`` (only a checkpoint this tool wrote).

    Returns:
        A :class:`StressResult`: ``out`` and every site grown.

    Raises:
        ConfigError: ``source`` is an hpu-fp8 checkpoint, stores a weight in a format a power of two does not scale
            exactly (FP16, FP8), a target is below 1, or a fold would leave float32's normal range.
        OutputExistsError: ``out`` exists and ``force`` is false (before the calibration runs).
        HpuFp8Error: everything :func:`~hpu_fp8_loader.calibrate` raises.

    Example:
        >>> from hpu_fp8_loader import TINY_MODELS, Fold, stress_model
        >>> result = stress_model(TINY_MODELS["qwen2-bytes"], "qwen2-stress", {Fold.DOWN: 1e6})
        >>> [(site.point, site.growth) for site in result.sites]
        [('qwen2.layers.0.mlp.down_proj', 12), ('qwen2.layers.1.mlp.down_proj', 12)]
    """
    source, calibration = Path(source), calibration or CalibrationOptions(samples=16, seq_len=128)
    for fold, ratio in targets.items():
        if not (math.isfinite(ratio) and ratio >= 1):
            raise ConfigError(f"stress: the {fold.value} target {ratio!r} is no ratio of at least 1")
    weights = open_weights(source, cache_bytes=0)
    if weights.is_spec:
        raise ConfigError(f"{source}: an hpu-fp8 checkpoint; a stress model is made from the BF16 source")
    d = weights.descriptor
    writer = _writer(weights, out, force)  # the dtypes and OUT refused before minutes of calibration
    sites = [s for s in fold_sites(d) if s.fold in targets]
    measured = calibration.run(source, channel_points=frozenset(p for s in sites for p in s.points))
    medians = {r.module: r.median for r in measured.ranges}
    exponents: dict[FoldSite, np.ndarray] = {}
    grown: list[StressedSite] = []
    for site in sites:
        amax = site_channel_amax(site, measured.channel_amax, d)
        point = site.points[0]
        if amax is None or not medians.get(point):
            continue
        channel = int(np.argmax(amax))
        peak, median = float(amax.max()), medians[point]
        growth = round(math.log2(targets[site.fold] * median / peak))
        if growth <= 0:
            continue
        exponents[site] = np.zeros(site.channels, np.int32)
        exponents[site][channel] = -growth
        grown.append(StressedSite(site.fold.value, site.name, point, channel, growth, peak / median, peak * 2.0**growth / median))
    record = {
        "format": "hpu-fp8-stress",
        "version": 1,
        "tool_version": __version__,
        "source": source.name,
        "targets": {fold.value: ratio for fold, ratio in targets.items()},
        "calibration": {"dataset": str(calibration.dataset), "samples": calibration.samples, "seq_len": calibration.seq_len},
        "sites": [asdict(s) for s in grown],
    }
    _write(weights, writer, exponents, {STRESS_FILE: (json.dumps(record, indent=2) + "\n").encode()})
    return StressResult(Path(out), grown)

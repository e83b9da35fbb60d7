"""Move a checkpoint between the Gaudi3/OCP FP8 range (±448) and Gaudi2's (±240).

448 -> 240 (vllm-gaudi's 448->240 rule, its Gaudi2 weight-loading wrapper in ``extension/ops.py``): every fp8
weight value x 0.5 and every weight scale x 2, so weight x scale is unchanged. Halving is exact
except at the subnormal end, where x 0.5 falls between two codes and rounds to nearest even; those
values are counted. Activation scales are derived again from the untouched act_amax.
240 -> gaudi3: a 240 checkpoint is valid on Gaudi3 as it is (every code it holds is a valid e4m3fn
code); it is relabelled, and no precision is gained without the source.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpu_fp8_loader.checks.validate import check_values, open_validated
from hpu_fp8_loader.errors import HpuFp8Error
from hpu_fp8_loader.io.safetensors_file import row_blocks
from hpu_fp8_loader.io.writer import CheckpointWriter, PlannedTensor
from hpu_fp8_loader.numerics import e4m3, scales
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import FP8_MAX_BY_TARGET, Target
from hpu_fp8_loader.spec.fp8 import GAUDI2_FP8_MAX

__all__ = ["RetargetResult", "retarget"]


@dataclass
class RetargetResult:
    """What :func:`retarget` did: rescaled the values, or only relabelled the checkpoint.

    Attributes:
        out: the published checkpoint directory.
        action: ``"rescaled"`` (448 -> 240: fp8 values x 0.5, weight scales x 2) or ``"relabelled"`` (only the
            target in config.json changed).
        message: one line on what was done and why, ending, after rescaling, with how many values rounded.
        values: fp8 values halved (0 when relabelled).
        rounded: of those, subnormals whose halving was not exact (rounded to nearest even).

    Example:
        >>> from hpu_fp8_loader import retarget
        >>> result = retarget("qwen2-fp8-gaudi3", "qwen2-fp8-gaudi2", "gaudi2")
        >>> result.action, result.rounded <= result.values
        ('rescaled', True)
    """

    out: Path
    action: str  # "rescaled" or "relabelled"
    message: str
    values: int = 0
    rounded: int = 0  # fp8 values whose halving was not exact


def _halve(codes: np.ndarray) -> tuple[np.ndarray, int]:
    """fp8 values x 0.5 in the ±240 range; returns the new codes and how many did not halve exactly."""
    halved = codes.astype(np.float32) * np.float32(0.5)
    result = e4m3.cast_to_fp8(halved, GAUDI2_FP8_MAX)
    return result, int(np.count_nonzero(result.astype(np.float32) != halved))


def _doubled(name: str, scale: np.ndarray) -> np.ndarray:
    """A weight scale x 2 (exact: a power of two), refused by name should it overflow float32."""
    with np.errstate(over="ignore"):
        doubled = scale * np.float32(2)
    if not np.isfinite(doubled).all():
        raise HpuFp8Error(f"{name}: weight scale {float(scale.max()):g} x 2 overflows float32; it cannot be rescaled for gaudi2")
    return doubled


def retarget(
    src: str | Path,
    out: str | Path,
    target: Target | str,
    max_shard_bytes: int = 5 * 10**9,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> RetargetResult:
    """Retarget ``src`` for ``target``, writing ``out``; a checkpoint that already targets it is refused.

    ``src`` passes the quick validation first, and every block read is value-checked on the way.
    To gaudi2 from ±448 (vllm-gaudi's 448 -> 240 rule): every fp8 weight value x 0.5 and every weight scale x 2,
    so weight x scale is unchanged (exact except at the subnormal end, where the values that round are counted);
    activation scales are derived again from the untouched act_amax. To gaudi3: a ±240 checkpoint is valid on
    Gaudi3 as it is, so it is only relabelled; no precision is gained without the BF16 source (convert it again
    with ``target="gaudi3"`` for that). A gaudi3-labelled checkpoint already at ±240 is relabelled for gaudi2.

    Args:
        src: the hpu-fp8 checkpoint directory.
        out: the checkpoint directory to write.
        target: ``Target.GAUDI2`` / ``"gaudi2"`` or ``Target.GAUDI3`` / ``"gaudi3"``.
        max_shard_bytes: the largest output shard.
        force: replace an existing ``out`` (only a checkpoint this tool wrote, or an empty directory).
        progress: called after each write with the bytes written and the total (e.g. ``Progress.show``).

    Returns:
        A :class:`~hpu_fp8_loader.RetargetResult`: what was done, and how many fp8 values rounded.

    Raises:
        ValueError: ``target`` is no Target value.
        HpuFp8Error: ``src`` already targets ``target``; ``src`` fails the quick validation; a weight scale x 2
            would overflow float32.
        NonFiniteError: a block read holds a NaN code, a value beyond ±fp8_max or a NaN/inf kept value.
        CheckpointNotFoundError: ``src`` is not a directory.
        NotHpuFp8CheckpointError: ``src`` is not an hpu-fp8 checkpoint.
        UnsupportedFormatVersionError: ``src`` declares another format_version.
        ConfigError: ``src``'s config.json is missing or invalid.
        OutputExistsError: ``out`` exists and ``force`` is false.
        OutputLockedError: another run is writing ``out``.
        UnsafePathError: ``out`` is, lies inside or contains ``src``, or ``OUT.partial`` is not this tool's (a link, a file, a user's directory).
        WriteFailedError: writing failed (no space left, an I/O error).

    Example:
        >>> from hpu_fp8_loader import retarget
        >>> result = retarget("qwen2-fp8-gaudi3", "qwen2-fp8-gaudi2", "gaudi2")  # FastDeploy serves ±240 only
        >>> print(result.message)
        rescaled for gaudi2: fp8 values x 0.5, weight scales x 2, act scales derived from act_amax for ±240; ...
    """
    target = Target(target)
    opened = open_validated(src)
    checkpoint, qc = opened.checkpoint, opened.qc
    if qc.target is target:
        raise HpuFp8Error(
            f"{src} already targets {target.value} (±{qc.fp8_max:g}); nothing to retarget, so {out} was not written"
        )
    if target is Target.GAUDI3:
        new_qc = qc.model_copy(update={"target": Target.GAUDI3})
        rescale = False
        message = (
            "relabelled for gaudi3: a ±240 checkpoint is valid on Gaudi3 as it is; it keeps fp8_max 240, "
            "and no precision is gained without the BF16 source (convert it again with --target gaudi3 for that)"
        )
    elif qc.fp8_max == FP8_MAX_BY_TARGET[Target.GAUDI3]:
        new_qc = qc.model_copy(update={"target": Target.GAUDI2, "fp8_max": GAUDI2_FP8_MAX})
        rescale = True
        message = "rescaled for gaudi2: fp8 values x 0.5, weight scales x 2, act scales derived from act_amax for ±240"
    else:  # a gaudi3-labelled checkpoint that already uses ±240
        new_qc = qc.model_copy(update={"target": Target.GAUDI2})
        rescale = False
        message = "relabelled for gaudi2: the checkpoint already uses ±240"
    planned = [PlannedTensor(name, info.dtype, info.shape) for name, info in checkpoint.tensors.items()]
    writer = CheckpointWriter(out, planned, max_shard_bytes, force, {"format": "pd"}, [src], progress)
    report = RetargetResult(Path(out), "rescaled" if rescale else "relabelled", message)
    for name, info in checkpoint.tensors.items():
        shard = checkpoint.files[info.file]
        if rescale and name.endswith(names.WEIGHT_SCALE):
            writer.write(name, _doubled(name, np.asarray(shard.get(name), np.float32)))
        elif rescale and name.endswith(names.ACT_SCALE):
            amax = np.asarray(checkpoint.get(name.removesuffix(names.ACT_SCALE) + names.ACT_AMAX), np.float32)
            writer.write(name, scales.act_scale_from_amax(amax, new_qc.fp8_max, new_qc.scale_rounding.value).reshape(info.shape))
        elif not info.shape:
            writer.write(name, np.asarray(shard.get(name)))
        else:  # weights, in row blocks, value-checked: fp8 ones halved when rescaling, the rest copied
            for start, stop in row_blocks(info.shape[0], math.prod(info.shape[1:])):
                block = shard.read_rows(name, start, stop)
                check_values(info, block, start, qc.fp8_max)
                if rescale and info.dtype == "F8_E4M3":
                    block, rounded = _halve(block)
                    report.rounded += rounded
                    report.values += block.size
                writer.write(name, block, start)
    config = {**checkpoint.config, "quantization_config": new_qc.model_dump(mode="json", exclude_none=True)}
    writer.finish(config, copy_from=Path(src))
    if rescale:
        report.message += f"; {report.rounded} of {report.values:,} fp8 values were subnormals that rounded when halved"
    return report

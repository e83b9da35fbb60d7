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
    src: str | Path, out: str | Path, target: Target | str, max_shard_bytes: int = 5 * 10**9, force: bool = False
) -> RetargetResult:
    """Retarget ``src`` for ``target``, writing ``out``; a checkpoint that already targets it is refused.

    ``src`` passes the quick validation first, and every block read is value-checked on the way.
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
    writer = CheckpointWriter(out, planned, max_shard_bytes, force, {"format": "pd"}, [src])
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

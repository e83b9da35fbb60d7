"""Reading a source checkpoint's tensor as values: BF16/FP16/FP32 as stored, FP8 times its scale.

A compressed-tensors (llm-compressor) checkpoint stores a linear as an F8_E4M3 ``X.weight`` beside
``X.weight_scale`` (``[1]`` tensor-wise or ``[out, 1]`` per row, bf16 or float32). Its values are
``fp8 x scale``; with that one rule the converter and the reference engine take such a checkpoint as
a source like any BF16 one, and requantize from the source's own FP8 values exactly once.
"""

from __future__ import annotations

import numpy as np

from .errors import ConfigError
from .io.checkpoint import Checkpoint
from .numerics import fp8_to_float32

__all__ = ["SOURCE_DTYPES", "scale_name", "source_problem", "source_rows", "source_scale"]

SOURCE_DTYPES = ("BF16", "F16", "F32", "F8_E4M3")


def scale_name(name: str) -> str:
    """The compressed-tensors weight_scale that goes with an FP8 ``X.weight``."""
    return name.removesuffix("weight") + "weight_scale"


def source_problem(checkpoint: Checkpoint, name: str) -> str | None:
    """Why a source tensor cannot be read as values (an unsupported dtype, a missing or bad scale), or None."""
    info = checkpoint.tensors[name]
    if info.dtype not in SOURCE_DTYPES:
        return f"tensor '{name}' has dtype {info.dtype}; supported: {', '.join(SOURCE_DTYPES)}"
    if info.dtype != "F8_E4M3":
        return None
    scale = checkpoint.tensors.get(scale_name(name))
    if scale is None:
        return f"tensor '{name}' is FP8 but '{scale_name(name)}' is missing"
    if scale.numel not in (1, info.shape[0]):
        return f"'{scale_name(name)}' has {scale.numel} values for the {info.shape[0]} rows of '{name}'"
    return None


def source_scale(checkpoint: Checkpoint, name: str) -> np.ndarray:
    """The float32 weight_scale of an FP8 source tensor, flat: one value, or one per row."""
    scale = np.asarray(checkpoint.get(scale_name(name))).astype(np.float32).reshape(-1)
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        raise ConfigError(
            f"{checkpoint.root}: '{scale_name(name)}' holds {scale.min()}..{scale.max()}; scales must be finite and > 0"
        )
    return scale


def source_rows(checkpoint: Checkpoint, name: str, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a source tensor (read with pread), FP8 ones dequantized to float32."""
    info = checkpoint.tensors[name]
    rows = checkpoint.files[info.file].read_rows(name, start, stop)
    if info.dtype != "F8_E4M3":
        return rows
    scale = source_scale(checkpoint, name)
    per_row = scale[start:stop].reshape(-1, *([1] * (rows.ndim - 1))) if scale.size > 1 else scale[0]
    values = fp8_to_float32(rows)
    values *= per_row
    return values

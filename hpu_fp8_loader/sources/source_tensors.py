"""Reading a source checkpoint: its layout (Paddle or torch names), and a tensor as values: BF16/FP16/FP32 as stored, FP8 times its scale.

A compressed-tensors (llm-compressor) checkpoint stores a linear as an F8_E4M3 ``X.weight`` beside
``X.weight_scale`` (``[1]`` tensor-wise or ``[out, 1]`` per row, bf16 or float32). Its values are
``fp8 x scale``; with that one rule the converter and the reference engine take such a checkpoint as
a source like any BF16 one, and requantize from the source's own FP8 values exactly once. A block-wise FP8
checkpoint (:mod:`hpu_fp8_loader.sources.block_fp8`) stores ``X.weight_scale_inv`` instead, one scale per block of
the stored matrix: its rows are dequantized block by block as they are read, never the whole tensor at once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection

import numpy as np

from hpu_fp8_loader.arch import Layout, ModelDescriptor
from hpu_fp8_loader.errors import ConfigError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.numerics.e4m3 import fp8_to_float32
from hpu_fp8_loader.sources.block_fp8 import BLOCK_SCALE, block_size, scale_by_blocks
from hpu_fp8_loader.spec.names import scale_name

__all__ = [
    "SCALE_DTYPES",
    "SOURCE_DTYPES",
    "check_source",
    "detect_layout",
    "fp8_scale_name",
    "read_scale",
    "scale_dtype_problem",
    "source_problem",
    "source_rows",
    "source_scale",
]

SOURCE_DTYPES = ("BF16", "F16", "F32", "F8_E4M3")
# What a scale tensor of a source may be stored as: floating point only. An integer tensor cast to float32 is a number
# too, so an int32 weight_scale_inv would pass for a scale of another size (1.867 for 0.000599) and give a checkpoint
# that validates; FP8 is no scale format either.
SCALE_DTYPES = ("BF16", "F16", "F32", "F64")


def detect_layout(checkpoint: Checkpoint, descriptor: ModelDescriptor) -> Layout:
    """Paddle or torch layout, from which names of the first layer's attention exist."""
    probe = descriptor.weights()[1:3]
    for layout in Layout:
        if all(p.name in checkpoint.tensors for w in probe for p in w.source_parts(layout, descriptor.prefix)):
            return layout
    raise ConfigError(
        f"{checkpoint.root}: neither Paddle names ({probe[1].name}) nor torch names "
        f"({probe[1].source_parts(Layout.TORCH, descriptor.prefix)[0].name}) found; is this a {descriptor.model_type} checkpoint?"
    )


def fp8_scale_name(checkpoint: Checkpoint, name: str) -> str:
    """The scale tensor beside an FP8 source tensor: ``X.weight_scale_inv`` in a block-wise FP8 checkpoint,
    ``X.weight_scale`` otherwise (compressed-tensors)."""
    if block_size(checkpoint.config, checkpoint.root) is not None:
        return name.removesuffix("weight") + BLOCK_SCALE
    return scale_name(name)


def source_problem(checkpoint: Checkpoint, name: str) -> str | None:
    """Why a source tensor cannot be read as values (an unsupported dtype, a missing or bad scale), or None."""
    info = checkpoint.tensors[name]
    if info.dtype not in SOURCE_DTYPES:
        return f"tensor '{info.name}' has dtype {info.dtype}; supported: {', '.join(SOURCE_DTYPES)}"
    if info.dtype != "F8_E4M3":
        return None
    scale_key = fp8_scale_name(checkpoint, name)
    scale = checkpoint.tensors.get(scale_key)
    if scale is None:
        return f"tensor '{info.name}' is FP8 but '{scale_key}' is missing"
    if (problem := scale_dtype_problem(checkpoint, scale_key)) is not None:
        return problem
    block = block_size(checkpoint.config, checkpoint.root)
    if block is not None:
        grid = tuple(math.ceil(n / b) for n, b in zip(info.shape, block, strict=False))
        if len(info.shape) != 2 or scale.shape != grid:
            return (
                f"'{scale.name}' has shape {list(scale.shape)}; the {list(info.shape)} '{info.name}' in "
                f"{block[0]}x{block[1]} blocks needs {list(grid)}"
            )
        return None
    if scale.numel not in (1, info.shape[0]):
        return f"'{scale_key}' has {scale.numel} values for the {info.shape[0]} rows of '{name}'"
    return None


def scale_dtype_problem(checkpoint: Checkpoint, key: str) -> str | None:
    """Why the scale tensor ``key`` cannot be read as scales (its dtype is not floating point), or None."""
    info = checkpoint.tensors[key]
    if info.dtype in SCALE_DTYPES:
        return None
    return f"'{info.name}' has dtype {info.dtype}; a scale tensor is floating point ({', '.join(SCALE_DTYPES)})"


def read_scale(checkpoint: Checkpoint, key: str) -> np.ndarray:
    """The float32 values of the scale tensor ``key``, as stored (shape kept); one that is not floating point is
    refused naming it (:func:`scale_dtype_problem`), never read as numbers."""
    if (problem := scale_dtype_problem(checkpoint, key)) is not None:
        raise ConfigError(f"{checkpoint.root}: {problem}")
    return np.asarray(checkpoint.get(key)).astype(np.float32)


def source_scale(checkpoint: Checkpoint, name: str) -> np.ndarray:
    """The float32 scale of an FP8 source tensor: flat (one value, or one per row), or a block-wise grid."""
    scale_key = fp8_scale_name(checkpoint, name)
    scale = read_scale(checkpoint, scale_key)
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        raise ConfigError(
            f"{checkpoint.root}: '{checkpoint.tensors[scale_key].name}' holds {scale.min()}..{scale.max()}; "
            "scales must be finite and > 0"
        )
    return scale if scale.ndim == 2 and block_size(checkpoint.config) is not None else scale.reshape(-1)


def source_rows(checkpoint: Checkpoint, name: str, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a source tensor (read with pread), FP8 ones dequantized to float32."""
    info = checkpoint.tensors[name]
    rows = checkpoint.files[info.file].read_rows(name, start, stop)
    if info.dtype != "F8_E4M3":
        return rows
    scale = source_scale(checkpoint, name)
    block = block_size(checkpoint.config)
    values = fp8_to_float32(rows)
    if block is not None:
        scale_by_blocks(values, scale, start, block)
    else:
        values *= scale[start:stop].reshape(-1, *([1] * (rows.ndim - 1))) if scale.size > 1 else scale[0]
    return values


# Source tensors that are known and deliberately not carried into an hpu-fp8 checkpoint, each with the reason
# a user is told. Any other tensor the model's config.json does not account for is refused: dropping it
# silently would publish a different model (a bias, a norm or a layer this format has no place for).
_NOT_CARRIED = (
    (re.compile(r"(^|\.)mtp_"), "ERNIE multi-token-prediction (MTP) draft weights, which the format does not carry"),
    (re.compile(r"\.rotary_emb\.inv_freq$"), "rotary inv_freq buffers, which are recomputed from rope_theta"),
    (
        re.compile(r"\.(input_scale|k_scale|v_scale|output_scale)$"),
        "compressed-tensors activation scales: convert takes activation statistics from --measurements "
        "(`hpu-fp8 import` keeps the source's own)",
    ),
)


def check_source(
    checkpoint: Checkpoint, descriptor: ModelDescriptor, layout: Layout, used_elsewhere: Collection[str] = ()
) -> list[str]:
    """Check that a source checkpoint is the model its config.json describes; returns what is left out, in words.

    Every tensor the model is made of must exist with the shape config.json implies and a readable
    dtype; every other tensor must be one the format knowingly leaves out (``_NOT_CARRIED``, an
    lm_head that config.json ties to the embedding) or be read by the caller (``used_elsewhere``).
    Anything else is a :class:`ConfigError` listing the first problems: a model variant this tool does
    not know would otherwise be converted without the tensors it does not know.
    """
    problems = []
    needed = set()
    for w in descriptor.weights():
        for part in w.source_parts(layout, descriptor.prefix):
            needed.add(part.name)
            info = checkpoint.tensors.get(part.name)
            if info is None:
                problems.append(f"tensor '{part.name}' is missing")
            elif info.shape != part.shape:
                problems.append(f"tensor '{part.name}' has shape {list(info.shape)}, config.json implies {list(part.shape)}")
            elif (problem := source_problem(checkpoint, part.name)) is not None:
                problems.append(problem)
            elif info.dtype == "F8_E4M3":
                needed.add(fp8_scale_name(checkpoint, part.name))
    left_out: dict[str, int] = {}
    for name in sorted(set(checkpoint.tensors) - needed - set(used_elsewhere)):
        reason = next((why for pattern, why in _NOT_CARRIED if pattern.search(name)), None)
        if reason is None and descriptor.tie_word_embeddings and name.endswith("lm_head.weight"):
            reason = "lm_head, which config.json ties to the embedding (tie_word_embeddings), as FastDeploy does"
        if reason is None:
            problems.append(
                f"tensor '{name}' is not part of a {descriptor.model_type} model as config.json describes it "
                "(a variant this tool does not know?)"
            )
        else:
            left_out[reason] = left_out.get(reason, 0) + 1
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise ConfigError(f"{checkpoint.root}: " + "; ".join(problems[:10]) + more)
    return [f"{count} tensor(s) not carried over: {reason}" for reason, count in left_out.items()]

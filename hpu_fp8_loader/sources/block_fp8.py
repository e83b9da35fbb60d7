"""Block-wise FP8 source checkpoints: which config.json says so, the block one scale covers, and FastDeploy's names.

Two layouts carry 128x128-block FP8 weights with a float32 scale per block that multiplies (real = fp8 x scale):

- Hugging Face (Qwen3-*-FP8, DeepSeek): ``quantization_config.quant_method: "fp8"`` with ``weight_block_size``
  ``[rows, columns]``; per linear an e4m3 ``X.weight`` ``[out, in]`` and ``X.weight_scale_inv``
  ``[ceil(out/rows), ceil(in/columns)]`` (transformers' ``integrations/finegrained_fp8.py``).
- FastDeploy's Paddle layout (the ERNIE-4.5-300B-A47B-FP8-Paddle kind): ``quantization: "mix_quant"`` with
  ``dense_quant_type`` / ``moe_quant_type`` ``"block_wise_fp8"``; per linear ``X.quant_weight`` ``[in, out]`` and
  ``X.weight_scale`` ``[ceil(in/128), ceil(out/128)]``. FastDeploy's loader renames them to ``weight`` /
  ``weight_scale_inv`` (``fastdeploy/model_executor/utils.py`` ``rename_offline_ckpt_suffix_to_fd_suffix``@8c3513a4)
  and builds ``BlockWiseFP8Config`` without a block size under mix_quant, so its default ``[128, 128]`` holds
  (``layers/quantization/mix_quant.py``, ``block_wise_fp8.py`` ``from_config``@8c3513a4).

:func:`open_source` renames the Paddle keys as FastDeploy does, so both layouts read alike: an F8_E4M3 ``X.weight``
beside ``X.weight_scale_inv`` whose grid covers the stored matrix in blocks of :func:`block_size`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from hpu_fp8_loader.errors import ConfigError
from hpu_fp8_loader.io.checkpoint import Checkpoint

__all__ = ["BLOCK_SCALE", "block_fp8_scheme", "block_size", "open_source", "scale_by_blocks"]

BLOCK_SCALE = "weight_scale_inv"
PADDLE_BLOCK = (128, 128)  # BlockWiseFP8Config's default; mix_quant passes none (mix_quant.py@8c3513a4)
_PADDLE_NAMES = (("quant_weight", "weight"), ("weight_scale", BLOCK_SCALE))


# The quant types FastDeploy's mix_quant reads for the linears (MixQuantConfig.from_config takes both as required keys:
# layers/quantization/mix_quant.py@8c3513a4); a block-FP8 checkpoint stores every one of them as 128x128 blocks.
_PADDLE_QUANT_TYPES = ("dense_quant_type", "moe_quant_type")


def _paddle_block(qc: dict) -> bool:
    """Whether ``qc`` claims FastDeploy's Paddle block FP8: mix_quant with block_wise_fp8 for some linears."""
    return qc.get("quantization") == "mix_quant" and "block_wise_fp8" in (qc.get(key) for key in _PADDLE_QUANT_TYPES)


def _check_paddle_block(qc: dict, where: str) -> None:
    """Refuse a Paddle block-FP8 config whose keys contradict the one layout it can mean: both quant types
    block_wise_fp8 (FastDeploy raises on a missing one; another type, such as wint8 or wfp8afp8, stores those linears
    in another form), no block size but FastDeploy's 128x128 (mix_quant passes none, so another one would be a claim
    FastDeploy ignores), and quantized weights."""
    for key in _PADDLE_QUANT_TYPES:
        value = qc.get(key)
        if value is None:
            raise ConfigError(
                f"{where}.{key} is missing; FastDeploy's mix_quant requires both dense_quant_type and moe_quant_type "
                "(block_wise_fp8 for a block-FP8 checkpoint)"
            )
        if value != "block_wise_fp8":
            raise ConfigError(
                f"{where}.{key} is {value!r:.40} beside block_wise_fp8; only a checkpoint whose linears are all "
                "block_wise_fp8 imports (the others would be stored in another form)"
            )
    size = qc.get("weight_block_size")
    if size is not None and size != list(PADDLE_BLOCK):
        raise ConfigError(
            f"{where}.weight_block_size is {size!r:.60}; FastDeploy's mix_quant ignores it and reads "
            f"{PADDLE_BLOCK[0]}x{PADDLE_BLOCK[1]} blocks, so the config and the tensors cannot both be right"
        )
    if "is_quantized" in qc and qc["is_quantized"] is not True:
        raise ConfigError(
            f"{where}.is_quantized is {qc['is_quantized']!r:.40}; a block-FP8 checkpoint stores quantized weights "
            "(FastDeploy reads is_quantized false as a BF16 checkpoint)"
        )


def block_fp8_scheme(config: dict, source: str | Path = "config.json") -> str | None:
    """The block-FP8 scheme config.json names, in words, or None for any other checkpoint; a block size that
    cannot be read, or static activation scales, are refused naming the key."""
    size = block_size(config, source)
    if size is None:
        return None
    layout = "FastDeploy Paddle" if _paddle_block(config["quantization_config"]) else "Hugging Face"
    return f"block-wise FP8 ({layout} layout, {size[0]}x{size[1]} blocks, activations dynamic)"


def block_size(config: dict, source: str | Path = "config.json") -> tuple[int, int] | None:
    """(rows, columns) of the stored matrix one block scale covers, or None when config.json names no block FP8."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    where = f"{source}: quantization_config"
    if _paddle_block(qc):
        _check_paddle_block(qc, where)
        return PADDLE_BLOCK
    if qc.get("quant_method") != "fp8":
        return None
    size = qc.get("weight_block_size")
    if size is None:
        raise ConfigError(
            f"{where}.weight_block_size is missing; only block-wise FP8 (quant_method fp8 with a block size) imports"
        )
    if not (
        isinstance(size, list) and len(size) == 2 and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in size)
    ):
        raise ConfigError(f"{where}.weight_block_size is {size!r:.60}; expected two positive integers such as [128, 128]")
    activations = qc.get("activation_scheme", "dynamic")
    if activations != "dynamic":
        raise ConfigError(
            f"{where}.activation_scheme is {activations!r:.40}; only dynamic block-FP8 checkpoints import "
            "(activation statistics come from --measurements or --calibrate)"
        )
    return size[0], size[1]


def open_source(root: str | Path) -> Checkpoint:
    """A source checkpoint, opened; a Paddle block-FP8 one with its keys renamed as FastDeploy's loader renames them
    (``quant_weight`` -> ``weight``, ``weight_scale`` -> ``weight_scale_inv``): a view, the files are untouched, and
    every TensorInfo keeps the name stored on disk."""
    checkpoint = Checkpoint.open(root)
    qc = checkpoint.config.get("quantization_config")
    if not (isinstance(qc, dict) and _paddle_block(qc)):
        return checkpoint
    for name in list(checkpoint.tensors):
        stem, _, suffix = name.rpartition(".")
        renamed = next((f"{stem}.{new}" for old, new in _PADDLE_NAMES if suffix == old), None)
        if renamed is None:
            continue
        if renamed in checkpoint.tensors:
            raise ConfigError(f"{checkpoint.root}: both '{name}' and '{renamed}' exist; which one is the weight?")
        info = checkpoint.tensors.pop(name)
        checkpoint.tensors[renamed] = info
        shard = checkpoint.files[info.file].tensors
        shard[renamed] = shard.pop(name)
    return checkpoint


def scale_by_blocks(values: np.ndarray, grid: np.ndarray, start: int, block: tuple[int, int]) -> None:
    """Multiply rows ``start:start + len(values)`` of a dequantized matrix, in place, by their scales from a block
    ``grid``; the edge blocks cropped (a ragged block covers only the rows and columns that exist).

    One column block at a time against a ``[rows, grid columns]`` table, never a per-element scale matrix: that
    matrix would be as large as the float32 values themselves and set the peak memory of a block-FP8 import.
    """
    rows, cols = block
    first = start // rows
    stop = start + values.shape[0]
    per_row = np.repeat(grid[first : math.ceil(stop / rows)], rows, axis=0)[start - first * rows : stop - first * rows]
    for j in range(per_row.shape[1]):
        values[:, j * cols : (j + 1) * cols] *= per_row[:, j : j + 1]

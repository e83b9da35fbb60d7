"""The worker side of a conversion: one spec tensor read, quantized and written at its offset, in bounded memory.

A worker process (or the main one, with one worker) gets a :class:`WorkerContext` once, opens the
source itself, and converts the tensors it is handed with :func:`convert_tensor`: small tensors read
whole, large ones in row blocks, FP8 (compressed-tensors) linears requantized through code tables.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpu_fp8_loader.arch import Layout, SourcePart, WeightTensor
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.errors import HpuFp8Error, NonFiniteError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.io.safetensors_file import row_blocks
from hpu_fp8_loader.io.writer import Shard, ShardFile
from hpu_fp8_loader.memory import out_of_memory
from hpu_fp8_loader.numerics import e4m3, scales
from hpu_fp8_loader.numerics.fusion import fuse_columns, transposed
from hpu_fp8_loader.numerics.requantize import requantize_rows, row_amax
from hpu_fp8_loader.sources.block_fp8 import block_size, open_source
from hpu_fp8_loader.sources.source_tensors import source_rows, source_scale
from hpu_fp8_loader.spec import names

__all__ = ["WorkerContext", "convert_tensor", "init_worker", "reads_whole"]


@dataclass(frozen=True)
class WorkerContext:
    """What every worker needs; sent once per worker process."""

    main_pid: int
    src: Path
    staging: Path
    layout: Layout
    prefix: str
    options: ConvertOptions
    shards: tuple[Shard, ...]
    skip_shards: frozenset[str]
    metadata: dict[str, str]


_worker: dict = {}


def _watch_main_process(main_pid: int) -> None:
    """Exit when the converting process is gone (``kill -9``, SIGTERM): an orphan worker would keep running,
    holding memory and the caller's stdout/stderr, so a caller waiting for end-of-file would hang."""
    while _alive(main_pid):
        time.sleep(0.5)
    os._exit(1)


def _alive(pid: int) -> bool:
    """Running, not merely a zombie: a killed process stays one while its caller reads its pipes to the end."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except ProcessLookupError:
        return False
    except OSError:  # no /proc (not Linux): signal 0 is all there is
        return True


def init_worker(context: WorkerContext) -> None:
    # Ctrl-C reaches the whole process group: the main process reports it once; workers just stop with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_main_process, args=(context.main_pid,), daemon=True).start()
    _worker.clear()
    _worker["context"] = context
    try:
        _worker["source"] = open_source(context.src)
    except HpuFp8Error as exc:  # raised by the first task instead: an initializer's error breaks the whole pool
        _worker["failure"] = exc
        return
    location = {}
    files = {}
    for shard in context.shards:
        if shard.file_name in context.skip_shards:
            continue
        files[shard.file_name] = ShardFile(context.staging, shard, context.metadata)
        for t in shard.tensors:
            location[t.name] = files[shard.file_name]
    _worker["location"] = location


def _part_amax(part, blocks, channel_wise: bool) -> np.ndarray | float:
    """amax of one source part from its row blocks ``(first_row, array)``; per output channel when
    ``channel_wise``. Refuses NaN/inf naming the source tensor and the index in it."""
    tensor_wise = 0.0
    channels: np.ndarray | None = None
    for start, block in blocks:
        try:
            if not channel_wise:
                tensor_wise = max(tensor_wise, float(e4m3.abs_max(block, part.name)))
            elif part.transpose:  # [out_p, in]: one channel per row
                peak = e4m3.channel_abs_max(transposed(block), part.name)
                channels = peak if channels is None else np.concatenate([channels, peak])
            else:  # [in, out_p]: one channel per column
                peak = e4m3.channel_abs_max(block, part.name)
                channels = peak if channels is None else np.maximum(channels, peak)
        except NonFiniteError:
            raise e4m3.locate_non_finite(part.name, block, start, part.shape) from None
    return channels if channels is not None else tensor_wise


def _streamed_blocks(source: Checkpoint, part, budget: int):
    for start, stop in row_blocks(part.shape[0], math.prod(part.shape[1:]), budget):
        yield start, source_rows(source, part.name, start, stop)


class _ErrorSum:
    """Relative RMSE of a requantization, accumulated block by block: ||fp8 x scale - source|| / ||source||."""

    def __init__(self):
        self.difference = self.norm = 0.0

    def add(self, values: np.ndarray, encoded: np.ndarray, scale: np.ndarray | float) -> None:
        difference = e4m3.dequantize(encoded, scale)
        difference -= values
        difference = difference.reshape(-1)
        flat = np.ascontiguousarray(values, np.float32).reshape(-1)
        # einsum, not a BLAS dot (see requantize._sums); float32 is plenty for a report
        self.add_sums(float(np.einsum("i,i", difference, difference)), float(np.einsum("i,i", flat, flat)))

    def add_sums(self, squared_difference: float, squared_source: float) -> None:
        self.difference += squared_difference
        self.norm += squared_source

    @property
    def relative(self) -> float:
        return (self.difference / self.norm) ** 0.5 if self.norm else 0.0


def convert_tensor(weight: WeightTensor) -> tuple[int, float | None]:
    """Convert and write one spec tensor; returns the source bytes read, and for a linear from an FP8
    (compressed-tensors) source the relative RMSE its requantization added. An allocation that fails is one
    OutOfMemoryError naming the tensor (it comes back through the worker's future like any HpuFp8Error)."""
    try:
        return _convert_tensor(weight)
    except MemoryError as exc:
        raise out_of_memory(f"converting {weight.name}", exc) from None


def reads_whole(parts: tuple[SourcePart, ...], bytes_in: int, whole_tensor_bytes: int) -> bool:
    """Whether a spec tensor's source parts are read whole rather than in row blocks.

    Each element counts as at least BF16's 2 bytes: a whole read becomes float32 whatever the source holds, so an FP8
    source counted by its own bytes would be read whole at twice the memory of the same tensor in BF16 (a 300B-width
    expert, 56 MiB of FP8, took a block-FP8 import's peak from 0.3 to 1.9 GiB: bench/import_block_fp8.py).
    """
    elements = sum(math.prod(p.shape) for p in parts)
    return max(bytes_in, 2 * elements) <= whole_tensor_bytes


def _convert_tensor(weight: WeightTensor) -> tuple[int, float | None]:
    if "failure" in _worker:
        raise _worker["failure"]
    context: WorkerContext = _worker["context"]
    source: Checkpoint = _worker["source"]
    options = context.options
    parts = weight.source_parts(context.layout, context.prefix)
    target = _worker["location"].get(weight.name)
    quantized = weight.quantized(options.keep_bf16)
    scale_name = names.tensor(weight.module, names.WEIGHT_SCALE) if quantized else None
    bytes_in = sum(source.tensors[p.name].nbytes for p in parts)
    if target is None and (scale_name is None or scale_name not in _worker["location"]):
        return bytes_in, None  # everything it writes lives in shards reused from an interrupted run
    whole = reads_whole(parts, bytes_in, options.whole_tensor_bytes)
    if quantized and _requantizes_by_tables(source, weight, parts):
        return bytes_in, _requantize_fp8(source, weight, parts, target, options, whole)
    errors = _ErrorSum() if quantized and any(source.tensors[p.name].dtype == "F8_E4M3" for p in parts) else None
    # Small tensors are read once and kept; large ones are read in row blocks, once per pass.
    arrays = [source_rows(source, p.name, 0, p.shape[0]) for p in parts] if whole else []

    def blocks(k: int):
        return [(0, arrays[k])] if whole else _streamed_blocks(source, parts[k], options.block_elements)

    amaxes = [_part_amax(p, blocks(k), weight.channel_wise) for k, p in enumerate(parts)]  # also refuses NaN/inf
    scale = _write_weight_scale(weight, amaxes, options) if quantized else None
    if target is not None and whole:
        # One contiguous copy serves the cast and the error report (quantize would copy a transposed view anyway).
        values = fuse_columns(arrays, [p.transpose for p in parts])
        encoded = np.ascontiguousarray(_encode(weight, values, scale, options))
        target.write(weight.name, encoded)
        if errors is not None:
            assert scale is not None  # errors are summed for linears only, and a linear has a scale
            errors.add(values, encoded, scale if weight.channel_wise else scale[0])
    elif target is not None:
        _write_streamed(source, weight, parts, scale, target, options, errors)
    return bytes_in, None if errors is None or target is None else errors.relative


def _write_weight_scale(weight: WeightTensor, amaxes: list, options: ConvertOptions) -> np.ndarray:
    """The weight scale from the parts' amax (per channel or their max), written unless its shard was reused."""
    scale_name = names.tensor(weight.module, names.WEIGHT_SCALE)
    amax = np.concatenate([np.atleast_1d(a) for a in amaxes]) if weight.channel_wise else max(float(np.max(a)) for a in amaxes)
    scale = scales.weight_scale_from_amax(amax, options.fp8_max, options.scale_rounding.value).reshape(-1)
    if scale_name in _worker["location"]:
        _worker["location"][scale_name].write(scale_name, scale.astype(np.float32))
    return scale


def _requantizes_by_tables(source: Checkpoint, weight: WeightTensor, parts) -> bool:
    """A linear made only of FP8 ``[out, in]`` matrices (compressed-tensors' layout): its new scale, tensor-wise
    or per output channel, is constant along each source row, so requantize.py maps its codes by tables. A block-wise
    source's scale changes along a row: it is dequantized and quantized as values instead."""
    return (
        weight.is_linear
        and block_size(source.config) is None
        and all(source.tensors[p.name].dtype == "F8_E4M3" and p.transpose for p in parts)
    )


def _requantize_fp8(source: Checkpoint, weight: WeightTensor, parts, target, options: ConvertOptions, whole: bool):
    """An FP8 (compressed-tensors) linear: amax from each row's largest code, codes mapped through tables;
    returns the relative RMSE the requantization added (None when the tensor's shard was reused)."""
    files = [source.files[source.tensors[p.name].file] for p in parts]
    kept = [f.read_rows(p.name, 0, p.shape[0]) for f, p in zip(files, parts, strict=True)] if whole else []
    source_scales = [source_scale(source, p.name) for p in parts]

    def blocks(k: int):
        """(first row, codes, source scale of those rows) of part k: kept whole, or read in row blocks."""
        spans = [(0, parts[k].shape[0])] if whole else row_blocks(parts[k].shape[0], parts[k].shape[1], options.block_elements)
        for start, stop in spans:
            codes = kept[k] if whole else files[k].read_rows(parts[k].name, start, stop)
            yield start, codes, _slice(source_scales[k], start, stop)

    amaxes = [np.concatenate([row_amax(c, s, p.name, start, p.shape) for start, c, s in blocks(k)]) for k, p in enumerate(parts)]
    scale = _write_weight_scale(weight, amaxes, options)
    if target is None:
        return None
    errors, requantized, offset = _ErrorSum(), [], 0
    for k, p in enumerate(parts):
        part_scale = scale[offset : offset + p.shape[0]] if weight.channel_wise else scale
        for start, codes, block_source_scale in blocks(k):
            new = requantize_rows(codes, block_source_scale, _slice(part_scale, start, start + len(codes)), options.fp8_max)
            errors.add_sums(new.squared_error, new.squared_source)
            if whole:
                requantized.append(new.codes)
            else:  # rows start:stop of [out_p, in] are spec columns offset+start : offset+stop
                target.write_columns(weight.name, transposed(new.codes), 0, offset + start)
        offset += p.shape[0]
    if whole:
        target.write(weight.name, fuse_columns(requantized, [True] * len(parts)))
    return errors.relative


def _encode(weight: WeightTensor, values: np.ndarray, scale: np.ndarray | None, options: ConvertOptions) -> np.ndarray:
    """The output bytes of a block: fp8 codes for linears (scale over the last axis), BF16/F32 otherwise."""
    if scale is not None:
        return e4m3.quantize(values, scale if weight.channel_wise else scale[0], options.fp8_max, weight.name)
    dtype = np.float32 if weight.source_dtype == "F32" else e4m3.BF16_DTYPE
    return values.astype(dtype, copy=False)


def _write_streamed(source, weight, parts, scale, target: ShardFile, options, errors: _ErrorSum | None = None) -> None:
    """Row blocks of each part; a transposed part lands as column segments of the spec tensor."""
    offset = 0
    for p in parts:
        width = p.shape[0] if p.transpose else p.shape[-1]
        part_scale = None if scale is None else (scale[offset : offset + width] if weight.channel_wise else scale)
        for start, stop in row_blocks(p.shape[0], math.prod(p.shape[1:]), options.block_elements):
            block = source_rows(source, p.name, start, stop)
            if p.transpose:  # rows start:stop of [out_p, in] are spec columns offset+start : offset+stop
                values, block_scale = transposed(block), None if part_scale is None else _slice(part_scale, start, stop)
                encoded = _encode(weight, values, block_scale, options)
                target.write_columns(weight.name, encoded, 0, offset + start)
            elif len(parts) == 1:
                values, block_scale = block, part_scale
                encoded = _encode(weight, block, part_scale, options)
                target.write(weight.name, encoded, start)
            else:  # a 1-D fused bias: its parts are consecutive runs
                target.write_columns(weight.name, _encode(weight, block, part_scale, options).reshape(1, -1), 0, offset + start)
                continue
            if errors is not None:
                assert block_scale is not None  # errors are summed for linears only, and a linear has a scale
                errors.add(values, encoded, block_scale if weight.channel_wise else block_scale[0])
        offset += width


def _slice(scale: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Rows start:stop of a per-row scale; a tensor-wise ``[1]`` scale serves every row as it is."""
    return scale if scale.size == 1 else scale[start:stop]

"""The worker side of a conversion: one output shard written whole, in file order, in bounded memory.

A worker process (or the main one, with one worker) gets a :class:`WorkerContext` once, opens the
source itself, and writes the shards it is handed with :func:`convert_shard`: every tensor of the shard in file
order, each spec weight read, quantized and written by :func:`convert_tensor` (small tensors read whole, large ones
in row blocks, FP8 (compressed-tensors) linears requantized through code tables), its scale right after it. Written
in order by one process, a shard is hashed as it is written (``ShardFile.digest``): no byte of it is read back.
A transposed source arrives as column segments of its spec tensor; they are put together in memory and written
whole where the tensor fits the worker's share (else written where they go, and that shard is hashed from disk).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpu_fp8_loader.arch import Layout, SourcePart, WeightTensor
from hpu_fp8_loader.conversion.folds import Scaling
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.errors import HpuFp8Error, NonFiniteError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.io.safetensors_file import numpy_dtype, row_blocks
from hpu_fp8_loader.io.writer import Shard, ShardFile
from hpu_fp8_loader.memory import memory_budget, out_of_memory
from hpu_fp8_loader.numerics import e4m3, scales
from hpu_fp8_loader.numerics.fusion import fuse_columns, transposed
from hpu_fp8_loader.numerics.requantize import requantize_rows, row_amax
from hpu_fp8_loader.sources.block_fp8 import block_size, open_source
from hpu_fp8_loader.sources.source_tensors import source_rows, source_scale
from hpu_fp8_loader.spec import names

__all__ = [
    "KEPT_TENSOR_BYTES",
    "ShardOutcome",
    "WorkerContext",
    "convert_shard",
    "convert_tensor",
    "init_worker",
    "kept_tensor_bytes",
    "reads_whole",
]

KEPT_TENSOR_BYTES = 2 << 30  # the default most bytes of one tensor's row blocks a worker keeps (ConvertOptions)


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
    act_tensors: dict[str, np.ndarray]  # the act_scale and act_amax tensors, F32 [1], by name
    scalings: dict[str, Scaling]  # spec weight name -> its exact channel folds (conversion/folds.py), applied as read


@dataclass(frozen=True)
class ShardOutcome:
    """What a finished shard reports: its digest when it was hashed as written, and each linear's requantization error."""

    file_name: str
    digest: tuple[int, str] | None  # (size, sha256 hex); None: written out of order, to be hashed from disk
    requantized: dict[str, float]


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


def init_worker(context: WorkerContext, progress: Callable[[int], object] | None = None) -> None:
    """Set a worker up: ``progress`` (a multiprocessing queue's ``put``, or a callable of the main process) hears the
    source bytes of each weight as it is written."""
    # Ctrl-C reaches the whole process group: the main process reports it once; workers just stop with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_main_process, args=(context.main_pid,), daemon=True).start()
    _worker.clear()
    _worker["context"] = context
    _worker["progress"] = progress
    try:
        _worker["source"] = open_source(context.src)
    except HpuFp8Error as exc:  # raised by the first task instead: an initializer's error breaks the whole pool
        _worker["failure"] = exc
        return
    _worker["kept_bytes"] = kept_tensor_bytes(context.options)


def convert_shard(file_name: str, weights: list[WeightTensor]) -> ShardOutcome:
    """Write shard ``file_name`` whole, in file order: its act tensors from the context, each of ``weights`` (the spec
    weights it holds) converted, each one's scale right after it. An allocation that fails is one OutOfMemoryError
    naming the tensor or the shard."""
    if "failure" in _worker:
        raise _worker["failure"]
    context: WorkerContext = _worker["context"]
    shard = next(s for s in context.shards if s.file_name == file_name)
    target = ShardFile(context.staging, shard, context.metadata)
    target.create()
    _worker["location"] = {t.name: target for t in shard.tensors}
    by_name = {w.name: w for w in weights}
    requantized = {}
    try:
        for planned in shard.tensors:
            if planned.name in context.act_tensors:
                target.write(planned.name, context.act_tensors[planned.name])
            elif planned.name in by_name:
                bytes_in, error = convert_tensor(by_name[planned.name])
                if error is not None:
                    requantized[planned.name] = error
                if _worker["progress"] is not None:
                    _worker["progress"](bytes_in)
        return ShardOutcome(file_name, target.digest(), requantized)
    except MemoryError as exc:
        raise out_of_memory(f"writing the shard {file_name}", exc) from None
    finally:
        target.close()


def kept_tensor_bytes(options: ConvertOptions) -> int:
    """The most bytes of row blocks a worker keeps from a tensor's amax pass for its quantization (see
    :class:`~hpu_fp8_loader.conversion.plan.ConvertOptions`): what makes a large tensor's source read once."""
    if options.kept_tensor_bytes is not None:
        return options.kept_tensor_bytes
    return min(KEPT_TENSOR_BYTES, memory_budget() // (3 * options.workers))


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


def _streamed_blocks(read: Callable[[int, int, int], np.ndarray], k: int, part, budget: int):
    for start, stop in row_blocks(part.shape[0], math.prod(part.shape[1:]), budget):
        yield start, read(k, start, stop)


def _keeping(blocks, kept: list):
    """``blocks`` passed on, each also appended to ``kept``: the amax pass's reads, kept for the quantization."""
    for block in blocks:
        kept.append(block)
        yield block


def _held_bytes(source: Checkpoint, parts, scaled: bool = False) -> int:
    """What keeping every row block of ``parts`` costs: their bytes as read (FP8 ones dequantized to float32, and
    every one as float32 when ``scaled`` by channel folds)."""
    infos = [source.tensors[p.name] for p in parts]
    return sum(4 * math.prod(info.shape) if scaled or info.dtype == "F8_E4M3" else info.nbytes for info in infos)


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
    quantized = weight.quantized(options.keep_bf16)
    bytes_in = sum(source.tensors[p.name].nbytes for p in parts)
    whole = reads_whole(parts, bytes_in, options.whole_tensor_bytes)
    target = _in_order(weight, parts, _worker["location"][weight.name], whole)
    if quantized and _requantizes_by_tables(source, weight, parts):
        return bytes_in, _requantize_fp8(source, weight, parts, target, options, whole)
    errors = _ErrorSum() if quantized and any(source.tensors[p.name].dtype == "F8_E4M3" for p in parts) else None
    read = _reader(source, weight, parts, context.scalings.get(weight.name))
    # Small tensors are read whole; large ones in row blocks, kept from the amax pass for the quantization when they
    # fit the worker's share of memory (the source read once), else read again for it.
    arrays = [read(k, 0, p.shape[0]) for k, p in enumerate(parts)] if whole else []
    held = _held_bytes(source, parts, weight.name in context.scalings)
    kept: list[list] | None = [[] for _ in parts] if not whole and held <= _worker["kept_bytes"] else None

    def blocks(k: int):
        if whole:
            return [(0, arrays[k])]
        streamed = _streamed_blocks(read, k, parts[k], options.block_elements)
        return streamed if kept is None else _keeping(streamed, kept[k])

    amaxes = [_part_amax(p, blocks(k), weight.channel_wise) for k, p in enumerate(parts)]  # also refuses NaN/inf
    scale = _weight_scale(weight, amaxes, options) if quantized else None
    if whole:
        # One contiguous copy serves the cast and the error report (quantize would copy a transposed view anyway).
        values = fuse_columns(arrays, [p.transpose for p in parts])
        encoded = np.ascontiguousarray(_encode(weight, values, scale, options))
        target.write(weight.name, encoded)
        if errors is not None:
            assert scale is not None  # errors are summed for linears only, and a linear has a scale
            errors.add(values, encoded, scale if weight.channel_wise else scale[0])
    else:
        _write_streamed(weight, parts, _blocks_again(read, parts, options, kept), scale, target, options, errors)
    target.close()
    if scale is not None:
        _write_weight_scale(weight, scale)
    return bytes_in, None if errors is None else errors.relative


def _reader(source: Checkpoint, weight: WeightTensor, parts, scaling: Scaling | None) -> Callable[[int, int, int], np.ndarray]:
    """``read(k, start, stop)``: rows ``start:stop`` of source part ``k``, as stored, or scaled by the weight's
    channel folds (float32, exact) when it has any."""
    offsets = np.cumsum([0] + [p.shape[0] if p.transpose else p.shape[-1] for p in parts])

    def read(k: int, start: int, stop: int) -> np.ndarray:
        rows = source_rows(source, parts[k].name, start, stop)
        if scaling is None:
            return rows
        return scaling.apply(rows, weight.name, start, int(offsets[k]), parts[k].transpose)

    return read


class _Assembled:
    """A spec tensor put together in memory from the column segments a transposed source gives, written whole (in
    file order) by :meth:`close`."""

    def __init__(self, target: ShardFile, name: str, shape: tuple[int, ...], dtype: np.dtype):
        self.target, self.name = target, name
        self.array = np.empty(shape if len(shape) == 2 else (1, shape[0]), dtype)

    def write_columns(self, name: str, block: np.ndarray, first_row: int, first_column: int) -> None:
        self.array[first_row : first_row + block.shape[0], first_column : first_column + block.shape[1]] = block

    def write(self, name: str, array: np.ndarray, first_row: int = 0) -> None:
        self.array[first_row : first_row + len(array)] = array

    def close(self) -> None:
        self.target.write(self.name, self.array.reshape(self.target.planned(self.name).shape))


class _Direct:
    """A spec tensor written where each piece goes (in order, or a shard then hashed from disk)."""

    def __init__(self, target: ShardFile):
        self.target = target

    def write_columns(self, name: str, block: np.ndarray, first_row: int, first_column: int) -> None:
        self.target.write_columns(name, block, first_row, first_column)

    def write(self, name: str, array: np.ndarray, first_row: int = 0) -> None:
        self.target.write(name, array, first_row)

    def close(self) -> None:
        pass


def _in_order(weight: WeightTensor, parts, target: ShardFile, whole: bool) -> _Assembled | _Direct:
    """Where a spec tensor's pieces go so that its shard is written in file order: straight to the shard when they
    arrive in order (a tensor read whole, row blocks, a fused bias's parts one after another), else (a transposed
    source streamed in row blocks gives column segments) put together in memory, when it fits the worker's share."""
    planned = target.planned(weight.name)
    segmented = not whole and any(p.transpose for p in parts)
    if segmented and planned.nbytes <= _worker["kept_bytes"]:
        return _Assembled(target, weight.name, planned.shape, numpy_dtype(planned.dtype))
    return _Direct(target)


def _weight_scale(weight: WeightTensor, amaxes: list, options: ConvertOptions) -> np.ndarray:
    """The weight scale from the parts' amax (per channel or their max)."""
    amax = np.concatenate([np.atleast_1d(a) for a in amaxes]) if weight.channel_wise else max(float(np.max(a)) for a in amaxes)
    return scales.weight_scale_from_amax(amax, options.fp8_max, options.scale_rounding.value).reshape(-1)


def _write_weight_scale(weight: WeightTensor, scale: np.ndarray) -> None:
    """The scale, after its weight: the next tensor of the same shard (``plan_shards`` keeps them together)."""
    scale_name = names.tensor(weight.module, names.WEIGHT_SCALE)
    _worker["location"][scale_name].write(scale_name, scale.astype(np.float32))


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
    returns the relative RMSE the requantization added."""
    files = [source.files[source.tensors[p.name].file] for p in parts]
    kept = [f.read_rows(p.name, 0, p.shape[0]) for f, p in zip(files, parts, strict=True)] if whole else []
    source_scales = [source_scale(source, p.name) for p in parts]
    # Read in row blocks: kept from the amax pass for the requantization when they fit (the source read once).
    held: list[list] | None = [[] for _ in parts] if not whole and _held_bytes(source, parts) <= _worker["kept_bytes"] else None

    def blocks(k: int):
        """(first row, codes, source scale of those rows) of part k: kept whole, held from the first pass, or read in
        row blocks."""
        if held is not None and held[k]:  # the second pass over blocks the first one held
            taken, held[k] = held[k], []
            yield from taken
            return
        spans = [(0, parts[k].shape[0])] if whole else row_blocks(parts[k].shape[0], parts[k].shape[1], options.block_elements)
        for start, stop in spans:
            codes = kept[k] if whole else files[k].read_rows(parts[k].name, start, stop)
            block = start, codes, _slice(source_scales[k], start, stop)
            if held is not None:
                held[k].append(block)
            yield block

    amaxes = [np.concatenate([row_amax(c, s, p.name, start, p.shape) for start, c, s in blocks(k)]) for k, p in enumerate(parts)]
    scale = _weight_scale(weight, amaxes, options)
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
    target.close()
    _write_weight_scale(weight, scale)
    return errors.relative


def _encode(weight: WeightTensor, values: np.ndarray, scale: np.ndarray | None, options: ConvertOptions) -> np.ndarray:
    """The output bytes of a block: fp8 codes for linears (scale over the last axis), BF16/F32 otherwise."""
    if scale is not None:
        return e4m3.quantize(values, scale if weight.channel_wise else scale[0], options.fp8_max, weight.name)
    dtype = np.float32 if weight.source_dtype == "F32" else e4m3.BF16_DTYPE
    return values.astype(dtype, copy=False)


def _blocks_again(read: Callable[[int, int, int], np.ndarray], parts, options: ConvertOptions, kept: list[list] | None):
    """Each part's row blocks for the quantization: the amax pass's, handed over (and let go) one by one when kept,
    else read again."""

    def part_blocks(k: int):
        if kept is None:
            yield from _streamed_blocks(read, k, parts[k], options.block_elements)
            return
        blocks, kept[k] = kept[k], []
        blocks.reverse()
        while blocks:
            yield blocks.pop()

    return part_blocks


def _write_streamed(weight, parts, part_blocks, scale, target, options, errors: _ErrorSum | None = None) -> None:
    """Row blocks of each part (``part_blocks(k)``: ``(first row, rows)`` of part k); a transposed part lands as
    column segments of the spec tensor."""
    offset = 0
    for k, p in enumerate(parts):
        width = p.shape[0] if p.transpose else p.shape[-1]
        part_scale = None if scale is None else (scale[offset : offset + width] if weight.channel_wise else scale)
        for start, block in part_blocks(k):
            stop = start + block.shape[0]
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

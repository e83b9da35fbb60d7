"""BF16 source checkpoint + activation amax -> hpu-fp8 v1 checkpoint, on CPU, in bounded memory.

The plan (every output tensor's name, dtype, shape and shard) is fixed from the descriptor before
any weight is read. Shards are created at full size in ``OUT.partial``; worker processes convert
one tensor at a time and write it at its offset, reading the source with ``pread`` in row blocks,
so a worker holds a few blocks, never a model. A journal in ``OUT.partial`` records each finished
shard with its sha256; a re-run after an interruption checks those and converts only the rest.
The index and the manifest are written last, then ``OUT.partial`` is renamed to ``OUT``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpu_fp8_loader import __version__
from hpu_fp8_loader.arch import Layout, ModelDescriptor, WeightTensor, describe
from hpu_fp8_loader.arch.contents import expected_tensors
from hpu_fp8_loader.conversion.activations import merge_measurements, resolve_act_amax
from hpu_fp8_loader.errors import ConfigError, HpuFp8Error, NonFiniteError, WorkerDiedError
from hpu_fp8_loader.io.checkpoint import CONFIG_FILE, Checkpoint, copied_source_files
from hpu_fp8_loader.io.fingerprint import file_fingerprint
from hpu_fp8_loader.io.manifest import file_digest
from hpu_fp8_loader.io.safetensors_file import BLOCK_ELEMENTS, row_blocks
from hpu_fp8_loader.io.writer import (
    PlannedTensor,
    Shard,
    ShardFile,
    check_apart,
    clear_staging,
    finish_output,
    plan_shards,
    prepare_output_dir,
)
from hpu_fp8_loader.numerics import e4m3, scales
from hpu_fp8_loader.numerics.fusion import fuse_columns, transposed
from hpu_fp8_loader.numerics.requantize import requantize_rows, row_amax
from hpu_fp8_loader.sources.source_tensors import check_source, detect_layout, source_rows, source_scale
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import (
    FP8_MAX_BY_TARGET,
    Calibration,
    CalibrationSource,
    DeadExpertPolicy,
    DeadExperts,
    ExpertRef,
    KvCacheScheme,
    MoePolicy,
    Producer,
    QuantizationConfig,
    ScaleRounding,
    Target,
    is_hpu_fp8,
)
from hpu_fp8_loader.spec.measurements import Measurements

__all__ = [
    "ConvertOptions",
    "ConvertProgress",
    "ConvertResult",
    "convert",
    "output_config",
    "planned_tensors",
    "quantization_config_for",
]

log = logging.getLogger(__name__)
_JOURNAL = ".hpu_fp8_progress.json"


@dataclass(frozen=True)
class ConvertOptions:
    target: Target = Target.GAUDI2
    kv_cache: KvCacheScheme = KvCacheScheme.FP8
    scale_rounding: ScaleRounding = ScaleRounding.NONE
    max_shard_bytes: int = 5 * 10**9
    force: bool = False
    workers: int = 1
    dead_experts: DeadExpertPolicy = DeadExpertPolicy.ERROR
    block_elements: int = BLOCK_ELEMENTS  # elements per row block when a tensor is streamed
    # Tensors whose source is at most this many bytes are read whole (fast path for fused experts).
    whole_tensor_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        # Accept the plain strings the CLI and Python callers pass ("gaudi2", "fp8", "pow2").
        object.__setattr__(self, "target", Target(self.target))
        object.__setattr__(self, "kv_cache", KvCacheScheme(self.kv_cache))
        object.__setattr__(self, "scale_rounding", ScaleRounding(self.scale_rounding))
        object.__setattr__(self, "dead_experts", DeadExpertPolicy(self.dead_experts))
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")

    @property
    def fp8_max(self) -> float:
        return FP8_MAX_BY_TARGET[self.target]


@dataclass(frozen=True)
class ConvertProgress:
    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int


@dataclass
class ConvertResult:
    out: Path
    layout: Layout
    tensors_quantized: int
    tensors_kept: int
    bytes_in: int
    bytes_out: int
    seconds: float
    reused_shards: int
    filled_experts: list[ExpertRef] = field(default_factory=list)
    # spec tensor -> relative RMSE added, for linears requantized from an FP8 (compressed-tensors) source
    requantization_errors: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.bytes_out / self.bytes_in if self.bytes_in else 0.0


# ----------------------------------------------------------------------------- planning


def planned_tensors(descriptor: ModelDescriptor, qc: QuantizationConfig) -> list[PlannedTensor]:
    """Every output tensor of the spec checkpoint, in the order shards are filled (:func:`expected_tensors`)."""
    return [PlannedTensor(name, dtype, shape) for name, (dtype, shape) in expected_tensors(descriptor, qc).items()]


def _refuse_hpu_fp8_source(checkpoint: Checkpoint) -> None:
    """An hpu-fp8 checkpoint is an output, not a source: say so once, instead of one complaint per scale tensor."""
    if is_hpu_fp8(checkpoint.config):
        raise ConfigError(
            f"{checkpoint.root}: already an hpu-fp8 checkpoint; convert reads the BF16 (or compressed-tensors) model, "
            "and `hpu-fp8 retarget` changes an hpu-fp8 checkpoint's target"
        )


# ----------------------------------------------------------------------------- the worker side


@dataclass(frozen=True)
class _Context:
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


def _init_worker(context: _Context) -> None:
    # Ctrl-C reaches the whole process group: the main process reports it once; workers just stop with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_main_process, args=(context.main_pid,), daemon=True).start()
    _worker.clear()
    _worker["context"] = context
    try:
        _worker["source"] = Checkpoint.open(context.src)
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
    result = None
    for start, block in blocks:
        try:
            if not channel_wise:
                value = e4m3.abs_max(block, part.name)
                result = value if result is None else max(result, value)
            elif part.transpose:  # [out_p, in]: one channel per row
                peak = e4m3.channel_abs_max(transposed(block), part.name)
                result = peak if result is None else np.concatenate([result, peak])
            else:  # [in, out_p]: one channel per column
                peak = e4m3.channel_abs_max(block, part.name)
                result = peak if result is None else np.maximum(result, peak)
        except NonFiniteError:
            raise e4m3.locate_non_finite(part.name, block, start, part.shape) from None
    return result if result is not None else 0.0


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


def _convert_tensor(weight: WeightTensor) -> tuple[int, float | None]:
    """Convert and write one spec tensor; returns the source bytes read, and for a linear from an FP8
    (compressed-tensors) source the relative RMSE its requantization added."""
    if "failure" in _worker:
        raise _worker["failure"]
    context: _Context = _worker["context"]
    source: Checkpoint = _worker["source"]
    options = context.options
    parts = weight.source_parts(context.layout, context.prefix)
    target = _worker["location"].get(weight.name)
    scale_name = names.tensor(weight.module, names.WEIGHT_SCALE) if weight.is_linear else None
    bytes_in = sum(source.tensors[p.name].nbytes for p in parts)
    if target is None and (scale_name is None or scale_name not in _worker["location"]):
        return bytes_in, None  # everything it writes lives in shards reused from an interrupted run
    whole = bytes_in <= options.whole_tensor_bytes
    if _requantizes_by_tables(source, weight, parts):
        return bytes_in, _requantize_fp8(source, weight, parts, target, scale_name, options, whole)
    errors = _ErrorSum() if weight.is_linear and any(source.tensors[p.name].dtype == "F8_E4M3" for p in parts) else None
    # Small tensors are read once and kept; large ones are read in row blocks, once per pass.
    arrays = [source_rows(source, p.name, 0, p.shape[0]) for p in parts] if whole else None

    def blocks(k: int):
        return [(0, arrays[k])] if whole else _streamed_blocks(source, parts[k], options.block_elements)

    amaxes = [_part_amax(p, blocks(k), weight.channel_wise) for k, p in enumerate(parts)]  # also refuses NaN/inf
    scale = _write_weight_scale(weight, amaxes, scale_name, options) if weight.is_linear else None
    if target is not None and whole:
        # One contiguous copy serves the cast and the error report (quantize would copy a transposed view anyway).
        values = fuse_columns(arrays, [p.transpose for p in parts])
        encoded = np.ascontiguousarray(_encode(weight, values, scale, options))
        target.write(weight.name, encoded)
        if errors is not None:
            errors.add(values, encoded, scale if weight.channel_wise else scale[0])
    elif target is not None:
        _write_streamed(source, weight, parts, scale, target, options, errors)
    return bytes_in, None if errors is None or target is None else errors.relative


def _write_weight_scale(weight: WeightTensor, amaxes: list, scale_name: str, options: ConvertOptions) -> np.ndarray:
    """The weight scale from the parts' amax (per channel or their max), written unless its shard was reused."""
    amax = np.concatenate([np.atleast_1d(a) for a in amaxes]) if weight.channel_wise else max(float(np.max(a)) for a in amaxes)
    scale = scales.weight_scale_from_amax(amax, options.fp8_max, options.scale_rounding.value).reshape(-1)
    if scale_name in _worker["location"]:
        _worker["location"][scale_name].write(scale_name, scale.astype(np.float32))
    return scale


def _requantizes_by_tables(source: Checkpoint, weight: WeightTensor, parts) -> bool:
    """A linear made only of FP8 ``[out, in]`` matrices (compressed-tensors' layout): its new scale, tensor-wise
    or per output channel, is constant along each source row, so requantize.py maps its codes by tables."""
    return weight.is_linear and all(source.tensors[p.name].dtype == "F8_E4M3" and p.transpose for p in parts)


def _requantize_fp8(source: Checkpoint, weight: WeightTensor, parts, target, scale_name: str, options, whole: bool):
    """An FP8 (compressed-tensors) linear: amax from each row's largest code, codes mapped through tables;
    returns the relative RMSE the requantization added (None when the tensor's shard was reused)."""
    files = [source.files[source.tensors[p.name].file] for p in parts]
    kept = [f.read_rows(p.name, 0, p.shape[0]) for f, p in zip(files, parts, strict=True)] if whole else None
    source_scales = [source_scale(source, p.name) for p in parts]

    def blocks(k: int):
        """(first row, codes, source scale of those rows) of part k: kept whole, or read in row blocks."""
        spans = [(0, parts[k].shape[0])] if whole else row_blocks(parts[k].shape[0], parts[k].shape[1], options.block_elements)
        for start, stop in spans:
            codes = kept[k] if whole else files[k].read_rows(parts[k].name, start, stop)
            yield start, codes, _slice(source_scales[k], start, stop)

    amaxes = [np.concatenate([row_amax(c, s, p.name, start, p.shape) for start, c, s in blocks(k)]) for k, p in enumerate(parts)]
    scale = _write_weight_scale(weight, amaxes, scale_name, options)
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
                values, block_scale = transposed(block), _slice(part_scale, start, stop)
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
                errors.add(values, encoded, block_scale if weight.channel_wise else block_scale[0])
        offset += width


def _slice(scale: np.ndarray | None, start: int, stop: int) -> np.ndarray | None:
    return scale if scale is None or scale.size == 1 else scale[start:stop]


# ----------------------------------------------------------------------------- the main side


def quantization_config_for(
    descriptor: ModelDescriptor,
    options: ConvertOptions,
    act: dict[str, float],
    origin: dict[str, str],
    sources: list[CalibrationSource],
    filled: list[ExpertRef],
) -> QuantizationConfig:
    """The quantization_config of a checkpoint made with ``options`` from these activation sources."""
    attention_fp8 = options.kv_cache is KvCacheScheme.FP8
    default = sources[0].id
    return QuantizationConfig(
        kv_cache_quant_type="float8_e4m3" if attention_fp8 else None,
        fp8_max=options.fp8_max,
        target=options.target,
        kv_cache_scheme=options.kv_cache,
        scale_rounding=options.scale_rounding,
        moe=MoePolicy(dead_experts=DeadExperts(policy=options.dead_experts, filled=filled)) if descriptor.moe else None,
        calibration=Calibration(
            sources=sources,
            default_source=default,
            overrides={m: origin[m] for m in act if origin.get(m, default) != default},
        ),
        producer=Producer(name="hpu-fp8-loader", version=__version__),
    )


def output_config(source_config: dict, descriptor: ModelDescriptor, qc: QuantizationConfig) -> dict:
    config = {k: v for k, v in source_config.items() if k not in ("torch_dtype", "transformers_version", "quantization_config")}
    config["architectures"] = [descriptor.architecture]
    config["dtype"] = "bfloat16"
    # keys whose absence FastDeploy reads with other defaults than the model's own (docs/fastdeploy.md section 3)
    config["tie_word_embeddings"] = descriptor.tie_word_embeddings
    if descriptor.moe is not None:
        config["moe_layer_start_index"] = descriptor.moe.start
        config["moe_use_aux_free"] = descriptor.moe.correction_bias
    config["quantization_config"] = qc.model_dump(mode="json", exclude_none=True)
    return config


def _fingerprint(checkpoint: Checkpoint, shards: list[Shard], qc: QuantizationConfig, act: dict[str, float]) -> str:
    """Identity of a conversion: the source files' content (io/fingerprint.py), the plan, the config and every
    amax. Resume requires equality."""
    source = sorted((str(p), file_fingerprint(p)) for p in checkpoint.files)
    plan = [(s.file_name, [(t.name, t.dtype, list(t.shape)) for t in s.tensors]) for s in shards]
    identity = {
        "source": source,
        "config": checkpoint.config,
        "plan": plan,
        "qc": qc.model_dump(mode="json", exclude={"producer"}),
        "act": act,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def _reusable_shards(staging: Path, fingerprint: str) -> dict[str, dict]:
    """Finished shards an interrupted run left in ``staging`` whose sha256 still matches; clears the rest."""
    journal = staging / _JOURNAL
    try:
        recorded = json.loads(journal.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        recorded = {}
    if recorded.get("fingerprint") != fingerprint:
        clear_staging(staging)
        return {}
    reusable = {}
    for name, entry in recorded.get("shards", {}).items():
        path = staging / name
        if path.is_file() and path.stat().st_size == entry.get("size") and file_digest(path)[1] == entry.get("sha256"):
            reusable[name] = entry
    return reusable


def _save_journal(staging: Path, fingerprint: str, done: dict[str, dict]) -> None:
    temporary = staging / (_JOURNAL + ".tmp")
    temporary.write_text(json.dumps({"fingerprint": fingerprint, "shards": done}))
    temporary.replace(staging / _JOURNAL)


def convert(
    src: str | Path,
    out: str | Path,
    measurements: Sequence[Measurements],
    options: ConvertOptions = ConvertOptions(),
    progress: Callable[[ConvertProgress], None] | None = None,
    used_elsewhere: Collection[str] = (),
) -> ConvertResult:
    """Convert ``src`` into an hpu-fp8 v1 checkpoint at ``out``.

    Everything that can be refused (measurements, shapes, dtypes, tensors the model does not account
    for, a corrupt tokenizer file, an existing ``out``) is refused before any output is written. On
    failure ``out`` is untouched and ``out.partial`` holds what was finished; the same call resumes
    from it. ``used_elsewhere``: source tensors a caller read itself (``import``'s input scales).
    """
    started = time.perf_counter()
    src, out = Path(src), Path(out)
    check_apart(out, [src])
    checkpoint = Checkpoint.open(src)
    _refuse_hpu_fp8_source(checkpoint)
    descriptor = describe(checkpoint.config, str(src / CONFIG_FILE), checkpoint.tensors)
    layout = detect_layout(checkpoint, descriptor)
    for note in check_source(checkpoint, descriptor, layout, used_elsewhere):
        log.warning("%s: %s", src, note)
    copied_source_files(src)
    attention_fp8 = options.kv_cache is KvCacheScheme.FP8
    modules = descriptor.act_modules(attention_fp8)
    amax, origin, sources = merge_measurements(measurements, descriptor)
    act, filled = resolve_act_amax(modules, amax, options.dead_experts)
    qc = quantization_config_for(descriptor, options, act, origin, sources, filled)
    shards = plan_shards(planned_tensors(descriptor, qc), options.max_shard_bytes)
    staging = prepare_output_dir(out, options.force, [src])
    fingerprint = _fingerprint(checkpoint, shards, qc, act)
    done = _reusable_shards(staging, fingerprint)
    log.info(
        "%s: %s, %s layout, %d tensors -> %d shard(s) of at most %d bytes, %d worker(s)",
        src,
        descriptor.model_type,
        layout.value,
        len(descriptor.weights()),
        len(shards),
        options.max_shard_bytes,
        options.workers,
    )
    if done:
        log.info(
            "resuming %s: %d of %d shard(s) finished earlier from the same source and options are kept",
            out,
            len(done),
            len(shards),
        )
    metadata = {"format": "pd", "producer": f"hpu-fp8-loader {__version__}"}
    context = _Context(os.getpid(), src, staging, layout, descriptor.prefix, options, tuple(shards), frozenset(done), metadata)
    files = {s.file_name: ShardFile(staging, s, metadata) for s in shards if s.file_name not in done}
    for shard_file in files.values():
        shard_file.create()
    for module, value in act.items():  # the small act tensors, written here
        for name, array in (
            (
                names.tensor(module, names.ACT_SCALE),
                scales.act_scale_from_amax(value, options.fp8_max, options.scale_rounding.value),
            ),
            (names.tensor(module, names.ACT_AMAX), np.float32(value)),
        ):
            shard_of = next(s.file_name for s in shards if any(t.name == name for t in s.tensors))
            if shard_of in files:
                files[shard_of].write(name, np.asarray(array, np.float32).reshape(1))
    requantized = _run_jobs(checkpoint, descriptor, context, shards, done, fingerprint, progress)
    (staging / _JOURNAL).unlink()
    finish_output(
        staging,
        out,
        shards,
        output_config(checkpoint.config, descriptor, qc),
        copy_from=src,
        digests={name: (entry["size"], entry["sha256"]) for name, entry in done.items()},
    )
    log.info("%s: published", out)
    weights = descriptor.weights()
    return ConvertResult(
        out=out,
        layout=layout,
        tensors_quantized=sum(w.is_linear for w in weights),
        tensors_kept=sum(not w.is_linear for w in weights),
        bytes_in=sum(info.nbytes for info in checkpoint.tensors.values()),
        bytes_out=sum(s.nbytes for s in shards),
        seconds=time.perf_counter() - started,
        reused_shards=len(context.skip_shards),
        filled_experts=filled,
        requantization_errors=dict(sorted(requantized.items(), key=lambda item: -item[1])),
    )


def _run_jobs(
    source: Checkpoint, descriptor, context: _Context, shards, done: dict, fingerprint: str, progress
) -> dict[str, float]:
    """Convert every tensor (in worker processes when asked), hashing each shard as it completes."""
    weights = descriptor.weights()
    owner = {t.name: s.file_name for s in shards for t in s.tensors}
    pending_in_shard = {s.file_name: {t.name for t in s.tensors} for s in shards if s.file_name not in done}
    for s in shards:  # act tensors are already written
        if s.file_name in pending_in_shard:
            pending_in_shard[s.file_name] -= {t.name for t in s.tensors if t.name.endswith((names.ACT_SCALE, names.ACT_AMAX))}
    total_bytes = sum(source.tensors[p.name].nbytes for w in weights for p in w.source_parts(context.layout, context.prefix))
    state = {"bytes": 0, "tensors": 0}
    requantized: dict[str, float] = {}

    def finished(weight: WeightTensor, outcome: tuple[int, float | None]) -> None:
        bytes_in, error = outcome
        if error is not None:
            requantized[weight.name] = error
        outputs = [weight.name] + ([names.tensor(weight.module, names.WEIGHT_SCALE)] if weight.is_linear else [])
        for name in outputs:
            shard = owner[name]
            if shard in pending_in_shard:
                pending_in_shard[shard].discard(name)
        for shard, remaining in list(pending_in_shard.items()):
            if not remaining:
                size, sha = file_digest(context.staging / shard)
                done[shard] = {"size": size, "sha256": sha}
                del pending_in_shard[shard]
                log.debug("%s finished (%d bytes, sha256 %s)", shard, size, sha)
                _save_journal(context.staging, fingerprint, done)
        state["bytes"] += bytes_in
        state["tensors"] += 1
        if progress:
            progress(ConvertProgress(state["bytes"], total_bytes, state["tensors"], len(weights)))

    if context.options.workers == 1:
        _init_worker(context)
        for w in weights:
            finished(w, _convert_tensor(w))
    else:
        mp = multiprocessing.get_context("forkserver")
        pool = ProcessPoolExecutor(context.options.workers, mp_context=mp, initializer=_init_worker, initargs=(context,))
        try:
            queue = list(reversed(_largest_first(weights)))
            running: dict[Future, WeightTensor] = {}
            while queue or running:
                while queue and len(running) < 2 * context.options.workers:
                    w = queue.pop()
                    try:
                        running[pool.submit(_convert_tensor, w)] = w
                    except BrokenProcessPool:  # a worker died before its result was collected
                        raise _worker_died(next(iter(running.values()), w)) from None
                finished_now, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished_now:
                    w = running.pop(future)
                    finished(w, _worker_result(future, w))
        except BaseException:
            _stop_workers(pool)
            raise
        pool.shutdown()
    for shard, remaining in pending_in_shard.items():
        if remaining:
            raise RuntimeError(f"internal error: shard {shard} still misses {', '.join(sorted(remaining)[:3])}")
    _save_journal(context.staging, fingerprint, done)
    return requantized


def _worker_result(future: Future, weight: WeightTensor) -> tuple[int, float | None]:
    """A worker's outcome; its HpuFp8Error comes back with its message, a dead worker as one line."""
    try:
        return future.result()
    except BrokenProcessPool:
        raise _worker_died(weight) from None


def _worker_died(weight: WeightTensor) -> WorkerDiedError:
    return WorkerDiedError(
        f"a worker process died while converting {weight.name} (killed by a signal; out of memory?). "
        "Nothing was published; run the same command again to resume, perhaps with fewer --workers"
    )


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """On failure or Ctrl-C, kill the workers instead of letting each finish its tensor first (what
    ``shutdown`` and the interpreter's exit would wait for)."""
    for process in list((pool._processes or {}).values()):  # no public way before Python 3.14's kill_workers
        process.kill()
    pool.shutdown(wait=True, cancel_futures=True)  # returns at once with the workers gone; joins the pool's thread


def _largest_first(weights: list[WeightTensor]) -> list[WeightTensor]:
    """Big tensors first, so two workers do not end with one of them alone on a huge tensor."""
    return sorted(weights, key=lambda w: -math.prod(w.shape))

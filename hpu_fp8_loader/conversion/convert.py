"""BF16 source checkpoint + activation amax -> hpu-fp8 v1 checkpoint, on CPU, in bounded memory.

The plan (every output tensor's name, dtype, shape and shard) is fixed from the descriptor before
any weight is read. Shards are created at full size in ``OUT.partial``; worker processes convert
one tensor at a time and write it at its offset, reading the source with ``pread`` in row blocks,
so a worker holds a few blocks, never a model. A journal in ``OUT.partial`` records each finished
shard with its sha256; a re-run after an interruption checks those and converts only the rest.
The index and the manifest are written last, then ``OUT.partial`` is renamed to ``OUT``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import queue as queue_module
import sys
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpu_fp8_loader import __version__
from hpu_fp8_loader.arch import Layout, ModelDescriptor, describe
from hpu_fp8_loader.arch.contents import bf16_modules
from hpu_fp8_loader.console import Progress
from hpu_fp8_loader.conversion.activations import merge_measurements, resolve_act_amax
from hpu_fp8_loader.conversion.folds import ChosenFolds, Scaling, weight_scalings
from hpu_fp8_loader.conversion.journal import STAGING_ONLY, conversion_fingerprint, reusable_shards, save_journal
from hpu_fp8_loader.conversion.plan import (
    ConvertOptions,
    output_config,
    planned_tensors,
    quantization_config_for,
    refuse_hpu_fp8_source,
)
from hpu_fp8_loader.conversion.worker import ShardOutcome, WorkerContext, convert_shard, init_worker
from hpu_fp8_loader.errors import ConfigError, MeasurementError, WorkerDiedError
from hpu_fp8_loader.io.checkpoint import CONFIG_FILE, Checkpoint, copied_source_files
from hpu_fp8_loader.io.manifest import file_digest
from hpu_fp8_loader.io.writer import (
    PlannedTensor,
    check_apart,
    check_publishable,
    finish_output,
    plan_shards,
    prepare_output_dir,
)
from hpu_fp8_loader.memory import out_of_memory
from hpu_fp8_loader.numerics import scales
from hpu_fp8_loader.sources.block_fp8 import open_source
from hpu_fp8_loader.sources.source_tensors import check_source, detect_layout
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.choices import Rebalance
from hpu_fp8_loader.spec.config import ExpertRef, KvCacheScheme
from hpu_fp8_loader.spec.measurements import Measurements, measurement_files

__all__ = ["ConvertProgress", "ConvertResult", "convert", "refuse_fp8_folds"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConvertProgress:
    """What :func:`convert` passes its ``progress`` callback after each tensor: source bytes and tensors done so far."""

    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int


def convert_steps(progress: Progress) -> Callable[[ConvertProgress], None]:
    """A conversion's reports passed on to ``progress``: source bytes against their total, tensors as a detail."""

    def show(p: ConvertProgress) -> None:
        progress.show(p.bytes_done, p.bytes_total, detail=f"{p.tensors_done}/{p.tensors_total} tensors")

    return show


@dataclass
class ConvertResult:
    """What :func:`convert` wrote, and what it did on the way.

    Attributes:
        out: the published hpu-fp8 v1 checkpoint directory.
        layout: the source's layout as detected: ``Layout.PADDLE`` or ``Layout.TORCH`` (Hugging Face).
        tensors_quantized: linear weights stored in FP8 (each with its weight scale).
        tensors_kept: weights kept at their source precision (embeddings, norms, biases, router, lm_head, and the
            linears of ``options.keep_bf16``).
        bytes_in: bytes of the source's tensors.
        bytes_out: bytes of the checkpoint's tensors.
        seconds: wall time of the conversion.
        reused_shards: shards kept from an interrupted earlier run of the same conversion (checked by sha256).
        filled_experts: dead experts whose amax came from their siblings (``dead_experts="sibling-max"``).
        requantization_errors: spec tensor -> the relative RMSE requantizing added, for linears read from an FP8
            (compressed-tensors) source, worst first; empty for a BF16 source.
        ratio: ``bytes_out / bytes_in`` (read-only).

    Example:
        >>> from hpu_fp8_loader import TINY_MODELS, convert, read_measurements
        >>> result = convert(TINY_MODELS["qwen2-bytes"], "qwen2-fp8", [read_measurements("measurements.json")])
        >>> result.out, result.layout, result.tensors_quantized, result.tensors_kept, f"{result.ratio:.2f}"
        (PosixPath('qwen2-fp8'), <Layout.TORCH: 'torch'>, 8, 9, '0.57')
    """

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


def convert(
    src: str | Path,
    out: str | Path,
    measurements: Sequence[Measurements],
    options: ConvertOptions | None = None,
    progress: Callable[[ConvertProgress], None] | None = None,
    used_elsewhere: Collection[str] = (),
    folds: ChosenFolds | None = None,
) -> ConvertResult:
    """Convert ``src`` into an hpu-fp8 v1 checkpoint at ``out``, on a CPU, in bounded memory.

    Everything that can be refused (measurements, shapes, dtypes, tensors the model does not account
    for, a corrupt tokenizer file, an existing ``out``) is refused before any output is written. On
    failure ``out`` is untouched and ``out.partial`` holds what was finished; the same call resumes
    from it. Workers read the source in row blocks and hold a few blocks each, never a model. The
    tokenizer and generation files of ``src`` are copied unchanged.

    Args:
        src: the BF16 source checkpoint directory (Paddle or Hugging Face torch layout, detected), or a
            compressed-tensors FP8 one (prefer :func:`~hpu_fp8_loader.import_compressed_tensors`, which also reads its
            input scales). A local directory: resolve a Hub repo id first (``hpu-fp8 convert`` does).
        out: the checkpoint directory to write; staged in ``out.partial`` and renamed when complete.
        measurements: one or more activation measurement sets, merged by max per module: a calibration's
            ``measurements``, :func:`~hpu_fp8_loader.read_measurements` or
            :func:`~hpu_fp8_loader.load_measurements`' result.
        options: target, KV cache, scale rounding, sharding, ``force``, workers, dead-expert policy; the defaults
            (``ConvertOptions()``) make a Gaudi2 (±240) checkpoint with an FP8 KV cache.
        progress: called after each tensor with a ``ConvertProgress`` (bytes and tensors done, and their totals).
        used_elsewhere: source tensors a caller read itself (``import``'s input scales), so that they are
            not refused as tensors the model does not account for.
        folds: the exact channel folds to apply before quantizing (``options.rebalance``), as
            :func:`~hpu_fp8_loader.quantize` chooses them from its calibration; ``measurements`` must then hold the
            amax of the folded model (:meth:`~hpu_fp8_loader.conversion.folds.ChosenFolds.rebalanced`).

    Returns:
        A :class:`~hpu_fp8_loader.ConvertResult`; ``result.out`` is the published checkpoint.

    Raises:
        CheckpointNotFoundError: ``src`` is not a directory, or a shard file is missing.
        ConfigError: config.json is missing or invalid; ``src`` is already an hpu-fp8 checkpoint (retarget changes
            one's target); the source's tensors are missing, unexpected or of the wrong shape or dtype for its
            config; or a file to copy (tokenizer) is corrupt.
        UnknownArchitectureError: config.json's model_type is not supported.
        SafetensorsFormatError: a source shard is truncated or corrupt.
        CheckpointIndexError: the source's index is malformed or disagrees with the shards.
        MeasurementError: no measurements; measurements of another model; an amax out of range; modules without a
            positive amax; dead experts while ``options.dead_experts`` is ``error``; ``options.rebalance`` without
            ``folds`` (measurement files hold no per-channel statistics: calibrate instead).
        NonFiniteError: a weight to quantize holds NaN or inf.
        UnsafePathError: ``out`` is, lies inside or contains ``src``; an index entry or a file to copy points
            outside ``src``; ``out.partial`` is not this tool's (a link, a file, a user's directory).
        OutputExistsError: ``out`` exists and ``options.force`` is false (or it is not a checkpoint this tool wrote).
        OutputLockedError: another run is writing ``out``.
        WriteFailedError: writing failed (no space left, an I/O error); run the same call again to resume.
        WorkerDiedError: a worker process was killed (out of memory?); run again, perhaps with fewer workers.

    Example:
        >>> from hpu_fp8_loader import ConvertOptions, convert, read_measurements
        >>> measurements = read_measurements("measurements.json")
        >>> result = convert("qwen2-bf16", "qwen2-fp8", [measurements], ConvertOptions(kv_cache="none"))
        >>> result.out
        PosixPath('qwen2-fp8')
    """
    started = time.perf_counter()
    options = options or ConvertOptions()
    src, out = Path(src), Path(out)
    check_apart(out, [src])
    checkpoint = open_source(src)
    refuse_hpu_fp8_source(checkpoint)
    descriptor = describe(checkpoint.config, str(src / CONFIG_FILE), checkpoint.tensors)
    layout = detect_layout(checkpoint, descriptor)
    for note in check_source(checkpoint, descriptor, layout, used_elsewhere):
        log.warning("%s: %s", src, note)
    if checkpoint.config.get("architectures") != [descriptor.architecture]:  # another supported model's is refused
        log.warning(
            "%s: config.json architectures %s is written as [%r], the class FastDeploy builds a %s model with",
            src,
            json.dumps(checkpoint.config.get("architectures")),
            descriptor.architecture,
            descriptor.model_type,
        )
    copied_source_files(src)
    scalings = _fold_scalings(checkpoint, descriptor, options, folds)
    attention_fp8 = options.kv_cache is KvCacheScheme.FP8
    modules = descriptor.act_modules(attention_fp8, frozenset(bf16_modules(descriptor, options.keep_bf16)))
    amax, origin, sources = merge_measurements(measurements, descriptor)
    act, filled = resolve_act_amax(modules, amax, options.dead_experts)
    qc = quantization_config_for(descriptor, options, act, origin, sources, filled, folds.record() if folds else None)
    shards = plan_shards(planned_tensors(descriptor, qc), options.max_shard_bytes, with_previous=_is_weight_scale)
    staging = prepare_output_dir(out, options.force, [src])
    fingerprint = conversion_fingerprint(checkpoint, shards, qc, act)
    done = reusable_shards(staging, fingerprint, shards)
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
    context = WorkerContext(
        os.getpid(), src, staging, layout, descriptor.prefix, options, tuple(shards), frozenset(done), metadata,
        _act_tensors(act, options), scalings,
    )  # fmt: skip
    requantized = _run_jobs(checkpoint, descriptor, context, shards, done, fingerprint, progress)
    check_publishable(out, options.force)  # before the journal goes: refused here, the same command still resumes
    for name in STAGING_ONLY:
        (staging / name).unlink(missing_ok=True)
    finish_output(
        staging,
        out,
        shards,
        output_config(checkpoint.config, descriptor, qc),
        copy_from=src,
        digests={name: (entry["size"], entry["sha256"]) for name, entry in done.items()},
        files=measurement_files(measurements),  # the amax behind every scale stay with the checkpoint
        force=options.force,
    )
    log.info("%s: published", out)
    weights = descriptor.weights()
    return ConvertResult(
        out=out,
        layout=layout,
        tensors_quantized=sum(w.quantized(options.keep_bf16) for w in weights),
        tensors_kept=sum(not w.quantized(options.keep_bf16) for w in weights),
        bytes_in=sum(info.nbytes for info in checkpoint.tensors.values()),
        bytes_out=sum(s.nbytes for s in shards),
        seconds=time.perf_counter() - started,
        reused_shards=len(context.skip_shards),
        filled_experts=filled,
        requantization_errors=dict(sorted(requantized.items(), key=lambda item: -item[1])),
    )


def _fold_scalings(
    checkpoint: Checkpoint, descriptor: ModelDescriptor, options: ConvertOptions, folds: ChosenFolds | None
) -> dict[str, Scaling]:
    """Each weight's scaling under ``folds``; refused where they cannot apply: asked for without folds (no
    per-channel statistics), or on FP8 source weights (a fold would requantize them twice)."""
    if options.rebalance is not Rebalance.OFF and folds is None:
        raise MeasurementError(
            f"--rebalance {options.rebalance.value} chooses its folds from a calibration's per-channel amax, which "
            "measurement files do not hold: convert with --calibrate instead"
        )
    scalings = weight_scalings(descriptor, folds.exponents) if folds else {}
    if scalings:
        refuse_fp8_folds(checkpoint)
    return scalings


def refuse_fp8_folds(checkpoint: Checkpoint) -> None:
    """Channel folds rebalance BF16 weights before their one quantization: an FP8 source weight (compressed-tensors,
    block-wise) would be requantized twice, so a source holding one is refused, naming it."""
    fp8 = next((name for name, info in checkpoint.tensors.items() if info.dtype == "F8_E4M3"), None)
    if fp8 is not None:
        raise ConfigError(
            f"{checkpoint.root}: {fp8} is FP8; channel folds rebalance BF16 weights before their one quantization "
            "(convert without --rebalance)"
        )


def _is_weight_scale(tensor: PlannedTensor) -> bool:
    return tensor.name.endswith("." + names.WEIGHT_SCALE)


def _act_tensors(act: dict[str, float], options: ConvertOptions) -> dict[str, np.ndarray]:
    """Each act module's F32 [1] ``act_scale`` and ``act_amax``, by tensor name: written by the worker of their shard."""
    tensors = {}
    for module, value in act.items():
        scale = scales.act_scale_from_amax(value, options.fp8_max, options.scale_rounding.value)
        tensors[names.tensor(module, names.ACT_SCALE)] = np.asarray(scale, np.float32).reshape(1)
        tensors[names.tensor(module, names.ACT_AMAX)] = np.asarray(value, np.float32).reshape(1)
    return tensors


def _run_jobs(
    source: Checkpoint, descriptor, context: WorkerContext, shards, done: dict, fingerprint: str, progress
) -> dict[str, float]:
    """Write every shard not reused (in worker processes when asked), each whole by one worker in file order: it is
    hashed as it is written, and the journal records it as it finishes."""
    weights = descriptor.weights()
    owner = {t.name: s.file_name for s in shards for t in s.tensors}
    todo = [s for s in shards if s.file_name not in done]
    held = {s.file_name: [w for w in weights if owner[w.name] == s.file_name] for s in todo}
    part_bytes = {
        w.name: sum(source.tensors[p.name].nbytes for p in w.source_parts(context.layout, context.prefix)) for w in weights
    }
    total_bytes = sum(part_bytes.values())
    reused = [w.name for w in weights if owner[w.name] in done]
    state = {"bytes": sum(part_bytes[name] for name in reused), "tensors": len(reused)}
    requantized: dict[str, float] = {}

    def written(bytes_in: int) -> None:
        state["bytes"] += bytes_in
        state["tensors"] += 1
        if progress:
            progress(ConvertProgress(state["bytes"], total_bytes, state["tensors"], len(weights)))

    def finished(outcome: ShardOutcome) -> None:
        requantized.update(outcome.requantized)
        if outcome.digest is not None:
            size, sha = outcome.digest
        else:  # written out of file order (a tensor too big to put together in memory): hashed from disk
            try:
                size, sha = file_digest(context.staging / outcome.file_name)
            except MemoryError as exc:
                raise out_of_memory(f"hashing the finished shard {outcome.file_name}", exc) from None
            log.info("%s: written out of file order, hashed from disk", outcome.file_name)
        done[outcome.file_name] = {"size": size, "sha256": sha}
        log.debug("%s finished (%d bytes, sha256 %s)", outcome.file_name, size, sha)
        save_journal(context.staging, fingerprint, done)

    if progress and state["bytes"]:
        progress(ConvertProgress(state["bytes"], total_bytes, state["tensors"], len(weights)))
    if context.options.workers == 1:
        init_worker(context, written)
        for shard in todo:
            finished(convert_shard(shard.file_name, held[shard.file_name]))
    else:
        _start_forkserver_quietly()
        mp = multiprocessing.get_context("forkserver")
        heard = mp.Queue()
        pool = ProcessPoolExecutor(context.options.workers, mp_context=mp, initializer=init_worker, initargs=(context, heard.put))
        try:
            queue = sorted(todo, key=lambda s: s.nbytes)  # popped from the end: the largest shards first
            running: dict[Future, str] = {}
            while queue or running:
                while queue and len(running) < context.options.workers:
                    shard = queue.pop()
                    try:
                        running[pool.submit(convert_shard, shard.file_name, held[shard.file_name])] = shard.file_name
                    except BrokenProcessPool:  # a worker died before its result was collected
                        raise _worker_died(next(iter(running.values()), shard.file_name)) from None
                    except (EOFError, OSError) as exc:  # the forkserver, which starts workers, is gone
                        raise _workers_not_started(exc) from None
                finished_now, _ = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                _drain(heard, written)
                for future in finished_now:
                    finished(_worker_result(future, running.pop(future)))
            _drain(heard, written)
        except BaseException:
            _stop_workers(pool)
            raise
        pool.shutdown()
    missing = [s.file_name for s in shards if s.file_name not in done]
    if missing:
        raise RuntimeError(f"internal error: shard(s) {', '.join(missing[:3])} not written")
    save_journal(context.staging, fingerprint, done)
    return requantized


def _drain(heard, written: Callable[[int], None]) -> None:
    """Pass on what the workers reported of their progress so far (the bytes of each weight written)."""
    while True:
        try:
            bytes_in = heard.get_nowait()
        except queue_module.Empty:
            return
        written(bytes_in)


def _worker_result(future: Future, shard: str) -> ShardOutcome:
    """A worker's outcome; its HpuFp8Error comes back with its message, a dead worker as one line."""
    try:
        return future.result()
    except BrokenProcessPool:
        raise _worker_died(shard) from None


def _worker_died(shard: str) -> WorkerDiedError:
    return WorkerDiedError(
        f"a worker process died while converting the tensors of {shard} (killed by a signal; out of memory?). "
        "Nothing was published; run the same command again to resume, perhaps with fewer --workers"
    )


def _workers_not_started(exc: EOFError | OSError) -> WorkerDiedError:
    # Its death shows as an EOF on our read or a broken pipe on our write, whichever the kill lands between.
    if isinstance(exc, EOFError | BrokenPipeError | ConnectionResetError):
        what = "died (killed by a signal?)"
    else:
        what = f"failed: {exc.strerror or exc}"
    return WorkerDiedError(
        f"the worker processes could not be started: multiprocessing's forkserver, which starts them, {what}. "
        "Nothing was published; run the same command again to resume"
    )


def _start_forkserver_quietly() -> None:
    """Start multiprocessing's forkserver (and its resource tracker) with stderr on /dev/null: every worker is forked
    from it and inherits it. What they could print there is noise on the caller's stderr: a worker's error comes
    back through its future, named, and the tracker's warnings about semaphores after a ``kill -9`` name nothing a
    user can act on. Already running (an earlier conversion in this process), it is left as it is."""
    from multiprocessing import forkserver

    sys.stderr.flush()
    saved, quiet = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(quiet, 2)
        forkserver.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(quiet)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """On failure or Ctrl-C, kill the workers instead of letting each finish its tensor first (what
    ``shutdown`` and the interpreter's exit would wait for)."""
    for process in list((pool._processes or {}).values()):  # no public way before Python 3.14's kill_workers
        process.kill()
    with contextlib.suppress(RuntimeError):  # its thread never started (no memory for its stack): nothing to join
        pool.shutdown(wait=True, cancel_futures=True)  # returns at once with the workers gone; joins the pool's thread

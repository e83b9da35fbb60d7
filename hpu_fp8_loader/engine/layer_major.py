"""Layer-major runs: every window through layer L before layer L+1 is read, so each layer is read once.

Run batch by batch, a model larger than the weight cache is read and converted again for every batch: 32 windows
of a 43.6 GB BF16 model in batches of 4 read ~350 GB. Here the hidden states of all windows wait between layers
instead: in memory when they take at most a quarter of :func:`~hpu_fp8_loader.memory.memory_budget`, else
in a memory-mapped scratch file, unlinked as soon as it is mapped (nothing is left behind, even after ``kill -9``)
with its disk space reserved up front (a full disk is one line now, not a SIGBUS hours in). Windows move through a
layer ``chunk`` at a time, with the very arithmetic of the batch-major forward on a batch of that size, so the
results are the same to the bit.

Within a layer the same holds part by part: a layer is a list of stages, each on one part of its weights (the
attention, the MLP, the router, one expert), and every chunk goes through a stage before the next stage's weights
are read. Memory: one part of a layer per model kind (a second one being read ahead, when they fit: EngineWeights),
one chunk of hidden states and its activations, and each model's stores when they are in memory (``windows x
seq_len x hidden x 4`` bytes each: :class:`Workspace`).
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from hpu_fp8_loader.arch import ModelDescriptor
from hpu_fp8_loader.console import Progress, human_bytes
from hpu_fp8_loader.errors import NonFiniteError, WriteFailedError
from hpu_fp8_loader.memory import memory_budget, out_of_memory, reserve_blas_buffers

__all__ = [
    "LayerModel",
    "LayerProgress",
    "Stage",
    "StageLoader",
    "Workspace",
    "blas_threads",
    "blas_threads_per_chunk",
    "emit",
    "hidden_store",
    "run_batch",
    "run_layer_major",
    "usable_cores",
]

log = logging.getLogger(__name__)

_events = threading.local()  # the buffer of the chunk this thread runs, while a stage's chunks run on threads


def emit(deliver: Callable[[], object]) -> None:
    """Deliver an observer's event now, or, while a stage runs its chunks on several threads, when its chunk's turn
    comes: every event reaches the observer in the order one thread would deliver it, chunk after chunk, so what an
    observer accumulates (an amax, a report's sums, a scale from the amax so far) is the same to the bit."""
    buffer = getattr(_events, "buffer", None)
    if buffer is None:
        deliver()
    else:
        buffer.append(deliver)


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a container or ``taskset`` narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def blas_threads() -> set[int]:
    """The threads each loaded BLAS library may use now (its ``OPENBLAS_NUM_THREADS``, or a ``threadpool_limits``)."""
    return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}


def blas_threads_per_chunk(workers: int) -> int:
    """BLAS's threads while ``workers`` chunks run at once: the cores left to each, never more than the process
    already allows (:func:`blas_threads`), since BLAS's thread count changes its rounding (OpenBLAS 0.3.31 on an
    AMD EPYC rounds a 64 x 64 x 192 sgemm differently on 2 threads than on 1) and a user who pinned it expects it
    kept."""
    return max(1, min([usable_cores() // workers, *blas_threads()]))


Step = Callable[[np.ndarray], np.ndarray]
Stage = Callable[[slice], None]
"""One chunk of windows (a slice of the run's windows) through one stage of a layer, in the model's workspace."""
StageLoader = Callable[[], Stage]
"""Reads the weights a stage needs and returns the stage, which holds them until it is dropped."""


class Workspace:
    """What the stages of one model share across all windows of a run.

    ``hidden`` holds every window's hidden states ``[N, T, hidden]`` between stages and layers; :meth:`store`
    gives further arrays of that shape a layer keeps between its stages (the normed input of an MLP, the MoE
    output being summed), made once and reused by every layer. Every store is in memory or in a scratch file, as the run decided (:func:`hidden_store`).
    """

    def __init__(self, windows: np.ndarray, hidden_size: int, in_memory: bool, scratch_dir, stack: ExitStack):
        self.windows = windows
        self._shape = (*windows.shape, hidden_size)
        self._in_memory, self._scratch_dir, self._stack = in_memory, scratch_dir, stack
        self._stores: dict[str, np.ndarray] = {}
        self.hidden = self.store("hidden")

    def store(self, name: str) -> np.ndarray:
        if name not in self._stores:
            self._stores[name] = self._stack.enter_context(hidden_store(self._shape, self._in_memory, self._scratch_dir))
        return self._stores[name]


class LayerModel(Protocol):
    """A model that runs in stages, each a function of one chunk of windows in a :class:`Workspace`: the
    embedding and each decoder layer are lists of stage loaders, run in order, every chunk through a stage before
    the next stage's weights are read. A stage holds its weights until it is dropped.

    ``stores`` is how many hidden-state-sized arrays the model's layers keep in its workspace, ``hidden``
    included: what the run sizes memory by, with :meth:`largest_part_parameters`."""

    @property
    def stores(self) -> int: ...

    @property
    def descriptor(self) -> ModelDescriptor: ...

    def largest_part_parameters(self) -> int:
        """Parameters of the most weights a stage holds at a time."""
        ...

    def embedding(self, space: Workspace) -> list[StageLoader]:
        """Stages that write ``space.hidden[part]`` from the token ids ``space.windows[part]``."""
        ...

    def layer(self, index: int, space: Workspace) -> list[StageLoader]:
        """Stages that take ``space.hidden[part]`` through decoder layer ``index``."""
        ...

    def head(self) -> Step:
        """Hidden states after the last layer -> logits ``[B, T, vocab]``."""
        ...


@dataclass(frozen=True)
class LayerProgress:
    """Where a layer-major run is, after each step (one chunk of windows through one stage of one model).

    Attributes:
        done: steps done.
        total: steps of the whole run: models x chunks x (layers, plus the head when logits are wanted).
        layer: the layer just run; ``layers`` for the head.
        layers: the model's decoder layers.
    """

    done: int
    total: int
    layer: int
    layers: int


def layer_steps(progress: Progress) -> Callable[[LayerProgress], None]:
    """A layer-major run's reports (calibrate, eval) passed on to ``progress``: steps against their total, each
    layer (or the head's logits) a stage, so that a log gets a line as a layer begins."""

    def show(p: LayerProgress) -> None:
        progress.show(p.done, p.total, f"layer {p.layer + 1} of {p.layers}" if p.layer < p.layers else "logits")

    return show


@contextmanager
def hidden_store(shape: tuple[int, ...], in_memory: bool, scratch_dir: str | Path | None = None) -> Iterator[np.ndarray]:
    """A float32 array of ``shape``: in memory, or mapped from a scratch file in ``scratch_dir`` (default: the
    system temp directory), which is unlinked as soon as it is mapped and its space reserved first."""
    if in_memory:
        yield np.empty(shape, np.float32)
        return
    nbytes = math.prod(shape) * 4
    directory = Path(scratch_dir if scratch_dir is not None else tempfile.gettempdir())
    try:
        fd, path = tempfile.mkstemp(prefix=".hpu-fp8-hidden-", suffix=".scratch", dir=directory)
    except OSError as exc:
        raise WriteFailedError(
            f"{directory}: cannot create a scratch file for the hidden states: {exc.strerror or exc}"
        ) from None
    try:
        with os.fdopen(fd, "r+b") as file:
            try:
                os.posix_fallocate(file.fileno(), 0, nbytes)
            except OSError as exc:
                raise WriteFailedError(
                    f"{directory}: cannot reserve {human_bytes(nbytes)} of scratch space for the hidden states: "
                    f"{exc.strerror or exc}; name a directory with room (eval: --scratch-dir)",
                    exc.strerror or "",
                ) from None
            store = np.memmap(file, np.float32, "r+", shape=shape)  # the map outlives the file's name and descriptor
    finally:
        os.unlink(path)
    yield store  # the space is freed when the last view of the map is gone


def run_layer_major(
    models: Mapping[str, LayerModel],
    windows: np.ndarray,
    chunk: int,
    logits: Callable[[slice, str, np.ndarray], object] | None = None,
    scratch_dir: str | Path | None = None,
    memory_bytes: int | None = None,
    progress: Callable[[LayerProgress], object] | None = None,
    threads: int | None = None,
) -> None:
    """Run token ``windows`` ``[N, T]`` through every model, layer-major: each part of each layer is read once.

    ``models`` are keyed by the label an error names (a NaN or inf is a NonFiniteError ``label: windows a..b: ...``,
    whether a step refused it or a layer's output holds it). Within a layer the models run in their order, and
    within a model each stage of the layer takes every chunk of ``chunk`` windows before the next stage's weights
    are read: an MoE layer's experts are read one after another, each once for all windows. With ``logits``, each
    chunk then goes through every model's head and ``logits(windows slice, label, logits)`` is called per model in
    their order, the chunks in order; without it, the heads are neither read nor run (calibration).

    The stores of all windows (:class:`Workspace`) stay in memory when they take at most a quarter of
    ``memory_bytes`` (default: :func:`memory_budget`) after one part of a layer, else in scratch files in
    ``scratch_dir`` (:func:`hidden_store`). Memory: one part of a layer per model kind (the largest: a dense
    MLP, or attention; an MoE layer's router part beside one expert), a chunk of hidden states and its
    activations per thread, plus the stores when they are in memory.

    ``threads`` (default: :func:`usable_cores`): chunks of one stage run on up to this many threads at once (numpy
    releases the GIL on large arrays, so the elementwise work a single BLAS call does not spread runs on every core
    too), BLAS then using the cores left to each (:func:`blas_threads_per_chunk`); the observers' events arrive in
    chunk order (:func:`emit`), and each chunk's arithmetic is its own, so the results are those of one thread with
    BLAS on as many threads. BLAS's own thread count may change a product's last bit, so ``threads`` values that
    leave BLAS a different number of threads may differ there; with BLAS held to one thread
    (``OPENBLAS_NUM_THREADS=1``) every ``threads`` gives the same bits.
    """
    if scratch_dir is not None and not (Path(scratch_dir).is_dir() and os.access(scratch_dir, os.W_OK | os.X_OK)):
        why = "is not a writable directory" if Path(scratch_dir).exists() else "does not exist"
        raise WriteFailedError(f"{scratch_dir}: the scratch directory {why}")  # refused before any work, used or not
    first = next(iter(models.values()))
    d = first.descriptor
    stores_bytes = sum(model.stores for model in models.values()) * math.prod(windows.shape) * d.hidden_size * 4
    budget = memory_budget() if memory_bytes is None else memory_bytes
    in_memory = (
        stores_bytes <= (budget - 4 * max(model.largest_part_parameters() for model in models.values())) // 4
    )  # after one float32 part of a layer
    log.info(
        "hidden states of %d window(s): %s %s",
        len(windows),
        human_bytes(stores_bytes),
        "in memory" if in_memory else f"in scratch files in {scratch_dir or tempfile.gettempdir()}",
    )
    chunks = [slice(start, min(start + chunk, len(windows))) for start in range(0, len(windows), chunk)]
    workers = max(1, min(threads or usable_cores(), len(chunks)))
    doing = f"the hidden states of {len(windows)} window(s)"  # what an allocation that fails was for
    try:
        with ExitStack() as stack:
            pool = None
            if workers > 1:
                stack.enter_context(threadpool_limits(blas_threads_per_chunk(workers)))
                pool = stack.enter_context(ThreadPoolExecutor(workers, thread_name_prefix="hpu-fp8-chunk"))
            reserve_blas_buffers("the first matrix product", workers)  # a refusal of ours, not OpenBLAS's exit
            spaces = {label: Workspace(windows, d.hidden_size, in_memory, scratch_dir, stack) for label in models}
            layers = {label: [model.layer(i, spaces[label]) for i in range(d.num_layers)] for label, model in models.items()}
            total = len(chunks) * (
                sum(len(stages) for plan in layers.values() for stages in plan) + (len(models) if logits else 0)
            )
            done = 0

            def advance(layer: int) -> None:
                nonlocal done
                done += 1
                if progress:
                    progress(LayerProgress(done, total, layer, d.num_layers))

            doing = "the embedding"
            _run_stages({label: model.embedding(spaces[label]) for label, model in models.items()}, chunks, pool, workers)
            hidden = {label: space.hidden for label, space in spaces.items()}
            for layer in range(d.num_layers):
                doing = f"layer {layer}"
                plans = {label: plan[layer] for label, plan in layers.items()}
                _run_stages(plans, chunks, pool, workers, hidden, layer, partial(advance, layer))
                for plan in layers.values():
                    plan[layer] = []  # its stages (and the weights they read) are done with
            if logits is None:
                return
            doing = "the output heads"
            heads = {label: model.head() for label, model in models.items()}
            for part in chunks:
                for label, head in heads.items():
                    doing = f"{label}: windows {part.start}..{part.stop - 1}, the logits"
                    x = np.array(spaces[label].hidden[part])
                    logits(part, label, _run(partial(head, x), label, part, "the logits"))
                    advance(d.num_layers)
    except MemoryError as exc:
        raise out_of_memory(doing, exc) from None


def run_batch(model: LayerModel, ids: np.ndarray, label: str) -> np.ndarray:
    """Logits ``[B, T, vocab]`` of one batch of token ids ``[B, T]``: a run of one chunk, each part read again
    (unless the model's weights are cached). ``label`` names the model in an error."""
    out: list[np.ndarray] = []
    run_layer_major({label: model}, ids, len(ids), lambda part, label, logits: out.append(logits))
    return out[0]


def _run_stages(
    plans: Mapping[str, list[StageLoader]],
    chunks: list[slice],
    pool: ThreadPoolExecutor | None,
    width: int,
    hidden: Mapping[str, np.ndarray] | None = None,
    layer: int | None = None,
    advance: Callable[[], None] | None = None,
) -> None:
    """The models' stages in lockstep: stage ``s`` of every model (in the models' order) over every chunk, then
    stage ``s + 1``; each model's stages run in their own order, so its arithmetic is that of running it alone.
    Models whose stages read the same part of a layer (eval's rows, sharing one mapping) then read it once for all.
    A stage (and its weights) is dropped before the next one is read; after a model's last stage of a layer, each
    chunk's hidden states are checked finite. With a ``pool``, a stage's chunks run on its threads."""
    for index in range(max((len(loaders) for loaders in plans.values()), default=0)):
        for label, loaders in plans.items():
            if index >= len(loaders):
                continue
            stage = loaders[index]()
            last = index == len(loaders) - 1
            what = "the embedding" if layer is None else f"layer {layer}"
            for part in _chunks_through(stage, chunks, label, pool, width, what):
                if last and hidden is not None and not np.isfinite(hidden[label][part]).all():
                    raise NonFiniteError(
                        f"{label}: windows {part.start}..{part.stop - 1}: the hidden states after layer {layer} are "
                        "not finite (a weight is so large that the float32 arithmetic overflows)"
                    )
                if advance:
                    advance()
            del stage


def _chunks_through(
    stage: Stage, chunks: list[slice], label: str, pool: ThreadPoolExecutor | None, width: int, what: str
) -> Iterator[slice]:
    """Run ``stage`` on every chunk, yielding each chunk once done, in order (its events delivered first): one after
    another, or with a ``pool`` ``width`` at once (its threads). A failure is raised once every chunk under way
    has stopped, so that none still writes into the stores the run is about to close."""
    if pool is None or len(chunks) == 1:
        for part in chunks:
            _run(partial(stage, part), label, part, what)
            yield part
        return
    pending: deque[tuple[slice, Future[list[Callable[[], object]]]]] = deque()

    def finished() -> slice:
        part, future = pending.popleft()
        for deliver in _run(future.result, label, part, what):
            _run(deliver, label, part, what)
        return part

    try:
        for part in chunks:
            pending.append((part, pool.submit(_buffered, stage, part)))
            if len(pending) == width:
                yield finished()
        while pending:
            yield finished()
    finally:
        for _, future in pending:
            future.cancel()
        wait([future for _, future in pending])


def _buffered(stage: Stage, part: slice) -> list[Callable[[], object]]:
    """One chunk through ``stage`` on a pool's thread; its observers' events kept for the caller to deliver."""
    buffer: list[Callable[[], object]] = []
    _events.buffer = buffer
    try:
        stage(part)
    finally:
        del _events.buffer
    return buffer


def _run(step: Callable[[], object], label: str, part: slice, what: str):
    """One step on one chunk (``what``: the layer, the embedding or the logits): a NaN or inf refused inside it is one
    line naming the model and the windows, and so is an allocation that fails."""
    where = f"{label}: windows {part.start}..{part.stop - 1}"
    try:
        return step()
    except NonFiniteError as exc:
        raise NonFiniteError(f"{where}: {exc}") from None
    except MemoryError as exc:
        raise out_of_memory(f"{where}, {what}", exc) from None

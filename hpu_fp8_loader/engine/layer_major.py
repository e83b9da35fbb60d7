"""Layer-major runs: every window through layer L before layer L+1 is read, so each layer is read once.

Run batch by batch, a model larger than the weight cache is read and converted again for every batch: 32 windows
of a 43.6 GB BF16 model in batches of 4 read ~350 GB. Here the hidden states of all windows wait between layers
instead: in memory when they take at most a quarter of :func:`~hpu_fp8_loader.memory.memory_budget`, else
in a memory-mapped scratch file, unlinked as soon as it is mapped (nothing is left behind, even after ``kill -9``)
with its disk space reserved up front (a full disk is one line now, not a SIGBUS hours in). Windows move through a
layer ``chunk`` at a time, with the very arithmetic of the batch-major forward on a batch of that size, so the
results are the same to the bit.

Memory: one layer's weights per model kind (a second one being read ahead, when they fit: EngineWeights), one chunk of hidden states and its activations, and the hidden-state
stores when they are in memory (``windows x seq_len x hidden x 4`` bytes per model).
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from hpu_fp8_loader.arch import ModelDescriptor
from hpu_fp8_loader.console import Progress, human_bytes
from hpu_fp8_loader.errors import NonFiniteError, WriteFailedError
from hpu_fp8_loader.memory import memory_budget, out_of_memory

__all__ = ["LayerModel", "LayerProgress", "hidden_store", "run_layer_major"]

log = logging.getLogger(__name__)

Step = Callable[[np.ndarray], np.ndarray]


class LayerModel(Protocol):
    """A model that runs in stages: each method reads what its stage needs and returns the stage as a function,
    which holds those weights until it is dropped."""

    @property
    def descriptor(self) -> ModelDescriptor: ...

    def embedding(self) -> Step:
        """Token ids ``[B, T]`` -> hidden states ``[B, T, hidden]``."""
        ...

    def layer(self, index: int) -> Step:
        """Hidden states through decoder layer ``index``."""
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
) -> None:
    """Run token ``windows`` ``[N, T]`` through every model, layer-major: each layer of each model is read once.

    ``models`` are keyed by the label an error names (a NaN or inf is a NonFiniteError ``label: windows a..b: ...``,
    whether a step refused it or a layer's output holds it). Within a layer the models run in their order, ``chunk`` windows at a time. With ``logits``, each
    chunk then goes through every model's head and ``logits(windows slice, label, logits)`` is called per model in
    their order, the chunks in order; without it, the heads are neither read nor run (calibration).

    The hidden states of all windows stay in memory when the stores take at most a quarter of ``memory_bytes``
    (default: :func:`memory_budget`) after one layer's weights, else in scratch files in ``scratch_dir``
    (:func:`hidden_store`). Memory: one layer's weights per model kind, a chunk of hidden states and its
    activations, plus the stores when they are in memory.
    """
    if scratch_dir is not None and not (Path(scratch_dir).is_dir() and os.access(scratch_dir, os.W_OK | os.X_OK)):
        why = "is not a writable directory" if Path(scratch_dir).exists() else "does not exist"
        raise WriteFailedError(f"{scratch_dir}: the scratch directory {why}")  # refused before any work, used or not
    first = next(iter(models.values()))
    d = first.descriptor
    shape = (*windows.shape, d.hidden_size)
    stores_bytes = len(models) * math.prod(shape) * 4
    budget = memory_budget() if memory_bytes is None else memory_bytes
    in_memory = stores_bytes <= (budget - 4 * d.largest_layer_parameters()) // 4  # after one float32 layer
    log.info(
        "hidden states of %d window(s): %s %s",
        len(windows),
        human_bytes(stores_bytes),
        "in memory" if in_memory else f"in scratch files in {scratch_dir or tempfile.gettempdir()}",
    )
    chunks = [slice(start, min(start + chunk, len(windows))) for start in range(0, len(windows), chunk)]
    total = len(models) * len(chunks) * (d.num_layers + (1 if logits else 0))
    done = 0

    def advance(layer: int) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(LayerProgress(done, total, layer, d.num_layers))

    doing = f"the hidden states of {len(windows)} window(s)"  # what an allocation that fails was for
    try:
        with ExitStack() as stack:
            stores = {label: stack.enter_context(hidden_store(shape, in_memory, scratch_dir)) for label in models}
            for label, model in models.items():
                doing = f"{label}: the embedding"
                embed = model.embedding()
                for part in chunks:
                    stores[label][part] = embed(windows[part])
                del embed
            for layer in range(d.num_layers):
                for label, model in models.items():
                    doing = f"{label}: layer {layer}"
                    step = model.layer(layer)
                    for part in chunks:
                        doing = f"{label}: windows {part.start}..{part.stop - 1}, layer {layer}"
                        stores[label][part] = _run(step, label, part, np.array(stores[label][part]), layer)
                        advance(layer)
                    del step
            if logits is None:
                return
            doing = "the output heads"
            heads = {label: model.head() for label, model in models.items()}
            for part in chunks:
                for label, head in heads.items():
                    doing = f"{label}: windows {part.start}..{part.stop - 1}, the logits"
                    logits(part, label, _run(head, label, part, np.array(stores[label][part])))
                    advance(d.num_layers)
    except MemoryError as exc:
        raise out_of_memory(doing, exc) from None


def _run(step: Step, label: str, part: slice, x: np.ndarray, layer: int | None = None) -> np.ndarray:
    """One step on one chunk; a NaN or inf, refused inside it or left in a layer's output, is one line naming the
    model and the windows (an overflow no cast or observer saw would otherwise reach the next layer silently)."""
    where = f"{label}: windows {part.start}..{part.stop - 1}"
    try:
        out = step(x)
    except NonFiniteError as exc:
        raise NonFiniteError(f"{where}: {exc}") from None
    if layer is not None and not np.isfinite(out).all():
        raise NonFiniteError(
            f"{where}: the hidden states after layer {layer} are not finite (a weight is so large that the float32 "
            "arithmetic overflows)"
        )
    return out

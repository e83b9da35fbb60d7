"""Weights for the engine, one layer at a time, as float32 in the spec's ``[in, out]`` layout.

From a BF16/FP16/FP32 source checkpoint (either layout: parts transposed and fused as the converter
does) or from an hpu-fp8 checkpoint (fp8 values times their weight scales). Nothing is read before
it is asked for, and what is returned is the caller's to drop: a model larger than RAM still runs.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hpu_fp8_loader.arch import Layout, ModelDescriptor, WeightTensor, describe
from hpu_fp8_loader.checks.validate import open_validated
from hpu_fp8_loader.io.checkpoint import CONFIG_FILE, Checkpoint, read_config
from hpu_fp8_loader.memory import memory_budget
from hpu_fp8_loader.numerics.fusion import fuse_columns
from hpu_fp8_loader.sources.block_fp8 import open_source
from hpu_fp8_loader.sources.source_tensors import check_source, detect_layout, source_rows
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import is_hpu_fp8

__all__ = ["EngineWeights", "open_weights"]


class EngineWeights:
    """``get(weight)`` -> float32 array of a descriptor weight, from whichever kind of checkpoint.

    When the whole model in float32 fits in ``cache_bytes`` (default: a quarter of what this
    process may still use, :func:`memory_budget`), layers are kept once converted, so repeated forwards (calibration batches) read and
    convert every weight once; otherwise every forward streams the layers again.

    Streamed, layer ``L + 1`` is read and converted on a second thread while layer ``L`` computes (read-ahead),
    when two layers in float32 fit half of what this process may still use: the disk's wait and the conversion,
    a third of a calibration of a model larger than RAM, then overlap the arithmetic. The arrays are those of a
    plain read, bit for bit; only the order of the work changes.
    """

    def __init__(self, checkpoint: Checkpoint, descriptor: ModelDescriptor, cache_bytes: int | None = None):
        self.checkpoint = checkpoint
        self.descriptor = descriptor
        budget = memory_budget() // 4 if cache_bytes is None else cache_bytes
        self._cache: dict[int | None, dict[str, np.ndarray]] | None = {} if 4 * descriptor.parameter_count() <= budget else None
        self.is_spec = is_hpu_fp8(checkpoint.config)
        self.layout = Layout.PADDLE if self.is_spec else detect_layout(checkpoint, descriptor)
        self._by_layer = descriptor.weights_by_layer()
        self.reads_ahead = self._cache is None and 2 * 4 * descriptor.largest_layer_parameters() <= memory_budget() // 2
        self._ahead: tuple[int, Future[dict[str, np.ndarray]]] | None = None
        self._reader: ThreadPoolExecutor | None = None

    @property
    def cached(self) -> bool:
        """Whether converted layers are kept for the next forward (the model fits the memory budget)."""
        return self._cache is not None

    def get(self, weight: WeightTensor) -> np.ndarray:
        if self.is_spec and weight.is_linear:
            scale = np.asarray(self.checkpoint.get(names.tensor(weight.module, names.WEIGHT_SCALE)), np.float32)
            return self.checkpoint.get(weight.name).astype(np.float32) * (scale if weight.channel_wise else scale[0])
        parts = weight.source_parts(self.layout, self.descriptor.prefix)
        arrays = [source_rows(self.checkpoint, p.name, 0, p.shape[0]).astype(np.float32) for p in parts]
        return fuse_columns(arrays, [p.transpose for p in parts])

    def layer(self, index: int | None) -> dict[str, np.ndarray]:
        """Every weight of one layer (``None``: embeddings, final norm, lm_head), keyed by spec name.

        With read-ahead, asking for decoder layer ``L`` also starts reading ``L + 1`` (what a forward asks for
        next); asking for anything else first waits for, and drops, a read-ahead it did not use."""
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == index:
            weights = ahead[1].result()
        else:
            if ahead is not None:
                ahead[1].result()  # never two readers of one file at once
            weights = self._read(index)
        if self._cache is not None:
            self._cache[index] = weights
        elif self.reads_ahead and index is not None and index + 1 < self.descriptor.num_layers:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="hpu-fp8-read-ahead")
            self._ahead = index + 1, self._reader.submit(self._read, index + 1)
        return weights

    def _read(self, index: int | None) -> dict[str, np.ndarray]:
        return {w.name: self.get(w) for w in self._by_layer.get(index, [])}


def open_weights(path: str | Path, cache_bytes: int | None = None) -> EngineWeights:
    """The weights of a BF16 source or an hpu-fp8 checkpoint, checked first as convert and validate check them:
    a config.json its tensors do not back is refused in one line instead of failing mid-forward (or not at all)."""
    if is_hpu_fp8(read_config(Path(path))):  # opened once, by the validation
        opened = open_validated(path)
        return EngineWeights(opened.checkpoint, opened.descriptor, cache_bytes)
    checkpoint = open_source(path)
    descriptor = describe(checkpoint.config, str(Path(path) / CONFIG_FILE), checkpoint.tensors)
    check_source(checkpoint, descriptor, detect_layout(checkpoint, descriptor))
    return EngineWeights(checkpoint, descriptor, cache_bytes)

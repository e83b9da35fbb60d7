"""Weights for the engine, one part of a layer at a time, as float32 in the spec's ``[in, out]`` layout.

From a BF16/FP16/FP32 source checkpoint (either layout: parts transposed and fused as the converter
does) or from an hpu-fp8 checkpoint (fp8 values times their weight scales). Nothing is read before
it is asked for, and what is returned is the caller's to drop: a model larger than RAM still runs.

A decoder layer is read in parts (:data:`ATTENTION`; then :data:`MLP`, or :data:`ROUTER` and each routed expert
by its number), the order the forward uses them, so memory holds one expert of a 64-expert layer, not the
layer: ERNIE-4.5-300B-A47B's MoE layer is 22.5 GB in float32, one of its experts 0.35 GB. The embedding is read
in blocks of rows (:meth:`EngineWeights.embedding_rows`), and the head (final norm, lm_head) is its own part.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hpu_fp8_loader.arch import Layout, ModelDescriptor, Role, WeightTensor, describe
from hpu_fp8_loader.checks.validate import open_validated
from hpu_fp8_loader.io.checkpoint import CONFIG_FILE, Checkpoint, read_config
from hpu_fp8_loader.memory import memory_budget
from hpu_fp8_loader.numerics.fusion import fuse_columns
from hpu_fp8_loader.sources.block_fp8 import open_source
from hpu_fp8_loader.sources.source_tensors import check_source, detect_layout, source_rows
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import is_hpu_fp8

__all__ = [
    "ATTENTION",
    "HEAD",
    "MLP",
    "ROUTER",
    "EngineWeights",
    "Part",
    "largest_part",
    "open_weights",
    "part_of",
    "weight_parts",
]

# The parts of a decoder layer, as the forward uses them; a routed expert's part is its number.
ATTENTION = "attention"  # both norms, q|k|v (its bias, Qwen3's q/k norms) and o_proj
MLP = "mlp"  # a dense layer's up_gate and down
ROUTER = "router"  # an MoE layer's router, its correction bias and the shared experts
HEAD = "head"  # the final norm and lm_head (the embedding when tied): layer None
Part = str | int

_ROUTER_ROLES = frozenset({Role.ROUTER, Role.ROUTER_BIAS, Role.SHARED_UP_GATE, Role.SHARED_DOWN})
EMBEDDING_BLOCK_BYTES = 64 * 2**20  # float32 rows of the embedding converted at a time


def largest_part(parts: dict[tuple[int | None, Part], list[WeightTensor]]) -> int:
    """Parameters of the largest of ``parts`` (:func:`weight_parts`): what holding one costs, per byte of a value."""
    return max(sum(math.prod(w.shape) for w in group) for group in parts.values())


def part_of(weight: WeightTensor) -> Part:
    """The part of its layer a weight is read with."""
    if weight.layer is None:
        return HEAD
    if weight.expert is not None:
        return weight.expert
    if weight.role in (Role.MLP_UP_GATE, Role.MLP_DOWN):
        return MLP
    return ROUTER if weight.role in _ROUTER_ROLES else ATTENTION


def weight_parts(descriptor: ModelDescriptor) -> dict[tuple[int | None, Part], list[WeightTensor]]:
    """Every part's weights, keyed ``(layer, part)`` in the order a forward asks for them: the layers, then the
    head. The embedding is read by rows, so it is in the head only when tied."""
    parts: dict[tuple[int | None, Part], list[WeightTensor]] = {}
    embedding = None
    for w in descriptor.weights():
        if w.role is Role.EMBEDDING:
            embedding = w
            continue
        parts.setdefault((w.layer, part_of(w)), []).append(w)
    if descriptor.tie_word_embeddings and embedding is not None:
        parts[(None, HEAD)].append(embedding)
    return dict(sorted(parts.items(), key=lambda item: item[0][0] is None))  # the head last, stable otherwise


class EngineWeights:
    """``part(layer, part)`` -> float32 arrays of that part's weights, from whichever kind of checkpoint.

    When the whole model in float32 fits in ``cache_bytes`` (default: a quarter of what this process may still
    use, :func:`memory_budget`), parts are kept once converted, so repeated forwards (calibration batches) read
    and convert every weight once; otherwise every forward streams them again.

    Streamed, the next part a forward uses is read and converted on a second thread while this one computes
    (read-ahead), when two of the largest parts in float32 fit half of what this process may still use: the
    disk's wait and the conversion then overlap the arithmetic. The arrays are those of a plain read, bit for
    bit; only the order of the work changes.
    """

    def __init__(self, checkpoint: Checkpoint, descriptor: ModelDescriptor, cache_bytes: int | None = None):
        self.checkpoint = checkpoint
        self.descriptor = descriptor
        budget = memory_budget() // 4 if cache_bytes is None else cache_bytes
        self._cache: dict[tuple[int | None, Part], dict[str, np.ndarray]] | None = (
            {} if 4 * descriptor.parameter_count() <= budget else None
        )
        self.is_spec = is_hpu_fp8(checkpoint.config)
        self.layout = Layout.PADDLE if self.is_spec else detect_layout(checkpoint, descriptor)
        self._parts = weight_parts(descriptor)
        self._embedding = next(w for w in descriptor.weights() if w.role is Role.EMBEDDING)
        self._order = [key for key in self._parts if key[0] is not None]  # what read-ahead follows
        self._next = {key: after for key, after in zip(self._order, self._order[1:], strict=False)}
        self.reads_ahead = self._cache is None and 2 * 4 * self.largest_part_parameters(decoder=True) <= memory_budget() // 2
        self._ahead: tuple[tuple[int | None, Part], Future[dict[str, np.ndarray]]] | None = None
        self._reader: ThreadPoolExecutor | None = None

    @property
    def cached(self) -> bool:
        """Whether converted parts are kept for the next forward (the model fits the memory budget)."""
        return self._cache is not None

    def largest_part_parameters(self, decoder: bool = False) -> int:
        """Parameters of the largest part (of a decoder layer: what read-ahead holds twice): what holding one
        costs, per byte of a value. The embedding, read by rows, is not one."""
        return largest_part({key: self._parts[key] for key in self._order} if decoder else self._parts)

    def parts(self, layer: int) -> list[Part]:
        """The parts of decoder layer ``layer``, in the order its forward uses them."""
        return [part for index, part in self._parts if index == layer]

    def part_parameters(self, layer: int | None, part: Part) -> int:
        return sum(math.prod(w.shape) for w in self._parts[(layer, part)])

    def get(self, weight: WeightTensor, dtype: type | None = np.float32) -> np.ndarray:
        """One weight in the spec's layout, as ``dtype`` (``None``: as stored; FP8 values are float32 either way)."""
        if self.is_spec and weight.is_linear:
            scale = np.asarray(self.checkpoint.get(names.tensor(weight.module, names.WEIGHT_SCALE)), np.float32)
            return self.checkpoint.get(weight.name).astype(np.float32) * (scale if weight.channel_wise else scale[0])
        parts = weight.source_parts(self.layout, self.descriptor.prefix)
        arrays = [source_rows(self.checkpoint, p.name, 0, p.shape[0]) for p in parts]
        return fuse_columns(arrays, [p.transpose for p in parts], None if dtype is None else np.dtype(dtype))

    def embedding_blocks(self) -> list[tuple[int, int]]:
        """The embedding's rows in blocks of about :data:`EMBEDDING_BLOCK_BYTES` in float32, as ``(start, stop)``:
        a lookup block by block reads the table once for all windows and never holds it whole in float32
        (3.4 GB at 300B)."""
        rows, width = self._embedding.shape[0], math.prod(self._embedding.shape[1:])
        step = max(1, EMBEDDING_BLOCK_BYTES // (4 * width))
        return [(start, min(start + step, rows)) for start in range(0, rows, step)]

    def embedding_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the embedding in float32 (kept for the next forward when cached)."""
        key = (None, f"embedding[{start}:{stop}]")
        if self._cache is not None and key in self._cache:
            return self._cache[key]["rows"]
        (part,) = self._embedding.source_parts(self.layout, self.descriptor.prefix)
        assert not part.transpose  # an embedding is [vocab, hidden] in every layout
        rows = source_rows(self.checkpoint, part.name, start, stop).astype(np.float32)
        if self._cache is not None:
            self._cache[key] = {"rows": rows}
        return rows

    def part(self, layer: int | None, part: Part) -> dict[str, np.ndarray]:
        """Every weight of one part of ``layer`` (``None``: the head, as stored), keyed by spec name.

        With read-ahead, asking for a decoder layer's part also starts reading the next one a forward asks for;
        asking for anything else first waits for, and drops, a read-ahead it did not use."""
        key = (layer, part)
        if self._cache is not None and key in self._cache:
            return self._cache[key]
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == key:
            weights = ahead[1].result()
        else:
            if ahead is not None:
                ahead[1].result()  # never two readers of one file at once
            weights = self._read(key)
        if self._cache is not None:
            self._cache[key] = weights
        elif self.reads_ahead and key in self._next:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="hpu-fp8-read-ahead")
            after = self._next[key]
            self._ahead = after, self._reader.submit(self._read, after)
        return weights

    def _read(self, key: tuple[int | None, Part]) -> dict[str, np.ndarray]:
        """A part's weights in float32; the head's as stored (bf16: half the memory of the 3.4 GB float32 lm_head at
        300B), converted as it is multiplied (:func:`~hpu_fp8_loader.engine.model.head_product`)."""
        return {w.name: self.get(w, None if key[0] is None else np.float32) for w in self._parts[key]}


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

"""The observers the reference forward hands its activations to: calibrate's amax, and a report's FP8 errors.

One home for them, so that the arrows run one way: ``calibrate`` and ``evaluate`` build their observers here, and
:mod:`~hpu_fp8_loader.quality.report` collects and writes what these observed; none of the three imports another
to observe. Every observer works whether each layer is entered once (layer-major) or once per batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from hpu_fp8_loader.arch import ModelDescriptor, Role, WeightTensor
from hpu_fp8_loader.engine.model import Observer
from hpu_fp8_loader.errors import NonFiniteError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.numerics import e4m3, scales
from hpu_fp8_loader.numerics.magnitudes import MagnitudeHistogram
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.fp8 import GAUDI2_FP8_MAX

__all__ = [
    "HISTOGRAM_ROWS",
    "ROWS_PER_CALL",
    "AmaxObserver",
    "ChannelAmaxObserver",
    "CheckpointFp8",
    "ConverterFp8",
    "Fp8Side",
    "LinearError",
    "LinearErrorObserver",
    "RangeObserver",
    "TeeObserver",
]


class AmaxObserver(Observer):
    """What calibrate measures: each point's running max |x| and the tokens routed to each expert."""

    def __init__(self, prefix: str, all_experts: bool = False):
        self.prefix = prefix
        self.wants_all_experts = all_experts
        self.amax: dict[str, float] = {}
        self.expert_tokens: dict[str, int] = {}

    def record(self, module: str, values: np.ndarray) -> None:
        """Keep the running max |x|; a NaN or inf is refused, never recorded (``max(0, nan)`` is 0)."""
        if values.size:
            peak = float(np.max(np.abs(values)))
            if not np.isfinite(peak):
                what = "NaN" if np.isnan(peak) else "inf"
                raise NonFiniteError(f"activation {module} holds {what}")
            self.amax[module] = max(self.amax.get(module, 0.0), peak)

    def record_expert(self, layer: int, expert: int, intermediate: np.ndarray, routed_tokens: int) -> None:
        self.record(names.expert(self.prefix, layer, expert, "down_proj"), intermediate)
        key = names.expert_tokens_key(self.prefix, layer, expert)
        self.expert_tokens[key] = self.expert_tokens.get(key, 0) + routed_tokens


# Rows (tokens; an attention point's head vectors) of each input whose every value a range histogram counts, evenly
# spaced: a median read from 128 rows of each batch is as good as one from all of them, at a fraction of the cost
# (bench/engine.py: counting every row cost 7-16% of a calibration's forward, above its 10% goal).
HISTOGRAM_ROWS = 128


class RangeObserver(Observer):
    """How each point's magnitudes are spread (:mod:`~hpu_fp8_loader.quality.ranges` reads them against an amax):
    every value of up to :data:`HISTOGRAM_ROWS` evenly spaced rows of each input counted, an expert's intermediate
    over the tokens it computes, as the amax is (the amax itself is the amax observer's, over every value)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.histograms: dict[str, MagnitudeHistogram] = {}

    def record(self, module: str, values: np.ndarray) -> None:
        if values.size:
            self.histograms.setdefault(module, MagnitudeHistogram()).add(_evenly_spaced_rows(values, HISTOGRAM_ROWS))

    def record_expert(self, layer: int, expert: int, intermediate: np.ndarray, routed_tokens: int) -> None:
        self.record(names.expert(self.prefix, layer, expert, names.DOWN), intermediate)


class ChannelAmaxObserver(Observer):
    """Each chosen point's max |x| per channel (its last axis; the KV cache's heads and head dims as one axis), over
    every token it sees: what a channel fold's exponents are chosen from (:mod:`~hpu_fp8_loader.conversion.folds`)."""

    def __init__(self, prefix: str, points: frozenset[str]):
        self.prefix = prefix
        self.points = points
        self.amax: dict[str, np.ndarray] = {}

    def record(self, module: str, values: np.ndarray) -> None:
        if module not in self.points or not values.size:
            return
        width = values.shape[-1] if names.attention_point_of(module) is None else values.shape[-2] * values.shape[-1]
        peak = np.max(np.abs(values.reshape(-1, width)), axis=0)
        previous = self.amax.get(module)
        self.amax[module] = peak if previous is None else np.maximum(previous, peak)

    def record_expert(self, layer: int, expert: int, intermediate: np.ndarray, routed_tokens: int) -> None:
        self.record(names.expert(self.prefix, layer, expert, names.DOWN), intermediate)


# Rows of each input (a batch, a layer-major chunk, an expert's routed tokens) the error is measured on: enough
# for a stable ratio, few enough that the report costs a fraction of the forward.
ROWS_PER_CALL = 64


class TeeObserver(Observer):
    """Hands every event to each observer in turn, in order: an amax observer first refuses a NaN before
    anything later computes on it, and has updated the amax a later one reads."""

    def __init__(self, *observers: Observer):
        self.observers = observers
        self.wants_all_experts = any(o.wants_all_experts for o in observers)

    def record(self, module: str, values: np.ndarray) -> None:
        for observer in self.observers:
            observer.record(module, values)

    def record_expert(self, layer: int, expert: int, intermediate: np.ndarray, routed_tokens: int) -> None:
        for observer in self.observers:
            observer.record_expert(layer, expert, intermediate, routed_tokens)

    def enter_weights(self, layer: int, weights: dict[str, np.ndarray]) -> None:
        for observer in self.observers:
            observer.enter_weights(layer, weights)


class Fp8Side(Protocol):
    """Where the FP8 side of a linear comes from: an activation scale per point, a dequantized FP8 weight."""

    description: str

    def act_scale(self, point: str) -> float | None: ...

    def weight(self, weight: WeightTensor, values: np.ndarray) -> np.ndarray: ...


class ConverterFp8:
    """Calibrate's FP8 side: weights quantized as ``convert`` does at ±240 (no scale rounding), activations
    at the amax measured so far (``amax`` is the amax observer's live dict)."""

    description = "weights quantized as convert does (±240, no scale rounding); activations at the running amax"

    def __init__(self, amax: Mapping[str, float]):
        self.amax = amax

    def act_scale(self, point: str) -> float | None:
        amax = self.amax.get(point)
        return float(scales.act_scale_from_amax(amax, GAUDI2_FP8_MAX)) if amax else None

    def weight(self, weight: WeightTensor, values: np.ndarray) -> np.ndarray:
        amax = e4m3.channel_abs_max(values, weight.name) if weight.channel_wise else e4m3.abs_max(values, weight.name)
        scale = scales.weight_scale_from_amax(amax, GAUDI2_FP8_MAX).reshape(-1)
        used = scale if weight.channel_wise else scale[0]
        return e4m3.dequantize(e4m3.quantize(values, used, GAUDI2_FP8_MAX, weight.name), used)


class CheckpointFp8:
    """Eval's FP8 side: the hpu-fp8 checkpoint's own weight codes, weight scales and act_scale tensors."""

    description = "the FP8 checkpoint's weight codes, weight scales and act_scale tensors"

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint

    def _scalar(self, name: str) -> float | None:
        if name not in self.checkpoint.tensors:
            return None
        return float(np.asarray(self.checkpoint.get(name), np.float32).reshape(-1)[0])

    def act_scale(self, point: str) -> float | None:
        return self._scalar(names.tensor(point, names.ACT_SCALE))

    def weight(self, weight: WeightTensor, values: np.ndarray) -> np.ndarray:
        scale = np.asarray(self.checkpoint.get(names.tensor(weight.module, names.WEIGHT_SCALE)), np.float32).reshape(-1)
        return e4m3.dequantize(self.checkpoint.get(weight.name), scale if weight.channel_wise else scale[0])


@dataclass
class LinearError:
    """One linear's accumulated FP8 output error (squared sums over the rows measured) and weight spread."""

    module: str
    role: Role
    layer: int
    expert: int | None
    point: str  # the activation point feeding it (routed experts' up_gate: the layer's shared input)
    squared_error: float = 0.0
    squared_reference: float = 0.0
    rows: int = 0
    channel_spread: float | None = None  # max / min per-output-channel amax; None when a channel is all zeros

    @property
    def relative_error(self) -> float | None:
        return (self.squared_error / self.squared_reference) ** 0.5 if self.squared_reference else None


def _evenly_spaced_rows(values: np.ndarray, count: int) -> np.ndarray:
    rows = values.reshape(-1, values.shape[-1])
    if rows.shape[0] > count:
        rows = rows[np.linspace(0, rows.shape[0] - 1, count).astype(np.int64)]
    return np.ascontiguousarray(rows, np.float32)


class LinearErrorObserver(Observer):
    """Accumulates each linear's FP8 output error from the inputs the forward records and the weights
    ``enter_weights`` hands over; works whether a part of a layer is entered once (layer-major) or once per batch.
    FP8 weights are made once per entry, and only for linears whose input arrives.

    An input that arrives before its weights (a routed expert's up_gate reads the layer's shared input, recorded
    before the experts are read one by one) waits, as the rows measured and the activation scale at that moment,
    until the weights are entered: the error is the one measured had they been there."""

    def __init__(self, descriptor: ModelDescriptor, fp8: Fp8Side, rows_per_call: int = ROWS_PER_CALL):
        self.fp8 = fp8
        self.prefix = descriptor.prefix
        self.rows_per_call = rows_per_call
        self.linears: dict[str, LinearError] = {}
        self._by_point: dict[str, list[WeightTensor]] = {}
        self._by_name: dict[str, WeightTensor] = {}
        for w in descriptor.weights():
            if not w.is_linear:
                continue
            assert w.layer is not None  # every linear belongs to a decoder layer
            point = names.shared_expert_input(self.prefix, w.layer) if w.role is Role.EXPERT_UP_GATE else w.module
            self._by_point.setdefault(point, []).append(w)
            self._by_name[w.name] = w
            self.linears[w.module] = LinearError(w.module, w.role, w.layer, w.expert, point)
        self._weights: dict[str, np.ndarray] = {}
        self._fp8_weights: dict[str, np.ndarray] = {}
        self._spread_done: set[str] = set()
        self._waiting: dict[str, list[tuple[str, np.ndarray, float]]] = {}  # weight name -> (point, rows, scale)

    def enter_weights(self, layer: int, weights: dict[str, np.ndarray]) -> None:
        self._weights, self._fp8_weights = weights, {}
        for name, values in weights.items():
            weight = self._by_name.get(name)
            if weight is None:
                continue
            if name not in self._spread_done:
                self._spread_done.add(name)
                channels = e4m3.channel_abs_max(values, weight.module)
                low = float(channels.min())
                self.linears[weight.module].channel_spread = float(channels.max()) / low if low > 0 else None
            for point, rows, scale in self._waiting.pop(name, ()):
                self._measure(weight, point, rows, scale)

    def record(self, module: str, values: np.ndarray) -> None:
        self._arrived(module, values)

    def record_expert(self, layer: int, expert: int, intermediate: np.ndarray, routed_tokens: int) -> None:
        self._arrived(names.expert(self.prefix, layer, expert, names.DOWN), intermediate)

    def _arrived(self, point: str, values: np.ndarray) -> None:
        scale = self.fp8.act_scale(point)
        if not values.size or scale is None:
            return
        rows = _evenly_spaced_rows(values, self.rows_per_call)
        for weight in self._by_point.get(point, ()):
            if weight.name in self._weights:
                self._measure(weight, point, rows, scale)
            else:
                self._waiting.setdefault(weight.name, []).append((point, np.array(rows), scale))

    def _measure(self, weight: WeightTensor, point: str, x: np.ndarray, scale: float) -> None:
        reference = self._weights[weight.name]
        if weight.name not in self._fp8_weights:
            self._fp8_weights[weight.name] = self.fp8.weight(weight, reference)
        x_fp8 = e4m3.dequantize(e4m3.quantize(x, scale, GAUDI2_FP8_MAX, f"activation {point}"), scale)
        y = x @ reference
        difference = x_fp8 @ self._fp8_weights[weight.name] - y
        stats = self.linears[weight.module]
        stats.squared_error += float(np.einsum("ij,ij", difference, difference, dtype=np.float64))
        stats.squared_reference += float(np.einsum("ij,ij", y, y, dtype=np.float64))
        stats.rows += x.shape[0]

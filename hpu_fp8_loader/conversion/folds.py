"""Exact channel folds: a power of two per channel moved out of one weight and into the next linear, the model's
function unchanged to the bit.

Where a linear's input channel ``c`` comes straight from a per-channel multiply (a norm's weight, another linear's
output column), dividing that producer's channel by ``2^e`` and multiplying the consumer's row ``c`` by ``2^e``
leaves every product the consumer forms, and so the output, as it was. With powers of two the folds are exact in
every float format (a power of two only moves the exponent), so the folded BF16 model computes what the original
computes, to the bit, as long as no value leaves the format's normal range: :meth:`Scaling.apply` refuses one that
would. Four folds per layer cover every quantization point FastDeploy gives a per-tensor scale:

- ``qkv``: ``input_layernorm`` -> ``qkv_proj``'s rows.
- ``mlp-input``: ``post_attention_layernorm`` -> the rows of every linear it feeds: the dense MLP's ``up_gate_proj``,
  or an MoE layer's router (so the routing is unchanged), each routed expert's and the shared experts' ``up_gate_proj``.
- ``down``: the ``up`` half of ``up_gate_proj``'s columns -> ``down_proj``'s rows (SwiGLU is ``silu(gate) * up``, so
  scaling ``up`` scales the product), in the dense MLP, the shared experts and each routed expert.
- ``o-proj``: the ``v`` columns of ``qkv_proj`` (and of its bias) -> ``o_proj``'s rows: attention mixes tokens, not
  channels, so each ``v`` channel reaches ``o_proj`` scaled as it was made; with GQA one ``v`` channel feeds the
  same row of every query head of its group.

An exponent ``e > 0`` shrinks the activation channel (rebalancing: :mod:`~hpu_fp8_loader.quality.rebalance`);
``e < 0`` grows it (the stress models of :mod:`~hpu_fp8_loader.quality.stress`).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from hpu_fp8_loader.arch import ModelDescriptor
from hpu_fp8_loader.errors import ConfigError
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.choices import Rebalance
from hpu_fp8_loader.spec.config import Rebalancing
from hpu_fp8_loader.spec.measurements import Measurements

__all__ = [
    "ChosenFolds",
    "Fold",
    "FoldSite",
    "Scaling",
    "fold_points",
    "fold_sites",
    "mlp_input_consumers",
    "per_kv_channel_max",
    "point_exponents",
    "site_channel_amax",
    "weight_scalings",
]


class Fold(enum.Enum):
    """The four kinds of fold site of a decoder layer (what ``hpu-fp8 stress --at`` and the rebalancing name).

    Attributes:
        QKV: ``"qkv"``, ``input_layernorm`` -> ``qkv_proj``'s rows.
        MLP_INPUT: ``"mlp-input"``, ``post_attention_layernorm`` -> every linear it feeds (and the MoE router).
        DOWN: ``"down"``, the ``up`` half of ``up_gate_proj`` -> ``down_proj``'s rows.
        O_PROJ: ``"o-proj"``, the ``v`` columns of ``qkv_proj`` -> ``o_proj``'s rows.

    Example:
        >>> from hpu_fp8_loader import TINY_MODELS, Fold, stress_model
        >>> stress_model(TINY_MODELS["qwen2-bytes"], "qwen2-stress", {Fold("down"): 1e6}).out
        PosixPath('qwen2-stress')
    """

    QKV = "qkv"
    MLP_INPUT = "mlp-input"
    DOWN = "down"
    O_PROJ = "o-proj"


@dataclass(frozen=True)
class FoldSite:
    """One place a fold applies: its kind, its layer, the module it is named by, and the activation points whose
    channels it moves (what a calibration measures per channel to choose its exponents).

    ``name`` is the consumer's input as the spec names it: ``qkv_proj``, ``post_attention_layernorm`` (whose
    output every linear of the MLP or MoE reads), a ``down_proj``, ``o_proj``. ``channels`` is the exponent
    vector's length: hidden, an MLP's or expert's intermediate width, or the KV width.
    """

    fold: Fold
    layer: int
    name: str
    points: tuple[str, ...]
    channels: int


def fold_sites(d: ModelDescriptor) -> list[FoldSite]:
    """Every fold site of the model, layer by layer, in model order."""
    sites: list[FoldSite] = []
    for i in range(d.num_layers):
        m = names.layer_names(d.prefix, i)
        sites.append(FoldSite(Fold.QKV, i, m.qkv, (m.qkv,), d.hidden_size))
        sites.append(FoldSite(Fold.O_PROJ, i, m.o_proj, (m.o_proj, m.attention_point("cache_v")), d.kv_width))
        if not d.is_moe_layer(i):
            up_gate = names.tensor(m.mlp, names.UP_GATE)
            sites.append(FoldSite(Fold.MLP_INPUT, i, m.post_attention_norm, (up_gate,), d.hidden_size))
            down = names.tensor(m.mlp, names.DOWN)
            sites.append(FoldSite(Fold.DOWN, i, down, (down,), d.intermediate_size))
            continue
        moe = d.moe
        assert moe is not None  # is_moe_layer holds only with an MoE config
        inputs: tuple[str, ...] = (names.shared_expert_input(d.prefix, i),)
        if moe.num_shared_experts:
            inputs += (names.tensor(m.shared_experts, names.UP_GATE),)
        sites.append(FoldSite(Fold.MLP_INPUT, i, m.post_attention_norm, inputs, d.hidden_size))
        for e in range(moe.num_experts):
            down = names.expert(d.prefix, i, e, names.DOWN)
            sites.append(FoldSite(Fold.DOWN, i, down, (down,), moe.intermediate_size))
        if moe.num_shared_experts:
            down = names.tensor(m.shared_experts, names.DOWN)
            sites.append(FoldSite(Fold.DOWN, i, down, (down,), moe.num_shared_experts * moe.intermediate_size))
    return sites


@dataclass(frozen=True)
class ChosenFolds:
    """The folds a conversion applies: each site's exponents (activation channel ``c`` divided by ``2^e_c``), only
    for sites where one is nonzero, and how they were chosen."""

    mode: Rebalance
    migration: float
    exponents: dict[FoldSite, np.ndarray]

    def digest(self) -> str:
        """sha256 of every site's name and exponents, in model order: what identifies the folds in a checkpoint."""
        hashed = hashlib.sha256()
        for site, e in self.exponents.items():
            hashed.update(site.name.encode() + b"\0" + np.asarray(e, "<i4").tobytes())
        return hashed.hexdigest()

    def record(self) -> Rebalancing | None:
        """What quantization_config records of these folds; None when no channel moves (nothing was rebalanced)."""
        if not self.exponents:
            return None
        return Rebalancing(
            mode="flagged" if self.mode is Rebalance.FLAGGED else "all",
            migration=self.migration,
            sites=[site.name for site in self.exponents],
            largest_exponent=max(int(np.max(np.abs(e))) for e in self.exponents.values()),
            exponents_sha256=self.digest(),
        )

    def rebalanced(self, measurements: Measurements, channel_amax: Mapping[str, np.ndarray], d: ModelDescriptor) -> Measurements:
        """``measurements`` with each moved point's amax as the folded model has it, exactly: the max over its
        channels of ``a_c / 2^e_c``; its provenance says so."""
        amax = dict(measurements.amax)
        for site, e in self.exponents.items():
            for point in site.points:
                if point in amax and point in channel_amax:
                    amax[point] = float(np.max(np.ldexp(channel_amax[point], -point_exponents(site, point, e, d))))
        tool = f"{measurements.provenance.tool} (amax of the model rebalanced with {self.mode.value} folds)"
        return measurements.model_copy(
            update={"amax": amax, "provenance": measurements.provenance.model_copy(update={"tool": tool})}
        )


def fold_points(d: ModelDescriptor) -> frozenset[str]:
    """Every activation point a fold moves: what a calibration measures per channel for :func:`choose_rebalancing`."""
    return frozenset(point for site in fold_sites(d) for point in site.points)


def point_exponents(site: FoldSite, point: str, e: np.ndarray, d: ModelDescriptor) -> np.ndarray:
    """The exponent of each channel of ``point`` under the site's exponents: ``o_proj``'s input repeats each KV
    channel's for every query head of its group; every other point is the site's own channels."""
    return e[_kv_channel_of_query(d)] if site.fold is Fold.O_PROJ and point == site.points[0] else e


def _kv_channel_of_query(d: ModelDescriptor) -> np.ndarray:
    """For each channel of o_proj's input (query head ``h``, dim ``i``), the KV channel it reads: ``(h // group, i)``."""
    heads = np.arange(d.num_heads)
    group = d.num_heads // d.num_kv_heads
    return ((heads[:, None] // group) * d.head_dim + np.arange(d.head_dim)[None, :]).reshape(-1)


def per_kv_channel_max(values: np.ndarray, d: ModelDescriptor) -> np.ndarray:
    """Values of o_proj's input channels (or rows) reduced, by max, to the KV channel each reads: the query heads of a
    group share their KV head (:func:`_kv_channel_of_query`'s mapping)."""
    return values.reshape(d.num_kv_heads, d.num_heads // d.num_kv_heads, d.head_dim).max(axis=1).reshape(-1)


def site_channel_amax(site: FoldSite, channel_amax: Mapping[str, np.ndarray], d: ModelDescriptor) -> np.ndarray | None:
    """Each fold channel's max |x| over every point it moves (``o-proj``: each KV channel's over the query heads it
    serves and the V cache); None where a point was not reached (a routed expert no token was routed to)."""
    if any(point not in channel_amax for point in site.points):
        return None
    peaks = []
    for point in site.points:
        values = channel_amax[point]
        peaks.append(per_kv_channel_max(values, d) if site.fold is Fold.O_PROJ and point == site.points[0] else values)
    return np.max(peaks, axis=0)


@dataclass
class Scaling:
    """The power-of-two exponents one weight's rows (its input channels, ``[in]``) and columns (its output channels,
    ``[out]``; a norm's or bias's only axis) are scaled by; None where an axis is not scaled."""

    rows: np.ndarray | None = None
    cols: np.ndarray | None = None

    def add(self, axis: str, where: slice | np.ndarray, exponents: np.ndarray, width: int) -> None:
        current = getattr(self, axis)
        if current is None:
            current = np.zeros(width, np.int32)
            setattr(self, axis, current)
        current[where] += exponents

    def apply(
        self, block: np.ndarray, name: str, first_row: int = 0, column_offset: int = 0, transpose: bool = False
    ) -> np.ndarray:
        """``block`` scaled exactly, as float32: rows ``first_row:`` of the weight in the spec's ``[in, out]`` layout,
        or of one source part of it (its spec columns start at ``column_offset``; ``transpose``: a torch part, ``[out,
        in]``, whose rows are spec columns); a 1-D block is elements of a norm or bias. Refused, naming ``name``, where
        a nonzero value would leave float32's normal range (no longer the same bf16 value times a power of two)."""
        values = np.asarray(block, np.float32)
        count = values.shape[0]
        if values.ndim == 1:
            exponents = _part(self.cols, column_offset + first_row, count)
        elif transpose:
            exponents = _part(self.cols, column_offset + first_row, count)[:, None] + _part(self.rows, 0, values.shape[1])
        else:
            exponents = _part(self.rows, first_row, count)[:, None] + _part(self.cols, column_offset, values.shape[1])
        with np.errstate(over="ignore", under="ignore"):  # what overflowed or underflowed is refused below, by name
            scaled = np.ldexp(values, exponents).astype(np.float32)
        lost = ~np.isfinite(scaled) | ((np.abs(scaled) < np.finfo(np.float32).tiny) & (values != 0))
        if lost.any():
            raise ConfigError(
                f"{name}: a channel fold takes {int(lost.sum())} value(s) out of float32's normal range "
                "(the power of two is too large for these weights): nothing was written"
            )
        return scaled


def _part(exponents: np.ndarray | None, start: int, count: int) -> np.ndarray:
    """``count`` exponents from ``start``; zeros for an axis not scaled."""
    return np.zeros(count, np.int32) if exponents is None else exponents[start : start + count]


def weight_scalings(d: ModelDescriptor, exponents: Mapping[FoldSite, np.ndarray]) -> dict[str, Scaling]:
    """What each weight is scaled by when each site's activation channels are divided by ``2^exponents[site]``: the
    producer's channels divided, the consumers' rows multiplied. Sites absent (or all zeros) change nothing."""
    scalings: dict[str, Scaling] = {}
    shapes = {w.name: w.shape for w in d.weights()}

    def scale(name: str, axis: str, where: slice | np.ndarray, values: np.ndarray) -> None:
        shape = shapes[name]
        scalings.setdefault(name, Scaling()).add(axis, where, values, shape[0] if axis == "rows" else shape[-1])

    for site, e in exponents.items():
        e = np.asarray(e, np.int32)
        if e.shape != (site.channels,):
            raise ConfigError(f"{site.name}: {e.shape} exponents for a fold of {site.channels} channels")
        if not e.any():
            continue
        m = names.layer_names(d.prefix, site.layer)
        weight = lambda module: names.tensor(module, names.WEIGHT)  # noqa: E731
        if site.fold is Fold.QKV:
            scale(weight(m.input_norm), "cols", slice(None), -e)
            scale(weight(m.qkv), "rows", slice(None), e)
        elif site.fold is Fold.MLP_INPUT:
            scale(weight(m.post_attention_norm), "cols", slice(None), -e)
            for consumer in mlp_input_consumers(d, site.layer):
                scale(consumer, "rows", slice(None), e)
        elif site.fold is Fold.DOWN:
            module = site.name.rpartition(".")[0]
            width = site.channels
            scale(weight(names.tensor(module, names.UP_GATE)), "cols", slice(width, 2 * width), -e)
            scale(weight(site.name), "rows", slice(None), e)
        else:
            v = slice(d.q_width + d.kv_width, d.qkv_width)
            scale(weight(m.qkv), "cols", v, -e)
            if d.qkv_bias:
                scale(names.tensor(m.qkv, names.BIAS), "cols", v, -e)
            scale(weight(m.o_proj), "rows", slice(None), point_exponents(site, m.o_proj, e, d))
    return scalings


def mlp_input_consumers(d: ModelDescriptor, layer: int) -> list[str]:
    """Every weight that reads a layer's post-attention norm output, by spec name."""
    m = names.layer_names(d.prefix, layer)
    if not d.is_moe_layer(layer):
        return [names.tensor(names.tensor(m.mlp, names.UP_GATE), names.WEIGHT)]
    moe = d.moe
    assert moe is not None
    consumers = [names.tensor(m.router, names.WEIGHT)]
    consumers += [names.tensor(names.expert(d.prefix, layer, e, names.UP_GATE), names.WEIGHT) for e in range(moe.num_experts)]
    if moe.num_shared_experts:
        consumers.append(names.tensor(names.tensor(m.shared_experts, names.UP_GATE), names.WEIGHT))
    return consumers

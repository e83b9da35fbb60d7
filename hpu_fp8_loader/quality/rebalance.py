"""Exact offline rebalancing: where a point's range fails, its large channels are moved into the next linear's rows.

SmoothQuant's migration (Xiao et al., 2023: divide activation channel ``c`` by ``s_c = a_c^alpha / w_c^(1 - alpha)``,
``a_c`` its max |x|, ``w_c`` the max |W| of the rows it meets, and multiply those rows by it), with each ``s_c``
rounded to a power of two so that the fold is exact (:mod:`~hpu_fp8_loader.conversion.folds`): the rebalanced BF16
model computes what the source computes, to the bit, and stays inside the format FastDeploy serves (per-tensor
linears, per-channel experts, one input scale per fused group), loaded like any other checkpoint. Only the
quantization sees a difference: the outlier channels are smaller, the weights' rows larger.

The exponents come from a calibration's per-channel amax and the source's weights; each moved point's new amax
follows exactly from them (a power of two commutes with the max), so no second calibration runs.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hpu_fp8_loader.arch import WeightTensor
from hpu_fp8_loader.conversion.folds import (
    ChosenFolds,
    Fold,
    FoldSite,
    fold_sites,
    mlp_input_consumers,
    per_kv_channel_max,
    site_channel_amax,
)
from hpu_fp8_loader.engine.weights import EngineWeights
from hpu_fp8_loader.quality.ranges import PointRange
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.choices import Rebalance

__all__ = ["MIGRATION", "choose_rebalancing"]

MIGRATION = 0.5
"""SmoothQuant's alpha: how much of a channel's range moves into the weights (0.5 balances the two maxima)."""


def _consumer_rows(site: FoldSite, weights: EngineWeights) -> list[str]:
    """The weights whose rows a site's channels meet in a quantized product (the router is not quantized)."""
    d = weights.descriptor
    m = names.layer_names(d.prefix, site.layer)
    if site.fold is Fold.QKV:
        return [names.tensor(m.qkv, names.WEIGHT)]
    if site.fold is Fold.MLP_INPUT:
        router = names.tensor(m.router, names.WEIGHT)
        return [name for name in mlp_input_consumers(d, site.layer) if name != router]
    return [names.tensor(site.name, names.WEIGHT)]


def _weight_amax(site: FoldSite, weights: EngineWeights, by_name: Mapping[str, WeightTensor]) -> np.ndarray:
    """Each fold channel's max |W| over the rows it meets (``o-proj``: over every query head's rows of its KV
    channel), read from the source; ``by_name``: the model's weights by spec name."""
    rows = np.max([np.max(np.abs(weights.get(by_name[name])), axis=1) for name in _consumer_rows(site, weights)], axis=0)
    return per_kv_channel_max(rows, weights.descriptor) if site.fold is Fold.O_PROJ else rows


def choose_rebalancing(
    weights: EngineWeights,
    channel_amax: Mapping[str, np.ndarray],
    ranges: list[PointRange],
    mode: Rebalance,
    migration: float = MIGRATION,
) -> ChosenFolds:
    """The folds for ``mode`` (``flagged`` or ``all``): at each chosen site,
    ``e_c = round(log2(a_c^migration / w_c^(1 - migration)))``.

    ``flagged`` chooses the sites one of whose points' ``ranges`` (the calibration's) exceeds what E4M3 at ±240
    holds; ``all`` every site. A channel whose activation or weight max is zero keeps exponent 0; so does every
    channel of a site a point of which no calibration token reached. The consumers' weights are read from the
    source, once per chosen site.
    """
    d = weights.descriptor
    beyond = {r.module for r in ranges if r.beyond}
    if mode is Rebalance.OFF:
        raise ValueError("choose_rebalancing: mode off chooses no folds")
    chosen: dict[FoldSite, np.ndarray] = {}
    by_name = {w.name: w for w in d.weights()}  # once: a 300B model has thousands of sites and of weights
    for site in fold_sites(d):
        if mode is Rebalance.FLAGGED and not beyond.intersection(site.points):
            continue
        act = site_channel_amax(site, channel_amax, d)
        if act is None:
            continue
        weight = _weight_amax(site, weights, by_name)
        usable = (act > 0) & (weight > 0)
        e = np.zeros(site.channels, np.int32)
        with np.errstate(divide="ignore"):
            shift = migration * np.log2(act) - (1 - migration) * np.log2(weight)
        e[usable] = np.rint(shift[usable]).astype(np.int32)
        if e.any():
            chosen[site] = e
    return ChosenFolds(mode, migration, chosen)

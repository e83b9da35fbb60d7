"""Faults put into what the hook hands FastDeploy, for the suite's negative controls: each one wrong value.

``inject(kind)`` replaces ``mapping.map_rank``, which the hook's ``fill_model`` looks up when it runs; the emulation
(``engine/fp8.py``) imported the real one by name, so it never sees the fault. One kind is inside the hook's own
rules instead: ``expert-keys-hold-raw-amax`` makes ``mapping.holds_raw_amax`` true for expert keys too, so every
MoE input scale is derived 240x wrong; ``export-legacy`` shares that rule, and a test that writes its oracle with
the same fault shows why only an oracle from PaddleCustomDevice's own converter can catch it; ``HOOK_RULES`` holds
faults of the same kind inside the hook's other rules. Returns the kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np


def _flip_weight_bit(piece, mapping):
    if piece.array.dtype.name != "float8_e4m3fn":
        return None
    array = piece.array.copy()
    array.view(np.uint8).reshape(-1)[0] ^= 1
    return mapping.MappedPiece(piece.name, array, piece.expert)


def _act_scale_as_descale(piece, mapping):
    if not piece.name.endswith(".mlp.up_gate_proj.act_scale"):
        return None
    return mapping.MappedPiece(piece.name, (np.float32(1) / piece.array.astype(np.float32)).astype(piece.array.dtype))


def _expert_scales_swapped(piece, mapping):
    if not piece.name.endswith(".down_proj_in_scale"):  # the [E, 1] stack of per-expert scales, reversed
        return None
    return mapping.MappedPiece(piece.name, piece.array[::-1].copy())


def _zero_moe_in_scale(piece, mapping):
    """The MoE input multiplier as FastDeploy creates it (``Constant(0)``): a hook that skipped it would leave this."""
    if not piece.name.endswith(".up_gate_proj_in_scale"):
        return None
    return mapping.MappedPiece(piece.name, np.zeros_like(piece.array), piece.expert)


ONE_PIECE: dict[str, Callable] = {
    "flip-weight-bit": _flip_weight_bit,
    "act-scale-as-descale": _act_scale_as_descale,
    "expert-scales-swapped": _expert_scales_swapped,
    "zero-moe-in-scale": _zero_moe_in_scale,
}


def _qk_norms_swapped(pieces: list, mapping) -> list:
    """The first layer's q_norm and k_norm weights exchanged (both [head_dim]: no shape check can see it)."""
    index = {piece.name: i for i, piece in enumerate(pieces)}
    q = next(name for name in index if name.endswith(".self_attn.q_norm.weight"))
    k = q.replace(".q_norm.", ".k_norm.")
    i, j = index[q], index[k]
    pieces[i], pieces[j] = mapping.MappedPiece(q, pieces[j].array), mapping.MappedPiece(k, pieces[i].array)
    return pieces


def expert_keys_hold_raw_amax(real: Callable[[str], bool]) -> Callable[[str], bool]:
    """``holds_raw_amax`` with expert keys read as the raw amax too (they hold amax / 240)."""
    return lambda key: real(key) or ".experts." in key


# Faults inside the hook's own rules, one of each kind an independent review put there; each replaces one function of
# ``mapping`` that the hook looks up when it runs (``export-legacy`` imported its own by name and stays right).


def _ranks_replaced(mapping, ranks: Callable) -> None:
    """The hook's parallelism with the fields ``ranks(par)`` returns in place of FastDeploy's, everything else kept."""
    real = mapping.map_rank

    def replaced(checkpoint, qc, d, par, *args, **kwargs):
        return real(checkpoint, qc, d, dataclasses.replace(par, **ranks(par)), *args, **kwargs)

    mapping.map_rank = replaced


def _linear_multiplier_as_descale(mapping) -> None:
    """A dense linear's (act_scale, act_scale_inv) handed over the wrong way round."""
    real = mapping._linear_act_scales
    mapping._linear_act_scales = lambda s, raw: real(s, raw)[::-1]


def _expert_scale_split_before_5757(mapping) -> None:
    """An expert up_gate's weight_scale split contiguously, as FastDeploy did before #5757, not gate|up-paired."""
    real = mapping.scale_share

    def contiguous(checkpoint, d, w, par):
        if w.role is not mapping.Role.EXPERT_UP_GATE or par.tp_size == 1:
            return real(checkpoint, d, w, par)
        part = w.shape[1] // par.tp_size
        name = mapping.names.tensor(w.module, mapping.names.WEIGHT_SCALE)
        return mapping._read(checkpoint, name, columns=((par.tp_rank * part, (par.tp_rank + 1) * part),))

    mapping.scale_share = contiguous


def _expert_activation_scales_swapped(mapping) -> None:
    """Experts 0 and 1 of every MoE layer read each other's down_proj activation amax."""
    real = mapping._activation_scale
    swap = {".experts.0.": ".experts.1.", ".experts.1.": ".experts.0."}

    def swapped(checkpoint, module, qc):
        for this, other in swap.items():
            if this in module:
                return real(checkpoint, module.replace(this, other), qc)
        return real(checkpoint, module, qc)

    mapping._activation_scale = swapped


HOOK_RULES: dict[str, Callable] = {
    "every-rank-as-rank-0": lambda mapping: _ranks_replaced(mapping, lambda par: {"tp_rank": 0, "ep_rank": 0}),
    # every EP rank given rank 0's experts; the EP rank read off the tensor-parallel rank (the same at TP 2 x EP 2)
    "experts-of-ep-rank-0": lambda mapping: _ranks_replaced(mapping, lambda par: {"ep_rank": 0}),
    "ep-rank-from-tp-rank": lambda mapping: _ranks_replaced(mapping, lambda par: {"ep_rank": par.tp_rank}),
    "linear-multiplier-as-descale": _linear_multiplier_as_descale,
    "expert-scale-split-before-5757": _expert_scale_split_before_5757,
    "expert-activation-scales-swapped": _expert_activation_scales_swapped,
}


def inject(kind: str) -> str:
    from hpu_fp8_loader.fastdeploy import mapping

    if kind == "expert-keys-hold-raw-amax":
        mapping.holds_raw_amax = expert_keys_hold_raw_amax(mapping.holds_raw_amax)
        return kind
    if kind in HOOK_RULES:
        HOOK_RULES[kind](mapping)
        return kind
    real = mapping.map_rank

    def faulty(*args, **kwargs) -> Iterator:
        if kind == "qk-norms-swapped":
            yield from _qk_norms_swapped(list(real(*args, **kwargs)), mapping)
            return
        done = False
        for piece in real(*args, **kwargs):
            changed = None if done else ONE_PIECE[kind](piece, mapping)
            done = done or changed is not None
            yield piece if changed is None else changed

    mapping.map_rank = faulty
    return kind

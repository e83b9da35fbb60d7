"""Faults put into what the hook hands FastDeploy, for the suite's negative controls: each one wrong value.

``inject(kind)`` replaces ``mapping.map_rank``, which the hook's ``fill_model`` looks up when it runs; the emulation
(``engine/fp8.py``) imported the real one by name, so it never sees the fault. One kind is inside the hook's own
rules instead: ``expert-keys-hold-raw-amax`` makes ``mapping.holds_raw_amax`` true for expert keys too, so every
MoE input scale is derived 240x wrong; ``export-legacy`` shares that rule, and a test that writes its oracle with
the same fault shows why only an oracle from PaddleCustomDevice's own converter can catch it. Returns the kind.
"""

from __future__ import annotations

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


def inject(kind: str) -> str:
    from hpu_fp8_loader.fastdeploy import mapping

    if kind == "expert-keys-hold-raw-amax":
        mapping.holds_raw_amax = expert_keys_hold_raw_amax(mapping.holds_raw_amax)
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

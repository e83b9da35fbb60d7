"""Which activation amax each act module gets: merged measurement sets, ``s`` fixed, dead experts.

Shared by everything that makes a spec checkpoint (convert, import-legacy), so every path refuses
the same things with the same messages.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence

from hpu_fp8_loader.arch import ModelDescriptor
from hpu_fp8_loader.errors import MeasurementError
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import AmaxSourceKind, CalibrationSource, DeadExpertPolicy, ExpertRef
from hpu_fp8_loader.spec.fp8 import act_amax_problem
from hpu_fp8_loader.spec.measurements import Measurements

__all__ = ["dead_expert_summary", "merge_measurements", "resolve_act_amax"]

log = logging.getLogger(__name__)
# A dead-expert message shows this many layers and this many experts of each; the rest are counted.
_LAYERS_SHOWN = 5
_EXPERTS_SHOWN = 8


def merge_measurements(
    measurements: Sequence[Measurements], descriptor: ModelDescriptor
) -> tuple[dict[str, float], dict[str, str], list[CalibrationSource]]:
    """Max-merge several measurement sets: (amax per module, source id per module, sources).

    Refuses a set taken on another model (a different identity, or keys this model does not have) and
    an amax outside the range a checkpoint may store.
    """
    if not measurements:
        raise MeasurementError("no measurements given; pass --measurements")
    known = set(descriptor.act_modules(attention_fp8=True))
    experts = descriptor.moe.num_experts if descriptor.moe else 0
    amax: dict[str, float] = {}
    origin: dict[str, str] = {}
    sources = []
    for i, m in enumerate(measurements):
        label = f"measurements #{i + 1}" + (f" ({', '.join(m.provenance.files)})" if m.provenance.files else "")
        ident = m.model
        if ident is not None and (ident.model_type, ident.num_hidden_layers, ident.moe_num_experts) != (
            descriptor.model_type,
            descriptor.num_layers,
            experts,
        ):
            raise MeasurementError(
                f"{label} were taken on {ident.model_type} with {ident.num_hidden_layers} layers and "
                f"{ident.moe_num_experts} experts; this model is {descriptor.model_type} with {descriptor.num_layers} "
                f"layers and {experts} experts"
            )
        foreign = sorted(set(m.amax) - known)
        if foreign:
            raise MeasurementError(
                f"{label} hold {len(foreign)} point(s) this model does not have, e.g. {', '.join(foreign[:3])} "
                f"(the model has {descriptor.num_layers} layers"
                + (f", {experts} experts per MoE layer" if experts else "")
                + "): were they taken on another model?"
            )
        _check_unnormed_attention(m, descriptor, label)
        _check_ranges(m, label)
        source_id = f"{m.provenance.kind.value}-{i + 1}"
        sources.append(CalibrationSource(id=source_id, **m.provenance.model_dump()))
        for module, value in m.amax.items():
            if module not in amax or value > amax[module]:
                amax[module], origin[module] = value, source_id
    return amax, origin, sources


def _check_unnormed_attention(measurements: Measurements, descriptor: ModelDescriptor, label: str) -> None:
    """Refuse FastDeploy's own q / cache_k amax of a model with q/k norms (Qwen3): its measurement kernels apply no
    q/k RMSNorm, so they measure tensors the FP8 kernels never quantize (docs/fastdeploy.md section 14), and a
    max-merge would let those wrong values win silently."""
    if not descriptor.qk_norm or measurements.provenance.kind is not AmaxSourceKind.FASTDEPLOY_MEASUREMENT:
        return
    wrong = sorted(m for m in measurements.amax if names.attention_point_of(m) in ("q", "cache_k"))
    if wrong:
        raise MeasurementError(
            f"{label} are FastDeploy's own measurements of a {descriptor.model_type} model, whose q and cache_k it "
            f"records without the q/k RMSNorm its FP8 kernels apply ({len(wrong)} values, e.g. {wrong[0]}); calibrate "
            "with `hpu-fp8 calibrate` (or `convert --calibrate`), which computes the norms, and pass its JSON file, not "
            "a --fastdeploy-format copy (docs/fastdeploy.md section 14)"
        )


def _check_ranges(measurements: Measurements, label: str) -> None:
    """Refuse, by module, an amax outside the range a checkpoint may store: never publish what validate rejects.

    Zero passes here: :func:`resolve_act_amax` decides what a zero means (a dead expert, or an error).
    """
    for module, value in measurements.amax.items():
        problem = act_amax_problem(value) if value != 0 else None
        if problem:
            raise MeasurementError(f"{label}: {module}: {problem}")


def dead_expert_summary(dead: Iterable[tuple[int, int]], experts_per_layer: int | None = None, whole: bool = False) -> str:
    """``(layer, expert)`` pairs summarised per layer for a one-line message: ``layer 3: experts 5, 9, 12 (3 of 64);
    layer 7: expert 1 (1 of 64); 4 more layers``. A large MoE can have hundreds of dead experts, so a few layers and
    experts are shown; ``whole`` shows every one, for where a script or a curious person reads it (``-v``).

    Example:
        >>> dead_expert_summary([(3, 12), (3, 5), (7, 1)], 64)
        'layer 3: experts 5, 12 (2 of 64); layer 7: expert 1 (1 of 64)'
    """
    by_layer: dict[int, list[int]] = {}
    for layer, expert in sorted(set(dead)):
        by_layer.setdefault(layer, []).append(expert)
    layers_shown, experts_shown = (len(by_layer), None) if whole else (_LAYERS_SHOWN, _EXPERTS_SHOWN)
    parts = []
    for layer, experts in list(by_layer.items())[:layers_shown]:
        cut = experts if experts_shown is None else experts[:experts_shown]
        shown = ", ".join(map(str, cut)) + (", ..." if len(cut) < len(experts) else "")
        count = f"{len(experts)} of {experts_per_layer}" if experts_per_layer else f"{len(experts)}"
        parts.append(f"layer {layer}: expert{'s' if len(experts) > 1 else ''} {shown} ({count})")
    hidden = len(by_layer) - layers_shown
    return "; ".join(parts) + (f"; {hidden} more layer{'s' if hidden > 1 else ''}" if hidden > 0 else "")


def resolve_act_amax(
    modules: Sequence[str], amax: dict[str, float], policy: DeadExpertPolicy
) -> tuple[dict[str, float], list[ExpertRef]]:
    """amax of every act module (``s`` fixed at 1.0), dead experts handled by ``policy``.

    Refuses, by name, every module without a positive amax; never divides by zero or invents 1e-5.
    """
    out: dict[str, float] = {}
    missing: list[str] = []
    zero: list[str] = []
    dead: list[tuple[str, tuple[int, int]]] = []  # (module, (layer, expert))
    for module in modules:
        value = amax.get(module)
        if names.attention_point_of(module) == "s":
            out[module] = 1.0  # FastDeploy's decode path quantizes exp scores peaking at exactly 1
        elif value is not None and value > 0:
            out[module] = value
        elif (expert := names.expert_of(module)) is not None:
            dead.append((module, expert))
        else:
            (missing if value is None else zero).append(module)
    if missing:
        raise MeasurementError(f"measurements lack {len(missing)} module(s): {', '.join(missing[:20])}")
    if zero:
        raise MeasurementError(f"amax is zero for {len(zero)} module(s) (an uncalibrated path?): {', '.join(zero[:20])}")
    filled: list[ExpertRef] = []
    if dead:
        pairs = [pair for _, pair in dead]
        experts = max(Counter(of[0] for m in modules if (of := names.expert_of(m)) is not None).values())
        log.info("experts without a positive amax: %s", dead_expert_summary(pairs, experts, whole=True))
        if policy is DeadExpertPolicy.ERROR:
            raise MeasurementError(
                f"{len(dead)} expert(s) have no positive amax (no calibration token was routed to them): "
                f"{dead_expert_summary(pairs, experts)}. Calibrate with more data or `hpu-fp8 calibrate "
                "--all-experts`, or pass --dead-experts sibling-max to give each the max of its layer's other experts "
                "(recorded in config.json); -v lists every one."
            )
        for module, (layer, expert_id) in dead:
            siblings = [v for m, v in out.items() if (of := names.expert_of(m)) is not None and of[0] == layer]
            if not siblings:
                raise MeasurementError(f"every expert of layer {layer} is dead; there is no sibling to take an amax from")
            out[module] = max(siblings)
            filled.append(ExpertRef(layer=layer, expert=expert_id))
    return {m: out[m] for m in modules}, filled

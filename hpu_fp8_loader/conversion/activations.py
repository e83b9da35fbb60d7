"""Which activation amax each act module gets: merged measurement sets, ``s`` fixed, dead experts.

Shared by everything that makes a spec checkpoint (convert, import-legacy), so every path refuses
the same things with the same messages.
"""

from __future__ import annotations

from collections.abc import Sequence

from hpu_fp8_loader.arch import ModelDescriptor
from hpu_fp8_loader.errors import MeasurementError
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import CalibrationSource, DeadExpertPolicy, ExpertRef
from hpu_fp8_loader.spec.fp8 import act_amax_problem
from hpu_fp8_loader.spec.measurements import Measurements

__all__ = ["merge_measurements", "resolve_act_amax"]


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
        _check_ranges(m, label)
        source_id = f"{m.provenance.kind.value}-{i + 1}"
        sources.append(CalibrationSource(id=source_id, **m.provenance.model_dump()))
        for module, value in m.amax.items():
            if module not in amax or value > amax[module]:
                amax[module], origin[module] = value, source_id
    return amax, origin, sources


def _check_ranges(measurements: Measurements, label: str) -> None:
    """Refuse, by module, an amax outside the range a checkpoint may store: never publish what validate rejects.

    Zero passes here: :func:`resolve_act_amax` decides what a zero means (a dead expert, or an error).
    """
    for module, value in measurements.amax.items():
        problem = act_amax_problem(value) if value != 0 else None
        if problem:
            raise MeasurementError(f"{label}: {module}: {problem}")


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
        listing = ", ".join(f"layer {layer} expert {e}" for _, (layer, e) in dead)
        if policy is DeadExpertPolicy.ERROR:
            raise MeasurementError(
                f"{len(dead)} expert(s) have no positive amax (no calibration token was routed to them): {listing}. "
                "Calibrate with more data or `hpu-fp8 calibrate --all-experts`, or pass --dead-experts sibling-max "
                "to give each the max of its layer's other experts (recorded in config.json)."
            )
        for module, (layer, expert_id) in dead:
            siblings = [v for m, v in out.items() if (of := names.expert_of(m)) is not None and of[0] == layer]
            if not siblings:
                raise MeasurementError(f"every expert of layer {layer} is dead; there is no sibling to take an amax from")
            out[module] = max(siblings)
            filled.append(ExpertRef(layer=layer, expert=expert_id))
    return {m: out[m] for m in modules}, filled

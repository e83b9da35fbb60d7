"""What is inside an hpu-fp8 checkpoint: layers, roles, dtypes, bytes, scale ranges, saturation."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hpu_fp8_loader.checks.validate import open_validated
from hpu_fp8_loader.numerics import scales
from hpu_fp8_loader.spec import names

__all__ = ["Inspection", "RoleSummary", "inspect_checkpoint"]


@dataclass
class RoleSummary:
    tensors: int = 0
    bytes: int = 0
    dtypes: list[str] = field(default_factory=list)
    weight_scale: dict[str, float] | None = None  # min / median / max
    act_scale: dict[str, float] | None = None
    saturated_share: float | None = None  # share of fp8 values at ±fp8_max


@dataclass
class Inspection:
    root: str
    model_type: str
    layers: int
    moe_layers: list[int]
    experts: int
    fp8_max: float
    target: str
    kv_cache_scheme: str
    total_bytes: int
    roles: dict[str, RoleSummary]

    def to_dict(self) -> dict:
        return asdict(self)


def _stats(values: list[np.ndarray]) -> dict[str, float] | None:
    if not values:
        return None
    flat = np.concatenate([v.reshape(-1) for v in values]).astype(np.float64)
    return {"min": float(flat.min()), "median": float(np.median(flat)), "max": float(flat.max())}


def _role_of_act(module: str) -> str:
    tail = module.split(".self_attn.")[-1] if ".self_attn." in module else None
    if tail in names.ATTENTION_POINTS:
        return f"attn_{tail}"
    return "act_inputs"


def inspect_checkpoint(root: str | Path) -> Inspection:
    """Summarise a checkpoint by role; reads every fp8 weight once to count saturated values.

    The quick validation runs first: a summary of a checkpoint validate rejects (a config.json its
    tensors do not back, a missing manifest) would describe a model that is not there.
    """
    opened = open_validated(root)
    checkpoint, qc, descriptor = opened.checkpoint, opened.qc, opened.descriptor
    limit = scales.max_code(qc.fp8_max)
    role_of = {w.name: w.role.value for w in descriptor.weights()}
    module_role = {w.module: w.role.value for w in descriptor.weights() if w.is_linear}
    roles: dict[str, RoleSummary] = defaultdict(RoleSummary)
    weight_scales: dict[str, list[np.ndarray]] = defaultdict(list)
    act_scales: dict[str, list[np.ndarray]] = defaultdict(list)
    saturated: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for name, info in checkpoint.tensors.items():
        module, _, suffix = name.rpartition(".")
        if name in role_of:
            role = role_of[name]
        elif suffix == names.WEIGHT_SCALE:
            role = module_role.get(module, "other")
            weight_scales[role].append(np.asarray(checkpoint.get(name), np.float32))
        elif suffix in (names.ACT_SCALE, names.ACT_AMAX):
            role = _role_of_act(module)
            if suffix == names.ACT_SCALE:
                act_scales[role].append(np.asarray(checkpoint.get(name), np.float32))
        else:
            role = "other"
        summary = roles[role]
        summary.tensors += 1
        summary.bytes += info.nbytes
        if info.dtype not in summary.dtypes:
            summary.dtypes.append(info.dtype)
        if info.dtype == "F8_E4M3":
            codes = checkpoint.get(name).reshape(-1).view(np.uint8)
            counts = saturated[role]
            counts[0] += int(np.count_nonzero((codes & 0x7F) == limit))
            counts[1] += codes.size
    for role, summary in roles.items():
        summary.weight_scale = _stats(weight_scales.get(role, []))
        summary.act_scale = _stats(act_scales.get(role, []))
        if role in saturated and saturated[role][1]:
            summary.saturated_share = saturated[role][0] / saturated[role][1]
    return Inspection(
        root=str(root),
        model_type=descriptor.model_type,
        layers=descriptor.num_layers,
        moe_layers=descriptor.moe_layers(),
        experts=descriptor.moe.num_experts if descriptor.moe else 0,
        fp8_max=qc.fp8_max,
        target=qc.target.value,
        kv_cache_scheme=qc.kv_cache_scheme.value,
        total_bytes=sum(s.bytes for s in roles.values()),
        roles=dict(sorted(roles.items())),
    )

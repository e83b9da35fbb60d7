"""What is inside an hpu-fp8 checkpoint: layers, roles, dtypes, bytes, scale ranges, saturation."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hpu_fp8_loader.checks.validate import open_validated
from hpu_fp8_loader.numerics import scales
from hpu_fp8_loader.sources.resolve import SPEC_PATTERNS, local_or_hub
from hpu_fp8_loader.spec import names

__all__ = ["Inspection", "RoleSummary", "inspect_checkpoint"]


@dataclass
class RoleSummary:
    """The tensors of one role in an :class:`Inspection`: count, bytes, dtypes, scale ranges and FP8 saturation."""

    tensors: int = 0
    bytes: int = 0
    dtypes: list[str] = field(default_factory=list)
    weight_scale: dict[str, float] | None = None  # min / median / max
    act_scale: dict[str, float] | None = None
    saturated_share: float | None = None  # share of fp8 values at ±fp8_max


@dataclass
class Inspection:
    """What :func:`inspect_checkpoint` found: the model's shape, its FP8 settings, and a summary per tensor role.

    Attributes:
        root: the checkpoint directory (for a Hub repo id, its snapshot in the Hugging Face cache).
        model_type: ``"ernie4_5_moe"``, ``"ernie4_5"``, ``"qwen2"``, ``"qwen3"`` or ``"qwen3_moe"``.
        layers: decoder layers.
        moe_layers: the indices of the MoE layers (empty for a dense model).
        experts: routed experts per MoE layer (0 for a dense model).
        fp8_max: the FP8 range the values are stored at (240.0 or 448.0).
        target: ``"gaudi2"`` or ``"gaudi3"``.
        kv_cache_scheme: ``"fp8"`` or ``"none"``.
        total_bytes: bytes of all tensors.
        roles: role (such as ``"attn_qkv"``, ``"mlp_down"``, ``"act_inputs"``, ``"embedding"``) -> its
            ``RoleSummary``: ``tensors``, ``bytes``, ``dtypes``, ``weight_scale`` and ``act_scale`` (min / median /
            max, or None), ``saturated_share`` (the share of fp8 values at ±fp8_max, or None).

    Example:
        >>> from hpu_fp8_loader import inspect_checkpoint
        >>> inspection = inspect_checkpoint("qwen2-fp8")
        >>> inspection.model_type, inspection.layers, inspection.target
        ('qwen2', 2, 'gaudi2')
        >>> inspection.roles["attn_qkv"].dtypes
        ['F8_E4M3', 'F32']
    """

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
    point = names.attention_point_of(module)
    if point is not None:
        return f"attn_{point}"
    return "act_inputs"


def inspect_checkpoint(root: str | Path, revision: str | None = None) -> Inspection:
    """Summarise a checkpoint by role; reads every fp8 weight once to count saturated values.

    The quick validation runs first: a summary of a checkpoint validate rejects (a config.json its
    tensors do not back, a missing manifest) would describe a model that is not there.

    Args:
        root: the hpu-fp8 checkpoint directory, or a Hub repo id (``ORG/NAME``) when no such local path exists: its
            whole snapshot is downloaded (every fp8 weight is read), or found in the cache offline.
        revision: the Hub branch, tag or commit when ``root`` is a repo id (``main`` by default).

    Returns:
        An :class:`~hpu_fp8_loader.Inspection`; ``to_dict()`` gives the JSON ``hpu-fp8 inspect --json`` prints.

    Raises:
        HpuFp8Error: the checkpoint fails the quick validation (the first violations are named).
        CheckpointNotFoundError: ``root`` is not a directory; as a repo id: missing, gated or private on the Hub, a
            revision that does not exist, or offline and not in the cache.
        HubError: the Hub cannot be reached or refused the request.
        NotHpuFp8CheckpointError: not an hpu-fp8 checkpoint.
        UnsupportedFormatVersionError: the checkpoint declares another format_version.
        ConfigError: config.json is missing or invalid.
        UnknownArchitectureError: config.json's model_type is not supported.

    Example:
        >>> from hpu_fp8_loader import inspect_checkpoint
        >>> for role, summary in inspect_checkpoint("qwen2-fp8").roles.items():
        ...     print(role, summary.tensors, summary.bytes, summary.saturated_share)
    """
    root = local_or_hub(root, revision, SPEC_PATTERNS)
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

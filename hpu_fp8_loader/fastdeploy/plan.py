"""Sizing a deployment from config.json alone: per-rank parameter bytes by group, KV bytes per token.

The per-rank shapes are the mapping's own (``parameter_specs``), so the plan and the hook never
disagree about what a rank holds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpu_fp8_loader.arch import Layout, ModelDescriptor, Role, describe
from hpu_fp8_loader.arch.contents import check_keep_bf16
from hpu_fp8_loader.errors import ConfigError
from hpu_fp8_loader.fastdeploy.capacity import KvCapacity, kv_capacity
from hpu_fp8_loader.fastdeploy.mapping import Parallelism, check_parallelism, parameter_specs
from hpu_fp8_loader.io.checkpoint import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, Checkpoint, read_config
from hpu_fp8_loader.io.jsonfile import read_json_object
from hpu_fp8_loader.io.safetensors_file import ITEMSIZES
from hpu_fp8_loader.sources.resolve import CONFIG_PATTERNS, local_or_hub
from hpu_fp8_loader.spec.choices import Target
from hpu_fp8_loader.spec.config import Bf16Group, KvCacheScheme

__all__ = ["DeploymentPlan", "describe_model", "describe_model_config", "parameter_group", "plan_deployment"]

GROUPS = ("attention", "dense_mlp", "shared_experts", "routed_experts", "router", "embeddings", "lm_head", "norms")


def parameter_group(name: str) -> str:
    """Which group a FastDeploy parameter belongs to, for sizing."""
    if name.startswith("lm_head."):
        return "lm_head"
    if ".embed_tokens." in name:
        return "embeddings"
    if name.endswith(("layernorm.weight", ".norm.weight", ".q_norm.weight", ".k_norm.weight")):  # Qwen3's per-head q/k norms too
        return "norms"
    if ".mlp.gate." in name or name.endswith("gate_correction_bias"):
        return "router"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".mlp." in name:
        return "dense_mlp"
    return "attention"


@dataclass
class DeploymentPlan:
    """What one rank of a FastDeploy deployment holds: parameter bytes by group, and KV cache bytes per token.

    Attributes:
        model_type: ``"ernie4_5_moe"``, ``"ernie4_5"`` or ``"qwen2"``.
        tp: tensor-parallel ranks.
        ep: expert-parallel ranks.
        kv_cache: ``"fp8"`` or ``"none"`` (BF16).
        parameters: parameters of the whole model.
        bytes_per_rank: group (``attention``, ``dense_mlp``, ``shared_experts``, ``routed_experts``, ``router``,
            ``embeddings``, ``lm_head``, ``norms``) -> bytes on the busiest rank.
        total_bytes_per_rank: the sum of ``bytes_per_rank``.
        kv_bytes_per_token_per_rank: KV cache bytes one token takes on a rank, with the ``kv_cache`` chosen.
        kv_bytes_per_token_per_rank_bf16: the same with a BF16 KV cache, for comparison.
        capacity: with a ``device``: the KV-cache tokens a rank gets from FastDeploy's HPU worker after the weights,
            and ``--max-model-len`` / ``--max-num-seqs`` that fit (a :class:`~hpu_fp8_loader.fastdeploy.capacity.KvCapacity`:
            ``kv_tokens``, ``blocks``, ``max_model_len``, ``max_num_seqs``, ``fits``, ``problem``, ...); else ``None``.
        keep_bf16: the groups of linears sized as BF16 (``"dense"``, ``"experts"``), sorted; empty by default.

    Example:
        >>> from hpu_fp8_loader import describe_model, plan_deployment
        >>> plan = plan_deployment(describe_model("qwen2-fp8"), tp=2)
        >>> plan.total_bytes_per_rank, plan.kv_bytes_per_token_per_rank, plan.kv_bytes_per_token_per_rank_bf16
        (264064, 128, 256)
        >>> plan.to_dict()["bytes_per_rank"]["dense_mlp"]
        147480
    """

    model_type: str
    tp: int
    ep: int
    kv_cache: str
    parameters: int  # of the whole model
    bytes_per_rank: dict[str, int] = field(default_factory=dict)  # group -> bytes on the busiest rank
    total_bytes_per_rank: int = 0
    kv_bytes_per_token_per_rank: int = 0
    kv_bytes_per_token_per_rank_bf16: int = 0
    capacity: KvCapacity | None = None
    keep_bf16: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def plan_deployment(
    d: ModelDescriptor,
    tp: int = 1,
    ep: int = 1,
    kv_cache: KvCacheScheme = KvCacheScheme.FP8,
    device: Target | str | None = None,
    max_model_len: int | None = None,
    max_position_embeddings: int | None = None,
    keep_bf16: frozenset[Bf16Group] = frozenset(),
) -> DeploymentPlan:
    """Bytes a rank holds at ``tp`` x ``ep`` (rank 0; every rank holds the same), and its KV cache per token.

    Sizing from config.json alone, before anything is converted or downloaded: the per-rank shapes are the
    mapping's own, so the plan and the loader hook never disagree about what a rank holds.

    Args:
        d: the model's descriptor, from :func:`~hpu_fp8_loader.describe_model`.
        tp: tensor-parallel ranks.
        ep: expert-parallel ranks (MoE models only).
        kv_cache: ``KvCacheScheme.FP8`` / ``"fp8"`` (one byte a KV value) or ``"none"`` (BF16, two bytes).
        device: ``"gaudi2"`` or ``"gaudi3"``: also size the KV cache as FastDeploy's HPU worker does (``capacity``).
        max_model_len: with ``device``, the ``--max-model-len`` to serve (default: suggested from the memory left).
        max_position_embeddings: with ``device``, the model's (config.json's; :func:`describe_model_config`), the
            longest ``max_model_len`` suggested.
        keep_bf16: groups of linears kept in BF16 (``{"experts"}``, ``{"dense"}``): sized as FastDeploy's unquantized
            layers, two bytes a weight and no scales.

    Returns:
        A :class:`~hpu_fp8_loader.DeploymentPlan`.

    Raises:
        ConfigError: ``tp`` or ``ep`` is below 1, or the model cannot be served so (a width ``tp`` does not split
            evenly, fewer KV heads than ranks, expert parallelism for a dense model or one that does not divide the
            experts, MoE layers FastDeploy's ERNIE cannot build); for ``tp``, the message lists the valid sizes;
            ``keep_bf16`` groups convert refuses to keep (experts of a dense model, every linear).
        ValueError: ``kv_cache`` is no KvCacheScheme value.

    Example:
        >>> from hpu_fp8_loader import describe_model, plan_deployment
        >>> plan = plan_deployment(describe_model("ERNIE-4.5-21B-A3B-Paddle"), tp=4, kv_cache="none")
        >>> print(f"{plan.total_bytes_per_rank / 2**30:.1f} GiB a rank, {plan.kv_bytes_per_token_per_rank} KV bytes a token")
    """
    kv_cache = KvCacheScheme(kv_cache)
    if max_model_len is not None and device is None:
        raise ConfigError(f"max_model_len {max_model_len} is given without a device to size it for")
    keep_bf16 = frozenset(Bf16Group(group) for group in keep_bf16)
    check_keep_bf16(d, keep_bf16)  # what convert refuses is never planned
    par = Parallelism(tp, 0, ep, 0)
    check_parallelism(d, par)
    by_group = dict.fromkeys(GROUPS, 0)
    for name, spec in parameter_specs(d, kv_cache, par, keep_bf16).items():
        by_group[parameter_group(name)] += math.prod(spec.shape) * ITEMSIZES[spec.dtype]
    per_token = 2 * d.num_layers * (d.num_kv_heads // tp) * d.head_dim  # K and V values
    kv_bytes = per_token * (1 if kv_cache is KvCacheScheme.FP8 else 2)
    weight_bytes = sum(by_group.values())
    capacity = None
    if device is not None:
        capacity = kv_capacity(weight_bytes, kv_bytes, device, max_model_len, max_position_embeddings)
    return DeploymentPlan(
        model_type=d.model_type,
        tp=tp,
        ep=ep,
        kv_cache=kv_cache.value,
        parameters=d.parameter_count(),
        bytes_per_rank=by_group,
        total_bytes_per_rank=weight_bytes,
        kv_bytes_per_token_per_rank=kv_bytes,
        kv_bytes_per_token_per_rank_bf16=per_token * 2,
        capacity=capacity,
        keep_bf16=sorted(group.value for group in keep_bf16),
    )


def describe_model(model: str | Path, revision: str | None = None) -> ModelDescriptor:
    """The descriptor of MODEL: a directory (its config.json) or a config.json file.

    When the directory also holds the weights, the config's layer and expert counts are checked against
    them, so that a deployment is never planned for a config its files do not back. A BF16 source and an
    hpu-fp8 checkpoint of one model have the same descriptor.

    Args:
        model: a checkpoint directory, or a config.json file (no weights needed), or a Hub repo id (``ORG/NAME``)
            when no such local path exists: only its config.json is downloaded (the weights are checked only when
            the Hugging Face cache already holds them), or found in the cache offline.
        revision: the Hub branch, tag or commit when ``model`` is a repo id (``main`` by default).

    Returns:
        The model's ``ModelDescriptor`` (``model_type``, ``num_layers``, ``num_heads``, ``num_kv_heads``,
        ``head_dim``, ``hidden_size``, ``vocab_size``, ``moe``, ...), what :func:`plan_deployment` takes.

    Raises:
        ConfigError: the file (or the directory's config.json) is missing or not a JSON object, a model key is
            invalid or out of bounds, or the config's layer or expert counts, or its heads and ``head_dim``, disagree
            with the weights.
        UnknownArchitectureError: config.json's model_type is not supported.
        CheckpointNotFoundError: a shard file of the directory is missing; as a repo id: missing, gated or private on
            the Hub, a revision that does not exist, or offline and not in the cache.
        HubError: the Hub cannot be reached or refused the request.
        CheckpointIndexError: the directory's shard index is malformed or disagrees with the shards.
        SafetensorsFormatError: a shard of the directory is truncated or corrupt.

    Example:
        >>> from hpu_fp8_loader import describe_model, plan_deployment
        >>> descriptor = describe_model("ERNIE-4.5-21B-A3B-Paddle/config.json")
        >>> plan_deployment(descriptor, tp=2).total_bytes_per_rank
    """
    return describe_model_config(model, revision)[0]


def describe_model_config(model: str | Path, revision: str | None = None) -> tuple[ModelDescriptor, dict]:
    """:func:`describe_model`, and the config.json it read (for keys the descriptor does not hold, such as
    ``max_position_embeddings``); the same arguments and errors.

    Example:
        >>> descriptor, config = describe_model_config("qwen2-fp8")
        >>> config.get("max_position_embeddings")
    """
    model = local_or_hub(model, revision, CONFIG_PATTERNS)
    if not model.is_dir():
        config = read_json_object(model, ConfigError)
        return describe(config, str(model)), config
    has_weights = (model / INDEX_FILE).is_file() or (model / SINGLE_FILE).is_file()
    config = read_config(model)
    tensors = Checkpoint.open(model).tensors if has_weights else None
    descriptor = describe(config, str(model / CONFIG_FILE), tensors)
    if tensors is not None:
        _check_attention_shapes(descriptor, {name: info.shape for name, info in tensors.items()}, model / CONFIG_FILE)
    return descriptor, config


def _check_attention_shapes(d: ModelDescriptor, shapes: dict[str, tuple[int, ...]], config: Path) -> None:
    """The first layer's attention weights have the shapes config.json's heads and ``head_dim`` imply, in whichever
    layout the files hold them (Paddle names, as a BF16 Paddle source and an hpu-fp8 checkpoint store them, or
    torch's): a wrong ``head_dim`` would otherwise size every KV cache and rank of the plan from a model the files
    are not. The counts are checked by :func:`describe`; the rest of the weights, by convert and validate."""
    implied: dict[str, list[tuple[int, ...]]] = {}  # a name both layouts use (Qwen's o_proj) has both shapes
    for w in d.weights():
        if w.layer == 0 and w.role in (Role.ATTN_QKV, Role.ATTN_O):
            for part in (part for layout in Layout for part in w.source_parts(layout, d.prefix)):
                implied.setdefault(part.name, []).append(part.shape)
    for name, allowed in implied.items():
        held = shapes.get(name)
        if held is not None and held not in allowed:
            raise ConfigError(
                f"{config}: tensor '{name}' has shape {list(held)}, but num_attention_heads {d.num_heads}, "
                f"num_key_value_heads {d.num_kv_heads}, head_dim {d.head_dim} and hidden_size {d.hidden_size} "
                f"imply {' or '.join(str(list(shape)) for shape in allowed)}"
            )

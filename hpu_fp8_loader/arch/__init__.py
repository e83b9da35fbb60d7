"""Architecture descriptors, keyed by config.json ``model_type``."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import UnknownArchitectureError
from .base import LINEAR_ROLES, Layout, ModelDescriptor, MoeConfig, Role, SourcePart, WeightTensor
from .ernie import ernie_dense, ernie_moe
from .qwen2 import qwen2

__all__ = [
    "LINEAR_ROLES",
    "SUPPORTED_MODEL_TYPES",
    "Layout",
    "ModelDescriptor",
    "MoeConfig",
    "Role",
    "SourcePart",
    "WeightTensor",
    "describe",
]

_REGISTRY: dict[str, Callable[[dict], ModelDescriptor]] = {
    "ernie4_5_moe": ernie_moe,
    "ernie4_5": ernie_dense,
    "qwen2": qwen2,
}
SUPPORTED_MODEL_TYPES = tuple(_REGISTRY)


def describe(config: dict) -> ModelDescriptor:
    """The descriptor of the model a config.json describes."""
    model_type = config.get("model_type")
    try:
        build = _REGISTRY[model_type]
    except KeyError:
        raise UnknownArchitectureError(
            f"config.json: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        ) from None
    return build(config)

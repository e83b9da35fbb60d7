"""Architecture descriptors, keyed by config.json ``model_type``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

from hpu_fp8_loader.arch.base import LINEAR_ROLES, Layout, ModelDescriptor, MoeConfig, Role, SourcePart, WeightTensor
from hpu_fp8_loader.arch.config_keys import (
    ErnieConfig,
    ErnieMoeConfig,
    ModelConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    check_against_tensors,
    read_model_config,
)
from hpu_fp8_loader.arch.ernie import ernie_dense, ernie_moe
from hpu_fp8_loader.arch.qwen2 import qwen2
from hpu_fp8_loader.arch.qwen3 import qwen3, qwen3_moe
from hpu_fp8_loader.errors import ConfigError, UnknownArchitectureError

__all__ = [
    "LINEAR_ROLES",
    "SUPPORTED_MODEL_TYPES",
    "Layout",
    "ModelDescriptor",
    "MoeConfig",
    "Role",
    "SourcePart",
    "WeightTensor",
    "config_keys_of",
    "describe",
]

_REGISTRY: dict[str, tuple[type[ModelConfig], Callable[..., ModelDescriptor]]] = {
    "ernie4_5_moe": (ErnieMoeConfig, ernie_moe),
    "ernie4_5": (ErnieConfig, ernie_dense),
    "qwen2": (Qwen2Config, qwen2),
    "qwen3": (Qwen3Config, qwen3),
    "qwen3_moe": (Qwen3MoeConfig, qwen3_moe),
}
SUPPORTED_MODEL_TYPES = tuple(_REGISTRY)


def _architecture(config: dict, source: str) -> tuple[type[ModelConfig], Callable[..., ModelDescriptor]]:
    """The config model and descriptor builder for ``config``'s model_type, which must be a supported string."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"{source}: 'model_type' must be a string such as \"qwen2\", got {json.dumps(model_type, default=str)}")
    if model_type not in _REGISTRY:
        raise UnknownArchitectureError(
            f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return _REGISTRY[model_type]


def config_keys_of(config: dict, source: str = "config.json") -> frozenset[str]:
    """Every config.json key the descriptor of ``config``'s model_type reads."""
    return frozenset(_architecture(config, source)[0].model_fields)


def describe(config: dict, source: str = "config.json", tensors: Iterable[str] | None = None) -> ModelDescriptor:
    """The descriptor of the model a config.json describes.

    Every key read is type- and bounds-checked first (:mod:`.config_keys`); with ``tensors`` (the
    names a checkpoint's files hold) the layer and expert counts are also checked against them, so
    that nothing is enumerated for a config its files do not back.
    """
    model, build = _architecture(config, source)
    parsed = read_model_config(model, config, source)
    if tensors is not None:
        check_against_tensors(parsed, tensors, source)
    return build(parsed)

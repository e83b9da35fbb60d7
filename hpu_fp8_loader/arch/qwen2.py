"""Qwen2 (and the Qwen2.5 releases, which share the architecture): q/k/v biases, no MoE."""

from __future__ import annotations

from hpu_fp8_loader.arch.base import ModelDescriptor
from hpu_fp8_loader.arch.config_keys import Qwen2Config
from hpu_fp8_loader.spec.config import FASTDEPLOY_ARCHITECTURES

__all__ = ["qwen2"]


def qwen2(config: Qwen2Config) -> ModelDescriptor:
    return ModelDescriptor(
        model_type=config.model_type,
        architecture=FASTDEPLOY_ARCHITECTURES[config.model_type],
        prefix="qwen2",
        qkv_bias=True,
        **config.common_sizes(),
    )

"""Qwen2 (and the Qwen2.5 releases, which share the architecture): q/k/v biases, no MoE."""

from __future__ import annotations

from hpu_fp8_loader.arch.base import ModelDescriptor
from hpu_fp8_loader.arch.config_keys import Qwen2Config

__all__ = ["qwen2"]


def qwen2(config: Qwen2Config) -> ModelDescriptor:
    return ModelDescriptor(
        model_type=config.model_type,
        architecture="Qwen2ForCausalLM",
        prefix="qwen2",
        qkv_bias=True,
        **config.common_sizes(),
    )

"""Qwen2 (and the Qwen2.5 releases, which share the architecture): q/k/v biases, no MoE."""

from __future__ import annotations

from .base import ModelDescriptor
from .config_keys import common_sizes, head_dim

__all__ = ["qwen2"]


def qwen2(config: dict) -> ModelDescriptor:
    return ModelDescriptor(
        model_type="qwen2",
        architecture="Qwen2ForCausalLM",
        prefix="qwen2",
        head_dim=head_dim(config),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=True,
        **common_sizes(config),
    )

"""Qwen3 dense (qwen3) and Qwen3-MoE (qwen3_moe), as FastDeploy builds them.

FastDeploy's ``Qwen3Model`` / ``Qwen3MoeModel`` set the prefix to ``model`` (the Hugging Face one), build
qkv_proj without bias and per-layer ``self_attn.q_norm`` / ``k_norm`` RMSNorms over head_dim
(fastdeploy/model_executor/models/qwen3.py@8c3513a4, qwen3moe.py@8c3513a4). Qwen3-MoE routes every layer
through ``num_experts`` experts (the config keys refuse anything else), with a float32 router, no shared
experts and no correction bias.
"""

from __future__ import annotations

from hpu_fp8_loader.arch.base import ModelDescriptor, MoeConfig
from hpu_fp8_loader.arch.config_keys import Qwen3Config, Qwen3MoeConfig
from hpu_fp8_loader.spec.config import FASTDEPLOY_ARCHITECTURES

__all__ = ["qwen3", "qwen3_moe"]

PREFIX = "model"


def _moe(config: Qwen3MoeConfig) -> MoeConfig:
    return MoeConfig(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        num_shared_experts=0,
        start=0,
        end=config.num_hidden_layers - 1,
        interval=1,
        correction_bias=False,
    )


def qwen3(config: Qwen3Config) -> ModelDescriptor:
    return ModelDescriptor(
        model_type=config.model_type,
        architecture=FASTDEPLOY_ARCHITECTURES[config.model_type],
        prefix=PREFIX,
        qkv_bias=False,
        qk_norm=True,
        moe=_moe(config) if isinstance(config, Qwen3MoeConfig) else None,
        **config.common_sizes(),
    )


def qwen3_moe(config: Qwen3MoeConfig) -> ModelDescriptor:
    return qwen3(config)

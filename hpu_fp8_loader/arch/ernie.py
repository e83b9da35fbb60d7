"""ERNIE-4.5: the MoE models (ernie4_5_moe) and the dense ones (ernie4_5)."""

from __future__ import annotations

from hpu_fp8_loader.arch.base import ModelDescriptor, MoeConfig
from hpu_fp8_loader.arch.config_keys import ErnieConfig, ErnieMoeConfig
from hpu_fp8_loader.spec.config import FASTDEPLOY_ARCHITECTURES

__all__ = ["ernie_dense", "ernie_moe"]


def _moe(config: ErnieMoeConfig) -> MoeConfig:
    return MoeConfig(
        num_experts=config.moe_num_experts,
        top_k=config.moe_k,
        intermediate_size=config.moe_intermediate_size,
        num_shared_experts=config.moe_num_shared_experts or 0,
        start=config.moe_layer_start_index,
        end=config.last_moe_layer,
        interval=config.moe_layer_interval,
        correction_bias=config.moe_use_aux_free,
    )


def _ernie(config: ErnieConfig) -> ModelDescriptor:
    return ModelDescriptor(
        model_type=config.model_type,
        architecture=FASTDEPLOY_ARCHITECTURES[config.model_type],
        prefix="ernie",
        qkv_bias=False,
        moe=_moe(config) if isinstance(config, ErnieMoeConfig) else None,
        **config.common_sizes(),
    )


def ernie_moe(config: ErnieMoeConfig) -> ModelDescriptor:
    return _ernie(config)


def ernie_dense(config: ErnieConfig) -> ModelDescriptor:
    return _ernie(config)

"""Spec names and FastDeploy measurement keys (docs/fastdeploy.md section 10, "Measurement mode")."""

from __future__ import annotations

import pytest
from helpers.real_configs import ERNIE_21B, QWEN2

from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.spec import names


@pytest.mark.parametrize(
    ("key", "module"),
    [
        ("ernie.layers.3.self_attn.qkv_proj.activation_scale", "ernie.layers.3.self_attn.qkv_proj"),
        ("ernie.layers.3.self_attn.q_matmul.activation_scale", "ernie.layers.3.self_attn.q"),
        ("ernie.layers.3.self_attn.cachek_matmul.activation_scale", "ernie.layers.3.self_attn.cache_k"),
        ("ernie.layers.3.self_attn.cachev_matmul.activation_scale", "ernie.layers.3.self_attn.cache_v"),
        ("ernie.layers.3.self_attn.s_matmul.activation_scale", "ernie.layers.3.self_attn.s"),
        ("ernie.layers.3.self_attn.o_proj.activation_scale", "ernie.layers.3.self_attn.o_proj"),
        ("ernie.layers.0.mlp.up_gate_proj.activation_scale", "ernie.layers.0.mlp.up_gate_proj"),
        ("ernie.layers.0.mlp.down_proj.activation_scale", "ernie.layers.0.mlp.down_proj"),
        ("ernie.layers.3.mlp.shared_experts.up_gate_proj.activation_scale", "ernie.layers.3.mlp.shared_experts.up_gate_proj"),
        ("ernie.layers.3.mlp.experts.up_gate_proj.activation_scale", "ernie.layers.3.mlp.experts.up_gate_proj"),
        ("ernie.layers.3.mlp.experts.17.down_proj.activation_scale", "ernie.layers.3.mlp.experts.17.down_proj"),
        ("qwen2.layers.5.self_attn.cachek_matmul.activation_scale", "qwen2.layers.5.self_attn.cache_k"),
    ],
)
def test_fastdeploy_keys_map_to_spec_modules_and_back(key, module):
    assert names.module_from_fastdeploy_key(key) == module
    assert names.fastdeploy_key_from_module(module) == key


def test_per_expert_up_gate_input_keys_merge_into_the_shared_input():
    key = "ernie.layers.3.mlp.experts.5.up_gate_proj.activation_scale"
    assert names.module_from_fastdeploy_key(key) == "ernie.layers.3.mlp.experts.up_gate_proj"


@pytest.mark.parametrize(
    "key",
    [
        "ernie.layers.3.self_attn.qkv_proj.weight",
        "ernie.layers.3.self_attn.k_matmul.activation_scale",
        "lm_head.activation_scale",
    ],
)
def test_unknown_fastdeploy_keys_are_refused(key):
    with pytest.raises(ValueError, match="activation_scale|measurement key"):
        names.module_from_fastdeploy_key(key)


@pytest.mark.parametrize("config", [ERNIE_21B, QWEN2["7B"]])
def test_every_act_module_of_a_real_model_has_a_fastdeploy_key(config):
    for module in describe(config).act_modules(attention_fp8=True):
        assert names.module_from_fastdeploy_key(names.fastdeploy_key_from_module(module)) == module


@pytest.mark.parametrize(
    "module",
    [
        "ernie.layers.01.self_attn.qkv_proj",  # would name layer 1 twice
        "ernie.layers.\u0661.self_attn.qkv_proj",  # an Arabic-Indic one: int() reads it as 1
        "ernie.layers.3.mlp.experts.007.down_proj",
        "ernie.layers.3.mlp.experts.\uff17.down_proj",  # a fullwidth 7
    ],
)
def test_layer_and_expert_numbers_are_plain_ascii_decimal(module):
    assert not names.is_act_module(module)
    with pytest.raises(ValueError, match="not a FastDeploy measurement key"):
        names.module_from_fastdeploy_key(f"{module}.activation_scale")

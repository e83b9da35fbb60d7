"""Architecture descriptors on the models' published configurations (tests/helpers/real_configs.py)."""

from __future__ import annotations

import pytest
from helpers.real_configs import ERNIE_03B, ERNIE_21B, ERNIE_300B, QWEN2

from hpu_fp8_loader.arch import Layout, Role, describe
from hpu_fp8_loader.errors import ConfigError, UnknownArchitectureError


def test_ernie_21b_has_21_8b_parameters():
    assert describe(ERNIE_21B).parameter_count() == pytest.approx(21.8e9, abs=0.1e9)


def test_qwen2_7b_has_7_6b_parameters():
    assert describe(QWEN2["7B"]).parameter_count() == pytest.approx(7.6e9, abs=0.1e9)


def test_ernie_300b_parameter_count_matches_the_published_config():
    assert describe(ERNIE_300B).parameter_count() == pytest.approx(298.6e9, abs=0.1e9)


def test_ernie_21b_layer_zero_dense_then_moe_to_the_last_layer():
    d = describe(ERNIE_21B)
    assert d.moe_layers() == list(range(1, 28))
    assert describe(ERNIE_300B).moe_layers() == list(range(3, 54))


def test_ernie_21b_shapes_match_the_published_config():
    shapes = {w.name: w.shape for w in describe(ERNIE_21B).weights()}
    assert shapes["ernie.layers.0.self_attn.qkv_proj.weight"] == (2560, 3584)
    assert shapes["ernie.layers.0.self_attn.o_proj.weight"] == (2560, 2560)
    assert shapes["ernie.layers.0.mlp.up_gate_proj.weight"] == (2560, 24576)
    assert shapes["ernie.layers.1.mlp.experts.63.up_gate_proj.weight"] == (2560, 3072)
    assert shapes["ernie.layers.1.mlp.experts.0.down_proj.weight"] == (1536, 2560)
    assert shapes["ernie.layers.1.mlp.shared_experts.up_gate_proj.weight"] == (2560, 6144)
    assert shapes["ernie.layers.1.mlp.shared_experts.down_proj.weight"] == (3072, 2560)
    assert shapes["ernie.layers.1.mlp.gate.weight"] == (2560, 64)
    assert shapes["ernie.layers.1.mlp.moe_statics.e_score_correction_bias"] == (1, 64)
    assert "lm_head.weight" not in shapes  # tied


def test_ernie_21b_quantized_and_activation_counts_match_the_legacy_layout():
    d = describe(ERNIE_21B)
    assert sum(w.is_linear for w in d.weights()) == 3568
    assert len(d.act_modules(attention_fp8=True)) == 1979


def test_ernie_300b_quantized_and_activation_counts_match_the_legacy_layout():
    d = describe(ERNIE_300B)
    assert sum(w.is_linear for w in d.weights()) == 6642
    assert len(d.act_modules(attention_fp8=True)) == 3645


def test_dense_ernie_takes_head_dim_from_config_when_present():
    d = describe(ERNIE_03B)
    assert d.head_dim == 128 and d.q_width == 2048
    shapes = {w.name: w.shape for w in d.weights()}
    assert shapes["ernie.layers.0.self_attn.qkv_proj.weight"] == (1024, 2560)
    assert shapes["ernie.layers.0.self_attn.o_proj.weight"] == (2048, 1024)


def test_head_dim_null_falls_back_to_hidden_over_heads():
    assert describe({**ERNIE_21B, "head_dim": None}).head_dim == 128
    assert describe({k: v for k, v in ERNIE_21B.items() if k != "head_dim"}).head_dim == 128


@pytest.mark.parametrize(("size", "width"), [("0.5B", 1152), ("1.5B", 2048), ("7B", 4608), ("72B", 10240)])
def test_qwen2_fused_qkv_width_and_bias(size, width):
    shapes = {w.name: w.shape for w in describe(QWEN2[size]).weights()}
    assert shapes["qwen2.layers.0.self_attn.qkv_proj.weight"][1] == width
    assert shapes["qwen2.layers.0.self_attn.qkv_proj.bias"] == (width,)
    assert ("lm_head.weight" in shapes) == (not QWEN2[size]["tie_word_embeddings"])


def test_moe_layers_follow_fastdeploy_rule_not_transformers_for_interval_two():
    # FastDeploy: (L - start) % interval == 0; transformers: (L + 1) % interval == 0. They differ here.
    d = describe(
        {**ERNIE_21B, "num_hidden_layers": 8, "moe_layer_start_index": 2, "moe_layer_end_index": 7, "moe_layer_interval": 2}
    )
    assert d.moe_layers() == [2, 4, 6]
    assert [i for i in range(8) if 2 <= i <= 7 and (i + 1) % 2 == 0] == [3, 5, 7]


def test_moe_end_index_minus_one_means_last_layer():
    assert describe({**ERNIE_21B, "moe_layer_end_index": -1}).moe_layers()[-1] == 27


def test_torch_layout_splits_and_transposes():
    d = describe(QWEN2["7B"])
    qkv = next(w for w in d.weights() if w.role is Role.ATTN_QKV)
    parts = qkv.source_parts(Layout.TORCH, d.prefix)
    assert [(p.name, p.shape, p.transpose) for p in parts] == [
        ("model.layers.0.self_attn.q_proj.weight", (3584, 3584), True),
        ("model.layers.0.self_attn.k_proj.weight", (512, 3584), True),
        ("model.layers.0.self_attn.v_proj.weight", (512, 3584), True),
    ]
    lm_head = next(w for w in d.weights() if w.role is Role.LM_HEAD)
    assert lm_head.source_parts(Layout.TORCH, d.prefix)[0].shape == (152064, 3584)
    router = next(w for w in describe(ERNIE_21B).weights() if w.role is Role.ROUTER)
    part = router.source_parts(Layout.TORCH, "ernie")[0]
    assert (part.name, part.shape, part.transpose) == ("model.layers.1.mlp.gate.weight", (64, 2560), True)


def test_gate_comes_before_up():
    w = next(w for w in describe(ERNIE_21B).weights() if w.role is Role.EXPERT_UP_GATE)
    assert [p.name.rsplit(".", 2)[-2] for p in w.source_parts(Layout.TORCH, "ernie")] == ["gate_proj", "up_proj"]


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(UnknownArchitectureError, match="'llama'.*ernie4_5_moe, ernie4_5, qwen2"):
        describe({"model_type": "llama"})


def test_missing_key_is_named():
    with pytest.raises(ConfigError, match="'moe_k'"):
        describe({k: v for k, v in ERNIE_21B.items() if k != "moe_k"})


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("tie_word_embeddings", "false", "'tie_word_embeddings' should be a valid boolean, got \"false\""),
        ("num_key_value_heads", 4.0, "'num_key_value_heads' should be a valid integer, got 4.0"),
        ("moe_num_experts", "64", "'moe_num_experts' should be a valid integer, got \"64\""),
        ("moe_use_aux_free", 1, "'moe_use_aux_free' should be a valid boolean, got 1"),
        ("num_hidden_layers", 10**8, "'num_hidden_layers' should be less than or equal to 1024, got 100000000"),
        ("moe_layer_interval", 0, "'moe_layer_interval' should be greater than or equal to 1, got 0"),
    ],
)
def test_config_values_of_the_wrong_type_or_size_are_named_errors(key, value, message):
    """Never Python truthiness or int(): bool("false") is True, and int(4.0) hid a config written by hand."""
    with pytest.raises(ConfigError) as caught:
        describe({**ERNIE_21B, key: value}, "ernie/config.json")
    assert str(caught.value) == f"ernie/config.json: {message}"


def test_the_bound_on_layers_times_experts_names_both_keys():
    with pytest.raises(ConfigError, match="num_hidden_layers 1024 x moe_num_experts 1024 is more than 131,072"):
        describe({**ERNIE_21B, "num_hidden_layers": 1024, "moe_layer_end_index": -1, "moe_num_experts": 1024})


def test_a_list_model_type_is_a_named_error_not_a_type_error():
    with pytest.raises(ConfigError, match="'model_type' must be a string"):
        describe({**ERNIE_21B, "model_type": ["ernie4_5_moe"]})


def test_layer_and_expert_counts_are_checked_against_the_tensors_present(source_factory):
    from hpu_fp8_loader.io.checkpoint import Checkpoint

    checkpoint = Checkpoint.open(source_factory())
    assert describe(checkpoint.config, tensors=checkpoint.tensors).num_layers == 3
    extra = [*checkpoint.tensors, "ernie.layers.3.input_layernorm.weight"]
    with pytest.raises(ConfigError, match="'num_hidden_layers' is 3, but the checkpoint's tensors hold layers 0..3"):
        describe(checkpoint.config, tensors=extra)
    with pytest.raises(ConfigError, match="'moe_num_experts' is 8, but the checkpoint's tensors hold experts 0..3"):
        describe({**checkpoint.config, "moe_num_experts": 8}, tensors=checkpoint.tensors)

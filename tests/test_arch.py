"""Architecture descriptors on the models' published configurations (tests/helpers/real_configs.py)."""

from __future__ import annotations

import pytest
from helpers.real_configs import ERNIE_03B, ERNIE_21B, ERNIE_300B, QWEN2, QWEN3, QWEN3_MOE

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


def _active_parameters(d) -> float:
    """Parameters a token runs through: everything but the routed experts, plus top_k of them."""
    total = d.parameter_count()
    if d.moe is None:
        return total
    routed = sum(w.shape[0] * w.shape[1] for w in d.weights() if w.expert is not None)
    return total - routed + routed * d.moe.top_k / d.moe.num_experts


# (config, total, active, non-embedding) in billions, as the Qwen3 model cards state them
QWEN3_SIZES = [
    (QWEN3["0.6B"], 0.6, 0.6, 0.44),
    (QWEN3["8B"], 8.2, 8.2, 6.95),
    (QWEN3["32B"], 32.8, 32.8, 31.2),
    (QWEN3_MOE["30B-A3B"], 30.5, 3.3, 29.9),
    (QWEN3_MOE["235B-A22B"], 235.0, 22.0, 234.0),
]


@pytest.mark.parametrize(("config", "total", "active", "non_embedding"), QWEN3_SIZES)
def test_qwen3_parameter_counts_match_the_model_cards(config, total, active, non_embedding):
    d = describe(config)
    embeddings = d.vocab_size * d.hidden_size * (1 if d.tie_word_embeddings else 2)
    assert d.parameter_count() / 1e9 == pytest.approx(total, abs=0.1 if total < 100 else 0.5)
    assert _active_parameters(d) / 1e9 == pytest.approx(active, abs=0.1 if active < 10 else 0.5)
    assert (d.parameter_count() - embeddings) / 1e9 == pytest.approx(non_embedding, abs=0.05 if total < 100 else 0.5)


def test_qwen3_names_q_and_k_norms_under_prefix_model_and_no_qkv_bias():
    d = describe(QWEN3["8B"])
    assert (d.prefix, d.architecture, d.qkv_bias, d.qk_norm) == ("model", "Qwen3ForCausalLM", False, True)
    shapes = {w.name: (w.role, w.shape) for w in d.weights()}
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (Role.ATTN_QKV, (4096, (32 + 2 * 8) * 128))
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (Role.NORM, (128,))
    assert shapes["model.layers.35.self_attn.k_norm.weight"] == (Role.NORM, (128,))
    assert "model.layers.0.self_attn.qkv_proj.bias" not in shapes
    assert shapes["lm_head.weight"] == (Role.LM_HEAD, (4096, 151936))
    norm = next(w for w in d.weights() if w.name.endswith("q_norm.weight"))
    assert norm.source_parts(Layout.TORCH, d.prefix)[0].name == "model.layers.0.self_attn.q_norm.weight"


def test_qwen3_0_6b_head_dim_is_not_hidden_over_heads_and_embeddings_are_tied():
    d = describe(QWEN3["0.6B"])
    assert d.head_dim == 128 != d.hidden_size // d.num_heads
    shapes = {w.name: w.shape for w in d.weights()}
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (1024, (16 + 2 * 8) * 128)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (16 * 128, 1024)  # o_proj input: heads x head_dim
    assert "lm_head.weight" not in shapes


def test_qwen3_moe_30b_experts_router_and_no_shared_experts():
    d = describe(QWEN3_MOE["30B-A3B"])
    assert d.architecture == "Qwen3MoeForCausalLM" and d.moe_layers() == list(range(48))
    shapes = {w.name: (w.role, w.shape) for w in d.weights()}
    assert shapes["model.layers.0.mlp.gate.weight"] == (Role.ROUTER, (2048, 128))
    assert shapes["model.layers.47.mlp.experts.127.up_gate_proj.weight"] == (Role.EXPERT_UP_GATE, (2048, 2 * 768))
    assert shapes["model.layers.0.mlp.experts.0.down_proj.weight"] == (Role.EXPERT_DOWN, (768, 2048))
    assert not any("shared_experts" in n or "e_score_correction_bias" in n or ".mlp.up_gate_proj" in n for n in shapes)
    router = next(w for w in d.weights() if w.role is Role.ROUTER)
    assert router.source_dtype == "F32"
    gate, up = next(w for w in d.weights() if w.role is Role.EXPERT_UP_GATE).source_parts(Layout.TORCH, d.prefix)
    assert (gate.name, gate.shape, up.name) == (
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        (768, 2048),
        "model.layers.0.mlp.experts.0.up_proj.weight",
    )


def test_qwen3_moe_act_points_per_layer():
    d = describe(QWEN3_MOE["30B-A3B"])
    # 4 attention points, qkv, o_proj, the shared expert input, one down_proj input per expert
    assert len(d.act_modules(attention_fp8=True)) == 48 * (4 + 2 + 1 + 128)
    assert sum(w.is_linear for w in d.weights()) == 48 * (2 + 2 * 128)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"norm_topk_prob": False}, "norm_topk_prob is false .*fused_moe_hpu_backend.py"),
        ({"norm_topk_prob": None}, "'norm_topk_prob' should be a valid boolean"),
        ({"mlp_only_layers": [0]}, r"mlp_only_layers is \[0\]: layers with a dense MLP.*convert_model"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step is 2: layers with a dense MLP"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings is true, .* never ties lm_head"),
        ({"num_experts_per_tok": 129}, "num_experts_per_tok 129 is more than num_experts 128"),
        ({"attention_bias": True}, "attention_bias is true.*with_bias=False"),
        ({"num_experts": "128"}, "'num_experts' should be a valid integer"),
    ],
)
def test_qwen3_moe_configs_fastdeploys_hpu_path_cannot_run_are_refused_naming_the_key(change, message):
    with pytest.raises(ConfigError, match=f"^q/config.json: {message}"):
        describe({**QWEN3_MOE["30B-A3B"], **change}, "q/config.json")


def test_qwen3_moe_without_norm_topk_prob_is_refused_as_transformers_reads_it_false():
    config = {k: v for k, v in QWEN3_MOE["30B-A3B"].items() if k != "norm_topk_prob"}
    with pytest.raises(ConfigError, match="norm_topk_prob is false \\(transformers' default when absent\\)"):
        describe(config)


def test_qwen3_needs_an_explicit_head_dim():
    """transformers defaults an absent head_dim to 128, FastDeploy to hidden/heads: which one the model means is unknown."""
    with pytest.raises(ConfigError, match="'head_dim' is missing"):
        describe({k: v for k, v in QWEN3["8B"].items() if k != "head_dim"})


def test_qwen3_moe_expert_count_is_checked_against_the_tensors():
    config = {**QWEN3_MOE["30B-A3B"], "num_hidden_layers": 1}
    held = [w.name for w in describe(config).weights() if w.expert is None or w.expert < 64]
    with pytest.raises(ConfigError, match="'num_experts' is 128, but the checkpoint's tensors hold experts 0..63"):
        describe(config, tensors=held)


def test_qwen3_moe_expert_count_spelt_as_transformers_5_saves_it_is_named():
    config = {k: v for k, v in QWEN3_MOE["30B-A3B"].items() if k != "num_experts"}
    with pytest.raises(ConfigError, match="'num_experts' is missing: this config spells it num_local_experts"):
        describe({**config, "num_local_experts": 128})

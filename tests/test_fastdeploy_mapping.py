"""The FastDeploy mapping against docs/fastdeploy.md: names (section 11), shapes and dtypes (section 5
"Linear layers" and "MoE", section 6 "Attention scales"), formulas, and the tensor/expert-parallel
splits (section 5, "Tensor-parallel splits") -- checked by reassembling every rank's share and
comparing with the spec checkpoint."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.errors import ConfigError, HpuFp8Error
from hpu_fp8_loader.fastdeploy.mapping import Parallelism, check_parallelism, map_rank, parameter_specs, valid_tp_sizes
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.io.safetensors_file import dtype_name
from hpu_fp8_loader.spec.config import KvCacheScheme, parse_quantization_config


def mapped(root, par: Parallelism) -> dict[str, np.ndarray]:
    """Every parameter of a rank, stacked MoE parameters assembled, checked against parameter_specs."""
    checkpoint = Checkpoint.open(root)
    qc = parse_quantization_config(checkpoint.config)
    d = describe(checkpoint.config)
    specs = parameter_specs(d, qc.kv_cache_scheme, par)
    out: dict[str, np.ndarray] = {}
    for piece in map_rank(checkpoint, qc, d, par):
        spec = specs[piece.name]
        assert dtype_name(piece.array.dtype) == spec.dtype, piece.name
        if piece.expert is None:
            assert piece.name not in out, f"{piece.name} mapped twice"
            assert piece.array.shape == spec.shape, piece.name
            out[piece.name] = piece.array
        else:
            stacked = out.setdefault(piece.name, np.zeros(spec.shape, piece.array.dtype))
            stacked[piece.expert] = piece.array
    assert set(out) == set(specs)  # every parameter filled, nothing else
    return out


def bf16(x) -> np.ndarray:
    return np.atleast_1d(np.asarray(x, np.float32)).astype(ml_dtypes.bfloat16)


def f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


@pytest.mark.parametrize("preset", ["ernie-moe-tiny", "ernie-dense-tiny", "qwen2-tiny", "qwen3-tiny", "qwen3-moe-tiny"])
@pytest.mark.parametrize("kv_cache", ["fp8", "none"])
def test_every_rank_fills_exactly_its_parameters(spec_factory, preset, kv_cache):
    root = spec_factory(preset, kv_cache)
    for tp in valid_tp_sizes(describe(Checkpoint.open(root).config)):
        for rank in range(tp):
            params = mapped(root, Parallelism(tp, rank))
            assert any(".attn.cache_k_scale" in n for n in params) == (kv_cache == "fp8")


def test_linear_values_follow_the_contract_formulas(spec_factory):
    spec = Checkpoint.open(spec_factory())
    params = mapped(spec_factory(), Parallelism())
    for module in (
        "ernie.layers.0.self_attn.qkv_proj",
        "ernie.layers.0.mlp.down_proj",
        "ernie.layers.2.mlp.shared_experts.up_gate_proj",
    ):
        amax = spec.get(f"{module}.act_amax")[0]
        np.testing.assert_array_equal(params[f"{module}.weight"].view(np.uint8), spec.get(f"{module}.weight").view(np.uint8))
        assert f32(params[f"{module}.weight_scale"])[0] == spec.get(f"{module}.weight_scale")[0]  # bf16-exact: no loss
        assert params[f"{module}.act_scale"][0] == bf16(np.float32(240) / amax)[0]  # a multiplier (docs/fastdeploy.md section 5)
        assert params[f"{module}.act_scale_inv"][0] == bf16(amax / np.float32(240))[0]  # a descale


def test_moe_values_follow_the_contract_formulas(spec_factory):
    spec = Checkpoint.open(spec_factory())
    params = mapped(spec_factory(), Parallelism())
    base = "ernie.layers.1.mlp.experts"
    shared = spec.get(f"{base}.up_gate_proj.act_amax")[0]
    experts = [spec.get(f"{base}.{e}.down_proj.act_amax")[0] for e in range(4)]
    assert params[f"{base}.up_gate_proj_in_scale"][0] == bf16(np.float32(240) / shared)[0]  # multiplier, max over experts
    np.testing.assert_array_equal(
        params[f"{base}.down_proj_in_scale"], bf16(np.array(experts, np.float32)[:, None] / np.float32(240))
    )
    assert params[f"{base}.down_proj_in_scale"].shape == (
        4,
        1,
    )  # [E, 1], not pre-packed to [E, 1, 64] (docs/fastdeploy.md section 5)
    for e in range(4):
        np.testing.assert_array_equal(
            params[f"{base}.up_gate_proj_weight"][e].view(np.uint8), spec.get(f"{base}.{e}.up_gate_proj.weight").view(np.uint8)
        )
        np.testing.assert_array_equal(
            f32(params[f"{base}.up_gate_proj_weight_scale"][e]), spec.get(f"{base}.{e}.up_gate_proj.weight_scale")
        )
        np.testing.assert_array_equal(
            f32(params[f"{base}.down_proj_weight_scale"][e]), spec.get(f"{base}.{e}.down_proj.weight_scale")
        )
    np.testing.assert_array_equal(params["ernie.layers.1.mlp.gate.weight"], spec.get("ernie.layers.1.mlp.gate.weight"))
    np.testing.assert_array_equal(
        params[f"{base}.gate_correction_bias"], spec.get("ernie.layers.1.mlp.moe_statics.e_score_correction_bias")
    )


def test_attention_scalars_follow_the_contract_formulas(spec_factory):
    spec = Checkpoint.open(spec_factory("qwen2-tiny"))
    params = mapped(spec_factory("qwen2-tiny"), Parallelism())
    head_dim = 16  # qwen2-tiny: hidden 64 / 4 heads
    b = np.float32(240)
    amax = {p: spec.get(f"qwen2.layers.1.self_attn.{p}.act_amax")[0] for p in ("cache_k", "cache_v", "q", "s")}
    attn = {k.rsplit(".", 1)[1]: v[0] for k, v in params.items() if k.startswith("qwen2.layers.1.self_attn.attn.")}
    assert {v.dtype for v in attn.values()} == {np.dtype(np.float32)}
    assert attn["cache_k_scale"] == b / amax["cache_k"] and attn["cache_k_out_scale"] == amax["cache_k"] / b
    assert attn["cache_v_scale"] == b / amax["cache_v"] and attn["cache_v_out_scale"] == amax["cache_v"] / b
    assert attn["q_scale"] == b / amax["q"] and attn["q_out_scale"] == amax["q"] / b
    assert attn["q_scaling_scale"] == pytest.approx(240 / (amax["q"] * head_dim**-0.5), rel=1e-6)
    assert attn["q_scaling_out_scale"] == pytest.approx(amax["q"] * head_dim**-0.5 / 240, rel=1e-6)
    assert attn["s_scale"] == 240 and attn["s_out_scale"] == np.float32(1) / b  # s amax is 1


def _concat(parts):
    return np.concatenate(parts, axis=-1)


def test_tensor_parallel_shares_reassemble_the_checkpoint(spec_factory):
    root, tp = spec_factory(), 2  # the tiny models' 2 KV heads allow TP 1 and 2 on HPU
    spec = Checkpoint.open(root)
    d = describe(spec.config)
    ranks = [mapped(root, Parallelism(tp, r)) for r in range(tp)]
    u8 = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    # row-parallel: o_proj and down_proj split along the input axis
    for name in ("ernie.layers.0.self_attn.o_proj.weight", "ernie.layers.0.mlp.down_proj.weight"):
        np.testing.assert_array_equal(np.concatenate([u8(r[name]) for r in ranks]), u8(spec.get(name)))
    # paired column split of gate|up: each half split on its own
    full = u8(spec.get("ernie.layers.0.mlp.up_gate_proj.weight"))
    half = full.shape[1] // 2
    np.testing.assert_array_equal(
        _concat([u8(r["ernie.layers.0.mlp.up_gate_proj.weight"])[:, : half // tp] for r in ranks]), full[:, :half]
    )
    np.testing.assert_array_equal(
        _concat([u8(r["ernie.layers.0.mlp.up_gate_proj.weight"])[:, half // tp :] for r in ranks]), full[:, half:]
    )
    # GQA q|k|v: q heads split; KV heads split, num_key_value_heads // tp a rank
    qkv = u8(spec.get("ernie.layers.0.self_attn.qkv_proj.weight"))
    q_width, kv_width, hd = d.q_width, d.kv_width, d.head_dim
    q_rank = q_width // tp
    np.testing.assert_array_equal(
        _concat([u8(r["ernie.layers.0.self_attn.qkv_proj.weight"])[:, :q_rank] for r in ranks]), qkv[:, :q_width]
    )
    kv_rank = d.num_kv_heads // tp * hd
    assert kv_rank > 0
    for r, params in enumerate(ranks):
        k = u8(params["ernie.layers.0.self_attn.qkv_proj.weight"])[:, q_rank:]
        k, v = k[:, :kv_rank], k[:, kv_rank:]
        assert v.shape[1] == kv_rank
        np.testing.assert_array_equal(k, qkv[:, q_width + r * kv_rank : q_width + (r + 1) * kv_rank])
        np.testing.assert_array_equal(v, qkv[:, q_width + kv_width + r * kv_rank : q_width + kv_width + (r + 1) * kv_rank])
    # experts: paired split of weights and of their channel-wise scales, down rows split, down scales whole
    base = "ernie.layers.2.mlp.experts"
    up = u8(spec.get(f"{base}.3.up_gate_proj.weight"))
    scale = spec.get(f"{base}.3.up_gate_proj.weight_scale")
    inter = up.shape[1] // 2
    gate_parts = [u8(r[f"{base}.up_gate_proj_weight"][3])[:, : inter // tp] for r in ranks]
    np.testing.assert_array_equal(_concat(gate_parts), up[:, :inter])
    gate_scales = [f32(r[f"{base}.up_gate_proj_weight_scale"][3])[: inter // tp] for r in ranks]
    up_scales = [f32(r[f"{base}.up_gate_proj_weight_scale"][3])[inter // tp :] for r in ranks]
    np.testing.assert_array_equal(np.concatenate(gate_scales), scale[:inter])
    np.testing.assert_array_equal(np.concatenate(up_scales), scale[inter:])
    contiguous = scale[
        : 2 * inter // tp
    ]  # 404cf0ec's rule (docs/fastdeploy.md section 5): would pair rank 0's weights with gate-only scales
    assert not np.array_equal(f32(ranks[0][f"{base}.up_gate_proj_weight_scale"][3]), contiguous)
    np.testing.assert_array_equal(
        np.concatenate([u8(r[f"{base}.down_proj_weight"][3]) for r in ranks]), u8(spec.get(f"{base}.3.down_proj.weight"))
    )
    for r in ranks:
        np.testing.assert_array_equal(f32(r[f"{base}.down_proj_weight_scale"][3]), spec.get(f"{base}.3.down_proj.weight_scale"))
        assert r[f"{base}.up_gate_proj_in_scale"][0] == ranks[0][f"{base}.up_gate_proj_in_scale"][0]  # per-tensor: replicated
    # vocabulary: embedding rows, untied lm_head columns
    np.testing.assert_array_equal(
        np.concatenate([u8(r["ernie.embed_tokens.embeddings.weight"]) for r in ranks]), u8(spec.get("ernie.embed_tokens.weight"))
    )


def test_qwen2_bias_and_untied_lm_head_split_like_their_weights(spec_factory):
    root = spec_factory("qwen2-tiny")
    spec = Checkpoint.open(root)
    ranks = [mapped(root, Parallelism(2, r)) for r in range(2)]
    bias = spec.get("qwen2.layers.0.self_attn.qkv_proj.bias").view(np.uint16)
    q = 32  # 2 of 4 heads x 16
    np.testing.assert_array_equal(
        np.concatenate([r["qwen2.layers.0.self_attn.qkv_proj.bias"].view(np.uint16)[:q] for r in ranks]), bias[:64]
    )
    np.testing.assert_array_equal(
        np.concatenate([r["lm_head.linear.weight"].view(np.uint16) for r in ranks], axis=1),
        spec.get("lm_head.weight").view(np.uint16),
    )


def test_expert_parallelism_gives_each_rank_whole_experts(spec_factory):
    spec = Checkpoint.open(spec_factory())
    for ep_rank in range(2):
        params = mapped(spec_factory(), Parallelism(2, 0, 2, ep_rank))
        stacked = params["ernie.layers.1.mlp.experts.up_gate_proj_weight"]
        assert stacked.shape == (2, 64, 64)  # 2 local experts, intermediate not split under EP
        for i in range(2):
            e = 2 * ep_rank + i
            np.testing.assert_array_equal(
                stacked[i].view(np.uint8), spec.get(f"ernie.layers.1.mlp.experts.{e}.up_gate_proj.weight").view(np.uint8)
            )
        assert params["ernie.layers.1.mlp.gate.weight"].shape == (64, 4)  # the router sees every expert


@pytest.mark.parametrize(
    ("par", "message"),
    [
        (Parallelism(4, 0), "tensor parallelism 4 cannot serve.*num_key_value_heads // tp = 0 KV heads.*valid: 1, 2$"),
        (Parallelism(8, 0), "tensor parallelism 8 cannot serve.*valid: 1, 2$"),
        (Parallelism(3, 0), "tensor parallelism 3 cannot serve.*valid: 1, 2$"),
        (Parallelism(1, 0, 3, 0), "expert parallelism 3 does not divide 4 experts"),
    ],
)
def test_impossible_parallelism_is_refused_with_the_valid_choices(spec_factory, par, message):
    with pytest.raises(ConfigError, match=message):
        mapped(spec_factory(), par)


def test_rank_out_of_range_and_gaudi3_range_are_refused(tmp_path, spec_factory):
    with pytest.raises(ConfigError, match="rank 2 is not in 0..1"):
        Parallelism(2, 2)
    spec = Checkpoint.open(spec_factory())
    qc = parse_quantization_config(spec.config).model_copy(update={"fp8_max": 448.0, "target": "gaudi3"})
    with pytest.raises(HpuFp8Error, match="retarget --target gaudi2"):
        next(map_rank(spec, qc, describe(spec.config), Parallelism()))


def test_valid_tp_sizes_of_the_real_models():
    from helpers.real_configs import ERNIE_21B, ERNIE_300B, QWEN2

    assert valid_tp_sizes(describe(ERNIE_21B), 8) == [1, 2, 4]
    assert valid_tp_sizes(describe(ERNIE_300B), 8) == [1, 2, 4, 8]
    assert valid_tp_sizes(describe(QWEN2["7B"]), 8) == [1, 2, 4]
    assert valid_tp_sizes(describe(QWEN2["1.5B"]), 8) == [1, 2]  # 2 KV heads: TP 4 would leave a rank none
    with pytest.raises(ConfigError, match=r"does not split this model's heads and widths evenly \(64 heads, 8 KV heads\)"):
        check_parallelism(describe(ERNIE_300B), Parallelism(3, 0))


def test_a_tied_lm_head_is_each_ranks_embedding_rows_transposed(spec_factory):
    """FastDeploy builds a column-parallel lm_head tied or not and, tied, fills it from the rank's embedding
    shard transposed (docs/fastdeploy.md, "lm_head"); an untied one comes from the checkpoint's lm_head."""
    tied = spec_factory()  # ernie-moe-tiny ties its embeddings
    d = describe(Checkpoint.open(tied).config)
    assert d.tie_word_embeddings
    for rank in range(2):
        params = mapped(tied, Parallelism(2, rank))
        embedding = params["ernie.embed_tokens.embeddings.weight"]
        assert params["lm_head.linear.weight"].shape == embedding.shape[::-1] == (d.hidden_size, d.vocab_size // 2)
        np.testing.assert_array_equal(params["lm_head.linear.weight"].view(np.uint16), embedding.T.view(np.uint16))
    untied = spec_factory("qwen2-tiny")
    spec = Checkpoint.open(untied)
    params = mapped(untied, Parallelism(2, 1))
    np.testing.assert_array_equal(
        params["lm_head.linear.weight"].view(np.uint16),
        spec.get("lm_head.weight")[:, spec.get("lm_head.weight").shape[1] // 2 :].view(np.uint16),
    )


def test_moe_layers_fastdeploy_would_build_differently_are_refused():
    """FastDeploy's ERNIE builds MoE at every layer >= moe_layer_start_index, ignoring the end index and interval."""
    from helpers.real_configs import ERNIE_21B

    check_parallelism(describe(ERNIE_21B), Parallelism())  # MoE from layer 1 to the last: served
    for key, value, layers in (("moe_layer_interval", 2, r"\[1, 3, 5"), ("moe_layer_end_index", 20, "layers 1-20")):
        with pytest.raises(ConfigError, match=f"every layer from moe_layer_start_index 1 on \\(layers 1-27\\).*{layers}"):
            check_parallelism(describe({**ERNIE_21B, key: value}), Parallelism())


def test_converted_configs_spell_out_the_keys_fastdeploy_defaults_differently(spec_factory):
    """FastDeploy reads an absent tie_word_embeddings / moe_use_aux_free as false and moe_layer_start_index as 0."""
    config = Checkpoint.open(spec_factory()).config
    d = describe(config)
    assert config["tie_word_embeddings"] is d.tie_word_embeddings is True
    assert config["moe_layer_start_index"] == d.moe.start and config["moe_use_aux_free"] is d.moe.correction_bias


# ----------------------------------------------------------------------------- Qwen3 and Qwen3-MoE (docs section 14)


def test_qwen3_moe_parameters_are_those_fastdeploys_classes_create():
    """Qwen3-30B-A3B at TP 4, each shape derived by hand from FastDeploy's code at 8c3513a4 (docs/fastdeploy.md
    section 14): Qwen3Attention (no qkv bias, o_proj input head_dim * heads, q/k norms [head_dim]), Qwen3MoeBlock (a
    float32 [H, E] gate, FusedMoE with moe_intermediate_size // tp), no correction bias and no shared experts."""
    from helpers.real_configs import QWEN3_MOE

    specs = parameter_specs(describe(QWEN3_MOE["30B-A3B"]), KvCacheScheme.FP8, Parallelism(4, 1))
    layer = "model.layers.47"
    hd, heads, kv, h, e, inter = 128, 32 // 4, 4 // 4, 2048, 128, 768 // 4
    expected = {
        f"{layer}.self_attn.q_norm.weight": ("BF16", (hd,)),
        f"{layer}.self_attn.k_norm.weight": ("BF16", (hd,)),
        f"{layer}.self_attn.qkv_proj.weight": ("F8_E4M3", (h, (heads + 2 * kv) * hd)),
        f"{layer}.self_attn.o_proj.weight": ("F8_E4M3", (heads * hd, h)),
        f"{layer}.mlp.gate.weight": ("F32", (h, e)),
        f"{layer}.mlp.experts.up_gate_proj_weight": ("F8_E4M3", (e, h, 2 * inter)),
        f"{layer}.mlp.experts.down_proj_weight": ("F8_E4M3", (e, inter, h)),
        f"{layer}.mlp.experts.up_gate_proj_weight_scale": ("BF16", (e, 2 * inter)),
        f"{layer}.mlp.experts.down_proj_weight_scale": ("BF16", (e, h)),
        f"{layer}.mlp.experts.up_gate_proj_in_scale": ("BF16", (1,)),
        f"{layer}.mlp.experts.down_proj_in_scale": ("BF16", (e, 1)),
        "model.embed_tokens.embeddings.weight": ("BF16", (151936 // 4, h)),
        "lm_head.linear.weight": ("BF16", (h, 151936 // 4)),
        "model.norm.weight": ("BF16", (h,)),
    }
    assert {name: (specs[name].dtype, specs[name].shape) for name in expected} == expected
    built = set(specs)
    assert not any(n.endswith(("qkv_proj.bias", "gate_correction_bias")) or ".shared_experts." in n for n in built)
    assert not any(n.endswith(".mlp.up_gate_proj.weight") for n in built)  # every layer MoE, no dense MLP
    # expert parallelism: FusedMoE forces the experts' TP to 1 and gives each rank E // ep whole experts
    ep = parameter_specs(describe(QWEN3_MOE["30B-A3B"]), KvCacheScheme.FP8, Parallelism(1, 0, 4, 3))
    assert ep[f"{layer}.mlp.experts.up_gate_proj_weight"].shape == (e // 4, h, 2 * 768)


def test_valid_tp_sizes_of_the_real_qwen3_models_stop_at_their_kv_heads():
    from helpers.real_configs import QWEN3, QWEN3_MOE

    for size in ("0.6B", "8B", "32B"):
        assert valid_tp_sizes(describe(QWEN3[size]), 16) == [1, 2, 4, 8]
    for size in ("30B-A3B", "235B-A22B"):
        assert valid_tp_sizes(describe(QWEN3_MOE[size]), 16) == [1, 2, 4]
    with pytest.raises(
        ConfigError, match=r"tensor parallelism 8 cannot serve this qwen3_moe model: .*num_key_value_heads // tp = 0"
    ):
        check_parallelism(describe(QWEN3_MOE["30B-A3B"]), Parallelism(8, 0))


def test_qwen3_tied_lm_head_is_built_from_the_embedding_like_ernies():
    from helpers.real_configs import QWEN3

    specs = parameter_specs(describe(QWEN3["0.6B"]), KvCacheScheme.FP8, Parallelism(2, 0))
    assert specs["lm_head.linear.weight"].shape == (1024, 151936 // 2)  # Qwen3ForCausalLM ties it from the embedding
    assert "lm_head.weight" not in specs and specs["model.layers.0.self_attn.o_proj.weight"].shape == (16 * 128 // 2, 1024)


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_qwen3_q_k_norms_are_whole_on_every_rank_while_heads_split(spec_factory, preset):
    root, tp = spec_factory(preset), 2
    spec = Checkpoint.open(root)
    d = describe(spec.config)
    assert d.head_dim * d.num_heads != d.hidden_size  # the preset's head_dim is not hidden / heads: o_proj must use it
    ranks = [mapped(root, Parallelism(tp, r)) for r in range(tp)]
    u8 = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    for layer in range(d.num_layers):
        for norm in ("q_norm", "k_norm"):
            name = f"model.layers.{layer}.self_attn.{norm}.weight"
            for params in ranks:
                np.testing.assert_array_equal(u8(params[name]), u8(spec.get(name)))
        o_proj = f"model.layers.{layer}.self_attn.o_proj.weight"
        assert ranks[0][o_proj].shape == (d.num_heads // tp * d.head_dim, d.hidden_size)
        np.testing.assert_array_equal(np.concatenate([u8(r[o_proj]) for r in ranks]), u8(spec.get(o_proj)))
        qkv = f"model.layers.{layer}.self_attn.qkv_proj.weight"
        assert ranks[0][qkv].shape[1] == (d.num_heads + 2 * d.num_kv_heads) // tp * d.head_dim
    if d.moe:
        assert not any("gate_correction_bias" in name or "shared_experts" in name for name in ranks[0])
        gate = "model.layers.0.mlp.gate.weight"
        assert ranks[0][gate].dtype == np.float32 and ranks[1][gate].shape == (d.hidden_size, d.moe.num_experts)


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_cli_map_writes_exactly_what_each_qwen3_rank_is_filled_with(tmp_path, spec_factory, preset):
    from click.testing import CliRunner

    from hpu_fp8_loader.cli.main import main
    from hpu_fp8_loader.io.safetensors_file import SafetensorsFile

    root = spec_factory(preset)
    for tp in (1, 2):
        for rank in range(tp):
            out = tmp_path / f"tp{tp}-rank{rank}.safetensors"
            args = ["map", str(root), "--tp", str(tp), "--rank", str(rank), "-o", str(out), "--json"]
            result = CliRunner().invoke(main, args)
            assert result.exit_code == 0, result.output
            expected = mapped(root, Parallelism(tp, rank))
            written = SafetensorsFile(out)
            assert set(written.tensors) == set(expected)
            for name, value in expected.items():
                np.testing.assert_array_equal(written.get(name).view(np.uint8), value.view(np.uint8), err_msg=name)


def test_qwen3_moe_expert_parallelism_gives_each_rank_whole_experts(spec_factory):
    root = spec_factory("qwen3-moe-tiny")  # 4 experts of intermediate 32, hidden 64
    spec = Checkpoint.open(root)
    for ep_rank in range(2):
        params = mapped(root, Parallelism(2, 0, 2, ep_rank))
        for layer in range(2):
            base = f"model.layers.{layer}.mlp.experts"
            stacked = params[f"{base}.up_gate_proj_weight"]
            assert stacked.shape == (2, 64, 64)  # 2 local experts, their intermediate not split under EP
            for i in range(2):
                e = 2 * ep_rank + i
                np.testing.assert_array_equal(
                    stacked[i].view(np.uint8), spec.get(f"{base}.{e}.up_gate_proj.weight").view(np.uint8)
                )
                np.testing.assert_array_equal(
                    f32(params[f"{base}.down_proj_in_scale"][i]),
                    f32(bf16(spec.get(f"{base}.{e}.down_proj.act_amax")[0] / np.float32(240))),
                )
            assert params[f"model.layers.{layer}.mlp.gate.weight"].shape == (64, 4)  # the router sees every expert

"""`plan` on the models' published configurations (tests/helpers/real_configs.py), against byte counts worked out here by hand."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers.real_configs import ERNIE_21B, ERNIE_300B, QWEN2, QWEN3, QWEN3_MOE

from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.errors import ConfigError
from hpu_fp8_loader.fastdeploy.plan import plan_deployment

LINEAR_SCALES = 3 * 2  # weight_scale, act_scale, act_scale_inv: bf16 [1] each
ATTENTION_SCALARS = 10 * 4  # ten float32 [1] (docs/fastdeploy.md section 6, "Attention scales")


def expected(c: dict, tp: int, moe_layers: int, dense_layers: int, kv_fp8: bool = True) -> dict:
    h, layers, heads, kv, vocab = (
        c[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    )
    hd = c.get("head_dim") or h // heads
    kv_rank = kv // tp  # FastDeploy's HPU runner: num_key_value_heads // tp
    qkv_width = (heads // tp + 2 * kv_rank) * hd
    attention = layers * (h * qkv_width + heads * hd // tp * h + 2 * LINEAR_SCALES + (ATTENTION_SCALARS if kv_fp8 else 0))
    if c["model_type"] == "qwen2":
        attention += layers * qkv_width * 2  # the q|k|v bias, bf16
    inter = c["intermediate_size"] // tp
    dense = dense_layers * (h * 2 * inter + inter * h + 2 * LINEAR_SCALES)
    shared = routed = router = 0
    ernie = c["model_type"].startswith("ernie")
    if moe_layers:
        experts, moe_inter = c.get("moe_num_experts") or c["num_experts"], c["moe_intermediate_size"] // tp
        width = c.get("moe_num_shared_experts", 0) * c["moe_intermediate_size"] // tp  # Qwen3-MoE: none
        if width:
            shared = moe_layers * (h * 2 * width + width * h + 2 * LINEAR_SCALES)
        routed = moe_layers * (
            experts * (h * 2 * moe_inter + moe_inter * h) + experts * (2 * moe_inter + h) * 2 + 2 + experts * 2
        )
        router = moe_layers * (h * experts * 4 + (experts * 4 if ernie else 0))  # ERNIE's correction bias, float32
    return {
        "attention": attention, "dense_mlp": dense, "shared_experts": shared, "routed_experts": routed, "router": router,
        "embeddings": vocab // tp * h * 2, "lm_head": h * vocab // tp * 2,  # built tied or not
        "norms": (2 * layers + 1) * h * 2 + (0 if ernie or c["model_type"] == "qwen2" else layers * 2 * hd * 2),
        "kv": 2 * layers * kv_rank * hd,  # Qwen3's q/k norms: two bf16 [head_dim] a layer, on every rank
    }  # fmt: skip


CASES = [(ERNIE_21B, tp, 27, 1) for tp in (1, 2, 4)] + [(QWEN2["7B"], tp, 0, 28) for tp in (1, 2, 4)]
CASES += [(ERNIE_300B, tp, 51, 3) for tp in (1, 2, 4, 8)]
CASES += [(QWEN3[size], tp, 0, QWEN3[size]["num_hidden_layers"]) for size in QWEN3 for tp in (1, 2, 4, 8)]
CASES += [(QWEN3_MOE[size], tp, QWEN3_MOE[size]["num_hidden_layers"], 0) for size in QWEN3_MOE for tp in (1, 2, 4)]


@pytest.mark.parametrize(("config", "tp", "moe_layers", "dense_layers"), CASES)
def test_bytes_per_rank_and_kv_per_token_match_the_hand_count(config, tp, moe_layers, dense_layers):
    plan = plan_deployment(describe(config), tp)
    want = expected(config, tp, moe_layers, dense_layers)
    kv = want.pop("kv")
    assert plan.bytes_per_rank == want
    assert plan.kv_bytes_per_token_per_rank == kv and plan.kv_bytes_per_token_per_rank_bf16 == 2 * kv
    assert plan.total_bytes_per_rank == sum(want.values())


def test_the_21b_model_at_tp1_is_about_half_its_bf16_size():
    plan = plan_deployment(describe(ERNIE_21B), 1)
    # fp8 linears are half their bf16 size; the embedding, norms, router and the lm_head FastDeploy builds
    # beside the tied embedding (0.53 GB) stay 16/32-bit: 0.519 (0.506 without that lm_head)
    assert plan.total_bytes_per_rank / (2 * plan.parameters) == pytest.approx(0.519, abs=0.002)


def test_kv_scheme_none_sizes_a_bf16_cache_without_attention_scalars():
    fp8, none = (
        plan_deployment(describe(QWEN2["7B"]), 2, kv_cache="fp8"),
        plan_deployment(describe(QWEN2["7B"]), 2, kv_cache="none"),
    )
    assert none.kv_bytes_per_token_per_rank == 2 * fp8.kv_bytes_per_token_per_rank
    assert fp8.bytes_per_rank["attention"] - none.bytes_per_rank["attention"] == 28 * ATTENTION_SCALARS


@pytest.mark.parametrize("config", [ERNIE_21B, QWEN2["7B"]])
def test_tp8_is_refused_for_models_whose_heads_it_does_not_divide(config):
    with pytest.raises(ConfigError, match=r"tensor parallelism 8 cannot serve.*valid: 1, 2, 4(,|$)"):
        plan_deployment(describe(config), 8)


def test_cli_plan_from_a_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ERNIE_21B))
    result = CliRunner().invoke(main, ["plan", str(tmp_path / "config.json"), "--tp", "4", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["tp"] == 4 and data["bytes_per_rank"]["routed_experts"] > 0
    refused = CliRunner().invoke(main, ["plan", str(tmp_path), "--tp", "8"])
    assert refused.exit_code == 1 and "valid: 1, 2, 4" in refused.output


def test_qwen3_235b_fits_one_gaudi2_rank_at_tp4_and_not_below():
    """Measured: 110.3 GiB of parameters a rank at TP 2 (more than a Gaudi2 holds), 55.3 GiB at TP 4."""
    d = describe(QWEN3_MOE["235B-A22B"])
    two, four = (plan_deployment(d, tp, device="gaudi2").capacity for tp in (2, 4))
    assert two is not None and four is not None
    assert two.blocks == 0 and two.max_model_len == 0
    assert four.blocks > 0 and four.max_model_len >= 2048


def test_cli_plan_device_for_a_qwen3_moe_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE["30B-A3B"]))
    result = CliRunner().invoke(main, ["plan", str(tmp_path / "config.json"), "--tp", "2", "--device", "gaudi2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model_type"] == "qwen3_moe" and data["capacity"]["blocks"] > 0
    assert data["bytes_per_rank"]["norms"] > 0 and data["bytes_per_rank"]["shared_experts"] == 0
    refused = CliRunner().invoke(main, ["plan", str(tmp_path), "--tp", "8"])
    assert refused.exit_code == 1 and "num_key_value_heads // tp = 0" in refused.output and "valid: 1, 2, 4" in refused.output

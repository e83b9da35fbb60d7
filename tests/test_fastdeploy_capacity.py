"""`plan --device`: KV-cache tokens per rank by FastDeploy's HPU worker's own rule, worked out here from that rule.

The rule, as docs/fastdeploy.md ("KV-cache capacity") states it from FastDeploy's code: 96 GiB on every device,
x 0.9, less 768 MiB, less the weights and the profile run's KV cache (sequences of max_num_batched_tokens //
max_num_seqs tokens, each with 2 blocks of decode slack), in blocks of 64 tokens, at most 40000. A block holds
K and V of every layer for 64 tokens. FastDeploy refuses max_model_len // 64 + 2 blocks more than it has.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers.real_configs import ERNIE_21B, ERNIE_300B, QWEN2
from hostile.refusal import assert_refused

from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.errors import ConfigError
from hpu_fp8_loader.fastdeploy.plan import plan_deployment
from hpu_fp8_loader.sources.synth import preset_config

BUDGET = 96 * 2**30 * 0.9 - 768 * 2**20


def blocks_left(weights: int, block: int, batched: int, seqs: int) -> int:
    profile_blocks = seqs * ((batched // seqs + 63 + 2 * 64) // 64)
    return min(40000, int((BUDGET - weights - profile_blocks * block) // block))


def kv_block_bytes(c: dict, tp: int, fp8: bool) -> int:
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 64 * 2 * c["num_hidden_layers"] * (c["num_key_value_heads"] // tp) * head_dim * (1 if fp8 else 2)


def qwen2(size: str) -> dict:
    return {"model_type": "qwen2", **QWEN2[size]}


CASES = [
    ("ernie-21b tp1", ERNIE_21B, 1, True, 131072),
    ("ernie-21b tp2", ERNIE_21B, 2, True, 131072),
    ("ernie-21b tp1 bf16 kv", ERNIE_21B, 1, False, 131072),
    ("qwen2-7b tp1", qwen2("7B"), 1, True, 32768),
    ("qwen2-72b tp4 bf16 kv", qwen2("72B"), 4, False, 32768),
    ("qwen2-72b tp1 no max_position_embeddings", qwen2("72B"), 1, False, None),
]


@pytest.mark.parametrize(("name", "config", "tp", "fp8", "positions"), CASES, ids=[c[0] for c in CASES])
def test_capacity_follows_fastdeploys_rule(name, config, tp, fp8, positions):
    plan = plan_deployment(
        describe(config), tp, kv_cache="fp8" if fp8 else "none", device="gaudi2", max_position_embeddings=positions
    )
    c, weights, block = plan.capacity, plan.total_bytes_per_rank, kv_block_bytes(config, tp, fp8)
    assert c is not None and c.fits and c.problem == ""
    assert c.block_bytes == block == 64 * plan.kv_bytes_per_token_per_rank
    assert c.budget_bytes == int(BUDGET) and c.weight_bytes == weights
    # max_model_len: the model's positions (FastDeploy's default 2048 without them), or what one sequence can have
    longest = (blocks_left(weights, block, 8192, 1) - 2) * 64
    assert c.max_model_len == min(positions or 2048, longest)
    # the blocks and tokens of the options suggested, with the profile cache those options cause
    batched = min(8192, c.max_model_len * c.max_num_seqs)
    assert c.max_num_batched_tokens == batched
    assert c.blocks == blocks_left(weights, block, batched, c.max_num_seqs) and c.kv_tokens == 64 * c.blocks
    assert c.profile_kv_bytes == c.max_num_seqs * ((batched // c.max_num_seqs + 191) // 64) * block
    # FastDeploy's checks pass, and max_num_seqs sequences of max_model_len fit at once; one more would not
    per_sequence = (c.max_model_len + 63 + 128) // 64
    assert c.blocks >= c.max_model_len // 64 + 2 and c.max_model_len >= 16
    assert c.max_num_seqs * per_sequence <= c.blocks
    more = c.max_num_seqs + 1
    assert c.max_num_seqs == 256 or more * per_sequence > blocks_left(weights, block, min(8192, c.max_model_len * more), more)


def test_the_21b_at_tp1_on_a_gaudi2_in_figures():
    """The hand count of tests/test_fastdeploy_plan.py gives the weights; the rest is arithmetic on the rule."""
    plan = plan_deployment(describe(ERNIE_21B), 1, device="gaudi2", max_position_embeddings=131072)
    c = plan.capacity
    assert c is not None and c.block_bytes == 64 * 2 * 28 * 4 * 128  # fp8: one byte a value, 4 KV heads of 128
    assert (c.max_model_len, c.max_num_seqs) == (131072, (c.blocks // ((131072 + 191) // 64)))
    assert 2_000_000 < c.kv_tokens < 2_560_000  # ~64 GiB of 1.75 MiB blocks, under the 40000-block cap


@pytest.mark.parametrize("preset", ["ernie-moe-tiny", "ernie-dense-tiny", "qwen2-tiny"])
def test_tiny_presets_hit_fastdeploys_caps(preset):
    config = preset_config(preset)
    plan = plan_deployment(describe(config), device="gaudi2", max_position_embeddings=config["max_position_embeddings"])
    c = plan.capacity
    assert c is not None and c.blocks == 40000 and c.kv_tokens == 40000 * 64  # FastDeploy's cap on blocks
    assert c.max_model_len == config["max_position_embeddings"] and c.max_num_seqs == 256  # its cap on sequences


def test_a_gaudi3_gets_what_a_gaudi2_gets_as_fastdeploy_assumes_96_gib_everywhere():
    gaudi2, gaudi3 = (plan_deployment(describe(ERNIE_21B), 2, device=d).capacity for d in ("gaudi2", "gaudi3"))
    assert gaudi2 is not None and gaudi3 is not None
    assert (gaudi2.device_hbm_bytes, gaudi3.device_hbm_bytes) == (96 * 2**30, 128 * 2**30)
    assert gaudi2.assumed_hbm_bytes == gaudi3.assumed_hbm_bytes == 96 * 2**30
    assert (gaudi2.blocks, gaudi2.max_num_seqs) == (gaudi3.blocks, gaudi3.max_num_seqs)


def test_a_max_model_len_beyond_the_blocks_does_not_fit_and_says_why():
    plan = plan_deployment(describe(qwen2("72B")), 1, device="gaudi2", max_model_len=100_000)
    c = plan.capacity
    assert c is not None and not c.fits and c.max_num_seqs == 0
    left = blocks_left(plan.total_bytes_per_rank, kv_block_bytes(qwen2("72B"), 1, True), 8192, 1)
    assert c.problem == f"{left} KV-cache blocks of 64 tokens are left after the weights; a sequence of 100000 tokens needs 1564"


def test_weights_beyond_the_budget_leave_no_block():
    c = plan_deployment(describe(ERNIE_300B), 1, device="gaudi2").capacity
    assert c is not None and not c.fits and c.blocks == 0 and c.kv_tokens == 0
    assert c.problem.startswith("the weights take ") and "of the 85.65 GiB FastDeploy's HPU worker sizes for" in c.problem


def test_cli_plan_device_table_json_and_refusal(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**ERNIE_21B, "max_position_embeddings": 131072}))
    shown = CliRunner().invoke(main, ["plan", str(config), "--device", "gaudi2", "--tp", "2"])
    assert shown.exit_code == 0, shown.stderr
    capacity = plan_deployment(describe(ERNIE_21B), 2, device="gaudi2", max_position_embeddings=131072).capacity
    assert capacity is not None
    assert f"at most {capacity.kv_tokens:,} tokens" in shown.stdout
    assert shown.stdout.splitlines()[-1] == f"suggested: --max-model-len 131072 --max-num-seqs {capacity.max_num_seqs}"
    data = json.loads(CliRunner().invoke(main, ["plan", str(config), "--device", "gaudi3", "--tp", "2", "--json"]).stdout)
    assert data["capacity"]["kv_tokens"] == capacity.kv_tokens and data["capacity"]["device"] == "gaudi3"
    assert json.loads(CliRunner().invoke(main, ["plan", str(config), "--json"]).stdout)["capacity"] is None

    config.write_text(json.dumps(ERNIE_300B))
    refused = CliRunner().invoke(main, ["plan", str(config), "--device", "gaudi2", "--json"])
    line = assert_refused(refused, str(config), "does not fit a gaudi2", "the weights take")
    assert json.loads(refused.stdout)["capacity"]["fits"] is False and line.count("\n") == 0
    usage = CliRunner().invoke(main, ["plan", str(config), "--max-model-len", "4096"])
    assert_refused(usage, "--device", code=2)


def test_max_model_len_without_a_device_is_refused_in_python_too():
    with pytest.raises(ConfigError, match="without a device"):
        plan_deployment(describe(ERNIE_21B), max_model_len=4096)

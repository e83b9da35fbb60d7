"""`plan` on the published Qwen3 and Qwen3-MoE configurations: bytes per rank and KV cache per token, the figures
`hpu-fp8 plan` prints, pinned so that a change in the descriptor (head_dim, q/k norms, experts) shows up here."""

from __future__ import annotations

import pytest
from helpers.real_configs import QWEN3, QWEN3_MOE

from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.errors import ConfigError
from hpu_fp8_loader.fastdeploy.plan import plan_deployment

# (config, TP, GiB a rank, KV bytes a token a rank in fp8), as `hpu-fp8 plan CONFIG --tp N` prints them
FIGURES = [
    (QWEN3["0.6B"], 1, 0.99, 57_344),
    (QWEN3["8B"], 1, 8.79, 73_728),
    (QWEN3["32B"], 1, 32.0, 131_072),
    (QWEN3_MOE["30B-A3B"], 1, 29.1, 49_152),
    (QWEN3_MOE["235B-A22B"], 1, 220.0, 96_256),
    (QWEN3_MOE["235B-A22B"], 4, 55.3, 24_064),
]


@pytest.mark.parametrize(("config", "tp", "gib", "kv_bytes"), FIGURES)
def test_plan_figures_of_the_published_qwen3_configs(config, tp, gib, kv_bytes):
    d = describe(config)
    plan = plan_deployment(d, tp=tp)
    assert plan.total_bytes_per_rank / 2**30 == pytest.approx(gib, rel=0.01)
    # K and V of every layer, head_dim 128 each (explicit in config.json; 0.6B's hidden / heads would be 64)
    assert plan.kv_bytes_per_token_per_rank == kv_bytes == 2 * d.num_layers * (d.num_kv_heads // tp) * 128
    assert plan.kv_bytes_per_token_per_rank_bf16 == 2 * kv_bytes


def test_a_tp_above_the_kv_heads_of_qwen3_moe_is_refused_with_the_valid_ones():
    with pytest.raises(ConfigError, match="num_key_value_heads // tp = 0 KV heads; valid: 1, 2, 4"):
        plan_deployment(describe(QWEN3_MOE["235B-A22B"]), tp=8)

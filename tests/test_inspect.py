"""`inspect`: figures checked against an independent count over the same files."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from hpu_fp8_loader.checks.inspection import inspect_checkpoint
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.io.checkpoint import Checkpoint


def test_saturated_share_and_scale_stats_match_an_independent_count(spec_factory):
    root = spec_factory()
    result = inspect_checkpoint(root)
    checkpoint = Checkpoint.open(root)
    names = [n for n in checkpoint.tensors if ".mlp.experts." in n and n.endswith("down_proj.weight")]
    codes = np.concatenate([checkpoint.get(n).view(np.uint8).reshape(-1) for n in names])
    expected = np.count_nonzero(np.abs(codes.view(checkpoint.get(names[0]).dtype).astype(np.float32)) == 240.0) / codes.size
    assert result.roles["expert_down"].saturated_share == expected
    scales = np.concatenate([checkpoint.get(n[: -len("weight")] + "weight_scale") for n in names])
    assert result.roles["expert_down"].weight_scale == {
        "min": float(scales.min()),
        "median": float(np.median(scales)),
        "max": float(scales.max()),
    }
    assert result.roles["expert_down"].tensors == 2 * len(names)  # weights and their scales
    assert result.moe_layers == [1, 2] and result.experts == 4
    assert result.total_bytes == sum(i.nbytes for i in checkpoint.tensors.values())


def test_cli_table_and_json(spec_factory):
    root = spec_factory("qwen2-tiny", "none")
    table = CliRunner().invoke(main, ["inspect", str(root)])
    assert table.exit_code == 0 and "attn_qkv" in table.output and "KV cache none" in table.output
    data = json.loads(CliRunner().invoke(main, ["inspect", "--json", str(root)]).stdout)
    assert data["model_type"] == "qwen2" and "attn_cache_k" not in data["roles"]


def test_inspect_of_a_source_checkpoint_exits_2(source_factory):
    result = CliRunner().invoke(main, ["inspect", str(source_factory())])
    assert result.exit_code == 2 and "hpu-fp8 convert" in result.output

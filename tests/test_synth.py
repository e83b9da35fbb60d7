"""`synth`: deterministic BF16 source checkpoints in both layouts."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from click.testing import CliRunner

from hpu_fp8_loader.arch import Layout, Role, describe
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.errors import ConfigError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.sources.synth import preset_config, synthesize, weight_values


def _digest(root):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


@pytest.mark.parametrize("preset", ["ernie-moe-tiny", "ernie-dense-tiny", "qwen2-tiny"])
@pytest.mark.parametrize("layout", ["paddle", "torch"])
def test_every_descriptor_tensor_is_written_with_its_shape_and_dtype(source_factory, preset, layout):
    root = source_factory(preset, layout)
    checkpoint = Checkpoint.open(root)
    descriptor = describe(checkpoint.config)
    expected = {
        p.name: (w.source_dtype, p.shape) for w in descriptor.weights() for p in w.source_parts(Layout(layout), descriptor.prefix)
    }
    assert {n: (i.dtype, i.shape) for n, i in checkpoint.tensors.items()} == expected
    config = checkpoint.config
    assert ("dtype" in config) == (layout == "paddle") and ("torch_dtype" in config) == (layout == "torch")
    assert len(list(root.glob("*.safetensors"))) > 1  # sharded at 64 kB


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    config = preset_config("qwen2-tiny")
    synthesize(tmp_path / "a", config, seed=3)
    synthesize(tmp_path / "b", config, seed=3)
    synthesize(tmp_path / "c", config, seed=4)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert _digest(tmp_path / "a") != _digest(tmp_path / "c")


def test_paddle_and_torch_layouts_hold_the_same_numbers(source_factory):
    paddle = Checkpoint.open(source_factory("qwen2-tiny", "paddle"))
    torch = Checkpoint.open(source_factory("qwen2-tiny", "torch"))
    qkv = paddle.get("qwen2.layers.1.self_attn.qkv_proj.weight")
    q = torch.get("model.layers.1.self_attn.q_proj.weight")
    k = torch.get("model.layers.1.self_attn.k_proj.weight")
    np.testing.assert_array_equal(qkv[:, : q.shape[0]], q.T)
    np.testing.assert_array_equal(qkv[:, q.shape[0] : q.shape[0] + k.shape[0]], k.T)
    np.testing.assert_array_equal(paddle.get("lm_head.weight"), torch.get("lm_head.weight").T)


def test_values_have_outliers_and_float32_router(source_factory):
    checkpoint = Checkpoint.open(source_factory("ernie-moe-tiny"))
    assert checkpoint.tensors["ernie.layers.1.mlp.gate.weight"].dtype == "F32"
    assert checkpoint.tensors["ernie.layers.1.mlp.moe_statics.e_score_correction_bias"].dtype == "F32"
    w = checkpoint.get("ernie.layers.1.mlp.experts.0.up_gate_proj.weight").astype(np.float32)
    assert np.abs(w).max() > 6 * w.std()  # a few outliers, as real checkpoints have
    descriptor = describe(checkpoint.config)
    norm = next(x for x in descriptor.weights() if x.role is Role.NORM)
    assert abs(float(weight_values(norm, 7).mean()) - 1.0) < 0.05


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="ernie-moe-tiny"):
        preset_config("llama-tiny")


def test_cli_synth_with_overrides(tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "synth",
            str(tmp_path / "m"),
            "--preset",
            "qwen2-tiny",
            "--set",
            "hidden_size=32",
            "--set",
            "tie_word_embeddings=true",
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["hidden_size"] == 32 and config["tie_word_embeddings"] is True
    again = CliRunner().invoke(main, ["synth", str(tmp_path / "m"), "-q"])
    assert again.exit_code == 1 and "already exists" in again.output


def test_an_override_must_be_a_key_of_the_preset_or_of_the_model():
    assert preset_config("qwen2-tiny", {"head_dim": 16})["head_dim"] == 16  # read by the descriptor, absent from the preset
    with pytest.raises(ConfigError, match="unknown config key 'moe_num_experts' for qwen2-tiny"):
        preset_config("qwen2-tiny", {"moe_num_experts": 8})  # an ERNIE key: Qwen2 would silently ignore it
    with pytest.raises(ConfigError, match="'num_hiden_layers'.*did you mean num_hidden_layers"):
        preset_config("ernie-moe-tiny", {"num_hiden_layers": 2})

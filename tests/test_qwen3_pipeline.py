"""Qwen3 and Qwen3-MoE through the pipeline: synth -> calibrate -> convert -> validate in both source layouts, and
`import` of a compressed-tensors Qwen3 (static FP8, tensor-wise), built here in the layout llm-compressor writes
(tests/fixtures/qwen2-bytes-fp8-static shows it; no llm-compressor environment exists on this machine)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hpu_fp8_loader.checks.validate import validate
from hpu_fp8_loader.conversion.compressed_tensors import import_compressed_tensors
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.errors import MeasurementError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.numerics import e4m3
from hpu_fp8_loader.quality.calibrate import calibrate, write_fastdeploy_file
from hpu_fp8_loader.sources.measurements import load_measurements

np.float8_e4m3fn = ml_dtypes.float8_e4m3fn  # safetensors issue 682: its numpy path needs this alias for F8
QWEN3_PRESETS = ("qwen3-tiny", "qwen3-moe-tiny")
CT_TEMPLATE = Path(__file__).with_name("fixtures") / "qwen2-bytes-fp8-static"


@pytest.fixture(scope="module")
def measured(source_factory):
    """The reference engine's amax of each preset (the paddle layout; the torch one computes the same model)."""
    return {p: calibrate(source_factory(p, "paddle"), samples=4, seq_len=32).measurements for p in QWEN3_PRESETS}


@pytest.mark.parametrize("preset", QWEN3_PRESETS)
def test_both_layouts_calibrate_convert_and_validate_to_the_same_checkpoint(tmp_path, source_factory, measured, preset):
    outs = [convert(source_factory(preset, layout), tmp_path / layout, [measured[preset]]).out for layout in ("paddle", "torch")]
    assert all(validate(out).valid for out in outs)
    paddle, torch = (Checkpoint.open(out) for out in outs)
    assert paddle.tensors.keys() == torch.tensors.keys()
    for name in paddle.tensors:
        np.testing.assert_array_equal(paddle.get(name).view(np.uint8), torch.get(name).view(np.uint8), err_msg=name)
    held = paddle.tensors
    assert held["model.layers.1.self_attn.q_norm.weight"].dtype == "BF16" and held[
        "model.layers.1.self_attn.q_norm.weight"
    ].shape == (24,)
    assert held["model.layers.0.self_attn.qkv_proj.weight"].dtype == "F8_E4M3"
    assert "model.layers.0.self_attn.qkv_proj.bias" not in held
    q_amax = paddle.get("model.layers.1.self_attn.q.act_amax")[0]
    assert q_amax == np.float32(measured[preset].amax["model.layers.1.self_attn.q"])


def test_fastdeploys_own_measurements_of_qwen3_attention_are_refused_naming_why(tmp_path, source_factory, measured):
    """FastDeploy's measurement kernels skip the q/k norms: its q / cache_k amax of a Qwen3 must never reach a checkpoint."""
    text = tmp_path / "model_measurement.txt"
    write_fastdeploy_file(text, measured["qwen3-tiny"])
    fastdeploy = load_measurements(text).measurements
    with pytest.raises(MeasurementError, match=r"without the q/k RMSNorm .*self_attn\.cache_k.*hpu-fp8 calibrate"):
        convert(source_factory("qwen3-tiny", "paddle"), tmp_path / "out", [fastdeploy])
    assert not (tmp_path / "out").exists()
    # the same values from hpu-fp8's own JSON are accepted: the refusal is about where q / cache_k were measured
    assert validate(convert(source_factory("qwen3-tiny", "paddle"), tmp_path / "ok", [measured["qwen3-tiny"]]).out).valid


def _compressed_tensors(src: Path, out: Path, seed: int = 0) -> Path:
    """``src`` (torch layout) as llm-compressor's static FP8 writes it: every decoder linear F8_E4M3 with a BF16
    tensor-wise ``weight_scale`` (amax / 448) and a BF16 ``input_scale``; embeddings, lm_head and router kept."""
    rng = np.random.default_rng(seed)
    shutil.copytree(src, out)
    tensors = {}
    for shard in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(shard))
        shard.unlink()
    quantized = {}
    for name, value in tensors.items():
        if not name.endswith("_proj.weight"):
            quantized[name] = value
            continue
        weight = value.astype(np.float32)
        scale = np.array([np.abs(weight).max() / 448.0], np.float32).astype(ml_dtypes.bfloat16)
        quantized[name] = e4m3.quantize(weight, float(scale.astype(np.float32)[0]), 448.0, name)
        quantized[name.removesuffix("weight") + "weight_scale"] = scale
        quantized[name.removesuffix("weight") + "input_scale"] = rng.uniform(0.005, 0.05, 1).astype(ml_dtypes.bfloat16)
    save_file(quantized, out / "model.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(quantized, "model.safetensors")}))
    config = json.loads((out / "config.json").read_text())
    template = json.loads((CT_TEMPLATE / "config.json").read_text())["quantization_config"]
    config["quantization_config"] = {**template, "ignore": ["lm_head", "re:.*embed_tokens", "re:.*mlp.gate$"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("preset", QWEN3_PRESETS)
def test_a_compressed_tensors_qwen3_imports_its_input_scales_and_validates(tmp_path, source_factory, measured, preset):
    src = _compressed_tensors(source_factory(preset, "torch"), tmp_path / "ct")
    result = import_compressed_tensors(src, tmp_path / "out", measurements=[measured[preset]])
    assert validate(tmp_path / "out").valid and "static tensor" in result.scheme
    source, spec = Checkpoint.open(src), Checkpoint.open(tmp_path / "out")
    q, k, v = (float(source.get(f"model.layers.1.self_attn.{p}_proj.input_scale").astype(np.float32)[0]) for p in "qkv")
    assert spec.get("model.layers.1.self_attn.qkv_proj.act_amax")[0] == np.float32(max(q, k, v) * 448.0)
    # the q / cache_k points (after q/k norm and RoPE) have no compressed-tensors scale: they come from the engine
    calibration = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["calibration"]
    kinds = {s["id"]: s["kind"] for s in calibration["sources"]}
    assert kinds[calibration["overrides"]["model.layers.1.self_attn.q"]] == "reference-engine"
    assert 0 < max(error for _, error in result.errors) < 0.05

"""The single-process converter: numerics per tensor, layouts, and refusals that leave nothing behind."""

from __future__ import annotations

import json
import re
import shutil

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from helpers.checkpoint_damage import overwrite_tensor_bytes

from hpu_fp8_loader.arch import Layout, describe
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.conversion.activations import dead_expert_summary
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.errors import ConfigError, HpuFp8Error, MeasurementError, NonFiniteError, OutputExistsError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements
from hpu_fp8_loader.spec import names


@pytest.mark.parametrize("preset", ["ernie-moe-tiny", "qwen2-tiny"])
def test_dequantized_weights_match_the_source_within_fp8_rounding(source_factory, spec_factory, preset):
    torch_src = Checkpoint.open(source_factory(preset, "torch"))
    spec = Checkpoint.open(spec_factory(preset))  # converted from the paddle layout
    descriptor = describe(spec.config)
    checked = 0
    for w in descriptor.weights():
        parts = w.source_parts(Layout.TORCH, descriptor.prefix)
        arrays = [torch_src.get(p.name).astype(np.float32) for p in parts]
        source = np.concatenate([a.T if p.transpose else a for p, a in zip(parts, arrays, strict=True)], axis=-1)
        assert source.shape == w.shape
        if not w.is_linear:
            np.testing.assert_array_equal(spec.get(w.name).astype(np.float32), source)
            continue
        scale = spec.get(names.tensor(w.module, names.WEIGHT_SCALE))
        back = spec.get(w.name).astype(np.float32) * scale
        # Round to nearest: at most half a step (2^-4 relative, or 2^-10 * scale among subnormals).
        assert np.all(np.abs(back - source) <= np.maximum(np.abs(source) / 16, scale * 2.0**-10) * 1.0001), w.name
        # The scale covers the amax (no clipping), and is tight: the largest value uses the top binade.
        assert np.all(np.abs(source) <= scale * 240.0 * (1 + 1e-6)), w.name
        amax = np.abs(source).max(axis=0) if w.channel_wise else np.abs(source).max()
        assert np.all(amax >= scale * 128.0), w.name
        checked += 1
    assert checked == sum(w.is_linear for w in descriptor.weights())


def test_act_tensors_come_from_the_measurements(spec_factory):
    spec = Checkpoint.open(spec_factory())
    m = synthetic_measurements(preset_config("ernie-moe-tiny"))
    for module, amax in m.amax.items():
        assert spec.get(names.tensor(module, names.ACT_AMAX))[0] == np.float32(amax)
        assert spec.get(names.tensor(module, names.ACT_SCALE))[0] == np.float32(amax) / np.float32(240.0)


def test_output_config_is_fastdeploy_paddle_format_from_a_torch_source(source_factory, tmp_path):
    out = convert(
        source_factory("qwen2-tiny", "torch"), tmp_path / "o", [synthetic_measurements(preset_config("qwen2-tiny"))]
    ).out
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "torch_dtype" not in config and "transformers_version" not in config
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (out / "generation_config.json").read_bytes() == (
        source_factory("qwen2-tiny", "torch") / "generation_config.json"
    ).read_bytes()


def test_a_null_head_dim_is_written_as_the_number_fastdeploy_needs(tmp_path):
    """Some copies of ERNIE-4.5-21B-A3B's config.json say ``"head_dim": null``; FastDeploy derives head_dim only
    where the key is absent, so the output states hidden / heads (docs/spec.md section 4.3)."""
    config = preset_config("ernie-moe-tiny", {"head_dim": None})
    synthesize(tmp_path / "src", config, seed=1)
    out = convert(tmp_path / "src", tmp_path / "o", [synthetic_measurements(config)]).out
    written = json.loads((out / "config.json").read_text())
    assert written["head_dim"] == config["hidden_size"] // config["num_attention_heads"]
    assert json.loads((tmp_path / "src" / "config.json").read_text())["head_dim"] is None  # the source untouched


def _convert_fails(src, out, error, match, measurements=None):
    measurements = measurements if measurements is not None else [synthetic_measurements(preset_config("ernie-moe-tiny"))]
    with pytest.raises(error, match=match):
        convert(src, out, measurements, ConvertOptions())
    assert not out.exists()  # nothing that looks complete
    assert not (out.with_name(out.name + ".partial") / "hpu_fp8_manifest.json").exists()


def test_nan_in_a_source_weight_is_named_and_nothing_is_published(source_factory, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(source_factory(), src)
    name = "ernie.layers.1.mlp.experts.2.down_proj.weight"
    values = np.zeros((32, 64), ml_dtypes.bfloat16)
    values[3, 5] = np.nan
    overwrite_tensor_bytes(src, name, values.tobytes())
    _convert_fails(src, tmp_path / "out", NonFiniteError, rf"'{name}' \[32, 64\] holds nan at index \[3, 5\]")


def test_missing_measurements_are_listed(source_factory, tmp_path):
    m = synthetic_measurements(preset_config("ernie-moe-tiny"))
    del m.amax["ernie.layers.2.self_attn.o_proj"]
    del m.amax["ernie.layers.0.mlp.down_proj"]
    _convert_fails(
        source_factory(),
        tmp_path / "out",
        MeasurementError,
        "lack 2 module.*layers.0.mlp.down_proj.*layers.2.self_attn.o_proj",
        [m],
    )


def test_zero_amax_is_refused_never_divided_by(source_factory, tmp_path):
    m = synthetic_measurements(preset_config("ernie-moe-tiny"))
    m.amax["ernie.layers.1.mlp.shared_experts.down_proj"] = 0.0
    _convert_fails(source_factory(), tmp_path / "out", MeasurementError, "zero.*shared_experts.down_proj", [m])


def test_dead_experts_stop_the_conversion_summarised_per_layer_and_listed_whole_with_v(source_factory, tmp_path):
    m = synthetic_measurements(preset_config("ernie-moe-tiny"))
    m.amax["ernie.layers.1.mlp.experts.3.down_proj"] = 0.0
    del m.amax["ernie.layers.2.mlp.experts.0.down_proj"]
    summary = "layer 1: expert 3 (1 of 4); layer 2: expert 0 (1 of 4)"
    _convert_fails(source_factory(), tmp_path / "out", MeasurementError, rf"2 expert.*{re.escape(summary)}\..*sibling-max", [m])
    write_measurements(tmp_path / "m.json", m)
    result = CliRunner().invoke(
        main, ["-v", "convert", str(source_factory()), str(tmp_path / "o"), "--measurements", str(tmp_path / "m.json")]
    )
    assert result.exit_code == 1 and f"hpu-fp8: info: experts without a positive amax: {summary}" in result.stderr


def test_hundreds_of_dead_experts_read_as_a_few_layers_and_a_count():
    dead = [(layer, expert) for layer in range(1, 28) for expert in range(0, 64, 2)]  # 864 pairs
    summary = dead_expert_summary(dead, 64)
    assert summary.startswith("layer 1: experts 0, 2, 4, 6, 8, 10, 12, 14, ... (32 of 64); layer 2: experts 0, 2,")
    assert summary.count("layer ") == 5 and summary.endswith("; 22 more layers")
    whole = dead_expert_summary(dead, 64, whole=True)
    assert whole.count("layer ") == 27 and "..." not in whole and "62 (32 of 64); layer 27: experts 0, 2" in whole


def test_sibling_max_fills_dead_experts_and_records_them(source_factory, tmp_path):
    m = synthetic_measurements(preset_config("ernie-moe-tiny"))
    m.amax["ernie.layers.1.mlp.experts.3.down_proj"] = 0.0
    out = convert(source_factory(), tmp_path / "out", [m], ConvertOptions(dead_experts="sibling-max")).out
    spec = Checkpoint.open(out)
    siblings = max(m.amax[f"ernie.layers.1.mlp.experts.{e}.down_proj"] for e in range(3))
    assert spec.get("ernie.layers.1.mlp.experts.3.down_proj.act_amax")[0] == np.float32(siblings)
    dead = json.loads((out / "config.json").read_text())["quantization_config"]["moe"]["dead_experts"]
    assert dead == {"policy": "sibling-max", "filled": [{"layer": 1, "expert": 3}]}


def test_a_layer_without_any_live_expert_is_refused(source_factory, tmp_path):
    m = synthetic_measurements(preset_config("ernie-moe-tiny"))
    for e in range(4):
        m.amax[f"ernie.layers.2.mlp.experts.{e}.down_proj"] = 0.0
    with pytest.raises(MeasurementError, match="every expert of layer 2 is dead"):
        convert(source_factory(), tmp_path / "out", [m], ConvertOptions(dead_experts="sibling-max"))


def test_measurements_of_another_model_are_refused(source_factory, tmp_path):
    _convert_fails(
        source_factory(),
        tmp_path / "out",
        MeasurementError,
        "qwen2 with 2 layers",
        [synthetic_measurements(preset_config("qwen2-tiny"))],
    )


def test_shape_contradicting_config_is_named(source_factory, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(source_factory(), src)
    config = json.loads((src / "config.json").read_text())
    config["moe_intermediate_size"] = 16
    (src / "config.json").write_text(json.dumps(config))
    m = synthetic_measurements(config)
    _convert_fails(
        src,
        tmp_path / "out",
        ConfigError,
        r"experts.0.up_gate_proj.weight' has shape \[64, 64\], config.json implies \[64, 32\]",
        [m],
    )


def test_existing_output_is_refused_without_force_and_source_never_equals_output(source_factory, spec_factory, tmp_path):
    m = [synthetic_measurements(preset_config("ernie-moe-tiny"))]
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OutputExistsError, match=r"out: already exists; pass force=True to replace it$"):
        convert(source_factory(), out, m)  # Python's spelling: the CLI's --force is no parameter here
    convert(source_factory(), out, m, ConvertOptions(force=True))
    assert (out / "hpu_fp8_manifest.json").is_file()
    with pytest.raises(HpuFp8Error, match="it is the source"):
        convert(source_factory(), source_factory(), m)


def test_pow2_rounding_makes_every_scale_a_power_of_two_and_validates(source_factory, tmp_path):
    from hpu_fp8_loader.checks.validate import validate

    out = convert(
        source_factory(),
        tmp_path / "pow2",
        [synthetic_measurements(preset_config("ernie-moe-tiny"))],
        ConvertOptions(scale_rounding="pow2"),
    ).out
    assert validate(out).valid
    spec = Checkpoint.open(out)
    scales = [spec.get(n) for n in spec.tensors if n.endswith(("weight_scale", "act_scale"))]
    for s in scales:
        mantissa, _ = np.frexp(s)
        assert np.all(mantissa == 0.5)
    qkv = "ernie.layers.0.self_attn.qkv_proj"
    assert spec.get(f"{qkv}.act_scale")[0] >= spec.get(f"{qkv}.act_amax")[0] / 240

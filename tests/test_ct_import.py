"""`hpu-fp8 import` of compressed-tensors FP8 checkpoints made by llm-compressor itself
(tests/fixtures/, by scripts/make_ct_fixtures.py in llm-compressor's own environment), plus
hand-built edge cases."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from hpu_fp8_loader.arch import Layout, describe
from hpu_fp8_loader.checks.validate import validate
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.conversion.compressed_tensors import import_compressed_tensors
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.errors import ConfigError, MeasurementError, NonFiniteError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.numerics import e4m3, scales
from hpu_fp8_loader.quality.calibrate import calibrate
from hpu_fp8_loader.quality.evaluate import evaluate
from hpu_fp8_loader.sources.source_tensors import source_rows
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS
from hpu_fp8_loader.spec import names

np.float8_e4m3fn = ml_dtypes.float8_e4m3fn  # safetensors issue 682: its numpy path needs this alias for F8
FIXTURES = Path(__file__).with_name("fixtures")
STATIC, DYNAMIC, ERNIE = (
    FIXTURES / n for n in ("qwen2-bytes-fp8-static", "qwen2-bytes-fp8-dynamic", "ernie-moe-bytes-fp8-dynamic")
)


@pytest.fixture(scope="module")
def measured():
    return {name: calibrate(path, samples=8, seq_len=128).measurements for name, path in TINY_MODELS.items()}


def test_static_input_scales_become_act_amax(tmp_path):
    result = import_compressed_tensors(STATIC, tmp_path / "out", ConvertOptions(kv_cache="none"))
    assert validate(tmp_path / "out").valid and "static tensor" in result.scheme
    source, spec = Checkpoint.open(STATIC), Checkpoint.open(tmp_path / "out")
    scales = [float(source.get(f"model.layers.1.self_attn.{p}_proj.input_scale").astype(np.float32)[0]) for p in "qkv"]
    assert spec.get("qwen2.layers.1.self_attn.qkv_proj.act_amax")[0] == np.float32(max(scales) * 448.0)
    calibration = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["calibration"]
    assert [s["kind"] for s in calibration["sources"]] == ["imported-input-scale"]
    assert 0 < max(error for _, error in result.errors) < 0.05


def test_points_the_source_lacks_come_from_measurements_with_their_provenance(tmp_path, measured):
    with pytest.raises(MeasurementError, match="lack .*self_attn.cache_k"):
        import_compressed_tensors(STATIC, tmp_path / "a")
    import_compressed_tensors(STATIC, tmp_path / "b", measurements=[measured["qwen2-bytes"]])
    calibration = json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]["calibration"]
    kinds = {s["id"]: s["kind"] for s in calibration["sources"]}
    assert kinds[calibration["default_source"]] == "imported-input-scale"
    assert {kinds[calibration["overrides"]["qwen2.layers.0.self_attn.q"]]} == {"reference-engine"}
    assert "qwen2.layers.0.self_attn.qkv_proj" not in calibration["overrides"]


def test_a_dynamic_moe_checkpoint_imports_and_evaluates_against_its_bf16_base(tmp_path, measured):
    result = import_compressed_tensors(ERNIE, tmp_path / "out", measurements=[measured["ernie-moe-bytes"]])
    assert validate(tmp_path / "out").valid and "per channel, activations dynamic" in result.scheme
    assert Checkpoint.open(tmp_path / "out").tensors["ernie.layers.1.mlp.experts.2.up_gate_proj.weight_scale"].shape == (192,)
    report = evaluate(TINY_MODELS["ernie-moe-bytes"], tmp_path / "out", samples=4, seq_len=128)
    fp8 = report.rows[0]
    assert fp8.top1_agreement > 0.9 and fp8.perplexity_increase < 0.05


def test_dynamic_without_statistics_is_refused_and_calibrate_fills_them(tmp_path):
    with pytest.raises(MeasurementError, match="dynamic activations carry no statistics"):
        import_compressed_tensors(DYNAMIC, tmp_path / "a")
    import_compressed_tensors(DYNAMIC, tmp_path / "b", measurements=[calibrate(DYNAMIC).measurements])
    assert validate(tmp_path / "b").valid


def _copy(tmp_path, source=STATIC) -> Path:
    target = tmp_path / "src"
    shutil.copytree(source, target)
    return target


def _edit_config(root: Path, edit) -> None:
    config = json.loads((root / "config.json").read_text())
    edit(config["quantization_config"])
    (root / "config.json").write_text(json.dumps(config))


def _edit_tensors(root: Path, edit) -> None:
    tensors = load_file(root / "model.safetensors")
    edit(tensors)
    save_file(tensors, root / "model.safetensors")
    index = root / "model.safetensors.index.json"
    if index.is_file():  # keep the index true to the shard
        data = json.loads(index.read_text())
        data["weight_map"] = dict.fromkeys(tensors, "model.safetensors")
        index.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int"), "int4 tensor.*only FP8"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(block_structure=[128, 128], strategy="block"), "block"),
        (
            lambda q: (
                q.update(format="nvfp4-pack-quantized") or q["config_groups"]["group_0"].update(format="nvfp4-pack-quantized")
            ),
            "nvfp4-pack-quantized",
        ),
        (lambda q: q.update(quant_method="gptq"), "quant_method is 'gptq'; `hpu-fp8 import` reads compressed-tensors FP8"),
    ],
)
def test_unsupported_schemes_are_refused_naming_what_was_found(tmp_path, edit, message):
    root = _copy(tmp_path)
    _edit_config(root, edit)
    with pytest.raises(ConfigError, match=message):
        import_compressed_tensors(root, tmp_path / "out", ConvertOptions(kv_cache="none"))
    assert not (tmp_path / "out").exists()


def test_a_missing_weight_scale_is_named(tmp_path):
    root = _copy(tmp_path)
    _edit_tensors(root, lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale"))
    with pytest.raises(ConfigError, match="'model.layers.0.mlp.up_proj.weight_scale' is missing"):
        import_compressed_tensors(root, tmp_path / "out", ConvertOptions(kv_cache="none"))


def test_an_input_scale_of_zero_is_refused(tmp_path):
    root = _copy(tmp_path)
    _edit_tensors(root, lambda t: t.update({"model.layers.1.mlp.down_proj.input_scale": np.zeros(1, ml_dtypes.bfloat16)}))
    with pytest.raises(ConfigError, match="down_proj.input_scale' is 0.0"):
        import_compressed_tensors(root, tmp_path / "out", ConvertOptions(kv_cache="none"))


def test_float32_scales_import_exactly_like_bf16_ones(tmp_path):
    root = _copy(tmp_path)
    _edit_tensors(root, lambda t: t.update({k: v.astype(np.float32) for k, v in t.items() if k.endswith("_scale")}))
    import_compressed_tensors(STATIC, tmp_path / "a", ConvertOptions(kv_cache="none"))
    import_compressed_tensors(root, tmp_path / "b", ConvertOptions(kv_cache="none"))
    a, b = Checkpoint.open(tmp_path / "a"), Checkpoint.open(tmp_path / "b")
    for name in a.tensors:
        np.testing.assert_array_equal(a.get(name).view(np.uint8), b.get(name).view(np.uint8), err_msg=name)


def test_an_ignore_list_that_leaves_the_router_quantized_is_handled(tmp_path, measured):
    root = _copy(tmp_path, ERNIE)

    def quantize_router(tensors):
        router = tensors["model.layers.1.mlp.gate.weight"].astype(np.float32)
        scale = np.abs(router).max(axis=1, keepdims=True) / 448
        tensors["model.layers.1.mlp.gate.weight"] = (router / scale).astype(ml_dtypes.float8_e4m3fn)
        tensors["model.layers.1.mlp.gate.weight_scale"] = scale.astype(ml_dtypes.bfloat16)

    _edit_tensors(root, quantize_router)
    _edit_config(root, lambda q: q.update(ignore=["lm_head", "re:.*embed_tokens"]))
    result = import_compressed_tensors(root, tmp_path / "out", measurements=[measured["ernie-moe-bytes"]])
    assert any("mlp.gate.weight: quantized in the source" in w for w in result.warnings)
    assert Checkpoint.open(tmp_path / "out").tensors["ernie.layers.1.mlp.gate.weight"].dtype == "F32"
    assert validate(tmp_path / "out").valid


@pytest.mark.slow
def test_cli_import_prints_the_scheme_and_the_worst_errors(tmp_path):
    result = CliRunner().invoke(main, ["import", str(STATIC), str(tmp_path / "out"), "--kv-cache", "none"])
    assert result.exit_code == 0, result.output
    assert "per tensor, activations static tensor" in result.output and "worst ten" in result.output


def test_a_static_moe_checkpoint_takes_expert_statistics_from_its_input_scales(tmp_path):
    source_dir = FIXTURES / "ernie-moe-bytes-fp8-static"
    import_compressed_tensors(source_dir, tmp_path / "out", ConvertOptions(kv_cache="none"))
    assert validate(tmp_path / "out").valid
    source, spec = Checkpoint.open(source_dir), Checkpoint.open(tmp_path / "out")

    def scale(name: str) -> float:
        return float(source.get(name).astype(np.float32)[0])

    base = "model.layers.1.mlp.experts"
    shared_input = max(scale(f"{base}.{e}.{p}_proj.input_scale") for e in range(4) for p in ("gate", "up"))
    assert spec.get("ernie.layers.1.mlp.experts.up_gate_proj.act_amax")[0] == np.float32(shared_input * 448.0)  # max over experts
    for e in range(4):
        assert spec.get(f"ernie.layers.1.mlp.experts.{e}.down_proj.act_amax")[0] == np.float32(
            scale(f"{base}.{e}.down_proj.input_scale") * 448.0
        )
    assert spec.tensors["ernie.layers.1.mlp.experts.0.up_gate_proj.weight_scale"].shape == (
        192,
    )  # tensor-wise source -> channel-wise spec


def test_k_and_v_scales_become_the_kv_cache_amax(tmp_path, measured):
    root = _copy(tmp_path)  # llm-compressor's kv_cache_scheme writes self_attn.k_scale / v_scale beside the projections
    _edit_tensors(
        root,
        lambda t: t.update(
            {
                "model.layers.0.self_attn.k_scale": np.array([0.05], ml_dtypes.bfloat16),
                "model.layers.0.self_attn.v_scale": np.array([0.02], ml_dtypes.bfloat16),
            }
        ),
    )
    import_compressed_tensors(root, tmp_path / "out", measurements=[measured["qwen2-bytes"]])
    spec = Checkpoint.open(tmp_path / "out")
    assert spec.get("qwen2.layers.0.self_attn.cache_k.act_amax")[0] == np.float32(
        float(np.float32(ml_dtypes.bfloat16(0.05))) * 448.0
    )
    assert spec.get("qwen2.layers.0.self_attn.cache_v.act_amax")[0] == np.float32(
        float(np.float32(ml_dtypes.bfloat16(0.02))) * 448.0
    )
    overrides = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["calibration"]["overrides"]
    assert "qwen2.layers.0.self_attn.cache_k" not in overrides and "qwen2.layers.1.self_attn.cache_k" in overrides


def _requantized_by_dequantizing(source: Checkpoint, spec: Checkpoint, fp8_max: float = 240.0) -> None:
    """Every linear of ``spec`` equals the element-wise route: each source part dequantized to float32,
    fused in [in, out], one scale from the amax (per channel for experts), e4m3.quantize."""
    d = describe(source.config)
    for w in (w for w in d.weights() if w.is_linear):
        parts = w.source_parts(Layout.TORCH, d.prefix)
        values = [source_rows(source, p.name, 0, p.shape[0]).astype(np.float32) for p in parts]
        fused = np.concatenate([v.T if p.transpose else v for p, v in zip(parts, values, strict=True)], axis=-1)
        amax = np.abs(fused).max(axis=0) if w.channel_wise else np.abs(fused).max()
        scale = scales.weight_scale_from_amax(amax, fp8_max)
        weight_scale = spec.get(names.tensor(w.module, names.WEIGHT_SCALE))
        np.testing.assert_array_equal(weight_scale, np.reshape(scale, weight_scale.shape), err_msg=w.name)
        expected = e4m3.quantize(fused, scale if w.channel_wise else scale.reshape(()), fp8_max, w.name)
        np.testing.assert_array_equal(spec.get(w.name).view(np.uint8), expected.view(np.uint8), err_msg=w.name)


STREAMED = {"whole_tensor_bytes": 0, "block_elements": 1000}  # every tensor in row blocks of a few rows
READ_TWICE = {**STREAMED, "kept_tensor_bytes": 0}  # the blocks read again for the quantization, not kept


@pytest.mark.parametrize("fixture", ["qwen2-bytes-fp8-static", "qwen2-bytes-fp8-dynamic", "ernie-moe-bytes-fp8-static"])
@pytest.mark.parametrize("reading", [{}, STREAMED, READ_TWICE], ids=["whole", "streamed", "read-twice"])
def test_imported_weights_are_exactly_dequantize_then_quantize(tmp_path, fixture, reading, measured):
    source_dir = FIXTURES / fixture
    extra = [] if "static" in fixture else [measured["qwen2-bytes"]]
    result = import_compressed_tensors(source_dir, tmp_path / "out", ConvertOptions(kv_cache="none", **reading), extra)
    _requantized_by_dequantizing(Checkpoint.open(source_dir), Checkpoint.open(tmp_path / "out"))
    assert len(result.errors) == sum(w.is_linear for w in describe(Checkpoint.open(source_dir).config).weights())


@pytest.mark.parametrize("reading", [{}, STREAMED, READ_TWICE], ids=["whole", "streamed", "read-twice"])
def test_a_group_mixing_fp8_and_bf16_parts_is_requantized_from_its_values(tmp_path, reading):
    root = _copy(tmp_path)  # an ignore list can leave one projection of a fused group unquantized

    def unquantize_v(tensors):
        name = "model.layers.0.self_attn.v_proj.weight"
        scale = tensors.pop(name.removesuffix("weight") + "weight_scale").astype(np.float32)
        tensors[name] = (tensors[name].astype(np.float32) * scale).astype(ml_dtypes.bfloat16)

    _edit_tensors(root, unquantize_v)
    result = import_compressed_tensors(root, tmp_path / "out", ConvertOptions(kv_cache="none", **reading))
    _requantized_by_dequantizing(Checkpoint.open(root), Checkpoint.open(tmp_path / "out"))
    assert 0 < dict(result.errors)["qwen2.layers.0.self_attn.qkv_proj.weight"] < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_nan_code_in_an_fp8_source_is_named_and_nothing_is_published(tmp_path, workers):
    root = _copy(tmp_path)

    def poison(tensors):
        codes = tensors["model.layers.1.mlp.down_proj.weight"].view(np.uint8).copy()
        codes[3, 5] = 0xFF  # e4m3fn has no inf; 0x7F / 0xFF are its NaNs
        tensors["model.layers.1.mlp.down_proj.weight"] = codes.view(ml_dtypes.float8_e4m3fn)

    _edit_tensors(root, poison)
    with pytest.raises(NonFiniteError, match=r"'model.layers.1.mlp.down_proj.weight' \[\d+, \d+\] holds nan at index \[3, 5\]"):
        import_compressed_tensors(root, tmp_path / "out", ConvertOptions(kv_cache="none", workers=workers))
    assert not (tmp_path / "out").exists()


def test_measurements_and_calibrate_together_are_refused_before_any_work(tmp_path):
    measurement = tmp_path / "m.json"
    measurement.write_text("{}")
    args = ["import", str(DYNAMIC), str(tmp_path / "out"), "--measurements", str(measurement), "--calibrate"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "--measurements and --calibrate both given" in result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()

"""Issue 14 item 10: an amax or scale outside the spec's ranges is refused before anything is published.

An act_amax must lie in [2^-100, 2^100] (spec.fp8.ACT_AMAX_RANGE): inside it every scale FastDeploy derives
is a normal float32; outside it ``map`` used to write ``act_scale = inf``, or convert published a
checkpoint validate then rejected. Each source of amax is tried: a measurement file (convert), a legacy
checkpoint's activation_scale (import-legacy), a compressed-tensors input_scale (import); and the last
guards: an FP8 source's weight_scale whose dequantized values overflow, a weight scale retarget would
double to inf, and the mapping's own check of every derived scale.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from doubles.legacy_model_convert import model_convert
from helpers.checkpoint_damage import overwrite_tensor_bytes
from safetensors.numpy import load_file, save_file

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.checks.validate import validate
from hpu_fp8_loader.conversion.compressed_tensors import import_compressed_tensors
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.errors import HpuFp8Error, NonFiniteError
from hpu_fp8_loader.fastdeploy.mapping import Parallelism, map_rank
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.io.safetensors_file import SafetensorsFile
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import parse_quantization_config

np.float8_e4m3fn = ml_dtypes.float8_e4m3fn  # safetensors issue 682: its numpy path needs this alias for F8

PRESET = "ernie-moe-tiny"
DOWN0 = "ernie.layers.0.mlp.down_proj"
CT_STATIC = Path(__file__).parents[1] / "fixtures" / "qwen2-bytes-fp8-static"


def _measurement_file(path: Path, **amax: float) -> Path:
    """The preset's synthetic measurements with some modules' amax replaced, as a measurement file."""
    measurements = synthetic_measurements(preset_config(PRESET))
    measurements.amax.update({module.replace("__", "."): value for module, value in amax.items()})
    path.write_text(measurements.model_dump_json(exclude_none=True))
    return path


@pytest.mark.parametrize("amax", [1e300, 3.5e38, 2.0**100 * 1.01, 1e-300, 1e-45, 2.0**-100 * 0.99])
def test_convert_refuses_an_amax_out_of_range_naming_the_module(tmp_path, source_factory, amax):
    source = source_factory(PRESET)
    before = tree_digest(source)
    measurements = _measurement_file(tmp_path / "m.json", **{DOWN0.replace(".", "__"): amax})
    result = run_cli("convert", source, tmp_path / "out", "--measurements", measurements, "--workers", 1)
    line = assert_refused(result, str(measurements), DOWN0, "outside the range")  # the file, not "measurements #1"
    assert f"{amax:g}" in line
    assert not (tmp_path / "out").exists() and tree_digest(source) == before


def test_amax_at_both_ends_of_the_range_converts_validates_and_maps_to_finite_scales(tmp_path, source_factory):
    q, cache_k = "ernie.layers.0.self_attn.q", "ernie.layers.1.self_attn.cache_k"  # q feeds the softmax-scaled scales
    measurements = _measurement_file(
        tmp_path / "m.json", **{q.replace(".", "__"): 2.0**-100, cache_k.replace(".", "__"): 2.0**100}
    )
    out = tmp_path / "out"
    assert run_cli("convert", source_factory(PRESET), out, "--measurements", measurements, "--workers", 1).exit_code == 0
    assert validate(out).valid
    result = run_cli("map", out, "-o", tmp_path / "rank0.safetensors")
    assert result.exit_code == 0, result.stderr
    rank = SafetensorsFile(tmp_path / "rank0.safetensors")
    for name in rank.tensors:
        if "scale" in name.rsplit(".", 1)[-1]:
            values = np.asarray(rank.get(name), np.float32)
            assert np.isfinite(values).all() and (values > 0).all(), name


@pytest.mark.parametrize(
    ("key", "amax", "module"),
    [
        ("ernie.layers.0.mlp.down_proj.activation_scale", 7.2e40, DOWN0),  # stored as amax / 240 = 3e38 in bf16
        ("ernie.layers.1.self_attn.cachek_matmul.activation_scale", 1e-38, "ernie.layers.1.self_attn.cache_k"),  # raw amax
    ],
)
def test_import_legacy_refuses_an_activation_scale_out_of_range(tmp_path, source_factory, key, amax, module):
    measurement = {names.fastdeploy_key_from_module(m): v for m, v in synthetic_measurements(preset_config(PRESET)).amax.items()}
    measurement[key] = amax
    legacy = model_convert(source_factory(PRESET, "paddle"), tmp_path / "legacy", measurement)
    before = tree_digest(legacy)
    assert_refused(run_cli("import-legacy", legacy, tmp_path / "out"), module, "outside the range")
    assert not (tmp_path / "out").exists() and tree_digest(legacy) == before


def _ct_copy(tmp_path: Path, edit) -> Path:
    root = tmp_path / "ct"
    shutil.copytree(CT_STATIC, root)
    tensors = load_file(root / "model.safetensors")
    edit(tensors)
    save_file(tensors, root / "model.safetensors")
    return root


def test_import_refuses_an_input_scale_whose_amax_is_out_of_range(tmp_path):
    tensor = "model.layers.1.mlp.down_proj.input_scale"  # 3e38 x 448: an amax beyond 2^100 (float32 inf)
    root = _ct_copy(tmp_path, lambda t: t.update({tensor: np.full(t[tensor].shape, 3e38, t[tensor].dtype)}))
    before = tree_digest(root)
    assert_refused(run_cli("import", root, tmp_path / "out", "--kv-cache", "none"), tensor, "outside the range")
    assert not (tmp_path / "out").exists() and tree_digest(root) == before


def test_import_refuses_a_weight_scale_whose_dequantized_values_overflow(tmp_path):
    tensor = "model.layers.0.mlp.up_proj.weight_scale"
    root = _ct_copy(tmp_path, lambda t: t.update({tensor: np.full(t[tensor].shape, 3e38, t[tensor].dtype)}))
    with pytest.raises(NonFiniteError, match=rf"row 0 dequantizes to inf .*'{tensor}' overflows float32"):
        import_compressed_tensors(root, tmp_path / "out", ConvertOptions(kv_cache="none", workers=1))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("quantization_config", "named"),
    [
        ("fp8", "quantization_config is a str"),
        (["compressed-tensors"], "quantization_config is a list"),
        (
            {"quant_method": "compressed-tensors", "config_groups": [{"weights": {}}]},
            "config_groups: Input should be a valid dict",
        ),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": None}}}, "config_groups.g.weights"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": "eight"}}}}, "num_bits"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": []}}}, "config_groups.g.weights"),
        ({"config_groups": {}}, "quant_method is missing"),
    ],
    ids=["string", "list", "list-config-groups", "null-weights", "string-num-bits", "list-weights", "no-quant-method"],
)
def test_import_names_a_malformed_quantization_config(tmp_path, quantization_config, named):
    root = tmp_path / "ct"
    shutil.copytree(CT_STATIC, root)
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (root / "config.json").write_text(json.dumps(config))
    assert_refused(run_cli("import", root, tmp_path / "out", "--kv-cache", "none"), named)
    assert not (tmp_path / "out").exists()


def test_retarget_refuses_a_weight_scale_it_would_double_to_inf(tmp_path, source_factory):
    out = tmp_path / "g3"
    convert(source_factory(PRESET), out, [synthetic_measurements(preset_config(PRESET))], ConvertOptions(target="gaudi3"))
    name = "ernie.layers.0.self_attn.o_proj.weight_scale"
    overwrite_tensor_bytes(out, name, np.array([0x7F7F0000], np.uint32).tobytes())  # 3.39e38: bf16's largest, valid
    assert validate(out).valid
    assert_refused(run_cli("retarget", out, tmp_path / "g2", "--target", "gaudi2"), name, "overflows")
    assert not (tmp_path / "g2").exists()


def test_the_mapping_never_hands_out_an_inf_scale_even_from_an_unvalidated_checkpoint(spec_copy):
    root = spec_copy()
    overwrite_tensor_bytes(root, f"{DOWN0}.act_amax", np.float32([1e-45]).tobytes())  # converted and validated before
    overwrite_tensor_bytes(root, f"{DOWN0}.act_scale", np.float32([2.0**-126]).tobytes())
    checkpoint = Checkpoint.open(root)  # no validation: the mapping's own guard is what is tested
    qc, descriptor = parse_quantization_config(checkpoint.config), describe(checkpoint.config)
    with pytest.raises(HpuFp8Error, match=rf"{DOWN0}\.act_amax: amax 1\.4013e-45 is outside the range .* divide by it"):
        list(map_rank(checkpoint, qc, descriptor, Parallelism()))  # refused before the formulas: no division by zero

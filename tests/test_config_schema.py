"""quantization_config schema and config.json rules (spec sections "config.json" and "quantization_config")."""

from __future__ import annotations

import jsonschema
import pytest

from hpu_fp8_loader.errors import ConfigError, NotHpuFp8CheckpointError, UnsupportedFormatVersionError
from hpu_fp8_loader.io.checkpoint import read_config
from hpu_fp8_loader.spec.config import QuantizationConfig, fastdeploy_config_problems, parse_quantization_config


@pytest.fixture
def config(spec_factory):
    return read_config(spec_factory())


def test_a_converted_config_parses_and_holds_fastdeploy_keys(config):
    qc = parse_quantization_config(config)
    raw = config["quantization_config"]
    assert raw["quantization"] == "mix_quant"
    assert raw["dense_quant_type"] == raw["moe_quant_type"] == "tensor_wise_fp8"
    assert raw["kv_cache_quant_type"] == "float8_e4m3" and raw["is_quantized"] is True
    assert qc.fp8_max == 240.0 and qc.target.value == "gaudi2" and qc.format_version == 1
    assert fastdeploy_config_problems(config) == []


def test_the_shipped_json_schema_accepts_a_real_config_and_rejects_nonsense(config):
    schema = QuantizationConfig.model_json_schema()
    jsonschema.validate(config["quantization_config"], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**config["quantization_config"], "fp8_dtype": "float8_e5m2"}, schema)


def test_unknown_format_version_names_both_versions(config):
    config["quantization_config"]["format_version"] = 2
    with pytest.raises(UnsupportedFormatVersionError, match="format_version is 2.*implements format_version 1"):
        parse_quantization_config(config)


def test_a_source_checkpoint_is_not_an_hpu_fp8_checkpoint(config):
    del config["quantization_config"]
    with pytest.raises(NotHpuFp8CheckpointError, match="hpu-fp8 convert"):
        parse_quantization_config(config)


def test_a_legacy_fastdeploy_checkpoint_points_to_import_legacy():
    legacy = {"quantization_config": {"quantization": "mix_quant", "dense_quant_type": "tensor_wise_fp8", "is_quantized": True}}
    with pytest.raises(NotHpuFp8CheckpointError, match="import-legacy"):
        parse_quantization_config(legacy)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"fp8_max": 448.0}, "target gaudi2 requires fp8_max 240"),
        ({"fp8_max": 300.0}, "fp8_max must be 240.0"),
        ({"kv_cache_quant_type": None}, "kv_cache_quant_type must be 'float8_e4m3' exactly when"),
        ({"scale_dtype": "bfloat16"}, "scale_dtype"),
        ({"unknown_key": 1}, "unknown_key"),
        ({"weights": {"routed_experts": "tensor"}}, "routed_experts"),
    ],
)
def test_schema_rejects_nonsense_with_a_specific_message(config, change, message):
    config["quantization_config"].update(change)
    with pytest.raises(ConfigError, match=message):
        parse_quantization_config(config)


def test_gaudi3_range_is_allowed_for_the_gaudi3_target(config):
    config["quantization_config"].update(fp8_max=448.0, target="gaudi3")
    qc = parse_quantization_config(config)
    assert not qc.servable_by_fastdeploy


def test_calibration_references_must_exist(config):
    config["quantization_config"]["calibration"]["overrides"] = {"ernie.layers.0.self_attn.qkv_proj": "nowhere"}
    with pytest.raises(ConfigError, match="unknown source 'nowhere'"):
        parse_quantization_config(config)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"torch_dtype": "bfloat16"}, "torch_dtype"),
        ({"transformers_version": "4.57.1"}, "4.57.1 > 4.56.0"),
        ({"architectures": ["Ernie4_5_MoeForCausalLMPT"]}, "FastDeploy registers"),
    ],
)
def test_fastdeploy_paddle_format_rules(config, change, message):
    config.update(change)
    assert any(message in p for p in fastdeploy_config_problems(config))


def test_config_without_dtype_is_not_paddle_format(config):
    del config["dtype"]
    assert any("no 'dtype'" in p for p in fastdeploy_config_problems(config))
    assert fastdeploy_config_problems({**config, "dtype": "bfloat16", "transformers_version": "4.56.0"}) == []

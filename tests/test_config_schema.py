"""quantization_config schema and config.json rules (spec sections "config.json" and "quantization_config")."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from hostile.refusal import assert_refused, run_cli

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


def test_validate_of_a_compressed_tensors_checkpoint_points_to_import():
    """llm-compressor's FP8 output (a fixture made by it) is refused with the command that brings it in."""
    source = Path(__file__).parent / "fixtures" / "qwen2-bytes-fp8-static"
    line = assert_refused(run_cli("validate", source), "config.json", "compressed-tensors", code=2)
    assert line.endswith("This is a compressed-tensors checkpoint; convert it with `hpu-fp8 import SRC OUT`.")


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
        ({"head_dim": None}, "'head_dim': null"),
    ],
)
def test_fastdeploy_paddle_format_rules(config, change, message):
    config.update(change)
    assert any(message in p for p in fastdeploy_config_problems(config))


def test_config_without_dtype_is_not_paddle_format(config):
    del config["dtype"]
    assert any("no 'dtype'" in p for p in fastdeploy_config_problems(config))
    assert fastdeploy_config_problems({**config, "dtype": "bfloat16", "transformers_version": "4.56.0"}) == []


# ----- the parser is at least as strict as the published JSON Schema (issue 14 item 14) -----
_WRONG_VALUES = ["240", "x", 1.0, 1, 0, -1, True, False, None, [], {}, 1e300]
_DELETE, _EXTRA = object(), object()


def _paths(value, prefix=()):
    """Every key path (dict keys and list indexes) of a JSON value."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield (*prefix, key)
        yield from _paths(child, (*prefix, key))


def _mutated(qc: dict, path: tuple, replacement) -> dict:
    copy = json.loads(json.dumps(qc))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    if replacement is _DELETE:
        del parent[path[-1]]
    elif replacement is _EXTRA:
        if not isinstance(parent[path[-1]], dict):
            return copy
        parent[path[-1]]["unexpected_key"] = 1
    else:
        parent[path[-1]] = replacement
    return copy


@pytest.mark.parametrize(
    "replacement", [*_WRONG_VALUES, _DELETE, _EXTRA], ids=[*map(json.dumps, _WRONG_VALUES), "delete", "extra-key"]
)
def test_every_config_the_published_schema_rejects_the_parser_rejects(config, replacement):
    """Each key of a real quantization_config replaced by a value of another type, deleted, or given an extra key."""
    schema = jsonschema.Draft202012Validator(json.loads(json.dumps(QuantizationConfig.model_json_schema())))
    qc = config["quantization_config"]
    checked, accepted = 0, []
    for path in _paths(qc):
        mutated = _mutated(qc, path, replacement)
        if schema.is_valid(mutated):
            continue
        checked += 1
        try:
            parse_quantization_config({**config, "quantization_config": mutated})
        except ConfigError:
            continue
        accepted.append(".".join(map(str, path)))
    assert checked > 0
    assert accepted == [], f"the schema rejects, the parser accepts: {accepted}"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"fp8_max": "240"}, "'fp8_max' should be a valid number, got \"240\""),
        ({"fp8_max": True}, "'fp8_max' should be a valid number, got true"),
        ({"format_version": 1.0}, "'format_version' should be 1, got 1.0"),
        ({"format_version": True}, "'format_version' should be 1, got true"),
        ({"is_quantized": 1}, "'is_quantized' should be true, got 1"),
        ({"activations": {"strategy": "tensor", "dynamic": 0}}, "'activations.dynamic' should be false, got 0"),
        ({"target": "GAUDI2"}, "'target' should be 'gaudi2' or 'gaudi3', got \"GAUDI2\""),
    ],
)
def test_wrong_json_types_are_refused_naming_the_key_and_the_json_value(config, change, message):
    """Also stricter than the schema where JSON Schema is lenient: 1.0 counts as an integer there, not here."""
    config["quantization_config"].update(change)
    with pytest.raises(ConfigError) as caught:
        parse_quantization_config(config, "ckpt/config.json")
    assert str(caught.value) == f"ckpt/config.json: quantization_config: {message}"


@pytest.mark.parametrize("what", ["quantization-config", "measurements"])
def test_the_printed_schema_carries_the_prose_of_the_docstrings_not_their_python_examples(what):
    from click.testing import CliRunner

    from hpu_fp8_loader.cli.main import main

    result = CliRunner().invoke(main, ["schema", what])
    assert result.exit_code == 0, result.output
    schema = json.loads(result.output)
    assert schema["description"] and ">>>" not in result.output and "Example:" not in result.output

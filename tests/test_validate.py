"""`validate`: one test per rule of docs/spec.md, each on a real checkpoint damaged in one way."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
from click.testing import CliRunner
from helpers.checkpoint_damage import overwrite_tensor_bytes

from hpu_fp8_loader.checks.validate import validate
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.errors import ConfigError, NotHpuFp8CheckpointError, UnsupportedFormatVersionError
from hpu_fp8_loader.io.checkpoint import read_config
from hpu_fp8_loader.io.manifest import write_manifest
from hpu_fp8_loader.io.safetensors_file import read_header

QKV = "ernie.layers.0.self_attn.qkv_proj"


def rules(report) -> set[str]:
    return {v.rule for v in report.violations}


def _edit_config(root, edit):
    config = read_config(root)
    edit(config)
    (root / "config.json").write_text(json.dumps(config))
    write_manifest(root)  # a consistent manifest, so only the rule under test fires


@pytest.mark.parametrize("preset", ["ernie-moe-tiny", "ernie-dense-tiny", "qwen2-tiny"])
@pytest.mark.parametrize("kv_cache", ["fp8", "none"])
def test_converted_checkpoints_are_valid(spec_factory, preset, kv_cache):
    for full in (True, False):
        report = validate(spec_factory(preset, kv_cache), full=full)
        assert report.valid, report.violations
    assert report.tensors > 0


def test_kv_scheme_none_has_no_attention_act_tensors(spec_factory):
    root = spec_factory("qwen2-tiny", "none")
    names = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(".self_attn.cache_k." in n or ".self_attn.s." in n for n in names)
    assert any(
        ".self_attn.cache_k." in n
        for n in json.loads((spec_factory("qwen2-tiny", "fp8") / "model.safetensors.index.json").read_text())["weight_map"]
    )


def test_truncated_shard(spec_copy):
    root = spec_copy()
    shard = sorted(root.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-10])
    report = validate(root)
    assert "container.shard" in rules(report) and not report.valid
    assert any("truncated" in v.message and v.where == shard.name for v in report.violations)


def test_header_offsets_beyond_the_file(spec_copy):
    root = spec_copy()
    shard = sorted(root.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    begin = header[name]["data_offsets"][0]
    header[name]["data_offsets"] = [begin + 10**7, begin + 10**7 + header[name]["data_offsets"][1] - begin]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    report = validate(root)
    assert any(v.rule == "container.shard" and "truncated" in v.message for v in report.violations)


def test_missing_shard(spec_copy):
    root = spec_copy()
    shard = sorted(root.glob("*.safetensors"))[1]
    shard.unlink()
    report = validate(root, full=False)
    assert any(v.rule == "container.shard" and "missing" in v.message for v in report.violations)
    assert "container.manifest" in rules(report)


@pytest.mark.parametrize("entry", ["../../etc/passwd", "/etc/passwd"])
def test_index_entry_outside_the_directory(spec_copy, entry):
    root = spec_copy()
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"][f"{QKV}.weight"] = entry
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    report = validate(root)
    assert any(v.rule == "container.shard" and v.where == entry and "checkpoint" in v.message for v in report.violations)


def test_index_that_is_not_json(spec_copy):
    root = spec_copy()
    (root / "model.safetensors.index.json").write_text("{not json")
    assert "container.index" in rules(validate(root))


@pytest.mark.parametrize(
    ("damage", "error", "message"),
    [
        (lambda root: (root / "config.json").write_text("{'single': quotes}"), ConfigError, "not valid JSON"),
        (lambda root: (root / "config.json").unlink(), ConfigError, "missing"),
        (
            lambda root: _edit_config(root, lambda c: c["quantization_config"].update(format_version=2)),
            UnsupportedFormatVersionError,
            "format_version is 2",
        ),
        (lambda root: _edit_config(root, lambda c: c.pop("quantization_config")), NotHpuFp8CheckpointError, "source"),
    ],
)
def test_unreadable_checkpoints_raise_and_exit_2(spec_copy, damage, error, message):
    root = spec_copy()
    damage(root)
    with pytest.raises(error, match=message):
        validate(root)
    result = CliRunner().invoke(main, ["validate", str(root)])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_a_source_checkpoint_is_unreadable_not_valid(source_factory):
    result = CliRunner().invoke(main, ["validate", "--json", str(source_factory())])
    assert result.exit_code == 2
    assert json.loads(result.stdout)["valid"] is False


def test_weight_scale_not_bf16_representable(spec_copy):
    root = spec_copy()
    overwrite_tensor_bytes(root, f"{QKV}.weight_scale", np.array([0.0123456], np.float32).tobytes())
    assert "scales.weight-bf16" in rules(validate(root))


@pytest.mark.parametrize("value", [0.0, -1.0, np.inf, np.nan])
def test_scales_must_be_finite_and_positive(spec_copy, value):
    root = spec_copy()
    overwrite_tensor_bytes(root, f"{QKV}.act_amax", np.array([value], np.float32).tobytes())
    report = validate(root, full=False)
    assert any(v.rule == "scales.finite-positive" and v.where == f"{QKV}.act_amax" for v in report.violations)


def test_act_scale_must_equal_amax_over_fp8_max(spec_copy):
    root = spec_copy()
    overwrite_tensor_bytes(root, f"{QKV}.act_amax", np.array([123.0], np.float32).tobytes())
    report = validate(root, full=False)
    assert any(v.rule == "scales.act-consistent" and v.where == f"{QKV}.act_scale" for v in report.violations)


def test_s_amax_must_be_one(spec_copy):
    root = spec_copy()
    s = "ernie.layers.1.self_attn.s"
    overwrite_tensor_bytes(root, f"{s}.act_amax", np.array([0.5], np.float32).tobytes())
    overwrite_tensor_bytes(root, f"{s}.act_scale", np.array([np.float32(0.5) / np.float32(240)], np.float32).tobytes())
    report = validate(root, full=False)
    assert rules(report) >= {"scales.s-amax-one"} and "scales.act-consistent" not in rules(report)


@pytest.mark.parametrize(("code", "kind"), [(0x7F, "NaN codes"), (0xFF, "NaN codes"), (0x78, "beyond"), (0xFB, "beyond")])
def test_fp8_codes_beyond_range_or_nan_are_found_by_the_full_scan(spec_copy, code, kind):
    root = spec_copy()
    name = "ernie.layers.2.mlp.experts.3.down_proj.weight"
    shard = next(p for p in root.glob("*.safetensors") if name in read_header(p)[0])
    info = read_header(shard)[0][name]
    with open(shard, "r+b") as f:
        f.seek(info.begin + 17)
        f.write(bytes([code]))
    write_manifest(root)
    assert validate(root, full=False).valid  # the quick check does not read weights
    for hashes in (False, True):  # the fp8-only reads and the hashing sequential read find the same
        report = validate(root, hashes=hashes)
        assert [(v.rule, v.where) for v in report.violations] == [("weights.fp8-codes", name)]
        assert kind in report.violations[0].message and "flat index 17" in report.violations[0].message


def test_manifest_sha256_is_checked_when_asked(spec_copy):
    root = spec_copy()
    overwrite_tensor_bytes(root, "ernie.norm.weight", bytes(2 * 64))  # same size, other bytes
    assert validate(root, full=False).valid and validate(root).valid
    for full in (True, False):
        report = validate(root, full=full, hashes=True)
        assert [v.rule for v in report.violations] == ["container.manifest"] and "sha256" in report.violations[0].message
    result = CliRunner().invoke(main, ["validate", "-q", "--hashes", str(root)])
    assert result.exit_code == 1 and "sha256 differs" in result.output


def test_missing_manifest_means_unfinished(spec_copy):
    root = spec_copy()
    (root / "hpu_fp8_manifest.json").unlink()
    assert any("never finished" in v.message for v in validate(root, full=False).violations)


def test_missing_and_unexpected_tensors_and_wrong_dtype(spec_copy, tmp_path):
    root = spec_copy()
    _edit_config(root, lambda c: c.update(num_hidden_layers=2, moe_layer_end_index=1))
    report = validate(root, full=False)
    assert any(v.rule == "tensors.expected" and "unexpected" in v.message for v in report.violations)
    root2 = tmp_path / "other"
    shutil.copytree(root, root2)
    _edit_config(root2, lambda c: c.update(num_hidden_layers=3, moe_layer_end_index=2, hidden_size=32))
    report = validate(root2, full=False)
    assert "tensors.dtype-shape" in rules(report)


def test_missing_tensor_is_named(spec_copy):
    root = spec_copy()
    _edit_config(root, lambda c: c.update(moe_num_shared_experts=0))
    report = validate(root, full=False)
    assert any(v.rule == "tensors.expected" and "shared_experts" in v.message for v in report.violations)
    _edit_config(root, lambda c: c.update(moe_num_shared_experts=1, num_hidden_layers=4, moe_layer_end_index=3))
    report = validate(root, full=False)
    assert any(v.rule == "tensors.expected" and "missing" in v.message and "layers.3" in v.message for v in report.violations)


@pytest.mark.parametrize(
    ("edit", "rule"),
    [
        (lambda c: c.update(torch_dtype="bfloat16"), "config.fastdeploy"),
        (lambda c: c.update(architectures=["Ernie4_5_MoeForCausalLMPT"]), "config.fastdeploy"),
        (lambda c: c["quantization_config"].update(ignore=["ernie.layers.0.self_attn.nothing"]), "config.ignore"),
        (
            lambda c: c["quantization_config"]["moe"]["dead_experts"].update(
                policy="sibling-max", filled=[{"layer": 0, "expert": 1}]
            ),
            "config.moe-policy",
        ),
    ],
)
def test_config_rules(spec_copy, edit, rule):
    root = spec_copy()
    _edit_config(root, edit)
    assert rule in rules(validate(root, full=False))


def test_gaudi3_range_warns_that_fastdeploy_cannot_serve_it(spec_copy):
    root = spec_copy()
    _edit_config(root, lambda c: c["quantization_config"].update(fp8_max=448.0, target="gaudi3"))
    report = validate(root, full=False)
    assert any("FastDeploy" in w and "retarget" in w for w in report.warnings)
    assert "scales.act-consistent" in rules(report)  # act scales were derived for 240


def test_cli_warnings_go_to_stderr_with_the_prefix_and_stdout_keeps_the_result(spec_copy):
    root = spec_copy()
    _edit_config(root, lambda c: c["quantization_config"].update(fp8_max=448.0, target="gaudi3"))
    plain, as_json = (CliRunner().invoke(main, ["validate", str(root), "--quick", *args]) for args in ([], ["--json"]))
    for result in (plain, as_json):
        warnings = [line for line in result.stderr.splitlines() if line.startswith("hpu-fp8: warning: fp8_max is 448")]
        assert len(warnings) == 1, result.stderr
    assert "fp8_max is 448" not in plain.stdout and plain.stdout.splitlines()[-1].startswith(f"{root}: INVALID")
    report = json.loads(as_json.stdout)  # --json: stdout is one JSON document, the warning inside it too
    assert any("fp8_max is 448" in w for w in report["warnings"])


def test_cli_lists_every_violation_and_exits_1(spec_copy):
    root = spec_copy()
    overwrite_tensor_bytes(root, f"{QKV}.weight_scale", np.array([0.0123456], np.float32).tobytes())
    overwrite_tensor_bytes(root, f"{QKV}.act_amax", np.array([0.0], np.float32).tobytes())
    result = CliRunner().invoke(main, ["validate", "-q", str(root)])
    assert result.exit_code == 1
    assert "[scales.weight-bf16]" in result.output and "[scales.finite-positive]" in result.output
    assert "INVALID" in result.output
    data = json.loads(CliRunner().invoke(main, ["validate", "--json", "--quick", str(root)]).stdout)
    assert data["valid"] is False and {v["rule"] for v in data["violations"]} >= {"scales.weight-bf16"}


def test_cli_valid_exits_0(spec_factory):
    result = CliRunner().invoke(main, ["validate", "-q", str(spec_factory())])
    assert result.exit_code == 0 and "valid hpu-fp8 v1 checkpoint" in result.output


def test_calibration_overrides_must_name_act_modules(spec_copy):
    root = spec_copy()

    def edit(c):
        calibration = c["quantization_config"]["calibration"]
        calibration["overrides"] = {"ernie.layers.0.mlp.gate": calibration["default_source"]}

    _edit_config(root, edit)
    assert "config.calibration" in rules(validate(root, full=False))


def test_pow2_declared_but_scales_not_powers_of_two(spec_copy):
    root = spec_copy()
    _edit_config(root, lambda c: c["quantization_config"].update(scale_rounding="pow2"))
    assert {"scales.pow2", "scales.act-consistent"} <= rules(validate(root, full=False))

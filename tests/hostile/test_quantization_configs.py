"""Hostile quantization_config values: validate and inspect refuse them as unreadable, naming the key (issue 14 item 14).

validate accepted ``fp8_max: "240"`` and ``format_version: 1.0``; pydantic's lax mode coerced them. The
parser is now strict, so what the published schema (``hpu-fp8 schema quantization-config``) rejects it
rejects too (the exhaustive check is tests/test_config_schema.py); here the CLI answers are checked.
"""

from __future__ import annotations

import json
import shutil

import pytest

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.cli.group import EXIT_UNREADABLE

# (dotted key, value): the value is put at that key of the converted checkpoint's quantization_config.
BAD_VALUES = [
    ("fp8_max", "240"),
    ("fp8_max", True),
    ("fp8_max", None),
    ("fp8_max", [240]),
    ("format_version", 1.0),
    ("format_version", "1"),
    ("format_version", True),
    ("format_version", None),
    ("is_quantized", 1),
    ("is_quantized", "true"),
    ("activations.dynamic", 0),
    ("activations.dynamic", "false"),
    ("activations.strategy", 1),
    ("kv_cache_scheme", 1),
    ("kv_cache_scheme", "FP8"),
    ("kv_cache_quant_type", 8),
    ("target", "GAUDI2"),
    ("target", ["gaudi2"]),
    ("scale_rounding", None),
    ("scale_dtype", 32),
    ("fp8_dtype", True),
    ("ignore", "lm_head"),
    ("ignore", [1]),
    ("weights.routed_experts", True),
    ("moe.dead_experts.policy", 0),
    ("moe.dead_experts.filled", {"layer": 1}),
    ("calibration.default_source", 0),
    ("calibration.overrides", []),
    ("calibration.sources", {}),
    ("producer.version", 1.0),
    ("producer.name", None),
    ("quantization", True),
    ("dense_quant_type", 8),
]


def _set(tree: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        tree = tree[key]
    tree[last] = value


@pytest.mark.parametrize("command", ["validate", "inspect"])
@pytest.mark.parametrize(("key", "value"), BAD_VALUES, ids=[f"{k}={json.dumps(v)}" for k, v in BAD_VALUES])
def test_a_wrongly_typed_quantization_config_value_is_unreadable_naming_the_key(command, key, value, spec_factory, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(spec_factory(), model)
    config = json.loads((model / "config.json").read_text())
    _set(config["quantization_config"], key, value)
    (model / "config.json").write_text(json.dumps(config))
    before = tree_digest(tmp_path)
    line = assert_refused(run_cli(command, model), key.rpartition(".")[2], "config.json", code=EXIT_UNREADABLE)
    assert "Value error" not in line and "None" not in line
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("command", ["validate", "inspect"])
def test_modules_to_not_convert_is_refused_saying_fastdeploy_acts_on_it(command, spec_factory, tmp_path):
    """FastDeploy from 82057cb7 builds every linear ``modules_to_not_convert`` matches unquantized; the spec keeps linears
    in BF16 only by group, so the key is refused, naming it and why, whatever it lists."""
    model = tmp_path / "model"
    shutil.copytree(spec_factory(), model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["ernie.layers.1.mlp.shared_experts.down_proj"]
    (model / "config.json").write_text(json.dumps(config))
    before = tree_digest(tmp_path)
    line = assert_refused(run_cli(command, model), "modules_to_not_convert", "82057cb7", code=EXIT_UNREADABLE)
    assert "by group" in line
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize(
    "entry",
    ["model.layers.0.self_attn.qkv_proj", "ernie.layers.0.self_attn", "ernie.layers.*.mlp.down_proj", "*"],
    ids=["model-prefix", "a-module-above-linears", "glob", "everything"],
)
def test_an_ignore_entry_fastdeploy_would_match_beyond_the_spec_is_refused(entry, spec_factory, tmp_path):
    """FastDeploy from 82057cb7 reads ``ignore`` as globs over every linear's prefix (and ``model.`` as the model's own
    prefix): each entry here is no linear's name, would keep linears FastDeploy matches in BF16 while the hook fills
    them in FP8, and is refused by validate naming it."""
    model = tmp_path / "model"
    shutil.copytree(spec_factory("ernie-moe-tiny"), model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"]["ignore"] = [entry]
    (model / "config.json").write_text(json.dumps(config))
    result = run_cli("validate", model)
    assert (
        result.exit_code == 1 and f"[config.ignore] quantization_config.ignore: {entry!r} is not a linear module" in result.output
    )
    assert "82057cb7" in result.output

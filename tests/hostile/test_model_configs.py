"""Hostile model config.json values: every command that reads the config refuses them in one line naming the key.

Issue 14 items 8 (``tie_word_embeddings: "false"`` read as true), 12 (``int()`` on config values gave
tracebacks) and 13 (config bombs ran for a minute before failing). Each case edits one key of a real
checkpoint's config.json (fixtures from conftest) and runs plan, convert, calibrate, validate and
inspect on it, and ``synth --set`` with the same value.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.arch.config_keys import MAX_EXPERT_MODULES, MAX_LAYERS
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements

MOE, QWEN = "ernie-moe-tiny", "qwen2-tiny"
# (preset, key, value): a value of the wrong JSON type, out of bounds, or inconsistent with other keys.
BAD_VALUES = [
    (QWEN, "tie_word_embeddings", "false"),
    (QWEN, "tie_word_embeddings", "true"),
    (QWEN, "tie_word_embeddings", 0),
    (MOE, "tie_word_embeddings", 1),
    (MOE, "tie_word_embeddings", None),
    (MOE, "num_hidden_layers", 3.0),
    (MOE, "num_hidden_layers", "3"),
    (MOE, "num_hidden_layers", True),
    (MOE, "num_hidden_layers", 0),
    (MOE, "num_hidden_layers", -1),
    (MOE, "num_hidden_layers", [3]),
    (MOE, "num_hidden_layers", 10**8),
    (MOE, "hidden_size", "64"),
    (MOE, "hidden_size", 10**9),
    (QWEN, "hidden_size", 64.5),
    (QWEN, "num_attention_heads", 0),
    (QWEN, "num_attention_heads", 10**6),
    (MOE, "num_key_value_heads", "2"),
    (MOE, "num_key_value_heads", 2.0),
    (MOE, "num_key_value_heads", [2]),
    (MOE, "num_key_value_heads", 3),
    (QWEN, "num_key_value_heads", {"n": 2}),
    (MOE, "head_dim", "16"),
    (MOE, "head_dim", 0),
    (MOE, "vocab_size", 10**12),
    (QWEN, "vocab_size", "512"),
    (MOE, "intermediate_size", True),
    (QWEN, "intermediate_size", 10**10),
    (MOE, "moe_num_experts", 10**7),
    (MOE, "moe_num_experts", 4.0),
    (MOE, "moe_num_experts", "4"),
    (MOE, "moe_num_experts", True),
    (MOE, "moe_num_experts", None),
    (MOE, "moe_k", 5),
    (MOE, "moe_k", "2"),
    (MOE, "moe_intermediate_size", 32.0),
    (MOE, "moe_intermediate_size", 10**10),
    (MOE, "moe_num_shared_experts", "1"),
    (MOE, "moe_num_shared_experts", -1),
    (MOE, "moe_layer_start_index", "1"),
    (MOE, "moe_layer_start_index", 1.0),
    (MOE, "moe_layer_start_index", [1, 1]),
    (MOE, "moe_layer_start_index", 5),
    (MOE, "moe_layer_end_index", "2"),
    (MOE, "moe_layer_end_index", 9),
    (MOE, "moe_layer_interval", 0),
    (MOE, "moe_layer_interval", "1"),
    (MOE, "moe_use_aux_free", "true"),
    (MOE, "moe_use_aux_free", 1),
    (MOE, "use_bias", "false"),
    (MOE, "use_bias", True),
    (MOE, "model_type", ["ernie4_5_moe"]),
    (MOE, "model_type", 5),
    (MOE, "model_type", "llama"),
    (QWEN, "architectures", "Qwen2ForCausalLM"),
    (QWEN, "architectures", [1]),
    (QWEN, "rms_norm_eps", "1e-6"),
    (QWEN, "rope_theta", -1),
    (MOE, "max_position_embeddings", "4096"),
    (MOE, "moe_norm_min", "1e-12"),
]
CASES = [pytest.param(*case, id=f"{case[1]}={json.dumps(case[2])}") for case in BAD_VALUES]
CONFIG_COMMANDS = ["plan", "convert", "calibrate", "validate", "inspect"]


@pytest.fixture(scope="module")
def measurement_file(tmp_path_factory):
    """Real synthetic measurements per preset, so convert gets as far as reading the config."""
    root = tmp_path_factory.mktemp("measurements")
    paths = {}
    for preset in (MOE, QWEN):
        paths[preset] = root / f"{preset}.json"
        write_measurements(paths[preset], synthetic_measurements(preset_config(preset)))
    return paths


def _with_config(checkpoint: Path, target: Path, **changes) -> Path:
    """A copy of ``checkpoint`` whose config.json has ``changes`` applied (None deletes nothing: it writes null)."""
    shutil.copytree(checkpoint, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def _command_args(command: str, model: Path, tmp_path: Path, measurements: Path) -> list:
    out = tmp_path / "out"
    return {
        "plan": ["plan", model],
        "convert": ["convert", model, out, "--measurements", measurements, "-q", "--workers", "1"],
        "calibrate": ["calibrate", model, "-o", out, "--samples", "1", "--seq-len", "8", "-q"],
        "validate": ["validate", model, "-q"],
        "inspect": ["inspect", model],
    }[command]


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
@pytest.mark.parametrize(("preset", "key", "value"), CASES)
def test_a_bad_config_value_is_refused_by_every_command_naming_the_key(
    command, preset, key, value, source_factory, spec_factory, measurement_file, tmp_path
):
    checkpoint = spec_factory(preset) if command in ("validate", "inspect") else source_factory(preset)
    model = _with_config(checkpoint, tmp_path / "model", **{key: value})
    before = tree_digest(tmp_path)
    result = run_cli(*_command_args(command, model, tmp_path, measurement_file[preset]))
    line = assert_refused(result, key)
    assert "Traceback" not in line and "Value error" not in line and "None" not in line
    assert tree_digest(tmp_path) == before  # the model untouched, no output left behind


@pytest.mark.parametrize(("preset", "key", "value"), CASES)
def test_synth_set_with_a_bad_value_is_refused_naming_the_key(preset, key, value, tmp_path):
    result = run_cli("synth", tmp_path / "out", "--preset", preset, "--set", f"{key}={json.dumps(value)}", "-q")
    assert_refused(result, key)
    assert not (tmp_path / "out").exists()


def test_a_string_false_no_longer_drops_lm_head(source_factory, measurement_file, tmp_path):
    """The reported case: an untied Qwen2 with tie_word_embeddings "false" was converted without lm_head."""
    model = _with_config(source_factory(QWEN), tmp_path / "model", tie_word_embeddings="false")
    result = run_cli("convert", model, tmp_path / "out", "--measurements", measurement_file[QWEN], "-q", "--workers", "1")
    assert_refused(result, "tie_word_embeddings", "config.json", '"false"')
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("key", "value"),
    [("num_hidden_layers", 10**8), ("moe_num_experts", 10**7), ("vocab_size", 10**15), ("hidden_size", 10**12)],
)
@pytest.mark.parametrize("command", ["plan", "convert", "calibrate"])
def test_a_config_bomb_is_refused_at_once(command, key, value, source_factory, measurement_file, tmp_path):
    """A 100-byte config declaring 10^8 layers ran for a minute and ate memory before failing."""
    model = _with_config(source_factory(MOE), tmp_path / "model", **{key: value})
    started = time.monotonic()
    result = run_cli(*_command_args(command, model, tmp_path, measurement_file[MOE]))
    assert_refused(result, key, "less than or equal to")
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"num_hidden_layers": MAX_LAYERS}, "num_hidden_layers"),
        ({"num_hidden_layers": 2, "moe_layer_end_index": 1}, "num_hidden_layers"),
        ({"moe_num_experts": MAX_EXPERT_MODULES // 1024}, "moe_num_experts"),
        ({"moe_num_experts": 3, "moe_k": 2}, "moe_num_experts"),
    ],
    ids=["layers-beyond-the-files", "fewer-layers-than-the-files", "experts-beyond-the-files", "fewer-experts"],
)
def test_plan_checks_layer_and_expert_counts_against_the_tensors_present(changes, key, source_factory, tmp_path):
    """Within the bounds but not what the files hold: refused from the tensor names, before enumerating."""
    model = _with_config(source_factory(MOE), tmp_path / "model", **changes)
    line = assert_refused(run_cli("plan", model), key, "config.json")
    assert "checkpoint's tensors hold" in line


def test_synth_set_with_a_typo_names_the_close_matches(tmp_path):
    result = run_cli("synth", tmp_path / "out", "--set", "hiden_size=32", "-q")
    assert_refused(result, "'hiden_size'", "hidden_size")
    assert not (tmp_path / "out").exists()


def test_synth_refuses_a_model_too_big_to_generate_before_writing(tmp_path):
    args = ["--set", "hidden_size=65536", "--set", "vocab_size=4000000", "--set", "num_attention_heads=512"]
    result = run_cli("synth", tmp_path / "out", *args, "-q")
    assert_refused(result, "ernie.embed_tokens.weight")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("preset", [MOE, QWEN])
def test_real_json_types_are_accepted(preset, source_factory):
    """The control: the fixtures' own configs (real booleans and integers) plan fine, with lm_head where untied."""
    result = run_cli("plan", source_factory(preset), "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["model_type"] == preset_config(preset)["model_type"]

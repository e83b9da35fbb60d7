"""A source must be the model its config.json describes, with nothing left over that nobody accounts for.

Found by a hostile run: convert dropped tensors it did not know (an o_proj bias, q_norm, a layer beyond
num_hidden_layers, an extra expert) and exited 0 with a checkpoint that validates; calibrate took a
config.json with fewer layers or other head counts than its tensors and exited 0 (or crashed with a
KeyError); a corrupt tokenizer.json was copied into the output; `import` ignored zero points and 2:4
sparsity. Known, deliberate omissions (ERNIE's MTP draft weights, rotary inv_freq buffers, a tied
lm_head) are named in a warning instead.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements

np.float8_e4m3fn = ml_dtypes.float8_e4m3fn  # safetensors issue 682: its numpy path needs this alias for F8
QWEN, MOE = "qwen2-tiny", "ernie-moe-tiny"
CT_STATIC = Path(__file__).parents[1] / "fixtures" / "qwen2-bytes-fp8-static"


@pytest.fixture
def copy_of(tmp_path, source_factory):
    """A private single-shard copy of a synthesized source, for one tensor to be added."""

    def make(preset: str) -> Path:
        root = tmp_path / "src"
        tensors = {}
        for shard in sorted(source_factory(preset).glob("*.safetensors")):
            tensors.update(load_file(shard))
        root.mkdir()
        save_file(tensors, root / "model.safetensors")
        shutil.copy(source_factory(preset) / "config.json", root / "config.json")
        write_measurements(tmp_path / "m.json", synthetic_measurements(preset_config(preset)))
        return root

    return make


def _add(root: Path, name: str, shape: tuple[int, ...], dtype=ml_dtypes.bfloat16) -> None:
    tensors = load_file(root / "model.safetensors")
    tensors[name] = np.ones(shape, dtype)
    save_file(tensors, root / "model.safetensors")


# case -> (preset, tensor added, its shape (64: the hidden size), what the refusal names)
UNKNOWN = {
    "o_proj-bias": (QWEN, "qwen2.layers.0.self_attn.o_proj.bias", (64,), "not part of"),
    "q_norm": (QWEN, "qwen2.layers.0.self_attn.q_norm.weight", (16,), "not part of"),
    "down_proj-bias": (QWEN, "qwen2.layers.1.mlp.down_proj.bias", (64,), "not part of"),
    "stray-top-level": (QWEN, "visual.patch_embed.weight", (4, 4), "not part of"),
    "expert-beyond-moe_num_experts": (MOE, "ernie.layers.1.mlp.experts.99.down_proj.weight", (32, 64), "moe_num_experts"),
}


@pytest.mark.parametrize("case", sorted(UNKNOWN))
@pytest.mark.parametrize("command", ["convert", "calibrate"])
def test_a_tensor_the_model_does_not_account_for_is_refused_by_name(tmp_path, copy_of, case, command):
    preset, name, shape, named = UNKNOWN[case]
    root = copy_of(preset)
    config = json.loads((root / "config.json").read_text())
    shape = tuple(config["hidden_size"] if n == 64 else n for n in shape)
    _add(root, name, shape)
    before = tree_digest(root)
    if command == "convert":
        argv = ("convert", root, tmp_path / "out", "--measurements", tmp_path / "m.json", "-q")
    else:
        argv = ("calibrate", root, "-o", tmp_path / "c.json", "--samples", "1", "--seq-len", "8", "-q")
    assert_refused(run_cli(*argv), name if named == "not part of" else "experts 0..99", named)
    assert tree_digest(root) == before
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists() and not (tmp_path / "c.json").exists()


@pytest.mark.slow
def test_known_omissions_convert_with_a_warning_naming_them(tmp_path, copy_of):
    root = copy_of(MOE)
    hidden = json.loads((root / "config.json").read_text())["hidden_size"]
    _add(root, "ernie.mtp_block.0.self_attn.qkv_proj.weight", (hidden, hidden))
    _add(root, "ernie.mtp_emb_norm.0.weight", (hidden,))
    _add(root, "ernie.layers.0.self_attn.rotary_emb.inv_freq", (8,), np.float32)
    result = run_cli("convert", root, tmp_path / "out", "--measurements", tmp_path / "m.json", "-q")
    assert result.exit_code == 0, result.stderr
    assert "2 tensor(s) not carried over: ERNIE multi-token-prediction (MTP)" in result.stderr
    assert "1 tensor(s) not carried over: rotary inv_freq" in result.stderr
    assert run_cli("validate", tmp_path / "out").exit_code == 0


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("num_hidden_layers", 1, "num_hidden_layers"),  # fewer than the tensors hold: calibrate used to exit 0
        ("num_hidden_layers", 4, "num_hidden_layers"),  # more: a KeyError mid-forward
        ("num_attention_heads", 8, "qkv_proj"),  # same hidden size, other head split: exit 0 and nonsense
        ("vocab_size", 300, "embed_tokens"),
    ],
)
def test_calibrate_checks_config_json_against_the_tensors(tmp_path, copy_of, key, value, named):
    root = copy_of(QWEN)
    config = json.loads((root / "config.json").read_text())
    config[key] = value
    (root / "config.json").write_text(json.dumps(config))
    result = run_cli("calibrate", root, "-o", tmp_path / "c.json", "--samples", "1", "--seq-len", "8", "-q")
    assert_refused(result, named)
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize(
    ("content", "named"),
    [('{"not": 1', "not valid JSON"), ('{"a": 1, "a": 2}', "duplicate key"), ("[1, 2]", "not a JSON object")],
)
def test_a_corrupt_tokenizer_file_is_refused_before_converting_not_published(tmp_path, copy_of, content, named):
    root = copy_of(QWEN)
    (root / "tokenizer_config.json").write_text(content)
    result = run_cli("convert", root, tmp_path / "out", "--measurements", tmp_path / "m.json", "-q")
    assert_refused(result, "tokenizer_config.json", named)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_tokenizer_file_that_is_a_directory_is_refused_before_converting(tmp_path, copy_of):
    root = copy_of(QWEN)
    (root / "tokenizer.json").mkdir()
    result = run_cli("convert", root, tmp_path / "out", "--measurements", tmp_path / "m.json", "-q")
    assert_refused(result, "tokenizer.json", "not a regular file")
    assert not (tmp_path / "out.partial").exists()


def _ct_copy(tmp_path: Path, edit) -> Path:
    root = tmp_path / "ct"
    shutil.copytree(CT_STATIC, root)
    config = json.loads((root / "config.json").read_text())
    edit(config["quantization_config"], root)
    (root / "config.json").write_text(json.dumps(config))
    return root


def _zero_point(qc: dict, root: Path) -> None:
    qc["config_groups"]["group_0"]["weights"]["symmetric"] = False
    _add(root, "model.layers.0.self_attn.q_proj.weight_zero_point", (1,), np.int8)


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (_zero_point, "asymmetric"),
        (lambda qc, root: qc.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparse-24-bitmask"),
        (lambda qc, root: _add(root, "model.layers.0.self_attn.q_proj.bogus", (4,)), "q_proj.bogus"),
    ],
    ids=["zero-points", "sparsity", "unknown-tensor"],
)
def test_import_refuses_what_it_would_otherwise_ignore(tmp_path, edit, named):
    source = _ct_copy(tmp_path, edit)
    assert_refused(run_cli("import", source, tmp_path / "out", "--kv-cache", "none"), named)
    assert not (tmp_path / "out").exists()


def test_validate_names_a_missing_quant_method_as_json_would(tmp_path, spec_factory):
    root = tmp_path / "ckpt"
    shutil.copytree(spec_factory(QWEN), root)
    config = json.loads((root / "config.json").read_text())
    del config["quantization_config"]["quant_method"]
    (root / "config.json").write_text(json.dumps(config))
    line = assert_refused(run_cli("inspect", root), "quant_method is missing")
    config["quantization_config"]["quant_method"] = None
    (root / "config.json").write_text(json.dumps(config))
    assert "quant_method is null" in assert_refused(run_cli("inspect", root)) and line


def test_a_source_with_both_a_single_file_and_an_index_that_ignores_it_is_ambiguous(tmp_path, source_factory):
    """transformers would load model.safetensors, we the index: refused instead of converting the other model."""
    root = tmp_path / "src"
    shutil.copytree(source_factory(QWEN), root)
    assert (root / "model.safetensors.index.json").is_file()  # the factory shards its sources
    shutil.copy(next(root.glob("model-*.safetensors")), root / "model.safetensors")
    write_measurements(tmp_path / "m.json", synthetic_measurements(preset_config(QWEN)))
    result = run_cli("convert", root, tmp_path / "out", "--measurements", tmp_path / "m.json", "-q")
    assert_refused(result, "model.safetensors", "ambiguous")


def test_an_index_that_omits_a_tensor_its_shards_hold_is_named_without_python_reprs(tmp_path, source_factory):
    root = tmp_path / "src"
    shutil.copytree(source_factory(QWEN), root)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    shard_of = index["weight_map"]
    omitted = next(n for n in sorted(shard_of) if sum(f == shard_of[n] for f in shard_of.values()) > 1)  # shard stays read
    del index["weight_map"][omitted]
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    line = assert_refused(run_cli("calibrate", root, "-o", tmp_path / "c.json", "--samples", "1", "--seq-len", "8"), omitted)
    assert "index omits" in line and "[" not in line


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "value"),
    [("hidden_act", "gelu"), ("rope_scaling", {"type": "yarn", "factor": 4.0}), ("use_sliding_window", True)],
)
def test_arithmetic_the_engine_does_not_compute_is_refused_by_calibrate_but_converts(tmp_path, copy_of, key, value):
    """calibrate would record another model's activations without a sign of it; convert reads no activations."""
    root = copy_of(QWEN)
    config = json.loads((root / "config.json").read_text())
    config[key] = value
    (root / "config.json").write_text(json.dumps(config))
    assert_refused(run_cli("calibrate", root, "-o", tmp_path / "c.json", "--samples", "1", "--seq-len", "8"), key)
    assert not (tmp_path / "c.json").exists()
    result = run_cli("convert", root, tmp_path / "out", "--measurements", tmp_path / "m.json", "-q")
    assert result.exit_code == 0, result.stderr

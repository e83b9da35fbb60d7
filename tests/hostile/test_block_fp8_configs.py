"""An FP8 source whose scales or config.json say something its tensors do not is refused (issue 39, items 3 and 4).

Each case used to import into a checkpoint that validates: an integer ``weight_scale_inv`` read as its value, a
Paddle ``block_wise_fp8`` config that lacks a quant type or names another (wint8, wfp8afp8) or another block size,
and a BF16 checkpoint whose config claims block FP8 (its provenance then said block FP8). Each is one line naming
the key or tensor, with the source unchanged and nothing published.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers.block_fp8 import paddle_block_checkpoint
from safetensors.numpy import load_file, save_file

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements

np.float8_e4m3fn = ml_dtypes.float8_e4m3fn  # safetensors issue 682: its numpy path needs this alias for F8


@pytest.fixture(scope="module")
def paddle_block(tmp_path_factory, source_factory) -> Path:
    """A FastDeploy Paddle block-FP8 checkpoint of ernie-moe-tiny (mix_quant, block_wise_fp8), never edited."""
    return paddle_block_checkpoint(source_factory("ernie-moe-tiny"), tmp_path_factory.mktemp("paddle") / "block")


@pytest.fixture
def ernie_measurements(tmp_path) -> Path:
    path = tmp_path / "ernie.json"
    write_measurements(path, synthetic_measurements(preset_config("ernie-moe-tiny")))
    return path


def _edited(
    original: Path, at: Path, config: Callable[[dict], None] | None = None, tensors: Callable[[dict], None] | None = None
) -> Path:
    shutil.copytree(original, at)
    if config is not None:
        data = json.loads((at / "config.json").read_text())
        config(data["quantization_config"])
        (at / "config.json").write_text(json.dumps(data))
    if tensors is not None:
        for shard in sorted(at.glob("*.safetensors")):
            held = load_file(shard)
            tensors(held)
            save_file(held, shard)
    return at


def _import_refused(tmp_path: Path, source: Path, measurements: Path, *named: str) -> str:
    before = tree_digest(source)
    line = assert_refused(run_cli("import", source, tmp_path / "out", "--measurements", measurements, "-q"), *named)
    assert tree_digest(source) == before
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial" / "hpu_fp8_manifest.json").exists()
    return line


def _first(tensors: dict, suffix: str) -> str:
    return next(name for name in sorted(tensors) if name.endswith(suffix))


@pytest.mark.parametrize(("dtype", "code"), [(np.int32, "I32"), (np.int64, "I64"), (np.uint8, "U8"), (np.int8, "I8")])
def test_an_integer_block_scale_is_refused_naming_it(tmp_path, block, measurements, dtype, code):
    """The issue's case: int32 scales gave a fused qkv_proj scale of 1.867 instead of 0.000599, and validated."""
    name = ""

    def to_integers(held: dict) -> None:
        nonlocal name
        name = _first(held, "q_proj.weight_scale_inv")
        held[name] = np.ones(held[name].shape, dtype)

    source = _edited(block, tmp_path / "ints", tensors=to_integers)
    _import_refused(tmp_path, source, measurements, name, f"has dtype {code}; a scale tensor is floating point")


def test_an_integer_paddle_block_scale_is_refused_naming_the_stored_key(tmp_path, paddle_block, ernie_measurements):
    name = ""

    def to_integers(held: dict) -> None:
        nonlocal name
        name = _first(held, "down_proj.weight_scale")
        held[name] = held[name].astype(np.int32)

    source = _edited(paddle_block, tmp_path / "ints", tensors=to_integers)
    _import_refused(tmp_path, source, ernie_measurements, name, "has dtype I32")


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda q: q.pop("dense_quant_type"), "dense_quant_type is missing"),
        (lambda q: q.pop("moe_quant_type"), "moe_quant_type is missing"),
        (lambda q: q.update(moe_quant_type="wint8"), "moe_quant_type is 'wint8' beside block_wise_fp8"),
        (lambda q: q.update(dense_quant_type="wfp8afp8"), "dense_quant_type is 'wfp8afp8' beside block_wise_fp8"),
        (lambda q: q.update(weight_block_size=[64, 64]), "weight_block_size is [64, 64]; FastDeploy's mix_quant ignores it"),
        (lambda q: q.update(weight_block_size="128"), "weight_block_size is '128'"),
        (lambda q: q.update(is_quantized=False), "is_quantized is False"),
    ],
    ids=["no dense type", "no moe type", "moe wint8", "dense wfp8afp8", "block 64", "block string", "not quantized"],
)
def test_a_paddle_block_config_contradicting_its_tensors_is_refused(tmp_path, paddle_block, ernie_measurements, edit, named):
    source = _edited(paddle_block, tmp_path / "edited", config=edit)
    _import_refused(tmp_path, source, ernie_measurements, "quantization_config", named)


def test_the_paddle_block_config_as_fastdeploy_writes_it_imports(tmp_path, paddle_block, ernie_measurements):
    """The control: the same checkpoint unedited (and with FastDeploy's own block size spelled out) imports."""
    for name, source in (
        ("as-is", paddle_block),
        ("spelled-out", _edited(paddle_block, tmp_path / "spelled", config=lambda q: q.update(weight_block_size=[128, 128]))),
    ):
        result = run_cli("import", source, tmp_path / name, "--measurements", ernie_measurements, "-q")
        assert result.exit_code == 0, result.stderr
        assert run_cli("validate", "-q", tmp_path / name).exit_code == 0


@pytest.mark.parametrize("layout", ["hugging-face", "paddle"])
def test_a_bf16_checkpoint_whose_config_claims_block_fp8_is_refused(
    tmp_path, source_factory, measurements, ernie_measurements, layout
):
    """Before: imported as if from block FP8, its provenance and printed requantization errors a fiction."""
    if layout == "paddle":
        qc = {"quantization": "mix_quant", "dense_quant_type": "block_wise_fp8", "moe_quant_type": "block_wise_fp8"}
        preset, amax = "ernie-moe-tiny", ernie_measurements
    else:
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        preset, amax = "qwen2-tiny", measurements
    source = tmp_path / "bf16"
    shutil.copytree(source_factory(preset, "paddle" if layout == "paddle" else "torch"), source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    _import_refused(tmp_path, source, amax, "config.json names block-wise FP8", "is BF16", "hpu-fp8 convert")


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (
            lambda q: q.update(quantization="mix_quant", dense_quant_type="wint8", moe_quant_type="wint8"),
            "`hpu-fp8 import` reads",
        ),
        (lambda q: q.update(quant_method="awq"), "quant_method is 'awq'; `hpu-fp8 import` reads"),
    ],
    ids=["mix_quant wint8", "awq"],
)
def test_a_scheme_import_does_not_read_says_which_it_reads(tmp_path, block, measurements, edit, named):
    """Before: "quant_method is missing, not 'compressed-tensors'", as if compressed-tensors were the only choice."""

    def replace(q: dict) -> None:
        q.clear()
        edit(q)

    line = _import_refused(tmp_path, _edited(block, tmp_path / "other", config=replace), measurements, named)
    assert "block FP8" in line and "import-legacy" in line


@pytest.mark.parametrize("suffix", ["activation_scale", "weight_scale"])
def test_an_integer_scale_of_a_legacy_checkpoint_is_refused_naming_it(tmp_path, legacy, suffix):
    """The same rule in import-legacy: a scale is read only from a floating-point tensor."""
    name = ""

    def to_integers(held: dict) -> None:
        nonlocal name
        name = _first(held, "qkv_proj." + suffix)
        held[name] = np.ones(held[name].shape, np.int32)

    source = _edited(legacy, tmp_path / "ints", tensors=to_integers)
    before = tree_digest(source)
    assert_refused(run_cli("import-legacy", source, tmp_path / "out"), name, "has dtype I32")
    assert tree_digest(source) == before and not (tmp_path / "out").exists()

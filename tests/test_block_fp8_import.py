"""`hpu-fp8 import` of block-wise FP8 checkpoints, both layouts, checked against transformers' own block code.

Sources are the tiny BF16 models quantized by transformers' fine-grained FP8 quantizer (tests/helpers/block_fp8.py);
every dequantized value is compared with transformers' ``_dequantize_fp8_weight``, ragged edge blocks included.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from hostile.refusal import assert_refused, run_cli
from safetensors.numpy import load_file, save_file

from hpu_fp8_loader.arch import Layout, describe
from hpu_fp8_loader.checks.validate import validate
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.conversion.block_fp8 import import_block_fp8
from hpu_fp8_loader.conversion.legacy_import import import_legacy
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.engine.weights import open_weights
from hpu_fp8_loader.errors import ConfigError, MeasurementError
from hpu_fp8_loader.fastdeploy.doctor import doctor
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.numerics import e4m3, scales
from hpu_fp8_loader.quality.calibrate import calibrate
from hpu_fp8_loader.sources.block_fp8 import open_source
from hpu_fp8_loader.sources.source_tensors import source_rows
from hpu_fp8_loader.sources.synth import preset_config, synthesize
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS
from hpu_fp8_loader.spec import names
from tests.helpers.block_fp8 import block_quantize, hf_block_checkpoint, oracle_dequantize, paddle_block_checkpoint

np.float8_e4m3fn = ml_dtypes.float8_e4m3fn  # safetensors issue 682: its numpy path needs this alias for F8
HF_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
PADDLE_CONFIG = {"quantization": "mix_quant", "dense_quant_type": "block_wise_fp8", "moe_quant_type": "block_wise_fp8"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("block")
    return {
        "hf-qwen2": hf_block_checkpoint(TINY_MODELS["qwen2-bytes"], root / "qwen2-hf"),
        "hf-ernie": hf_block_checkpoint(TINY_MODELS["ernie-moe-bytes"], root / "ernie-hf"),
        # the layout of the Qwen3-*-FP8 releases (Qwen3-8B-FP8, Qwen3-30B-A3B-FP8, ...)
        "hf-qwen3": hf_block_checkpoint(TINY_MODELS["qwen3-bytes"], root / "qwen3-hf"),
        "hf-qwen3-moe": hf_block_checkpoint(TINY_MODELS["qwen3-moe-bytes"], root / "qwen3-moe-hf"),
        "paddle-ernie": paddle_block_checkpoint(TINY_MODELS["ernie-moe-bytes"], root / "ernie-paddle"),
    }


@pytest.fixture(scope="module")
def measured():
    return {name: calibrate(path, samples=4, seq_len=64).measurements for name, path in TINY_MODELS.items()}


def _bare(tmp_path: Path, tensors: dict, qc: dict) -> Checkpoint:
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    return open_source(tmp_path)


def _spans(rows: int) -> list[tuple[int, int]]:
    """Row spans that start and stop inside blocks, as a streamed read does."""
    cuts = sorted({0, min(5, rows), min(133, rows), rows})
    return list(itertools.pairwise(cuts))


@pytest.mark.parametrize("shape", [(192, 192), (320, 192), (64, 128), (96, 128), (256, 384)])
def test_dequantized_rows_are_transformers_own_ragged_edges_included(tmp_path, shape):
    values = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    codes, grid = block_quantize(values)
    assert grid.shape == tuple(-(-n // 128) for n in shape)
    expected = oracle_dequantize(codes, grid)
    hf = _bare(tmp_path / "hf", {"w.weight": codes, "w.weight_scale_inv": grid}, HF_CONFIG)
    paddle = _bare(tmp_path / "pd", {"w.quant_weight": codes, "w.weight_scale": grid}, PADDLE_CONFIG)
    for checkpoint in (hf, paddle):
        streamed = np.concatenate([source_rows(checkpoint, "w.weight", a, b) for a, b in _spans(shape[0])])
        np.testing.assert_array_equal(streamed, expected)
        np.testing.assert_array_equal(source_rows(checkpoint, "w.weight", 0, shape[0]), expected)
    assert np.abs(expected - values).max() > 0  # the oracle compared with is the quantized model, not the original


def test_a_non_square_block_follows_the_stored_axes(tmp_path):
    values = np.random.default_rng(3).standard_normal((96, 80)).astype(np.float32)
    codes, grid = block_quantize(values, (32, 64))
    qc = {**HF_CONFIG, "weight_block_size": [32, 64]}
    checkpoint = _bare(tmp_path, {"w.weight": codes, "w.weight_scale_inv": grid}, qc)
    np.testing.assert_array_equal(source_rows(checkpoint, "w.weight", 7, 70), oracle_dequantize(codes, grid, (32, 64))[7:70])


def _oracle_values(source: Checkpoint, w, layout: Layout, prefix: str) -> np.ndarray:
    """The fused [in, out] float32 values of one spec weight, each FP8 part dequantized by transformers."""
    arrays = []
    for p in w.source_parts(layout, prefix):
        if source.tensors[p.name].dtype == "F8_E4M3":
            grid = np.asarray(source.get(p.name.removesuffix("weight") + "weight_scale_inv"))
            arrays.append(oracle_dequantize(np.asarray(source.get(p.name)), grid))
        else:
            arrays.append(np.asarray(source.get(p.name)).astype(np.float32))
    return np.concatenate([a.T if p.transpose else a for p, a in zip(w.source_parts(layout, prefix), arrays, strict=True)], -1)


STREAMED = {"whole_tensor_bytes": 0, "block_elements": 1000}  # every tensor in row blocks of a few rows
READ_TWICE = {**STREAMED, "kept_tensor_bytes": 0}  # the blocks read again for the quantization, not kept


KIND_MODELS = {
    "hf-qwen2": "qwen2-bytes", "hf-ernie": "ernie-moe-bytes", "paddle-ernie": "ernie-moe-bytes",
    "hf-qwen3": "qwen3-bytes", "hf-qwen3-moe": "qwen3-moe-bytes",
}  # fmt: skip


@pytest.mark.parametrize("kind", list(KIND_MODELS))
@pytest.mark.parametrize("reading", [{}, STREAMED, READ_TWICE], ids=["whole", "streamed", "read-twice"])
def test_imported_weights_are_the_oracle_dequantized_then_quantized_once(tmp_path, sources, measured, kind, reading):
    model = KIND_MODELS[kind]
    result = import_block_fp8(sources[kind], tmp_path / "out", ConvertOptions(**reading), [measured[model]])
    assert validate(tmp_path / "out").valid
    source, spec = open_source(sources[kind]), Checkpoint.open(tmp_path / "out")
    d = describe(source.config)
    layout = Layout.PADDLE if kind.startswith("paddle") else Layout.TORCH
    linears = [w for w in d.weights() if w.is_linear]
    for w in linears:
        values = _oracle_values(source, w, layout, d.prefix)
        amax = np.abs(values).max(axis=0) if w.channel_wise else np.abs(values).max()
        scale = scales.weight_scale_from_amax(amax, 240.0)
        np.testing.assert_array_equal(spec.get(names.tensor(w.module, names.WEIGHT_SCALE)).reshape(-1), np.reshape(scale, -1))
        expected = e4m3.quantize(values, scale if w.channel_wise else scale.reshape(()), 240.0, w.name)
        np.testing.assert_array_equal(spec.get(w.name).view(np.uint8), expected.view(np.uint8), err_msg=w.name)
    errors = [e for _, e in result.errors]
    assert {n for n, _ in result.errors} == {w.name for w in linears} and errors == sorted(errors, reverse=True)
    assert min(errors) > 0 and max(errors) < 0.06  # e4m3 at one scale per tensor: a few percent, as the CT import
    if "ernie" in kind:  # routed experts stay channel-wise, as FastDeploy's HPU path holds them
        assert spec.tensors["ernie.layers.1.mlp.experts.2.up_gate_proj.weight_scale"].shape == (192,)
    if kind == "hf-qwen3-moe":
        assert spec.tensors["model.layers.1.mlp.experts.2.up_gate_proj.weight_scale"].shape == (192,)


def test_the_engine_reads_the_dequantized_blocks_so_calibration_sees_the_fp8_model(sources):
    source = open_source(sources["paddle-ernie"])
    weights = open_weights(sources["paddle-ernie"])
    for w in (w for w in weights.descriptor.weights() if w.is_linear):
        np.testing.assert_array_equal(weights.get(w), _oracle_values(source, w, Layout.PADDLE, weights.descriptor.prefix))


def _edited(tmp_path: Path, source: Path, qc_edit=None, tensor_edit=None) -> Path:
    root = tmp_path / "src"
    root.mkdir()
    for f in source.iterdir():
        (root / f.name).write_bytes(f.read_bytes())
    if qc_edit:
        config = json.loads((root / "config.json").read_text())
        qc_edit(config["quantization_config"])
        (root / "config.json").write_text(json.dumps(config))
    if tensor_edit:
        tensors = load_file(root / "model.safetensors")
        tensor_edit(tensors)
        save_file(tensors, root / "model.safetensors")
    return root


@pytest.mark.parametrize(
    ("qc_edit", "tensor_edit", "message"),
    [
        (lambda q: q.pop("weight_block_size"), None, "quantization_config.weight_block_size is missing"),
        (lambda q: q.update(weight_block_size=[128]), None, r"weight_block_size is \[128\]; expected two positive"),
        (lambda q: q.update(weight_block_size=[0, 128]), None, "expected two positive integers"),
        (lambda q: q.update(activation_scheme="static"), None, "activation_scheme is 'static'"),
        (
            None,
            lambda t: t.pop("model.layers.1.mlp.down_proj.weight_scale_inv"),
            "'model.layers.1.mlp.down_proj.weight' is FP8 but 'model.layers.1.mlp.down_proj.weight_scale_inv' is missing",
        ),
        (
            None,
            lambda t: t.update({"model.layers.0.self_attn.k_proj.weight_scale_inv": np.ones((2, 1), np.float32)}),
            r"'model.layers.0.self_attn.k_proj.weight_scale_inv' has shape \[2, 1\]; .* needs \[1, 1\]",
        ),
        (
            None,
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale_inv": np.zeros((3, 1), np.float32)}),
            r"'model.layers.0.mlp.up_proj.weight_scale_inv' holds 0.0..0.0; scales must be finite and > 0",
        ),
    ],
)
def test_what_cannot_be_read_is_refused_naming_the_key_and_nothing_is_written(
    tmp_path, sources, measured, qc_edit, tensor_edit, message
):
    root = _edited(tmp_path, sources["hf-qwen2"], qc_edit, tensor_edit)
    with pytest.raises(ConfigError, match=message):
        import_block_fp8(root, tmp_path / "out", measurements=[measured["qwen2-bytes"]])
    assert not (tmp_path / "out").exists()


def test_without_statistics_the_import_asks_for_them(tmp_path, sources):
    with pytest.raises(MeasurementError, match="carries no statistics; pass --measurements or --calibrate"):
        import_block_fp8(sources["hf-qwen2"], tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_mtp_draft_weights_are_dropped_with_a_warning(tmp_path, sources, measured):
    def add_mtp(tensors):
        codes, grid = block_quantize(np.ones((256, 128), np.float32))
        tensors["ernie.mtp_linear_proj.0.quant_weight"], tensors["ernie.mtp_linear_proj.0.weight_scale"] = codes, grid

    root = _edited(tmp_path, sources["paddle-ernie"], tensor_edit=add_mtp)
    result = import_block_fp8(root, tmp_path / "out", measurements=[measured["ernie-moe-bytes"]])
    assert any("2 tensor(s) not carried over: ERNIE multi-token-prediction (MTP)" in w for w in result.left_out)
    assert validate(tmp_path / "out").valid and not any("mtp" in n for n in Checkpoint.open(tmp_path / "out").tensors)


@pytest.mark.parametrize("command", ["validate", "inspect"])
def test_validate_and_inspect_point_a_block_checkpoint_to_import(sources, command):
    for kind in ("hf-qwen2", "paddle-ernie"):
        line = assert_refused(run_cli(command, sources[kind]), "config.json")
        assert line.endswith("This is a block-wise FP8 checkpoint; bring it in with `hpu-fp8 import SRC OUT --calibrate`.")


@pytest.mark.slow
def test_doctor_points_a_block_checkpoint_to_import(sources):
    report = doctor(sources["hf-qwen2"], build=False)
    checkpoint = next(c for c in report.checks if c.name == "checkpoint")
    assert checkpoint.status == "fail" and "hpu-fp8 import SRC OUT --calibrate" in checkpoint.detail


def test_import_legacy_points_a_block_checkpoint_to_import(tmp_path, sources):
    with pytest.raises(ConfigError, match="block-wise FP8 checkpoint .*use `hpu-fp8 import`"):
        import_legacy(sources["paddle-ernie"], tmp_path / "out")


@pytest.mark.slow
def test_cli_import_calibrates_the_dequantized_blocks_and_prints_the_worst_errors(tmp_path, sources):
    args = ["import", str(sources["paddle-ernie"]), str(tmp_path / "out"), "--calibrate", "--samples", "4", "--seq-len", "64"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "from a block-wise FP8 checkpoint (block-wise FP8 (FastDeploy Paddle layout" in result.output
    assert "worst ten" in result.output and validate(tmp_path / "out").valid
    sources_kinds = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["calibration"]
    assert [s["kind"] for s in sources_kinds["sources"]] == ["reference-engine"]


@pytest.mark.parametrize("layout", ["hf", "paddle"])
def test_an_ernie_dense_block_checkpoint_imports_in_both_layouts(tmp_path, layout):
    """ERNIE-4.5 dense has no tiny trained model: a synthesized one, block-quantized as each layout's release is."""
    source = synthesize(tmp_path / "bf16", preset_config("ernie-dense-tiny"), "torch", seed=3)
    block = (hf_block_checkpoint if layout == "hf" else paddle_block_checkpoint)(source, tmp_path / "block")
    result = import_block_fp8(block, tmp_path / "out", ConvertOptions(), [calibrate(source, samples=2, seq_len=32).measurements])
    assert validate(tmp_path / "out").valid
    linears = [w.name for w in describe(json.loads((source / "config.json").read_text())).weights() if w.is_linear]
    assert sorted(n for n, _ in result.errors) == sorted(linears) and 0 < min(e for _, e in result.errors) < 0.06

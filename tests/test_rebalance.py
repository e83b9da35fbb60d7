"""Exact channel folds (conversion/folds.py): stress models that keep the function to the bit (quality/stress.py),
and rebalancing before quantization (quality/rebalance.py, ``convert --calibrate --rebalance``) that equals
converting the folded model; the per-token ceiling row and the paired gap-closed bootstrap they are measured by."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from hpu_fp8_loader.checks.validate import validate
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.folds import Fold, FoldSite, Scaling, fold_sites, weight_scalings
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.engine.fp8 import per_token_multiplier
from hpu_fp8_loader.engine.model import forward
from hpu_fp8_loader.engine.weights import open_weights
from hpu_fp8_loader.errors import ConfigError, MeasurementError, OutputExistsError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.numerics.bootstrap import bootstrap_gap_closed
from hpu_fp8_loader.quality.calibrate import CalibrationOptions, calibrate
from hpu_fp8_loader.quality.datasets import builtin_text
from hpu_fp8_loader.quality.evaluate import evaluate
from hpu_fp8_loader.quality.quantize import quantize
from hpu_fp8_loader.quality.report import Report
from hpu_fp8_loader.quality.stress import STRESS_FILE, stress_model, write_folded
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS
from hpu_fp8_loader.spec import names

IDS = np.frombuffer(builtin_text("held-out").encode()[:256], np.uint8).astype(np.int64).reshape(2, 128)
CALIBRATION = CalibrationOptions(samples=8, seq_len=128)
EVERY_FOLD = {Fold.QKV: 1e4, Fold.MLP_INPUT: 1e4, Fold.DOWN: 1e5, Fold.O_PROJ: 1e4}


@pytest.fixture(scope="module")
def stressed(tmp_path_factory):
    """(model, targets) -> (the stress model's directory, its StressResult), made once."""
    made = {}

    def make(model: str, targets: dict[Fold, float]):
        key = (model, tuple(sorted((f.value, r) for f, r in targets.items())))
        if key not in made:
            out = tmp_path_factory.mktemp("stress") / model
            made[key] = out, stress_model(TINY_MODELS[model], out, targets, CALIBRATION)
        return made[key]

    return make


def hf_logits(model_dir) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


@pytest.mark.parametrize("model", list(TINY_MODELS))
def test_a_stress_model_computes_exactly_what_its_source_computes(stressed, model):
    out, result = stressed(model, EVERY_FOLD)
    assert {s.fold for s in result.sites} == {f.value for f in EVERY_FOLD}
    ours = forward(open_weights(out), IDS)
    np.testing.assert_array_equal(ours, forward(open_weights(TINY_MODELS[model]), IDS))
    # an oracle that is not ours: transformers' float32 forward of both checkpoints, to the bit as well
    np.testing.assert_array_equal(hf_logits(out), hf_logits(TINY_MODELS[model]))
    changed = [n for n, info in Checkpoint.open(out).tensors.items() if not np.array_equal(
        np.asarray(Checkpoint.open(out).get(n)), np.asarray(Checkpoint.open(TINY_MODELS[model]).get(n)))]  # fmt: skip
    assert changed  # the weights did change: the function did not
    record = json.loads((out / STRESS_FILE).read_text())
    assert len(record["sites"]) == len(result.sites) and record["targets"]["down"] == 1e5


@pytest.mark.parametrize("model", ["qwen2-bytes", "qwen3-moe-bytes"])
def test_a_stress_model_reaches_the_ratios_it_dials(stressed, model):
    out, result = stressed(model, {Fold.DOWN: 1e5})
    measured = {r.module: r for r in calibrate(out, samples=CALIBRATION.samples, seq_len=CALIBRATION.seq_len).ranges}
    for site in result.sites:
        assert site.fold == "down" and site.growth >= 1
        assert site.ratio_after / 2**0.5 <= 1e5 <= site.ratio_after * 2**0.5  # the nearest power of two
        # one grown channel of an expert's 32 moves the median a little: the dial holds within a factor of 2
        assert measured[site.point].ratio == pytest.approx(site.ratio_after, rel=0.2), site.point
        assert 1e5 / 2 <= measured[site.point].ratio <= 1e5 * 2 and measured[site.point].beyond


def test_eval_warns_naming_a_stressed_point_and_not_the_source(stressed, tmp_path):
    out, result = stressed("qwen2-bytes", {Fold.DOWN: 1e5})
    quantize(out, tmp_path / "fp8", CALIBRATION)
    report = Report()
    stressed_eval = evaluate(out, tmp_path / "fp8", samples=4, variants=("fp8",), report=report)
    (warning,) = [w for w in stressed_eval.warnings if "E4M3 at ±240" in w]
    assert result.sites[0].point in warning
    widest = report.ranges[0]  # eval reads the range at the amax the checkpoint is served with: act_scale x 240
    served = float(np.asarray(Checkpoint.open(tmp_path / "fp8").get(names.tensor(widest["module"], names.ACT_SCALE)))[0])
    assert widest["module"] in {site.point for site in result.sites} and widest["amax"] == served * 240 and widest["beyond"]
    quantize(TINY_MODELS["qwen2-bytes"], tmp_path / "plain", CALIBRATION)
    plain = evaluate(TINY_MODELS["qwen2-bytes"], tmp_path / "plain", samples=4, variants=("fp8",))
    assert not [w for w in plain.warnings if "E4M3 at ±240" in w]


def test_a_stress_output_that_exists_is_refused_before_the_calibration_runs(tmp_path, monkeypatch):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")

    def never(*args, **kwargs):
        raise AssertionError("calibrated before the output was checked")

    monkeypatch.setattr(CalibrationOptions, "run", never)
    with pytest.raises(OutputExistsError, match="taken: already exists; pass"):
        stress_model(TINY_MODELS["qwen2-bytes"], tmp_path / "taken", {Fold.DOWN: 1e6})
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"


def test_a_fold_that_leaves_float32s_range_is_refused_naming_the_tensor():
    with pytest.raises(ConfigError, match=r"^w: a channel fold takes 1 value\(s\) out of float32's normal range"):
        Scaling(cols=np.array([200, 0], np.int32)).apply(np.array([[1e10, 1.0]], np.float32), "w")
    d = open_weights(TINY_MODELS["qwen2-bytes"]).descriptor
    site = fold_sites(d)[0]
    with pytest.raises(ConfigError, match=rf"^{site.name}: \(3,\) exponents for a fold of {site.channels} channels$"):
        weight_scalings(d, {site: np.zeros(3, np.int32)})


def test_a_scaling_applies_the_same_to_a_torch_part_and_to_the_spec_tensor():
    rng = np.random.default_rng(0)
    values = rng.standard_normal((6, 10)).astype(np.float32)  # spec [in, out], fused of two parts of 4 and 6 columns
    scaling = Scaling(rows=rng.integers(-3, 4, 6).astype(np.int32), cols=rng.integers(-3, 4, 10).astype(np.int32))
    whole = scaling.apply(values, "w")
    second = scaling.apply(values[:, 4:].T[2:5], "w", first_row=2, column_offset=4, transpose=True)  # torch rows 2:5
    np.testing.assert_array_equal(second, whole[:, 6:9].T)
    np.testing.assert_array_equal(scaling.apply(values[3:], "w", first_row=3), whole[3:])


@pytest.fixture(scope="module")
def rebalanced(tmp_path_factory, stressed):
    """The down-stressed Qwen2 (ratio 1e6: where static FP8 fails) quantized with --rebalance flagged."""
    out, _ = stressed("qwen2-bytes", {Fold.DOWN: 1e6})
    fp8 = tmp_path_factory.mktemp("rebalanced") / "fp8"
    return out, fp8, quantize(out, fp8, CALIBRATION, ConvertOptions(rebalance="flagged"))


def test_rebalancing_is_converting_the_exactly_folded_model(rebalanced, tmp_path):
    source, fp8, result = rebalanced
    assert [site.fold for site in result.folds.exponents] == [Fold.DOWN, Fold.DOWN]
    # the same folds written as a BF16 model, calibrated and converted without --rebalance: every tensor to the bit
    folded = write_folded(open_weights(source), tmp_path / "folded", result.folds.exponents)
    np.testing.assert_array_equal(forward(open_weights(folded), IDS), forward(open_weights(source), IDS))
    plain = tmp_path / "plain"
    convert(folded, plain, [calibrate(folded, samples=CALIBRATION.samples, seq_len=CALIBRATION.seq_len).measurements])
    ours, theirs = Checkpoint.open(fp8), Checkpoint.open(plain)
    assert ours.tensors.keys() == theirs.tensors.keys()
    for name in ours.tensors:
        np.testing.assert_array_equal(np.asarray(ours.get(name)), np.asarray(theirs.get(name)), err_msg=name)
    record = ours.config["quantization_config"]["rebalancing"]
    assert record["mode"] == "flagged" and record["sites"] == [s.name for s in result.folds.exponents]
    assert record["exponents_sha256"] == result.folds.digest() and record["largest_exponent"] >= 1
    assert "rebalancing" not in theirs.config["quantization_config"]
    assert validate(fp8).valid


@pytest.mark.parametrize("model", ["ernie-moe-bytes", "qwen3-moe-bytes", "qwen3-bytes"])
def test_rebalancing_every_site_of_a_moe_or_qk_norm_model_is_converting_its_folded_model(model, tmp_path):
    """--rebalance all moves every kind of site, the MoE ones included (the router compensated, every routed and
    shared expert's rows, each expert's down_proj input): the checkpoint is still that of the folded model, bit for
    bit, routing and all."""
    options = ConvertOptions(rebalance="all", dead_experts="sibling-max")
    result = quantize(TINY_MODELS[model], tmp_path / "fp8", CALIBRATION, options)
    assert {site.fold for site in result.folds.exponents} == set(Fold)
    folded = write_folded(open_weights(TINY_MODELS[model]), tmp_path / "folded", result.folds.exponents)
    np.testing.assert_array_equal(forward(open_weights(folded), IDS), forward(open_weights(TINY_MODELS[model]), IDS))
    measured = calibrate(folded, samples=CALIBRATION.samples, seq_len=CALIBRATION.seq_len).measurements
    assert measured.amax == result.measurements.amax  # the folded model's amax, derived without running it
    convert(folded, tmp_path / "plain", [measured], ConvertOptions(dead_experts="sibling-max"))
    ours, theirs = Checkpoint.open(tmp_path / "fp8"), Checkpoint.open(tmp_path / "plain")
    for name in ours.tensors:
        np.testing.assert_array_equal(np.asarray(ours.get(name)), np.asarray(theirs.get(name)), err_msg=name)


def test_rebalancing_a_torch_source_streamed_in_row_blocks_gives_the_same_bytes(rebalanced, tmp_path):
    source, fp8, _ = rebalanced
    options = ConvertOptions(rebalance="flagged", whole_tensor_bytes=0, block_elements=256, kept_tensor_bytes=0)
    streamed = quantize(source, tmp_path / "streamed", CALIBRATION, options)
    ours, theirs = Checkpoint.open(fp8), Checkpoint.open(streamed.conversion.out)
    for name in ours.tensors:
        np.testing.assert_array_equal(np.asarray(ours.get(name)), np.asarray(theirs.get(name)), err_msg=name)


def test_rebalancing_closes_the_stressed_gap_and_flags_nothing_on_the_shipped_model(rebalanced, tmp_path):
    source, fp8, _ = rebalanced
    floor = tmp_path / "floor"
    quantize(source, floor, CALIBRATION)
    before = evaluate(source, floor, samples=8, variants=("fp8", "per-token"))
    after = evaluate(source, fp8, samples=8, variants=("fp8",))
    kl = {row.variant: row for row in before.rows}
    closed, (low, _) = bootstrap_gap_closed(
        np.array(kl["fp8"].window_kl), np.array(after.rows[0].window_kl), np.array(kl["per-token"].window_kl)
    )
    assert closed > 0.5 and low > 0  # measured: about 0.99 (bench/outliers.py)
    shipped = quantize(TINY_MODELS["qwen2-bytes"], tmp_path / "shipped", CALIBRATION, ConvertOptions(rebalance="flagged"))
    assert (
        shipped.folds.exponents == {}
        and "rebalancing" not in Checkpoint.open(shipped.conversion.out).config["quantization_config"]
    )


def test_rebalancing_from_measurement_files_is_refused(tmp_path):
    measurements = calibrate(TINY_MODELS["qwen2-bytes"], samples=2, seq_len=64).measurements
    with pytest.raises(MeasurementError, match="--rebalance flagged chooses its folds from a calibration's per-channel"):
        convert(TINY_MODELS["qwen2-bytes"], tmp_path / "x", [measurements], ConvertOptions(rebalance="flagged"))
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()


def test_rebalancing_an_fp8_source_is_refused_before_anything_is_written(tmp_path):
    source = Path(__file__).with_name("fixtures") / "qwen2-bytes-fp8-static"  # compressed-tensors: F8_E4M3 weights
    with pytest.raises(ConfigError, match=r"\.weight is FP8; channel folds rebalance BF16 weights before their one quantization"):
        quantize(source, tmp_path / "x", CALIBRATION, ConvertOptions(rebalance="all"))
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()  # refused before calibrating


def test_a_stress_model_of_an_fp16_or_hpu_fp8_source_is_refused(tmp_path):
    fp16 = tmp_path / "fp16"
    shutil.copytree(TINY_MODELS["qwen2-bytes"], fp16)
    tensors = load_file(fp16 / "model.safetensors")
    save_file({name: value.to(torch.float16) for name, value in tensors.items()}, fp16 / "model.safetensors")
    with pytest.raises(ConfigError, match=r"is F16; a power of two scales only BF16 or F32 values exactly$"):
        stress_model(fp16, tmp_path / "out", {Fold.DOWN: 1e6})
    quantize(TINY_MODELS["qwen2-bytes"], tmp_path / "fp8", CALIBRATION)
    with pytest.raises(ConfigError, match="an hpu-fp8 checkpoint; a stress model is made from the BF16 source"):
        stress_model(tmp_path / "fp8", tmp_path / "out", {Fold.DOWN: 1e6})
    assert not (tmp_path / "out").exists()


def test_an_interrupted_rebalanced_quantize_reuses_its_folds(rebalanced, tmp_path, monkeypatch):
    source, fp8, first = rebalanced
    import hpu_fp8_loader.quality.quantize as quantize_module

    def fail(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(quantize_module, "convert", fail)
    with pytest.raises(RuntimeError):
        quantize(source, tmp_path / "again", CALIBRATION, ConvertOptions(rebalance="flagged"))
    monkeypatch.undo()
    again = quantize(source, tmp_path / "again", CALIBRATION, ConvertOptions(rebalance="flagged"))
    assert again.calibration is None  # the kept calibration and folds were reused
    assert again.folds.digest() == first.folds.digest()
    assert Checkpoint.open(tmp_path / "again").config["quantization_config"] == Checkpoint.open(fp8).config["quantization_config"]


def test_the_per_token_multiplier_maps_each_tokens_max_to_240_and_a_zero_token_to_one():
    x = np.array([[1.0, -3.0], [0.0, 0.0], [0.5, 0.25]], np.float32)
    np.testing.assert_array_equal(per_token_multiplier(x), np.array([[80.0], [1.0], [480.0]], np.float32))


def test_the_gap_closed_is_one_at_the_ceiling_zero_at_the_floor_and_refused_without_a_gap():
    floor, ceiling = np.array([3.0, 5.0, 4.0]), np.array([1.0, 2.0, 1.0])
    assert bootstrap_gap_closed(floor, ceiling, ceiling) == (1.0, (1.0, 1.0))
    assert bootstrap_gap_closed(floor, floor, ceiling) == (0.0, (0.0, 0.0))
    with pytest.raises(RuntimeError, match="no gap to close"):
        bootstrap_gap_closed(floor, floor, floor)


def test_the_cli_makes_a_stress_model_and_rebalances_it(tmp_path):
    runner = CliRunner()
    made = runner.invoke(main, ["stress", "qwen2-bytes", str(tmp_path / "s"), "--at", "down=1e6", "--samples", "4", "--json"])
    assert made.exit_code == 0, made.output
    sites = json.loads(made.stdout)["sites"]
    assert [s["point"] for s in sites] == [names.tensor(names.layer_names("qwen2", i).mlp, names.DOWN) for i in range(2)]
    converted = runner.invoke(
        main, ["convert", str(tmp_path / "s"), str(tmp_path / "f"), "--calibrate", "--samples", "4", "--rebalance", "flagged"]
    )
    assert converted.exit_code == 0, converted.output
    assert "span more than E4M3 at ±240" in converted.output  # the calibration's warning, before the folds fix it
    qc = Checkpoint.open(tmp_path / "f").config["quantization_config"]
    assert qc["rebalancing"]["sites"] == [s["point"] for s in sites]
    refused = runner.invoke(main, ["stress", "qwen2-bytes", str(tmp_path / "t"), "--at", "down=0.5"])
    assert refused.exit_code != 0 and "no ratio of at least 1" in refused.output
    unknown = runner.invoke(main, ["stress", "qwen2-bytes", str(tmp_path / "t"), "--at", "gate=10"])
    assert unknown.exit_code != 0 and "qkv, mlp-input, down, o-proj" in unknown.output
    assert not (tmp_path / "t").exists()


def test_eval_per_token_row_on_the_cli(rebalanced):
    source, fp8, _ = rebalanced
    result = CliRunner().invoke(main, ["eval", str(source), str(fp8), "--samples", "2", "--per-token", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["variant"]: row for row in json.loads(result.stdout)["rows"]}
    assert set(rows) == {"fp8", "weights-only", "no-kv-fp8", "per-token"}
    assert all(len(row["window_kl"]) == 2 and all(math.isfinite(v) for v in row["window_kl"]) for row in rows.values())


def test_fold_sites_cover_every_quantized_input_of_a_moe_layer():
    d = open_weights(TINY_MODELS["ernie-moe-bytes"]).descriptor
    sites: list[FoldSite] = fold_sites(d)
    points = {p for s in sites for p in s.points}
    linear_inputs = {m for m in d.act_modules(attention_fp8=False)}
    assert linear_inputs - points == set()  # every linear input FastDeploy scales per tensor can be rebalanced

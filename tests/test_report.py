"""Reports (quality/report.py, report_plots.py): per-linear FP8 error, amax, weight spread, expert load, the page."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.quality.calibrate import calibrate
from hpu_fp8_loader.quality.evaluate import evaluate
from hpu_fp8_loader.quality.observers import AmaxObserver, ConverterFp8, LinearErrorObserver, TeeObserver
from hpu_fp8_loader.quality.report import REPORT_FILE, Report
from hpu_fp8_loader.quality.report_plots import render, shown_name
from hpu_fp8_loader.sources.synth import preset_config
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS
from hpu_fp8_loader.spec import names


def _linear_modules(descriptor) -> set[str]:
    return {w.module for w in descriptor.weights() if w.is_linear}


def _layer_weights(descriptor, layer: int, rng) -> dict[str, np.ndarray]:
    return {w.name: rng.standard_normal(w.shape).astype(np.float32) for w in descriptor.weights() if w.layer == layer}


def test_a_linear_whose_weights_fp8_cannot_hold_is_ranked_first():
    """o_proj's weight row of input channel 0 is scaled by 1e6 while that channel's activation is always 0: the
    row adds nothing to y, but its per-tensor scale leaves every other weight below e4m3's smallest code, so
    FP8 loses nearly all of y there, while qkv stays at e4m3's few percent."""
    d = describe(preset_config("qwen2-tiny"))
    rng = np.random.default_rng(0)
    amax_observer = AmaxObserver(d.prefix)
    errors = LinearErrorObserver(d, ConverterFp8(amax_observer.amax))
    tee = TeeObserver(amax_observer, errors)
    weights = _layer_weights(d, 0, rng)
    m = names.layer_names(d.prefix, 0)
    weights[names.tensor(m.o_proj, names.WEIGHT)][0] *= np.float32(1e6)
    tee.enter_weights(0, weights)
    for module, width in ((m.qkv, d.hidden_size), (m.o_proj, d.q_width)):
        x = rng.standard_normal((2, 8, width)).astype(np.float32)
        x[..., 0] = 0
        tee.record(module, x)
    ranked = sorted((s for s in errors.linears.values() if s.rows), key=lambda s: -(s.relative_error or 0))
    assert [s.module for s in ranked] == [m.o_proj, m.qkv]
    assert ranked[0].relative_error > 0.5 and 0 < ranked[1].relative_error < 0.1
    assert amax_observer.amax[m.qkv] > 0  # the tee fed the amax observer too


def test_each_layer_entry_counts_whichever_order_the_forward_uses():
    """Layer-major (one entry, many chunks) and batch-major (an entry per batch) measure the same rows."""
    d = describe(preset_config("qwen2-tiny"))
    rng = np.random.default_rng(1)
    weights = _layer_weights(d, 0, rng)
    chunks = [rng.standard_normal((1, 4, d.hidden_size)).astype(np.float32) for _ in range(3)]
    amax = {names.layer_names(d.prefix, 0).qkv: float(max(np.abs(c).max() for c in chunks))}
    module = names.layer_names(d.prefix, 0).qkv
    layer_major, batch_major = LinearErrorObserver(d, ConverterFp8(amax)), LinearErrorObserver(d, ConverterFp8(amax))
    layer_major.enter_weights(0, weights)
    for chunk in chunks:
        layer_major.record(module, chunk)
        batch_major.enter_weights(0, weights)
        batch_major.record(module, chunk)
    a, b = layer_major.linears[module], batch_major.linears[module]
    assert a.rows == b.rows == 12 and a.relative_error == pytest.approx(b.relative_error, rel=1e-12)
    assert a.channel_spread == b.channel_spread and a.channel_spread > 1


def test_report_refuses_an_existing_non_empty_dir_without_force(tmp_path):
    (tmp_path / "rep").mkdir()
    (tmp_path / "rep" / "mine.txt").write_text("keep")
    args = ["calibrate", str(TINY_MODELS["qwen2-bytes"]), "-o", str(tmp_path / "m.json"), "--report", str(tmp_path / "rep")]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code == 1 and "rep: already exists and is not empty; pass --force" in refused.output
    forced = CliRunner().invoke(main, [*args, "--force"])
    assert forced.exit_code == 1 and "no hpu_fp8_manifest.json" in forced.output  # --force replaces only a report
    assert (tmp_path / "rep" / "mine.txt").read_text() == "keep" and not (tmp_path / "m.json").exists()


@pytest.fixture(scope="module")
def moe_report(tmp_path_factory):
    """One calibration of the tiny trained ERNIE MoE with a report, written twice: as measured, and with
    expert 2 of layer 1 given no tokens (a dead expert)."""
    root = tmp_path_factory.mktemp("report")
    report = Report()
    calibrate(TINY_MODELS["ernie-moe-bytes"], samples=2, seq_len=32, report=report)
    report.write(root / "measured")
    dead = names.expert_tokens_key("ernie", 1, 2)
    report.expert_tokens = {**report.expert_tokens, dead: 0}
    report.write(root / "dead")
    return report, root


@pytest.mark.slow  # matplotlib: about a second per report
def test_the_json_has_every_linear_with_an_error_in_0_1(moe_report):
    report, root = moe_report
    data = json.loads((root / "measured" / REPORT_FILE).read_text())
    assert data["kind"] == "calibrate" and data["fp8_max"] == 240.0
    assert {row["module"] for row in data["linears"]} == _linear_modules(report.descriptor)
    errors = [row["relative_error"] for row in data["linears"]]
    assert all(e is not None and 0 < e < 1 and np.isfinite(e) for e in errors), errors
    assert errors == sorted(errors, reverse=True)
    assert all(row["channel_spread"] >= 1 for row in data["linears"])
    assert data["layers"][0]["amax"]["self_attn.cache_k"] > 0 and data["experts"]["dead"] == []


@pytest.mark.slow
def test_the_heatmap_marks_a_dead_expert(moe_report):
    import matplotlib.image

    _, root = moe_report
    assert json.loads((root / "dead" / REPORT_FILE).read_text())["experts"]["dead"] == [[1, 2]]

    def red_pixels(directory: Path) -> int:
        rgb = matplotlib.image.imread(directory / "expert_tokens.png")[..., :3]
        return int(((rgb[..., 0] > 0.9) & (rgb[..., 1] < 0.2) & (rgb[..., 2] < 0.2)).sum())

    assert red_pixels(root / "measured") == 0 and red_pixels(root / "dead") > 20


@pytest.mark.slow
def test_the_page_shows_existing_pngs(moe_report):
    import re

    _, root = moe_report
    page = (root / "measured" / "index.html").read_text()
    images = re.findall(r'<img src="([^"]+)"', page)
    plots = json.loads((root / "measured" / REPORT_FILE).read_text())["plots"]
    assert sorted(images) == sorted(plots.values()) and len(images) == 6
    for image in images:
        assert (root / "measured" / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ernie.layers" in page and not list(root.glob(".*"))  # no staging directory left behind


@pytest.fixture(scope="module")
def eval_report(tmp_path_factory):
    """An evaluation of the tiny ERNIE MoE against an FP8 checkpoint of it, with a report."""
    root = tmp_path_factory.mktemp("eval-report")
    source = TINY_MODELS["ernie-moe-bytes"]
    calibration = calibrate(source, samples=4, seq_len=32)
    convert(source, root / "ernie-fp8", [calibration.measurements], ConvertOptions(dead_experts="sibling-max"))
    report = Report()
    evaluate(source, root / "ernie-fp8", samples=2, seq_len=32, variants=("fp8",), report=report)
    report.write(root / "rep")
    return report, root


@pytest.mark.slow  # matplotlib, and a calibration, conversion and evaluation
def test_eval_plots_held_out_against_calibrated_amax_and_names_both_models_by_base_name(eval_report):
    report, root = eval_report
    data = json.loads((root / "rep" / REPORT_FILE).read_text())
    points = {row["module"]: row for row in data["amax_points"]}
    assert set(points) == set(report.checkpoint_amax) and data["checkpoint"] == str(root / "ernie-fp8")
    for module, row in points.items():
        assert row["checkpoint"] == report.checkpoint_amax[module] and row["held_out"] == report.amax.get(module, 0.0)
    assert points["ernie.layers.1.mlp.experts.2.down_proj"]["point"] == "mlp.experts.*.down_proj"
    assert points["ernie.layers.0.self_attn.cache_k"]["point"] == "self_attn.cache_k"
    assert data["plots"]["held_out_amax"] == "held_out_amax.png"
    assert (root / "rep" / "held_out_amax.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (root / "rep" / "index.html").read_text()
    assert "<h1>hpu-fp8 eval report: ernie-fp8 vs ernie-moe-bytes</h1>" in page
    assert str(root) not in page and str(TINY_MODELS["ernie-moe-bytes"]) not in page  # base names, no local paths


def test_a_hub_snapshot_is_shown_as_its_repo_id_and_revision():
    snapshot = "/home/me/.cache/huggingface/hub/models--acme--qwen2-fp8/snapshots/0123456789abcdef0123"
    assert shown_name(snapshot) == "acme/qwen2-fp8@01234567" and shown_name("/data/models/ernie-fp8") == "ernie-fp8"


@pytest.mark.slow  # matplotlib
def test_line_plots_give_every_line_its_own_look_keep_the_legend_off_the_data_and_tick_whole_layers(
    eval_report, tmp_path, monkeypatch
):
    import matplotlib.pyplot as plt

    report, _ = eval_report
    data = report.to_dict()
    data["layers"] = [{**layer, "layer": i} for i, layer in enumerate(data["layers"] * 3)]  # six layers, as a model has
    figures = {}
    monkeypatch.setattr(plt, "close", lambda fig: figures.__setitem__(fig.axes[0].get_title().split(":")[0], fig))
    render(data, tmp_path)
    for title in ("Activation amax per layer and point", "Attention points", "Weight spread"):
        fig = next(f for t, f in figures.items() if t.startswith(title))
        ax = fig.axes[0]
        looks = [(line.get_color(), line.get_marker(), line.get_linestyle()) for line in ax.get_lines()]
        assert len(looks) >= 4 and len(set(looks)) == len(looks), title  # no two lines alike
        fig.canvas.draw()
        legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
        assert legend.x0 >= axes.x1, title  # beside the axes, never over the data
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), (title, ticks)
    assert len(next(f for t, f in figures.items() if t.startswith("Activation amax")).axes[0].get_lines()) > 10

"""FP8 range report: each point's amax against the median |x| (numerics/magnitudes.py, quality/ranges.py), in
calibrate and eval, and the warning that names a point beyond what E4M3 at ±240 holds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.engine.model import forward
from hpu_fp8_loader.engine.weights import open_weights
from hpu_fp8_loader.numerics.magnitudes import QUANTILE_PRECISION, MagnitudeHistogram
from hpu_fp8_loader.quality.calibrate import calibrate
from hpu_fp8_loader.quality.datasets import dataset_tokens, token_windows
from hpu_fp8_loader.quality.observers import RangeObserver
from hpu_fp8_loader.quality.ranges import NORMAL_SPAN, PointRange, point_ranges, range_warning
from hpu_fp8_loader.quality.report import Report
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS
from hpu_fp8_loader.spec import names

HALF_BIN = QUANTILE_PRECISION  # a quantile's bin's middle is within half its bin (9/8 at the widest) of the value


def test_the_normal_span_is_240_over_the_smallest_e4m3_normal():
    assert NORMAL_SPAN == 240 / 2.0**-6 == 15360


@pytest.mark.parametrize("q", [0.01, 0.5, 0.9, 0.99])
def test_a_histogram_quantile_is_within_half_a_bin_of_numpys(q):
    values = np.random.default_rng(0).lognormal(0, 3, 50_000).astype(np.float32) * np.sign(
        np.random.default_rng(1).normal(size=50_000)
    )
    h = MagnitudeHistogram()
    for chunk in np.array_split(values, 7):
        h.add(chunk)
    exact = float(np.quantile(np.abs(values), q, method="inverted_cdf"))
    assert exact / HALF_BIN <= h.quantile(q) <= exact * HALF_BIN
    assert h.count == values.size


def test_histograms_sum_exactly_in_any_order():
    values = np.random.default_rng(2).standard_normal((40, 64)).astype(np.float32)
    forward, backward = MagnitudeHistogram(), MagnitudeHistogram()
    for row in values:
        forward.add(row)
    for row in values[::-1]:
        backward.add(row)
    np.testing.assert_array_equal(forward.counts, backward.counts)


def test_zeros_make_an_infinite_ratio_beyond_the_span_and_json_null():
    h = MagnitudeHistogram()
    h.add(np.array([0.0, 0.0, 0.0, 3.0], np.float32))
    (r,) = point_ranges({"qwen2.layers.0.mlp.down_proj": h}, {"qwen2.layers.0.mlp.down_proj": 3.0})
    assert r.median == 0.0 and math.isinf(r.ratio) and r.beyond
    assert r.to_dict()["ratio"] is None
    json.dumps(r.to_dict(), allow_nan=False)


def test_a_point_without_an_amax_and_the_probability_point_are_left_out():
    h = MagnitudeHistogram()
    h.add(np.ones(4, np.float32))
    histograms = {"qwen2.layers.0.self_attn.s": h, "qwen2.layers.0.mlp.down_proj": h, "qwen2.layers.0.self_attn.o_proj": h}
    kept = point_ranges(histograms, {"qwen2.layers.0.self_attn.s": 1.0, "qwen2.layers.0.mlp.down_proj": 2.0})
    assert [r.module for r in kept] == ["qwen2.layers.0.mlp.down_proj"]


def test_the_warning_names_the_widest_points_first_and_counts_the_rest():
    ranges = [PointRange(f"qwen2.layers.{i}.mlp.down_proj", 1e5 * (i + 1), 1.0, 10.0, 100) for i in range(7)]
    ranges += [PointRange("qwen2.layers.0.self_attn.cache_v", 16000.0, 1.0, 10.0, 100)]
    ranges.append(PointRange("qwen2.layers.0.self_attn.qkv_proj", 10.0, 1.0, 5.0, 100))
    message = range_warning(sorted(ranges, key=lambda r: -r.ratio), "held-out text")
    assert message is not None
    assert message.startswith("8 quantization point(s) span more than E4M3 at ±240 holds")
    assert "qwen2.layers.6.mlp.down_proj 7e+05" in message and "and 3 more" in message
    assert "qkv_proj" not in message
    assert range_warning([ranges[-1]], "x") is None


def test_calibrate_reads_every_point_but_the_probability_point_and_the_median_of_what_it_saw():
    values: dict[str, list[np.ndarray]] = {}

    class Keep(RangeObserver):
        def record(self, module: str, data: np.ndarray) -> None:
            super().record(module, data)
            values.setdefault(module, []).append(np.abs(data).ravel())

    result = calibrate(TINY_MODELS["qwen2-bytes"], samples=4, seq_len=64)
    # the same windows again through an observer that keeps every value: the exact medians to compare with
    ids, _, _ = dataset_tokens(TINY_MODELS["qwen2-bytes"], 512, "builtin", limit=4 * 64)
    forward(open_weights(TINY_MODELS["qwen2-bytes"]), token_windows(ids, 4, 64, 4), Keep("qwen2"))
    expected = {m for m in result.measurements.amax if names.attention_point_of(m) != "s"}
    assert {r.module for r in result.ranges} == expected
    for r in result.ranges:
        # half a bin, and 5% for reading the median from HISTOGRAM_ROWS evenly spaced rows of each batch
        exact = float(np.quantile(np.concatenate(values[r.module]), 0.5, method="inverted_cdf"))
        assert exact / (HALF_BIN * 1.05) <= r.median <= exact * HALF_BIN * 1.05, r.module
        assert r.amax == result.measurements.amax[r.module]
    assert result.warnings == []  # the shipped models stay far inside: 1e2-1e3 at down_proj
    assert max(r.ratio for r in result.ranges) < 1e3


def test_calibrate_report_lists_the_ranges_and_plots_them(tmp_path):
    report = Report()
    calibrate(TINY_MODELS["ernie-moe-bytes"], samples=4, seq_len=64, report=report)
    report.write(tmp_path / "rep")
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert data["normal_span"] == NORMAL_SPAN
    rows = data["ranges"]
    assert rows and rows == sorted(rows, key=lambda r: -r["ratio"])
    assert {"module", "amax", "median", "p99", "ratio", "p99_ratio", "beyond", "point", "layer", "values"} <= rows[0].keys()
    assert any(r["point"] == "mlp.experts.*.down_proj" for r in rows)
    assert data["plots"]["act_range"] == "act_range.png" and (tmp_path / "rep" / "act_range.png").stat().st_size > 0
    assert "Widest ranges" in (tmp_path / "rep" / "index.html").read_text()


def test_calibrate_json_carries_the_warnings(tmp_path):
    result = CliRunner().invoke(
        main, ["calibrate", "qwen2-bytes", "-o", str(tmp_path / "m.json"), "--samples", "2", "--seq-len", "64", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["warnings"] == []

"""Accuracy a user can trust: eval's default text is the demo's 2,048 tokens, and top-1 agreement and mean KL come
with a 95% bootstrap interval over windows, in the table, the --json result and EvaluationResult."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
from click.testing import CliRunner

from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.numerics.bootstrap import bootstrap_ratio_interval
from hpu_fp8_loader.quality.evaluate import evaluate


def test_all_windows_equal_give_the_point_estimate_to_the_bit():
    kl, tokens = np.full(16, 0.1), np.full(16, 127)  # 0.1 has no exact binary form: no rounding luck
    point = kl.sum() / tokens.sum()
    assert bootstrap_ratio_interval(kl, tokens) == (point, point)
    assert bootstrap_ratio_interval(np.full(5, 120), np.full(5, 127)) == (120 / 127, 120 / 127)


def test_the_interval_narrows_with_more_windows():
    rng = np.random.default_rng(1)
    widths = []
    for windows in (8, 32, 128):
        agree = rng.binomial(127, 0.95, size=windows)
        low, high = bootstrap_ratio_interval(agree, np.full(windows, 127))
        assert low <= agree.sum() / (127 * windows) <= high
        widths.append(high - low)
    assert widths[0] > widths[1] > widths[2] > 0, widths


def test_a_fixed_seed_gives_the_same_interval_and_windows_not_tokens_are_resampled():
    agree, tokens = np.array([127, 100, 127, 90, 126, 127, 80, 127]), np.full(8, 127)
    assert bootstrap_ratio_interval(agree, tokens) == bootstrap_ratio_interval(agree, tokens)
    # the same tokens as if each were its own window: independent units, a far narrower (overconfident) interval
    flat = np.concatenate([np.r_[np.ones(a), np.zeros(127 - a)] for a in agree])
    by_token = bootstrap_ratio_interval(flat, np.ones_like(flat))
    by_window = bootstrap_ratio_interval(agree, tokens)
    assert by_window[1] - by_window[0] > 2 * (by_token[1] - by_token[0])


def test_the_default_text_is_at_least_the_demos_2048_tokens():
    defaults = inspect.signature(evaluate).parameters
    assert defaults["samples"].default * defaults["seq_len"].default >= 2048
    options = {p.name: p.default for p in main.commands["eval"].params}
    assert options["samples"] * options["seq_len"] >= 2048


@pytest.mark.slow
def test_eval_by_default_runs_2048_tokens_and_each_interval_holds_its_estimate(source_factory, spec_factory):
    source, checkpoint = str(source_factory("qwen2-tiny")), str(spec_factory("qwen2-tiny"))
    result = CliRunner().invoke(main, ["eval", source, checkpoint, "--json"])  # the defaults
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["tokens"] == 2048 and data["windows"] == 16 and len(data["rows"]) == 3
    for row in data["rows"]:
        low, high = row["top1_agreement_interval"]
        assert low <= row["top1_agreement"] <= high and low < high
        low, high = row["mean_kl_interval"]
        assert low <= row["mean_kl"] <= high and low < high


def test_the_table_shows_both_intervals(source_factory, spec_factory):
    source, checkpoint = str(source_factory("qwen2-tiny")), str(spec_factory("qwen2-tiny"))
    table = CliRunner().invoke(main, ["eval", source, checkpoint, "--weights-only", "--samples", "4", "--seq-len", "32"])
    assert table.exit_code == 0, table.stderr
    header, *rows = table.stdout.splitlines()[1:]
    assert "[low, high] %" in header and len(rows) == 2
    for line in rows:
        assert line.count("[") == 2 and line.count("]") == 2, line


def test_one_window_has_no_interval(source_factory, spec_factory):
    report = evaluate(source_factory("qwen2-tiny"), spec_factory("qwen2-tiny"), samples=1, seq_len=32, variants=("fp8",))
    assert report.windows == 1 and report.rows[0].top1_agreement_interval is None and report.rows[0].mean_kl_interval is None
    with pytest.raises(RuntimeError):
        bootstrap_ratio_interval(np.array([]), np.array([]))

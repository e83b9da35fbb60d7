"""Counts and ranks out of range are usage errors naming the option (exit 2), before anything is read or written.

Found by a hostile run: `synth --seed -1` ended in numpy's traceback, `plan --tp -2` said "rank 0 is not in 0..-3"."""

from __future__ import annotations

import pytest

from hostile.refusal import assert_refused, run_cli

# (argv before the option, option, bad values)
CASES = [
    (("plan", "{d}"), "--tp", ["0", "-2"]),
    (("plan", "{d}"), "--ep", ["0"]),
    (("map", "{d}", "-o", "{d}/r.safetensors"), "--tp", ["0", "-1"]),
    (("map", "{d}", "-o", "{d}/r.safetensors"), "--rank", ["-1"]),
    (("map", "{d}", "-o", "{d}/r.safetensors"), "--ep", ["0"]),
    (("map", "{d}", "-o", "{d}/r.safetensors"), "--ep-rank", ["-1"]),
    (("export-legacy", "{d}", "{d}/out"), "--tp", ["0"]),
    (("eval", "{d}", "{d}"), "--samples", ["0", "-4"]),
    (("eval", "{d}", "{d}"), "--seq-len", ["0"]),
    (("eval", "{d}", "{d}"), "--tp", ["0"]),
    (("calibrate", "{d}", "-o", "{d}/m.json"), "--batch-size", ["0"]),
    (("synth", "{d}/out"), "--seed", ["-1"]),
    (("doctor",), "--tp", ["0"]),
    (("convert", "{d}", "{d}/out", "--measurements", "{d}/m.json"), "--workers", ["0"]),
]


@pytest.mark.parametrize(
    ("argv", "option", "value"),
    [(argv, option, value) for argv, option, values in CASES for value in values],
    ids=lambda part: part if isinstance(part, str) else part[0],
)
def test_an_out_of_range_count_or_rank_is_a_usage_error(tmp_path, argv, option, value):
    before = sorted(tmp_path.iterdir())
    args = [a.replace("{d}", str(tmp_path)) for a in argv]
    assert_refused(run_cli(*args, option, value), option, code=2)
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (("--log-level", "bogus", "validate", "x"), "--log-level"),
        (("--frob", "validate", "x"), "--frob"),
        (("map", "{d}", "--tp", "2", "--rank", "1", "--all-ranks", "-o", "{d}/r"), "--all-ranks"),
        (("map", "{d}", "--ep-rank", "1", "--all-ranks", "-o", "{d}/r"), "--ep-rank"),
    ],
)
def test_group_options_and_conflicting_options_are_one_line_usage_errors(tmp_path, argv, named):
    before = sorted(tmp_path.iterdir())
    assert_refused(run_cli(*[a.replace("{d}", str(tmp_path)) for a in argv]), named, code=2)
    assert sorted(tmp_path.iterdir()) == before


def test_export_legacy_refuses_a_tp_that_cannot_serve_the_model_as_plan_does(tmp_path, spec_factory):
    checkpoint = spec_factory("ernie-moe-tiny")
    plan_line = assert_refused(run_cli("plan", checkpoint, "--tp", "3"), "valid:")
    line = assert_refused(run_cli("export-legacy", checkpoint, tmp_path / "legacy", "--tp", "3"), "tensor parallelism 3")
    assert line.split("valid:")[1] == plan_line.split("valid:")[1]
    assert not (tmp_path / "legacy").exists() and not (tmp_path / "legacy.partial").exists()

"""Progress that reaches a log: with stderr not a terminal, long work writes plain lines at a bounded rate.

The clock is a fake that moves a fixed number of seconds each time it is read (once when a job starts, once per
report), so every elapsed time and estimate below follows from the steps, never from the wall clock.
"""

from __future__ import annotations

import json
import logging
import re
from itertools import pairwise
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.block_fp8 import hf_block_checkpoint

from hpu_fp8_loader import console
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.console import LINE_AT_LEAST_EVERY_S, LINE_AT_MOST_EVERY_S, Progress
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements

FIXTURES = Path(__file__).with_name("fixtures")
LINE = re.compile(r"^hpu-fp8: progress: (?P<desc>[\w -]+): (?P<body>.*)$")
ELAPSED = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)? elapsed")
DURATION = r"(?:\d+h)?(?:\d+m)?(?:\d+s)?"
LEFT = re.compile(r"about (?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)? left")


class FakeClock:
    """Seconds that advance by ``tick`` each time they are read."""

    def __init__(self, tick: float):
        self.tick, self.now = tick, 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def seconds(match: re.Match) -> int:
    hours, minutes, secs = (int(part) if part else 0 for part in match.groups())
    return 3600 * hours + 60 * minutes + secs


def progress_lines(stderr: str) -> list[tuple[str, str]]:
    return [(m["desc"], m["body"]) for m in map(LINE.match, stderr.splitlines()) if m]


@pytest.fixture
def log_on_stderr(capsys):
    """The package configured as the CLI configures it by default; stderr captured (not a terminal)."""
    console.configure(logging.WARNING, quiet=False)
    yield lambda: capsys.readouterr().err
    console.configure(logging.WARNING, quiet=False)


def run_layers(progress: Progress, layers: int, steps_per_layer: int) -> None:
    total = layers * steps_per_layer
    for done in range(1, total + 1):
        progress.show(done, total, f"layer {(done - 1) // steps_per_layer + 1} of {layers}")


def test_a_line_at_layer_boundaries_at_most_every_10_s_with_every_field(log_on_stderr):
    clock = FakeClock(3.0)  # 4 steps a layer: a layer takes 12 s
    with Progress("calibrate", unit="step", clock=clock) as progress:
        run_layers(progress, layers=28, steps_per_layer=4)
    lines = progress_lines(log_on_stderr())
    *during, (desc, last) = lines
    assert desc == "calibrate" and last == "done, 112 steps in 5m39s"  # 112 steps and the close, after the start
    assert len(during) == 27  # every layer after the first: each begins 12 s after the one before
    for index, (desc, body) in enumerate(during):
        layer, done = index + 2, 4 * (index + 1) + 1  # the line comes with the first step of its layer
        elapsed = 3 * done  # the start read the clock once: 3 s, the step's report 3 s per step after it
        assert desc == "calibrate" and body.startswith(f"layer {layer} of 28, step {done} of 112 ({100 * done / 112:.0f}%), ")
        assert seconds(ELAPSED.search(body)) == elapsed
        left = LEFT.search(body)
        assert left and abs(seconds(left) - elapsed * (112 - done) / done) <= 0.5


def test_lines_are_at_least_10_s_apart_and_never_more_than_30_s(log_on_stderr):
    clock = FakeClock(1.0)  # layers of 4 s: most boundaries come too soon for a line of their own
    with Progress("eval", unit="step", clock=clock) as progress:
        run_layers(progress, layers=60, steps_per_layer=4)
    during = [seconds(ELAPSED.search(body)) for _, body in progress_lines(log_on_stderr())[:-1]]
    gaps = [b - a for a, b in zip([0, *during], during, strict=False)]
    assert len(during) > 10 and all(LINE_AT_MOST_EVERY_S <= gap <= LINE_AT_LEAST_EVERY_S for gap in gaps), gaps


def test_mid_stage_work_still_gets_a_line_every_30_s(log_on_stderr):
    clock = FakeClock(5.0)
    with Progress("convert", total=100 * 2**20, clock=clock) as progress:  # bytes, no stages: only the 30 s rule
        for done in range(1, 101):
            progress.show(done * 2**20, 100 * 2**20, detail=f"{done}/100 tensors")
    lines = progress_lines(log_on_stderr())
    during = [seconds(ELAPSED.search(body)) for _, body in lines[:-1]]
    assert during == list(range(30, 500, 30))  # every 30 s, counted from the start
    assert lines[0][1] == "6.00 MiB of 100 MiB (6%), 6/100 tensors, 30s elapsed, about 7m50s left"  # 30 s x 94 / 6
    assert lines[-1] == ("convert", "done, 100 MiB in 8m25s")


def test_unknown_totals_give_no_estimate(log_on_stderr):
    with Progress("scanning weights", clock=FakeClock(40.0)) as progress:
        progress.update(3 * 2**30)
    assert progress_lines(log_on_stderr()) == [
        ("scanning weights", "3.00 GiB, 40s elapsed"),
        ("scanning weights", "done, 3.00 GiB in 1m20s"),
    ]


def test_a_short_job_writes_nothing_and_a_failed_one_no_done_line(log_on_stderr):
    with Progress("synth", total=10, clock=FakeClock(0.5)) as progress:
        for _ in range(10):
            progress.update(1)
    assert log_on_stderr() == ""
    with pytest.raises(KeyboardInterrupt), Progress("eval", unit="step", clock=FakeClock(20.0)) as progress:
        progress.show(1, 4, "layer 1 of 2")
        raise KeyboardInterrupt
    assert [body.split(",")[0] for _, body in progress_lines(log_on_stderr())] == ["layer 1 of 2"]


@pytest.mark.parametrize(("quiet", "level"), [(True, logging.WARNING), (False, logging.ERROR)])
def test_quiet_or_errors_only_silence_the_lines(log_on_stderr, quiet, level):
    console.configure(level, quiet=quiet)
    with Progress("eval", unit="step", clock=FakeClock(60.0)) as progress:
        run_layers(progress, layers=4, steps_per_layer=1)
    assert log_on_stderr() == ""


# The commands themselves, with stderr captured by click's runner (not a terminal) and the fake clock injected.


@pytest.fixture
def fake_clock(monkeypatch):
    clock = FakeClock(4.0)
    monkeypatch.setattr(console, "monotonic", clock)
    return clock


def invoke(*args: object, env: dict | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def test_calibrate_writes_layer_lines_to_a_log(tmp_path, fake_clock):
    layers, source = 6, tmp_path / "six-layers"
    fake_clock.tick = 2.0  # 8 steps (4 chunks x 2 stages) of 2 s: a layer of 16 s
    synthesize(source, preset_config("qwen2-tiny", {"num_hidden_layers": layers}), "paddle", seed=0)
    args = ("calibrate", source, "-o", tmp_path / "m.json", "--samples", "4", "--seq-len", "16", "--batch-size", "1")
    result = invoke(*args)
    assert result.exit_code == 0, result.stderr
    lines = progress_lines(result.stderr)
    assert lines and {desc for desc, _ in lines} == {"calibrate"}
    *during, last = lines
    # 4 chunks through each dense layer's 2 stages (attention, MLP)
    assert last[1].startswith(f"done, {8 * layers} steps in ") and len(during) == layers - 1  # layers of 16 s
    for _, body in during:
        assert re.match(
            rf"layer \d+ of {layers}, step \d+ of {8 * layers} \(\d+%\), {DURATION} elapsed, about {DURATION} left$", body
        )
    elapsed = [seconds(ELAPSED.search(body)) for _, body in during]
    assert all(b - a >= LINE_AT_MOST_EVERY_S for a, b in pairwise(elapsed))
    quiet = invoke("-q", *args[:3], tmp_path / "q.json", *args[4:])
    assert quiet.exit_code == 0 and "progress" not in quiet.stderr
    # TQDM_DISABLE turns bars off (there are none off a terminal anyway); the lines are log output and stay
    disabled = invoke(*args[:3], tmp_path / "t.json", *args[4:], env={"TQDM_DISABLE": "1"})
    assert progress_lines(disabled.stderr)


def test_eval_and_convert_lines_stay_off_json_stdout(tmp_path, source_factory, spec_factory, fake_clock):
    source, checkpoint = source_factory("qwen2-tiny"), spec_factory("qwen2-tiny")
    evaluated = invoke("eval", source, checkpoint, "--samples", "2", "--seq-len", "16", "--weights-only", "--json")
    assert evaluated.exit_code == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["tokens"] == 32
    bodies = [body for desc, body in progress_lines(evaluated.stderr) if desc == "eval"]
    assert any(body.startswith("logits, ") for body in bodies) and bodies[-1].startswith("done, ")
    measurements = tmp_path / "m.json"
    write_measurements(measurements, synthetic_measurements(preset_config("qwen2-tiny")))
    converted = invoke("convert", source, tmp_path / "out", "--measurements", measurements, "--workers", "1")
    assert converted.exit_code == 0, converted.stderr
    bodies = [body for desc, body in progress_lines(converted.stderr) if desc == "convert"]
    assert bodies and all(re.search(r"\d+/\d+ tensors, ", body) for body in bodies[:-1]), converted.stderr


@pytest.mark.parametrize("kind", ["block-fp8", "compressed-tensors"])
def test_import_writes_its_conversion_lines_to_a_log(tmp_path, fake_clock, kind):
    """A 300B block-FP8 import runs for hours: it reports as convert does, and -q silences it."""
    if kind == "block-fp8":
        bf16 = synthesize(tmp_path / "bf16", preset_config("qwen2-tiny"), "torch", seed=0)
        source = hf_block_checkpoint(bf16, tmp_path / "source")
    else:
        source = FIXTURES / "qwen2-bytes-fp8-dynamic"
    measurements = tmp_path / "m.json"
    write_measurements(measurements, synthetic_measurements(preset_config("qwen2-tiny")))
    imported = invoke("import", source, tmp_path / "out", "--measurements", measurements, "--json")
    assert imported.exit_code == 0, imported.stderr
    assert json.loads(imported.stdout)["errors"]  # the lines stay off the JSON on stdout
    bodies = [body for desc, body in progress_lines(imported.stderr) if desc == "import"]
    assert len(bodies) > 1 and bodies[-1].startswith("done, ")
    assert all(re.search(r"\d+/\d+ tensors, ", body) for body in bodies[:-1]), imported.stderr
    quiet = invoke("import", source, tmp_path / "quiet", "--measurements", measurements, "-q")
    assert quiet.exit_code == 0 and "progress" not in quiet.stderr, quiet.stderr


def test_the_rewriting_commands_write_their_lines_to_a_log(tmp_path, spec_factory, fake_clock):
    """retarget, export-legacy and import-legacy rewrite a whole checkpoint (hundreds of GB at 300B): each reports
    the bytes it has written, and -q silences it."""
    checkpoint = spec_factory("qwen2-tiny")
    measurements = tmp_path / "m.json"
    write_measurements(measurements, synthetic_measurements(preset_config("qwen2-tiny")))
    runs = {
        "retarget": ("retarget", checkpoint, tmp_path / "g3", "--target", "gaudi3"),
        "export-legacy": ("export-legacy", checkpoint, tmp_path / "legacy"),
        "import-legacy": ("import-legacy", tmp_path / "legacy", tmp_path / "back", "--measurements", measurements),
    }
    for desc, args in runs.items():  # in this order: import-legacy reads what export-legacy wrote
        result = invoke(*args)
        assert result.exit_code == 0, result.stderr
        bodies = [body for d, body in progress_lines(result.stderr) if d == desc]
        assert len(bodies) > 1 and bodies[-1].startswith("done, "), result.stderr
        assert all(re.search(r"\(\d+%\)", body) for body in bodies[:-1]), result.stderr  # of a known total
        quiet = invoke(*args[:2], tmp_path / f"quiet-{desc}", *args[3:], "-q")
        assert quiet.exit_code == 0 and "progress" not in quiet.stderr, quiet.stderr


@pytest.mark.slow  # a whole push (calibrate, convert, eval) against the Hub double: ~10 s
def test_push_shows_its_calibration_conversion_and_evaluation_in_a_log(tmp_path, fake_clock):
    """push runs the three long steps of calibrate, convert and eval; each reports as those commands do."""
    args = ("push", "qwen2-bytes", "--repo-id", "me/q", "--base-model", "me/base", "--license", "mit", "--calibrate")
    pushed = invoke(*args, "--dry-run", "--work-dir", tmp_path / "work")
    assert pushed.exit_code == 0, pushed.stderr
    lines = progress_lines(pushed.stderr)
    assert sorted(desc for desc, body in lines if body.startswith("done, ")) == ["calibrate", "convert", "eval"]
    assert any(desc == "eval" and body.startswith("layer ") for desc, body in lines)
    quiet = invoke("-q", *args, "--dry-run", "--work-dir", tmp_path / "quiet")
    assert quiet.exit_code == 0 and "progress" not in quiet.stderr

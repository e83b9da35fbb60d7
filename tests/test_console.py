"""What the CLI writes besides its result: --json on every command, log levels, and progress bars only on a terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpu_fp8_loader.cli.group import INTERRUPTED, interrupted_line
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.console import human_bytes, human_count, human_rate
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements
from hpu_fp8_loader.spec import names

HPU_FP8 = str(Path(sys.executable).with_name("hpu-fp8"))


def invoke(*args: object, env: dict | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def test_every_command_offers_json_output():
    lacking = sorted(name for name, command in main.commands.items() if not any(p.name == "as_json" for p in command.params))
    assert lacking == []


@pytest.fixture
def measurements(tmp_path):
    path = tmp_path / "m.json"
    write_measurements(path, synthetic_measurements(preset_config("qwen2-tiny")))
    return path


@pytest.mark.slow
def test_json_results_are_one_document_on_stdout(tmp_path, source_factory, measurements):
    source, out = source_factory("qwen2-tiny"), tmp_path / "out"
    converted = invoke("convert", source, out, "--measurements", measurements, "--json")
    assert converted.exit_code == 0, converted.stderr
    result = json.loads(converted.stdout)
    assert result["out"] == str(out) and result["tensors_quantized"] > 0 and result["target"] == "gaudi2"

    mapped = invoke("map", out, "-o", tmp_path / "rank0.safetensors", "--json")
    assert json.loads(mapped.stdout)["parameters"] > 0
    exported = invoke("export-legacy", out, tmp_path / "legacy", "--json")
    assert json.loads(exported.stdout)["tensors"] > 0
    retargeted = invoke("retarget", out, tmp_path / "g3", "--target", "gaudi3", "--json")
    assert json.loads(retargeted.stdout)["action"] == "relabelled"
    calibrated = invoke("calibrate", source, "-o", tmp_path / "c.json", "--samples", "1", "--seq-len", "8", "--json")
    assert json.loads(calibrated.stdout)["points"] > 0, calibrated.stderr
    synthesized = invoke("synth", tmp_path / "s", "--preset", "qwen2-tiny", "--json")
    assert json.loads(synthesized.stdout)["model_type"] == "qwen2"


def _fastdeploy_file_with_a_warning(tmp_path: Path) -> Path:
    """FastDeploy's measurement text with an s_matmul amax other than 1.0: converts, with a warning."""
    amax = synthetic_measurements(preset_config("ernie-moe-tiny")).amax
    path = tmp_path / "model_measurement.txt"
    path.write_text(
        "".join(f"{names.fastdeploy_key_from_module(m)}\t{0.3 if m.endswith('.s') else v}\n" for m, v in amax.items())
    )
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "env", "shows_warning", "shows_info"),
    [
        ((), {}, True, False),
        (("-v",), {}, True, True),
        (("--log-level", "error"), {}, False, False),
        ((), {"HPU_FP8_LOG_LEVEL": "error"}, False, False),
        ((), {"HPU_FP8_LOG_LEVEL": "ERROR"}, False, False),  # as people write log levels in the environment
        (("-v",), {"HPU_FP8_LOG_LEVEL": "error"}, True, True),  # the command line beats the environment
        (("--log-level", "info", "-q"), {}, True, True),
    ],
)
def test_log_levels(tmp_path, source_factory, flags, env, shows_warning, shows_info):
    measurement = _fastdeploy_file_with_a_warning(tmp_path)
    result = invoke(*flags, "convert", source_factory(), tmp_path / "out", "--measurements", measurement, env=env)
    assert result.exit_code == 0, result.stderr
    assert ("hpu-fp8: warning:" in result.stderr and "s_matmul" in result.stderr) == shows_warning
    assert ("hpu-fp8: info:" in result.stderr and "published" in result.stderr) == shows_info


def _convert_with_stderr(tmp_path: Path, source: Path, measurements: Path, terminal: bool, env: dict) -> str:
    """Run convert with stderr on a pipe or on a pseudo-terminal; returns what reached stderr."""
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
    argv = [HPU_FP8, "convert", str(source), str(out), "--measurements", str(measurements), "--workers", "1"]
    environment = {
        name: value for name, value in os.environ.items() if name not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")
    }
    environment.update(env)
    if not terminal:
        done = subprocess.run(argv, capture_output=True, text=True, env=environment, check=True)
        return done.stderr
    controller, terminal_end = pty.openpty()
    fcntl.ioctl(terminal_end, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=terminal_end, env=environment)
    os.close(terminal_end)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the pty's far end closed: the process is gone
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert process.wait() == 0
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_progress_bars_only_on_a_terminal_and_never_when_switched_off(tmp_path, source_factory, measurements):
    source = source_factory("qwen2-tiny")
    on_terminal = _convert_with_stderr(tmp_path, source, measurements, True, {})
    assert "\r" in on_terminal and "convert" in on_terminal  # the bar is drawn where a person watches
    assert "\r" not in _convert_with_stderr(tmp_path, source, measurements, False, {})  # a pipe or log: no debris
    for switch in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):
        assert "\r" not in _convert_with_stderr(tmp_path, source, measurements, True, {switch: "1"}), switch
    assert "\r" in _convert_with_stderr(tmp_path, source, measurements, True, {"TQDM_DISABLE": "0"})


@pytest.mark.parametrize("command", [("validate", "x"), ("schema", "measurements"), ("inspect", "x")])
def test_ctrl_c_in_any_command_is_one_line_and_exit_130(monkeypatch, command):
    """Ctrl-C arrives as KeyboardInterrupt wherever the command is; stood in for by raising it from click's echo."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("hpu_fp8_loader.checks.validate.validate", interrupted)
    monkeypatch.setattr("hpu_fp8_loader.checks.inspection.inspect_checkpoint", interrupted)
    monkeypatch.setattr("hpu_fp8_loader.cli.checks_commands.emit_json", interrupted)
    result = invoke(*command)
    assert result.exit_code == 130 and result.stderr.strip() == f"hpu-fp8: error: {interrupted_line(command[0])}", result.stderr


def test_every_command_has_its_own_ctrl_c_line_and_only_what_resumes_says_so():
    assert set(INTERRUPTED) == set(main.commands)
    resuming = {name for name in main.commands if "resume" in interrupted_line(name).replace("not resume", "")}
    assert resuming == {"convert", "import"}  # convert's journal; import converts through it
    assert "does not resume" in interrupted_line("calibrate") and "does not resume" in interrupted_line("eval")


def test_ctrl_c_in_calibrate_does_not_promise_a_resume(monkeypatch, tmp_path):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("hpu_fp8_loader.quality.calibrate.calibrate", interrupt)
    result = invoke("calibrate", "qwen2-bytes", "-o", tmp_path / "m.json")
    assert result.exit_code == 130, result.stderr
    assert result.stderr.strip() == (
        "hpu-fp8: error: interrupted; no file was written; a calibration does not resume, so the same command starts "
        "from the beginning"
    )
    assert not (tmp_path / "m.json").exists()


@pytest.mark.parametrize(
    ("size", "shown"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (35_200, "34.4 KiB"), (1_047_552, "1.00 MiB"), (43.3 * 2**30, "43.3 GiB")],
)
def test_sizes_are_shown_to_three_significant_digits_in_the_unit_that_fits(size, shown):
    assert human_bytes(size) == shown
    assert human_rate(size * 2, 2.0) == f"{shown}/s" and human_rate(size, 0.0) == "too fast to time"


@pytest.mark.parametrize(
    ("count", "shown"), [(812, "812"), (999.5, "1.00 K"), (35_200, "35.2 K"), (999_500, "1.00 M"), (21_825_437_696, "21.8 B")]
)
def test_counts_are_shown_to_three_significant_digits(count, shown):
    assert human_count(count) == shown


def test_a_tiny_model_never_reads_as_zero(tmp_path, source_factory):
    """plan and convert of a model of a few hundred KiB: its sizes and parameter count in units that show them."""
    source = source_factory("qwen2-tiny")
    planned = invoke("plan", source)
    assert planned.exit_code == 0, planned.stderr
    assert re.match(r"qwen2: [\d.]+ K parameters;", planned.stdout) and " 0.00" not in planned.stdout
    assert re.search(r"total +[\d.]+ KiB", planned.stdout), planned.stdout
    write_measurements(tmp_path / "m.json", synthetic_measurements(preset_config("qwen2-tiny")))
    converted = invoke("convert", source, tmp_path / "out", "--measurements", tmp_path / "m.json", "--workers", "1")
    assert converted.exit_code == 0, converted.stderr
    assert re.search(r"; [\d.]+ KiB -> [\d.]+ KiB \(", converted.stdout) and "0.00 GiB" not in converted.stdout

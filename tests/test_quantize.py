"""One step to a local checkpoint: ``quantize`` / ``convert --calibrate`` calibrates, then converts, resumably.

The checkpoint must equal what ``calibrate`` then ``convert`` make (it is the same code), keep the
measurements it was made from, refuse OUT before the calibration runs, and reuse an interrupted run's
calibration instead of calibrating again.
"""

from __future__ import annotations

import json

import pytest
from hostile.refusal import assert_refused, run_cli, tree_digest

from hpu_fp8_loader import CalibrationOptions, OutputExistsError, quantize, read_measurements
from hpu_fp8_loader.conversion.journal import CALIBRATION
from hpu_fp8_loader.io.manifest import MANIFEST_FILE
from hpu_fp8_loader.quality import calibrate as calibrate_module
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS
from hpu_fp8_loader.spec.measurements import MEASUREMENTS_FILE

SOURCE = TINY_MODELS["qwen2-bytes"]
OPTIONS = CalibrationOptions(samples=4, seq_len=32)


def _files(root) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_one_step_equals_calibrate_then_convert_and_keeps_its_measurements(tmp_path):
    from hpu_fp8_loader import calibrate, convert

    result = quantize(SOURCE, tmp_path / "one", OPTIONS)
    measurements = calibrate(SOURCE, samples=4, seq_len=32).measurements
    convert(SOURCE, tmp_path / "two", [measurements])
    one, two = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert one.keys() == two.keys() and MEASUREMENTS_FILE in one and CALIBRATION not in one
    kept = read_measurements(tmp_path / "one" / MEASUREMENTS_FILE)
    assert kept.amax == measurements.amax == result.measurements.amax and kept.provenance.samples == 4
    for name in one:  # the same bytes, but for the calibration date and the producer's run
        if name.endswith(".safetensors"):
            assert one[name] == two[name], name
    assert MEASUREMENTS_FILE in json.loads(one[MANIFEST_FILE])["files"]
    assert result.calibration is not None and result.calibration.tokens == 4 * 32


def test_an_existing_out_is_refused_before_the_calibration_runs(tmp_path, monkeypatch):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    ran = []
    monkeypatch.setattr(calibrate_module, "calibrate", lambda *a, **k: ran.append(a))
    with pytest.raises(OutputExistsError, match="already exists; pass force=True"):
        quantize(SOURCE, tmp_path / "out", OPTIONS)
    assert ran == [] and (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_an_interrupted_run_reuses_its_calibration_and_resumes(tmp_path, monkeypatch):
    """Interrupted during the conversion: the calibration waits in OUT.partial, and the same call reuses it (it
    does not calibrate again) and publishes the checkpoint a run without interruption makes."""

    def stop(progress) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize(SOURCE, tmp_path / "out", OPTIONS, progress=stop)
    assert (tmp_path / "out.partial" / CALIBRATION).is_file() and not (tmp_path / "out").exists()
    calls = []
    real = calibrate_module.calibrate
    monkeypatch.setattr(calibrate_module, "calibrate", lambda *a, **k: calls.append(a) or real(*a, **k))
    resumed = quantize(SOURCE, tmp_path / "out", OPTIONS)
    assert calls == [] and resumed.calibration is None
    fresh = quantize(SOURCE, tmp_path / "fresh", OPTIONS)
    assert {n: b for n, b in _files(tmp_path / "out").items() if n.endswith(".safetensors")} == {
        n: b for n, b in _files(tmp_path / "fresh").items() if n.endswith(".safetensors")
    }
    assert resumed.measurements.amax == fresh.measurements.amax and not (tmp_path / "out.partial").exists()


def test_other_calibration_options_calibrate_again(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        quantize(SOURCE, tmp_path / "out", OPTIONS, progress=lambda p: (_ for _ in ()).throw(KeyboardInterrupt))
    again = quantize(SOURCE, tmp_path / "out", CalibrationOptions(samples=2, seq_len=32))
    assert again.calibration is not None and again.measurements.provenance.samples == 2


def test_convert_calibrate_on_the_command_line(tmp_path):
    out = tmp_path / "out"
    done = run_cli("convert", SOURCE, out, "--calibrate", "--samples", "4", "--seq-len", "32", "--workers", "1",
                   "--keep-bf16", "dense", "--json")  # fmt: skip
    assert_refused(done, "no linear is left in FP8")  # Qwen2 has only dense linears; refused before calibrating
    assert not (tmp_path / "out.partial").exists()
    done = run_cli("convert", SOURCE, out, "--calibrate", "--samples", "4", "--seq-len", "32", "--workers", "1", "--json")
    assert done.exit_code == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["calibration"]["tokens"] == 4 * 32 and read_measurements(out / MEASUREMENTS_FILE).provenance.seq_len == 32


@pytest.mark.parametrize(
    ("extra", "names", "code"),
    [
        ((), ("no activation statistics", "--measurements FILE or --calibrate"), 1),
        (("--calibrate", "--measurements", "{m}"), ("--measurements and --calibrate both given",), 1),
        (("--measurements", "{m}", "--samples", "64"), ("--samples applies to the calibration", "--calibrate"), 2),
        (("--measurements", "{m}", "--dataset", "x.txt"), ("--dataset applies to the calibration",), 2),
    ],
)
def test_one_source_of_statistics_is_asked_for_in_one_line(tmp_path, extra, names, code):
    measurements = tmp_path / "m.json"
    measurements.write_text("{}")
    before = tree_digest(SOURCE)
    args = [a.format(m=measurements) for a in extra]
    assert_refused(run_cli("convert", SOURCE, tmp_path / "out", *args), *names, code=code)
    assert tree_digest(SOURCE) == before and not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_calibration_options_run_what_calibrate_runs():
    from hpu_fp8_loader import calibrate

    options = CalibrationOptions(samples=2, seq_len=32, tokenizer="bytes", all_experts=True)
    assert options.run(SOURCE).measurements.amax == calibrate(SOURCE, samples=2, seq_len=32, all_experts=True).measurements.amax

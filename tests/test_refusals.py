"""The refusals a new user meets first, through the command line: each is one named line, a non-zero exit, and
nothing written; and the inputs that look odd but are right (a JSON measurement file named ``m.txt``, a directory
of them) are accepted."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpu_fp8_loader import TINY_MODELS
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.measurements import Measurements

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code != 0 and len(lines) == 1 and "Traceback" not in result.stderr, result.output
    return lines[0]


def convert(source: Path, out: Path, *measurements: Path):
    flags = [flag for m in measurements for flag in ("--measurements", m)]
    return run("convert", source, out, *flags, "-q", "--workers", "1")


def test_calibrate_zero_samples_is_a_usage_error_that_writes_nothing(tmp_path):
    out, fastdeploy = tmp_path / "m.json", tmp_path / "m.txt"
    result = run("calibrate", TINY_MODELS["qwen2-bytes"], "-o", out, "--fastdeploy-format", fastdeploy, "--samples", "0")
    assert result.exit_code == 2 and "--samples" in one_error_line(result)
    assert list(tmp_path.iterdir()) == []


def test_our_measurement_file_of_another_model_is_refused_naming_the_file_and_the_fields(tmp_path, source_factory):
    write_measurements(tmp_path / "qwen2.json", synthetic_measurements(preset_config("qwen2-tiny")))
    result = convert(source_factory("ernie-moe-tiny"), tmp_path / "out", tmp_path / "qwen2.json")
    line = one_error_line(result)
    assert "qwen2.json" in line and "taken on qwen2" in line and "this model is ernie4_5_moe" in line and "experts" in line
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize(
    ("extra", "named"), [("layers.9.self_attn.qkv_proj", "layers.9"), ("layers.1.mlp.experts.77.down_proj", "experts.77")]
)
def test_a_fastdeploy_file_naming_layers_or_experts_the_model_lacks_is_refused(tmp_path, source_factory, extra, named):
    amax = dict(synthetic_measurements(preset_config("ernie-moe-tiny")).amax)
    amax[f"ernie.{extra}"] = 1.5
    lines = "".join(f"{names.fastdeploy_key_from_module(m)}\t{v}\n" for m, v in amax.items())
    (tmp_path / "model_measurement.txt").write_text(lines)
    line = one_error_line(convert(source_factory("ernie-moe-tiny"), tmp_path / "out", tmp_path / "model_measurement.txt"))
    assert "model_measurement.txt" in line and named in line and "another model" in line
    assert not (tmp_path / "out").exists()


def test_eval_of_two_different_models_names_the_differing_fields(tmp_path, spec_factory):
    line = one_error_line(run("eval", TINY_MODELS["qwen2-bytes"], spec_factory("ernie-moe-tiny"), "--samples", "1"))
    assert "different models" in line and "model_type qwen2 vs ernie4_5_moe" in line


def _split(preset: str) -> tuple[Measurements, Measurements]:
    """A model's measurements as two sets: attention points, and the rest (each with the model's identity)."""
    whole = synthetic_measurements(preset_config(preset))
    attention = {m: v for m, v in whole.amax.items() if ".self_attn." in m}
    rest = {m: v for m, v in whole.amax.items() if m not in attention}
    return whole.model_copy(update={"amax": attention}), whole.model_copy(update={"amax": rest})


def _quantization_config(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["quantization_config"]


def test_a_directory_of_json_files_is_each_file_in_sorted_order(tmp_path, source_factory):
    """A directory of our files converts exactly as the files named one by one, in name order (z.json, the
    attention, after a.json); a JSON file is recognised by content whatever it is called."""
    attention, rest = _split("ernie-moe-tiny")
    folder = tmp_path / "measurements"
    folder.mkdir()
    write_measurements(folder / "z.json", attention)
    write_measurements(folder / "a.txt", rest)  # JSON named .txt: read as JSON, by content
    (folder / ".hidden").write_text("not a measurement")
    source = source_factory("ernie-moe-tiny")
    assert convert(source, tmp_path / "from-dir", folder).exit_code == 0
    assert convert(source, tmp_path / "one-by-one", folder / "a.txt", folder / "z.json").exit_code == 0
    assert _quantization_config(tmp_path / "from-dir") == _quantization_config(tmp_path / "one-by-one")
    sources = _quantization_config(tmp_path / "from-dir")["calibration"]["sources"]
    assert [s["files"] for s in sources] == [["a.txt"], ["z.json"]]
    shutil.copy(folder / "a.txt", tmp_path / "rest")  # no suffix at all
    assert convert(source, tmp_path / "no-suffix", tmp_path / "rest", folder / "z.json").exit_code == 0
    assert _quantization_config(tmp_path / "no-suffix")["calibration"]["sources"][0]["files"] == ["rest"]


@pytest.mark.parametrize("contents", ["mixed", "empty"])
def test_a_directory_of_both_kinds_or_neither_is_refused_naming_it(tmp_path, source_factory, contents):
    folder = tmp_path / "measurements"
    folder.mkdir()
    if contents == "mixed":
        write_measurements(folder / "ours.json", synthetic_measurements(preset_config("ernie-moe-tiny")))
        (folder / "model_measurement.txt").write_text("ernie.layers.0.self_attn.qkv_proj.activation_scale\t1.0\n")
    line = one_error_line(convert(source_factory("ernie-moe-tiny"), tmp_path / "out", folder))
    assert str(folder) in line
    assert ("both" in line) if contents == "mixed" else ("no measurement files" in line)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_the_readme_calibrate_example_writes_what_its_convert_example_reads():
    readme = (ROOT / "README.md").read_text()
    written = re.search(r"^\s+hpu-fp8 calibrate \S+ -o (\S+)", readme, re.M)
    read = re.search(r"^\s+hpu-fp8 convert (\S+) \S+ --measurements (\S+)", readme, re.M)
    calibrated = re.search(r"^\s+hpu-fp8 calibrate (\S+)", readme, re.M)
    assert written and read and calibrated
    assert written[1] == read[2] and calibrated[1] == read[1]

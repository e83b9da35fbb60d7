"""The measurement file format (spec section "Measurement files")."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.errors import MeasurementError, OutputExistsError
from hpu_fp8_loader.sources.measurements import read_measurements, write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements


@pytest.fixture
def measurement_file(tmp_path):
    path = tmp_path / "m.json"
    write_measurements(path, synthetic_measurements(preset_config("ernie-moe-tiny")))
    return path


def test_round_trip(measurement_file):
    m = read_measurements(measurement_file)
    assert m.format == "hpu-fp8-measurements" and m.version == 1
    assert m.amax["ernie.layers.1.self_attn.s"] == 1.0
    assert m.model.moe_num_experts == 4
    assert read_measurements(measurement_file) == m


def _edit(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "something-else"}, "'format' is not"),
        ({"version": 2}, "version 2"),
        ({"amax": {"ernie.layers.0.self_attn.k_proj": 1.0}}, "not a spec activation module"),
        ({"amax": {"ernie.layers.0.self_attn.qkv_proj": -1.0}}, "finite and >= 0"),
        ({"expert_tokens": {"ernie.layers.1.mlp.experts.x": 3}}, "expert_tokens key"),
    ],
)
def test_malformed_files_are_refused_naming_the_file(measurement_file, changes, message):
    _edit(measurement_file, **changes)
    with pytest.raises(MeasurementError, match=message) as info:
        read_measurements(measurement_file)
    assert str(measurement_file) in str(info.value)


def test_not_json(tmp_path):
    path = tmp_path / "m.json"
    path.write_text("ernie.layers.0.self_attn.qkv_proj.activation_scale\t3.5\n")
    with pytest.raises(MeasurementError, match="not valid JSON"):
        read_measurements(path)


def test_strict_numbers_refuse_what_json_does_not_say(measurement_file):
    """``"3.5"`` is a string and ``true`` a boolean: pydantic's lax mode would read both as numbers."""
    for value, shown in (("3.5", '"3.5"'), (True, "true")):
        data = json.loads(measurement_file.read_text())
        data["amax"]["ernie.layers.0.self_attn.qkv_proj"] = value
        measurement_file.write_text(json.dumps(data))
        with pytest.raises(MeasurementError) as info:
            read_measurements(measurement_file)
        assert str(info.value) == (
            f'{measurement_file}: amax["ernie.layers.0.self_attn.qkv_proj"]: input should be a valid number, got {shown}'
        )


def test_integers_written_without_a_fraction_are_still_amax(measurement_file):
    data = json.loads(measurement_file.read_text())
    data["amax"]["ernie.layers.0.self_attn.qkv_proj"] = 3
    measurement_file.write_text(json.dumps(data))
    assert read_measurements(measurement_file).amax["ernie.layers.0.self_attn.qkv_proj"] == 3.0


def test_writing_replaces_atomically_and_never_follows_a_planted_link(tmp_path, measurement_file):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out.json"
    (tmp_path / "out.json.partial").symlink_to(victim)
    out.symlink_to(victim)  # replacing OUT replaces the link, never writes through it
    write_measurements(out, read_measurements(measurement_file), force=True)
    assert victim.read_text() == "keep me" and not out.is_symlink()
    assert read_measurements(out) == read_measurements(measurement_file)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "out.json", "out.json.partial", "victim.txt"]
    assert (out.stat().st_mode & 0o777) == 0o666 & ~_umask()


def test_writing_without_force_refuses_an_existing_file_naming_the_python_parameter(tmp_path, measurement_file):
    """Python's default is calibrate -o's: an existing file is kept unless asked; the message names force=True, not
    the CLI's --force, which the same refusal names on the command line."""
    out = tmp_path / "out.json"
    out.write_text("someone else's")
    with pytest.raises(OutputExistsError, match=r"out.json: already exists; pass force=True to replace it$"):
        write_measurements(out, read_measurements(measurement_file))
    assert out.read_text() == "someone else's" and sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "out.json"]
    cli = CliRunner().invoke(main, ["calibrate", "qwen2-bytes", "-o", str(out)])
    assert cli.exit_code == 1 and cli.stderr.strip().endswith("out.json: already exists; pass --force to replace it")
    with pytest.raises(OutputExistsError, match="pass force=True"):  # the command line's spelling ended with it
        write_measurements(out, read_measurements(measurement_file))
    write_measurements(out, read_measurements(measurement_file), force=True)
    assert read_measurements(out) == read_measurements(measurement_file)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

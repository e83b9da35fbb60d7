"""The measurement file format (spec section "Measurement files")."""

from __future__ import annotations

import json

import pytest

from hpu_fp8_loader.errors import MeasurementError
from hpu_fp8_loader.spec.measurements import read_measurements, write_measurements
from hpu_fp8_loader.synth import preset_config, synthetic_measurements


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

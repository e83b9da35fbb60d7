"""FastDeploy measurement-mode files (docs/fastdeploy.md section 10). No real file has been seen: these are
synthetic files written the way PaddleCustomDevice's reference ops write them ([inferred])."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.errors import MeasurementError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.sources.measurements import load_measurements, write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements
from hpu_fp8_loader.spec import names


def write_fastdeploy(path, amax: dict[str, float], skip=lambda module: False) -> None:
    """FastDeploy's format: one 'key<TAB>float' line per point, raw amax, insertion order."""
    lines = [f"{names.fastdeploy_key_from_module(m)}\t{v!r}\n" for m, v in amax.items() if not skip(m)]
    path.write_text("".join(lines), encoding="utf-8")


@pytest.fixture
def ernie_amax():
    return synthetic_measurements(preset_config("ernie-moe-tiny")).amax


def test_a_single_file_reads_back_every_point(tmp_path, ernie_amax):
    write_fastdeploy(tmp_path / "model_measurement.txt", ernie_amax)
    loaded = load_measurements(tmp_path / "model_measurement.txt")
    assert loaded.measurements.amax == ernie_amax
    assert loaded.measurements.provenance.kind.value == "fastdeploy-measurement"
    assert loaded.warnings == []


def test_rank_files_are_merged_by_max(tmp_path, ernie_amax):
    rng = np.random.default_rng(0)
    ranks = [{m: v * float(rng.uniform(0.5, 1.0)) for m, v in ernie_amax.items()} for _ in range(4)]
    for r, amax in enumerate(ranks):
        write_fastdeploy(tmp_path / f"model_measurement_{r}.txt", amax)
    expected = {m: max(r[m] for r in ranks) for m in ernie_amax}
    for given in (tmp_path, tmp_path / "model_measurement.txt", tmp_path / "model_measurement_2.txt"):
        loaded = load_measurements(given)
        assert loaded.measurements.amax == expected
        assert loaded.measurements.provenance.files == [f"model_measurement_{r}.txt" for r in range(4)]


def test_an_incomplete_rank_set_is_refused(tmp_path, ernie_amax):
    for r in (0, 1, 3):
        write_fastdeploy(tmp_path / f"model_measurement_{r}.txt", ernie_amax)
    with pytest.raises(MeasurementError, match=r"rank\(s\) \[2\] are missing"):
        load_measurements(tmp_path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("ernie.layers.0.self_attn.qkv_proj.activation_scale 3.5", "expected 'key<TAB>float'"),
        ("ernie.layers.0.self_attn.qkv_proj.activation_scale\tabc", "expected 'key<TAB>float'"),
        ("ernie.layers.0.self_attn.k_matmul.activation_scale\t1.0", "FastDeploy measurement key"),
        ("ernie.layers.0.self_attn.qkv_proj.activation_scale\tnan", "not a finite decimal number"),
    ],
)
def test_garbage_lines_are_named_by_file_and_line(tmp_path, ernie_amax, line, message):
    write_fastdeploy(tmp_path / "model_measurement.txt", ernie_amax)
    with open(tmp_path / "model_measurement.txt", "a") as f:
        f.write("\n" + line + "\n")
    with pytest.raises(MeasurementError, match=message) as info:
        load_measurements(tmp_path / "model_measurement.txt")
    assert f"model_measurement.txt:{len(ernie_amax) + 2}:" in str(info.value)


def test_stale_or_dummy_files_are_flagged(tmp_path, ernie_amax):
    odd = {m: (0.2 if m.endswith(".self_attn.s") else 7.0 if m.endswith("qkv_proj") else v) for m, v in ernie_amax.items()}
    write_fastdeploy(tmp_path / "model_measurement.txt", odd)
    warnings = load_measurements(tmp_path / "model_measurement.txt").warnings
    assert any("s_matmul" in w and "0.2" in w for w in warnings)
    assert any("self_attn.qkv_proj" in w and "all 3 layers" in w for w in warnings)


def test_measurements_of_another_model_are_refused(tmp_path, source_factory):
    other = synthetic_measurements(preset_config("ernie-moe-tiny", {"num_hidden_layers": 5, "moe_layer_end_index": 4})).amax
    write_fastdeploy(tmp_path / "model_measurement.txt", other)
    loaded = load_measurements(tmp_path / "model_measurement.txt")
    with pytest.raises(MeasurementError, match="this model does not have.*layers.3.*has 3 layers"):
        convert(source_factory(), tmp_path / "out", [loaded.measurements])
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_qwen2_fastdeploy_file_lacks_the_mlp_and_is_combined_with_our_own(tmp_path, source_factory):
    config = preset_config("qwen2-tiny")
    ours = synthetic_measurements(config)
    fastdeploy = {m: v * 1.5 for m, v in ours.amax.items()}
    write_fastdeploy(tmp_path / "model_measurement.txt", fastdeploy, skip=lambda m: ".mlp." in m)  # Qwen2's MLP is never measured
    loaded = load_measurements(tmp_path / "model_measurement.txt").measurements
    with pytest.raises(MeasurementError, match="lack .*qwen2.layers.0.mlp.up_gate_proj"):
        convert(source_factory("qwen2-tiny", "torch"), tmp_path / "out", [loaded])
    write_measurements(tmp_path / "ours.json", ours)
    result = CliRunner().invoke(
        main,
        [
            "convert",
            str(source_factory("qwen2-tiny", "torch")),
            str(tmp_path / "out"),
            "--measurements",
            str(tmp_path / "model_measurement.txt"),
            "--measurements",
            str(tmp_path / "ours.json"),
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    spec = Checkpoint.open(tmp_path / "out")
    assert spec.get("qwen2.layers.0.self_attn.qkv_proj.act_amax")[0] == np.float32(
        fastdeploy["qwen2.layers.0.self_attn.qkv_proj"]
    )
    assert spec.get("qwen2.layers.0.mlp.up_gate_proj.act_amax")[0] == np.float32(ours.amax["qwen2.layers.0.mlp.up_gate_proj"])
    calibration = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["calibration"]
    kinds = {s["id"]: s["kind"] for s in calibration["sources"]}
    assert kinds[calibration["default_source"]] == "fastdeploy-measurement"
    assert {kinds[v] for v in calibration["overrides"].values()} == {"synthetic"}
    assert "qwen2.layers.1.mlp.down_proj" in calibration["overrides"]


def test_fastdeploy_file_converts_to_the_same_scales_as_the_json(tmp_path, source_factory, spec_factory, ernie_amax):
    write_fastdeploy(tmp_path / "model_measurement.txt", ernie_amax)
    convert(
        source_factory(),
        tmp_path / "out",
        [load_measurements(tmp_path / "model_measurement.txt").measurements],
        ConvertOptions(max_shard_bytes=64_000),
    )
    ours, reference = Checkpoint.open(tmp_path / "out"), Checkpoint.open(spec_factory())
    for name in reference.tensors:
        if name.endswith((names.ACT_SCALE, names.ACT_AMAX)):
            assert ours.get(name)[0] == reference.get(name)[0], name


@pytest.mark.parametrize("name", ["measurements", "m.txt", "model_measurement.txt"])
def test_our_json_is_recognised_by_content_whatever_its_name(tmp_path, name):
    ours = synthetic_measurements(preset_config("ernie-moe-tiny"))
    write_measurements(tmp_path / name, ours)
    loaded = load_measurements(tmp_path / name).measurements
    assert loaded.provenance.files == [name]  # the file it came from, for refusals and config.json's sources
    assert loaded.model_copy(update={"provenance": ours.provenance}) == ours


def test_every_float_text_python_writes_is_read(tmp_path):
    values = [0.0, 5e-324, 1e-05, 3.0, 12.5, 1.5e20, 3.4e38]
    amax = {f"ernie.layers.{i}.self_attn.o_proj": v for i, v in enumerate(values)}
    write_fastdeploy(tmp_path / "model_measurement.txt", amax)
    assert load_measurements(tmp_path / "model_measurement.txt").measurements.amax == amax

"""retarget: ±448 -> ±240 by x0.5 / x2 (vllm-gaudi's 448->240 rule), ±240 -> gaudi3 by relabelling."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from hpu_fp8_loader.checks.validate import validate
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.conversion.retarget import retarget
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements
from hpu_fp8_loader.spec import names


@pytest.fixture(scope="module")
def gaudi3(tmp_path_factory, source_factory):
    out = tmp_path_factory.mktemp("g3") / "ckpt"
    convert(source_factory(), out, [synthetic_measurements(preset_config("ernie-moe-tiny"))], ConvertOptions(target="gaudi3"))
    return out


def test_448_to_240_halves_values_doubles_scales_and_counts_what_rounds(tmp_path, gaudi3):
    report = retarget(gaudi3, tmp_path / "g2", "gaudi2")
    assert report.action == "rescaled" and validate(tmp_path / "g2").valid
    before, after = Checkpoint.open(gaudi3), Checkpoint.open(tmp_path / "g2")
    qc = json.loads((tmp_path / "g2" / "config.json").read_text())["quantization_config"]
    assert (qc["fp8_max"], qc["target"]) == (240.0, "gaudi2")
    rounded = values = 0
    for name, info in before.tensors.items():
        if info.dtype == "F8_E4M3":
            old, new = before.get(name).astype(np.float32), after.get(name).astype(np.float32)
            half = old / 2
            exact = half.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) == half  # independent of the code
            np.testing.assert_array_equal(new[exact], half[exact])
            assert np.all(np.abs(new[~exact] - half[~exact]) <= 2.0**-10)  # half a subnormal step
            rounded += int(np.count_nonzero(~exact))
            values += old.size
            base = name.removesuffix(".weight")
            np.testing.assert_array_equal(after.get(f"{base}.weight_scale"), before.get(f"{base}.weight_scale") * 2)
        elif name.endswith(names.ACT_AMAX):
            assert after.get(name)[0] == before.get(name)[0]
            scale = after.get(name.removesuffix(names.ACT_AMAX) + names.ACT_SCALE)[0]
            assert scale == before.get(name)[0] / np.float32(240)
    assert (report.rounded, report.values) == (rounded, values) and 0 < rounded < values / 100


def test_240_to_gaudi3_only_relabels(tmp_path, spec_factory):
    report = retarget(spec_factory(), tmp_path / "g3", "gaudi3")
    assert report.action == "relabelled" and "no precision is gained" in report.message
    qc = json.loads((tmp_path / "g3" / "config.json").read_text())["quantization_config"]
    assert (qc["fp8_max"], qc["target"]) == (240.0, "gaudi3")
    assert validate(tmp_path / "g3").valid
    before, after = Checkpoint.open(spec_factory()), Checkpoint.open(tmp_path / "g3")
    for name in before.tensors:
        np.testing.assert_array_equal(before.get(name).view(np.uint8), after.get(name).view(np.uint8))


def test_retargeting_onto_the_checkpoints_own_target_is_refused_and_writes_nothing(tmp_path, spec_factory):
    result = CliRunner().invoke(main, ["retarget", str(spec_factory()), str(tmp_path / "same"), "--target", "gaudi2"])
    assert result.exit_code == 1 and not (tmp_path / "same").exists()
    assert "already targets gaudi2 (±240); nothing to retarget" in result.stderr and "was not written" in result.stderr
    assert "Traceback" not in result.output


def test_cli_retarget(tmp_path, gaudi3):
    result = CliRunner().invoke(main, ["retarget", str(gaudi3), str(tmp_path / "g2"), "--target", "gaudi2"])
    assert result.exit_code == 0 and "rescaled for gaudi2" in result.output and "subnormals" in result.output
    again = CliRunner().invoke(main, ["retarget", str(gaudi3), str(tmp_path / "g2"), "--target", "gaudi2"])
    assert again.exit_code == 1 and "--force" in again.output


def test_a_448_checkpoint_is_not_exported_to_the_240_only_legacy_layout(tmp_path, gaudi3):
    from hpu_fp8_loader.errors import HpuFp8Error
    from hpu_fp8_loader.fastdeploy.legacy import export_legacy

    with pytest.raises(HpuFp8Error, match="retarget --target gaudi2"):
        export_legacy(gaudi3, tmp_path / "legacy")
    assert not (tmp_path / "legacy").exists()

"""FastDeploy's oracle fed by PaddleCustomDevice's own converter, not by our exporter (issue 27 item 1).

The other conformance cases load our ``export-legacy`` copy with FastDeploy's v0 loader, so a rule the exporter and
the hook share (``mapping.holds_raw_amax``: which legacy keys hold the raw amax) is checked by nobody: the same
wrong rule on both sides agrees with itself. Here the legacy checkpoint is written by PaddleCustomDevice's
``Model_convert.py`` (the converter FastDeploy's Gaudi guide has users run), executed unchanged in FastDeploy's
environment with two named CPU patches (runtime/pcd_model_convert.py), from the same BF16 checkpoint and the same
FastDeploy measurement text file our ``convert`` reads.

The source's weights are made *converter-exact* first: each weight PaddleCustomDevice quantizes (every bf16
``*_proj.weight``; routed experts per output column, everything else per tensor) gets one element raised to
``240 * 2**k`` just above its amax, so the weight scale is a power of two that float32 division, bf16 storage and
our bf16-exact scale all hold exactly; the measurement amax are those the legacy layout stores exactly. Any
difference left is then a difference of rules, not of rounding.

Opt-in, because the script is PaddleCustomDevice's and never copied here: ``HPU_FP8_PCD_MODEL_CONVERT`` names a
copy of ``backends/intel_hpu/custom_ops/python/paddlenlp_ops/Model_convert.py`` (``backends/intel_hpu/tools/`` from
PaddleCustomDevice#2329, 2026-01-08; checked with 20c9eae8, the version
that quantizes routed experts per channel, as FastDeploy's HPU MoE method expects). Without it the module is
skipped and says so.
"""

from __future__ import annotations

import json
import math
import os
import runpy
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from fd_environment import RUNTIME
from safetensors.numpy import load_file, save_file
from test_conformance import assert_conforms, legacy_exact

from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.fastdeploy import legacy, mapping
from hpu_fp8_loader.fastdeploy.legacy import export_legacy
from hpu_fp8_loader.quality.calibrate import write_fastdeploy_file
from hpu_fp8_loader.sources.measurements import load_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements

pytestmark = pytest.mark.slow
SCRIPT = "HPU_FP8_PCD_MODEL_CONVERT"
PRESET = "ernie-moe-tiny"


def converter_exact(src: Path, out: Path) -> Path:
    """``src`` with every weight PaddleCustomDevice quantizes given an amax of ``240 * 2**k`` (one element raised to
    it, sign kept), per output column for routed experts (``.experts.`` keys), per tensor otherwise."""
    shutil.copytree(src, out)
    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(shard)
        for key, array in tensors.items():
            if "_proj.weight" not in key or array.dtype != ml_dtypes.bfloat16:
                continue
            values = array.astype(np.float32)
            columns = values if ".experts." in key else values.reshape(-1, 1)
            for column in range(columns.shape[1]):
                row = int(np.abs(columns[:, column]).argmax())
                amax = abs(float(columns[row, column]))
                target = 240.0 * 2.0 ** math.ceil(math.log2(amax / 240.0))
                columns[row, column] = math.copysign(target, columns[row, column])
            tensors[key] = columns.reshape(values.shape).astype(ml_dtypes.bfloat16)
        save_file(tensors, shard, metadata={"format": "pd"})
    return out


@pytest.fixture(scope="module")
def pcd(request, tmp_path_factory):
    """(hpu-fp8 checkpoint, PaddleCustomDevice's legacy checkpoint, BF16 source, measurement file) of one model."""
    script = os.environ.get(SCRIPT)
    if not script:
        pytest.skip(f"{SCRIPT} is not set: name a copy of PaddleCustomDevice's Model_convert.py to run these cases")
    if not Path(script).is_file():
        pytest.fail(f"{SCRIPT}={script}: no such file", pytrace=False)
    root = tmp_path_factory.mktemp("pcd")
    config = preset_config(PRESET)
    synthesize(root / "bf16-drawn", config, seed=11)
    source = converter_exact(root / "bf16-drawn", root / "bf16")
    measurement = root / "model_measurement.txt"
    write_fastdeploy_file(measurement, legacy_exact(synthetic_measurements(config)))
    convert(source, root / "spec", [load_measurements(measurement).measurements], ConvertOptions(kv_cache="fp8"))
    environment = request.getfixturevalue("fastdeploy_env")["environment"]  # after the opt-in check: no build to skip
    done = environment.run([str(RUNTIME / "pcd_model_convert.py"), script, str(source), str(root / "pcd"), str(measurement)],
                           cwd=root)  # fmt: skip
    assert done.returncode == 0, f"Model_convert.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"requested_device": ["intel_hpu:5"]}
    return root / "spec", root / "pcd", source, measurement


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 0), (2, 1)])
def test_the_hook_fills_what_fastdeploy_loads_from_paddlecustomdevices_own_converter(run_case, pcd, tp, rank):
    """FastDeploy's v0 loader on Model_convert.py's output against the hook on our conversion of the same source
    and measurement file: every parameter and every MLP / MoE kernel argument to the bit, at TP 1 and both ranks of
    TP 2 (FastDeploy splits ERNIE's FP8 tensors itself)."""
    spec, converted, _, _ = pcd
    assert_conforms(run_case({"oracle": converted, "hook": spec, "tp": tp, "rank": rank}))


def test_our_export_is_paddlecustomdevices_output_tensor_for_tensor(pcd, tmp_path):
    """The second, separate comparison: ``export-legacy`` of the same conversion holds every tensor Model_convert.py
    writes, under the same name, with the same dtype, shape and bytes, and nothing else."""
    from hpu_fp8_loader.io.checkpoint import Checkpoint

    spec, converted, _, _ = pcd
    export_legacy(spec, tmp_path / "ours")
    theirs, ours = Checkpoint.open(converted), Checkpoint.open(tmp_path / "ours")
    assert set(ours.tensors) == set(theirs.tensors), sorted(set(ours.tensors) ^ set(theirs.tensors))
    differing = []
    for name, info in theirs.tensors.items():
        a, b = np.asarray(theirs.get(name)), np.asarray(ours.get(name))
        if (info.dtype, info.shape) != (ours.tensors[name].dtype, ours.tensors[name].shape) or a.tobytes() != b.tobytes():
            differing.append(name)
    assert differing == [], differing
    quantization = json.loads((converted / "config.json").read_text())["quantization_config"]
    assert quantization == json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]


def test_a_rule_the_exporter_shares_with_the_hook_is_caught_only_by_paddlecustomdevices_output(
    run_case, pcd, tmp_path, monkeypatch
):
    """The mutation the issue names: expert keys read as holding the raw amax (they hold amax / 240), in the hook
    and in export-legacy alike. Against our export written with the same rule it passes (common mode: the reason
    for this module); against Model_convert.py's output every MoE input scale differs, and the report names them."""
    spec, converted, _, _ = pcd
    faults = runpy.run_path(str(RUNTIME / "faults.py"))  # the very rule the FastDeploy-side run injects
    wrong = faults["expert_keys_hold_raw_amax"](mapping.holds_raw_amax)
    monkeypatch.setattr(mapping, "holds_raw_amax", wrong)
    monkeypatch.setattr(legacy, "holds_raw_amax", wrong)
    export_legacy(spec, tmp_path / "ours-with-the-fault")
    monkeypatch.undo()
    case = {"hook": spec, "tp": 1, "rank": 0, "inject": "expert-keys-hold-raw-amax"}
    assert_conforms(run_case({**case, "oracle": tmp_path / "ours-with-the-fault"}))
    report = run_case({**case, "oracle": converted})
    assert "error" not in report, report["error"]
    assert report["differences"] and all("_in_scale" in d for d in report["differences"]), report["differences"]
    assert report["kernel_differences"], "the MoE kernels are handed the wrong input scales too"
    print("caught against Model_convert.py's output:", *report["differences"], sep="\n  ")

"""`calibrate -o FILE` against hostile output locations and options: each is refused in one named line
BEFORE any calibration (the runs below would otherwise fail on their missing dataset, or take hours on a real
model), nothing is overwritten without --force, no file of the model is ever written, a planted link is never
followed, and activations that are NaN or inf are refused by name instead of being recorded as amax 0
(issue 14 items 5, 12 and 14)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.checkpoint_damage import overwrite_tensor_bytes

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.sources.measurements import load_measurements

QUICK = ("--samples", "2", "--seq-len", "32", "-q")


@pytest.fixture
def work(tmp_path, source_factory):
    """tmp_path holding a private copy of the model (``model/``), an existing file and an unrelated directory."""
    shutil.copytree(source_factory(), tmp_path / "model")
    (tmp_path / "existing.json").write_text("earlier measurements")
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "text.txt").write_text("calibration text " * 200)
    return tmp_path


# (-o, extra options, names in the error line); "{t}" is the work directory. --dataset is missing unless
# given: a refusal that names the output proves the output was checked before the calibration started.
CASES = {
    "existing-file": ("existing.json", [], ["existing.json", "--force"]),
    "model-config": ("model/config.json", [], ["config.json", "source"]),
    "model-config-forced": ("model/config.json", ["--force"], ["config.json", "source"]),
    "new-file-in-model": ("model/m.json", ["--force"], ["model/m.json", "source"]),
    "the-model-itself": ("model", ["--force"], ["model", "source"]),
    "parent-of-model": (".", ["--force"], ["contains the source"]),
    "a-directory": ("a_dir", ["--force"], ["a_dir", "directory"]),
    "missing-directory": ("nope/m.json", [], ["nope", "does not exist"]),
    "parent-is-a-file": ("a_file/m.json", [], ["a_file", "not a directory"]),
    "dataset-itself": ("text.txt", ["--force", "--dataset", "{t}/text.txt"], ["text.txt", "source"]),
    "fastdeploy-existing": ("m.json", ["--fastdeploy-format", "{t}/existing.json"], ["existing.json", "--force"]),
    "fastdeploy-in-model": ("m.json", ["--fastdeploy-format", "{t}/model/model_measurement.txt"], ["model_measurement.txt"]),
    "fastdeploy-same-as-out": ("m.json", ["--fastdeploy-format", "{t}/m.json"], ["--fastdeploy-format", "m.json"]),
    "samples-zero": ("m.json", ["--samples", "0"], ["--samples"]),
    "samples-negative": ("m.json", ["--samples", "-3"], ["--samples"]),
    "seq-len-zero": ("m.json", ["--seq-len", "0"], ["--seq-len"]),
    "seq-len-negative": ("m.json", ["--seq-len", "-1"], ["--seq-len"]),
    "batch-size-zero": ("m.json", ["--batch-size", "0"], ["--batch-size"]),
    "samples-not-a-number": ("m.json", ["--samples", "many"], ["--samples"]),
    "seq-len-huge": ("m.json", ["--seq-len", "5000", "--dataset", "builtin"], ["max_position_embeddings"]),
}


@pytest.mark.parametrize("case", CASES)
def test_hostile_outputs_and_options_are_refused_before_calibrating(work, case):
    out, extra, named = CASES[case]
    extra = [arg.replace("{t}", str(work)) for arg in extra]
    dataset = [] if "--dataset" in extra else ["--dataset", work / "missing.txt"]
    before = tree_digest(work)
    assert_refused(run_cli("calibrate", work / "model", "-o", work / out, *dataset, *extra, "-q"), *named)
    assert tree_digest(work) == before


def test_a_read_only_directory_is_refused_before_calibrating(work, monkeypatch):
    (work / "ro").mkdir(mode=0o555)
    if os.geteuid() == 0:  # root may write anywhere: stand in for the kernel's answer to any other user
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != work / "ro" and real_access(path, mode))
    assert_refused(run_cli("calibrate", work / "model", "-o", work / "ro" / "m.json", "--dataset", work / "x"), "not writable")


def test_a_planted_partial_link_is_never_followed(work):
    (work / "m.json.partial").symlink_to(work / "existing.json")
    result = run_cli("calibrate", work / "model", "-o", work / "m.json", *QUICK)
    assert result.exit_code == 0, result.output
    assert (work / "existing.json").read_text() == "earlier measurements"
    assert not (work / "m.json").is_symlink() and load_measurements(work / "m.json").measurements.amax
    assert not [p for p in work.iterdir() if p.name.startswith(".m.json")]  # no temporary file left behind


def test_force_replaces_a_link_not_its_target_and_leaves_no_temporary_file(work):
    (work / "m.json").symlink_to(work / "existing.json")
    (work / "fd.txt").write_text("old")
    result = run_cli(
        "calibrate", work / "model", "-o", work / "m.json", "--fastdeploy-format", work / "fd.txt", "--force", *QUICK
    )
    assert result.exit_code == 0, result.output
    assert (work / "existing.json").read_text() == "earlier measurements" and not (work / "m.json").is_symlink()
    assert load_measurements(work / "fd.txt").measurements.amax == load_measurements(work / "m.json").measurements.amax
    assert sorted(p.name for p in work.iterdir()) == ["a_dir", "a_file", "existing.json", "fd.txt", "m.json", "model", "text.txt"]


# bfloat16 bit patterns planted in layer 1's input norm: NaN, +inf, and the largest finite value (3.4e38),
# whose products overflow float32 to inf in the forward.
POISON = {"nan": (0x7FC0, "NaN"), "inf": (0x7F80, "inf"), "overflow": (0x7F7F, "inf")}


@pytest.mark.parametrize("case", POISON)
def test_non_finite_activations_are_refused_by_layer_and_nothing_is_written(work, case):
    bits, what = POISON[case]
    name = "ernie.layers.1.input_layernorm.weight"
    hidden = 64
    overwrite_tensor_bytes(work / "model", name, np.full(hidden, bits, np.uint16).tobytes())
    before = tree_digest(work)
    line = assert_refused(run_cli("calibrate", work / "model", "-o", work / "m.json", *QUICK), "layers.1", what)
    assert "amax 0" not in line
    assert tree_digest(work) == before

"""Output, report and dataset paths that are symbolic link loops: one line naming the path, nothing written.

Found by a hostile run (issue 28 item 5, 7 cases): ``Path.resolve()`` raises RuntimeError ("Symlink loop from ...")
on Python 3.11, which reached the user as a traceback from every command that checks its output against its
inputs (io/writer.check_apart) and from calibrate's --fastdeploy-format check. Each path is now resolved by
io/checkpoint.resolve_path, which names it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.block_fp8 import hf_block_checkpoint

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements

QUICK = ("--samples", "1", "--seq-len", "16", "-q")


def _self_loop(work: Path) -> Path:
    (work / "loop").symlink_to("loop")
    return work / "loop"


def _two_link_loop(work: Path) -> Path:
    (work / "a").symlink_to("b")
    (work / "b").symlink_to("a")
    return work / "a"


def _inside_a_loop(work: Path) -> Path:
    (work / "loop").symlink_to("loop")
    return work / "loop" / "out"


LOOPS: dict[str, Callable[[Path], Path]] = {"self": _self_loop, "two-links": _two_link_loop, "below-a-loop": _inside_a_loop}

# command -> its argv with the loop path as PATH. Each raised RuntimeError as a traceback before.
COMMANDS: dict[str, Callable[[Path, Path], list[object]]] = {
    "synth-out": lambda w, path: ["synth", path, "--preset", "qwen2-tiny", "-q"],
    "convert-out": lambda w, path: ["convert", w / "model", path, "--measurements", w / "m.json", "-q"],
    "retarget-out": lambda w, path: ["retarget", w / "fp8", path, "--target", "gaudi3"],
    "export-legacy-out": lambda w, path: ["export-legacy", w / "fp8", path],
    "export-compressed-tensors-out": lambda w, path: ["export-compressed-tensors", w / "fp8", path],
    "import-out": lambda w, path: ["import", w / "block", path, "--measurements", w / "m.json"],
    "map-output": lambda w, path: ["map", w / "fp8", "-o", path],
    "calibrate-output": lambda w, path: ["calibrate", w / "model", "-o", path, *QUICK],
    "calibrate-fastdeploy-format": lambda w, path: [
        "calibrate",
        w / "model",
        "-o",
        w / "m2.json",
        "--fastdeploy-format",
        path,
        *QUICK,
    ],
    "calibrate-report": lambda w, path: ["calibrate", w / "model", "-o", w / "m2.json", "--report", path, *QUICK],
    "eval-report": lambda w, path: ["eval", w / "model", w / "fp8", "--report", path, *QUICK[:-1]],
    "calibrate-dataset": lambda w, path: ["calibrate", w / "model", "-o", w / "m2.json", "--dataset", path, *QUICK],
    "eval-dataset": lambda w, path: ["eval", w / "model", w / "fp8", "--dataset", path, *QUICK[:-1]],
}


@pytest.fixture
def work(tmp_path, source_factory, spec_factory) -> Path:
    """tmp_path with private copies of the qwen2 source (``model/``), its checkpoint (``fp8/``) and measurements."""
    shutil.copytree(source_factory("qwen2-tiny", "paddle"), tmp_path / "model")
    shutil.copytree(spec_factory("qwen2-tiny"), tmp_path / "fp8")
    write_measurements(tmp_path / "m.json", synthetic_measurements(preset_config("qwen2-tiny")))
    hf_block_checkpoint(source_factory("qwen2-tiny", "torch"), tmp_path / "block")
    return tmp_path


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_path_that_is_a_link_loop_is_one_line_naming_it(work, command, loop):
    path = LOOPS[loop](work)
    before = tree_digest(work)
    line = assert_refused(run_cli(*COMMANDS[command](work, path)), str(path))
    assert "link loop" in line or "Too many levels of symbolic links" in line, line
    assert tree_digest(work) == before  # nothing written, nothing replaced, no OUT.partial

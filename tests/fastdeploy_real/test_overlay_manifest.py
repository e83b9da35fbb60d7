"""The PR 5855 overlay is taken only as the committed manifest names it: each file present with its sha256, over the
FastDeploy commit it was made for. Runs without FastDeploy (fd_environment.py's own checks)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from fd_environment import OVERLAY_MANIFEST, FastDeployEnvironment, overlaid, overlay_files

MANIFEST = json.loads(OVERLAY_MANIFEST.read_text())


def test_the_manifest_names_a_base_commit_and_each_files_source_and_sha256():
    assert len(MANIFEST["base"]) == 8 and MANIFEST["files"]
    for entry in MANIFEST["files"].values():
        assert entry["source"] and len(entry["sha256"]) == 64


def test_a_missing_or_changed_overlay_file_fails_naming_it(tmp_path: Path):
    relative = next(iter(MANIFEST["files"]))
    with pytest.raises(RuntimeError, match=f"{relative} is missing"):
        overlay_files(tmp_path)
    for name in MANIFEST["files"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("not FastDeploy's file\n")
    digest = hashlib.sha256(b"not FastDeploy's file\n").hexdigest()
    with pytest.raises(RuntimeError, match=f"{relative} has sha256 {digest}"):
        overlay_files(tmp_path)


def test_the_overlay_is_refused_over_another_fastdeploy_commit(tmp_path: Path):
    other = FastDeployEnvironment(Path("python3.10"), tmp_path, "deadbeef")
    with pytest.raises(RuntimeError, match=f"laid over FastDeploy {MANIFEST['base']}; the source under test is deadbeef"):
        overlaid(other, tmp_path)

"""Nothing leaked through a link, nothing written through one (issue 28, items 1-3).

A source laid out like a Hugging Face cache snapshot outside the real cache must not get its links into
``../../blobs`` followed (they may lead to ``/proc/self/environ`` or ``$HF_HOME/token``); a link or FIFO planted
under a fixed name in a staging or work directory is never written through, read as ours, or waited on; and an
OUT that appears while a command runs is never deleted at publish without ``--force``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.errors import OutputExistsError
from hpu_fp8_loader.io import writer
from hpu_fp8_loader.io.manifest import write_manifest
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements

SECRET = "hf_secret_do_not_leak_0123456789"
CLI = str(Path(sys.executable).with_name("hpu-fp8"))


def _all_bytes(root: Path) -> bytes:
    """Every byte of every regular file under ``root``, links not followed: where a token would be if it leaked."""
    if not root.exists():
        return b""
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink())


@pytest.fixture
def fake_home(tmp_path):
    """A stand-in for $HF_HOME holding a token file, as `hf auth login` leaves it."""
    home = tmp_path / "hf-home"
    home.mkdir()
    (home / "token").write_text(SECRET)
    return home


def cache_shaped(tmp_path: Path, source: Path, blobs: Path, link_to: str) -> Path:
    """``source`` copied to ``x/snapshots/model`` with ``x/blobs`` a link to ``blobs`` and its tokenizer side file
    ``vocab.txt`` a link to ``../../blobs/<link_to>``: shaped like a cache snapshot, but not in the cache."""
    root = tmp_path / "x"
    snapshot = root / "snapshots" / "model"
    shutil.copytree(source, snapshot)
    (root / "blobs").symlink_to(blobs)
    (snapshot / "vocab.txt").symlink_to(f"../../blobs/{link_to}")
    return snapshot


@pytest.fixture
def measurements(tmp_path):
    path = tmp_path / "m.json"
    write_measurements(path, synthetic_measurements(preset_config("qwen2-tiny")))
    return path


BLOB_TARGETS = {"proc-self-environ": ("/proc/self", "environ"), "hf-home-token": (None, "token")}


@pytest.mark.parametrize("target", sorted(BLOB_TARGETS))
def test_convert_of_a_cache_shaped_source_outside_the_cache_copies_no_secret(
    tmp_path, source_factory, fake_home, measurements, target
):
    blobs, name = BLOB_TARGETS[target]
    snapshot = cache_shaped(tmp_path, source_factory("qwen2-tiny"), Path(blobs) if blobs else fake_home, name)
    out = tmp_path / "out"
    env = {"HF_TOKEN": SECRET, "HF_HOME": str(fake_home), "HF_HUB_CACHE": str(tmp_path / "real-cache")}
    assert_refused(run_cli("convert", snapshot, out, "--measurements", measurements, "-q", env=env), "vocab.txt")
    assert SECRET.encode() not in _all_bytes(tmp_path / "out") + _all_bytes(tmp_path / "out.partial")
    assert not out.exists()


@pytest.mark.slow
def test_convert_in_a_process_whose_environment_holds_the_token_leaks_nothing(tmp_path, source_factory, measurements):
    """The issue's exact run: HF_TOKEN in the process's own environment, read back through /proc/self/environ."""
    snapshot = cache_shaped(tmp_path, source_factory("qwen2-tiny"), Path("/proc/self"), "environ")
    out = tmp_path / "out"
    env = {**os.environ, "HF_TOKEN": SECRET, "HF_HUB_CACHE": str(tmp_path / "real-cache")}
    done = subprocess.run(
        [CLI, "convert", str(snapshot), str(out), "--measurements", str(measurements), "-q"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "vocab.txt" in done.stderr, done.stderr
    assert SECRET not in done.stderr + done.stdout
    assert SECRET.encode() not in _all_bytes(tmp_path)  # nowhere: not in OUT, its staging, or anything else written


def test_validate_hashes_refuses_a_checkpoint_whose_manifest_lists_a_cache_shaped_link(tmp_path, spec_factory, fake_home):
    """An OUT made before the fix (the token copied in) must not be called valid: here its vocab.txt links to the
    token through a fake blob store, and the manifest lists the token's very bytes."""
    snapshot = cache_shaped(tmp_path, spec_factory("qwen2-tiny"), fake_home, "token")
    write_manifest(snapshot)  # records vocab.txt with the sha256 of the token, as a copied file would be
    result = run_cli("validate", "--hashes", snapshot, env={"HF_HUB_CACHE": str(tmp_path / "real-cache")})
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "vocab.txt" in result.output and SECRET not in result.output


def test_push_dry_run_of_a_cache_shaped_source_stages_no_secret(tmp_path, source_factory, fake_home, measurements):
    snapshot = cache_shaped(tmp_path, source_factory("qwen2-tiny"), fake_home, "token")
    work = tmp_path / "work"
    args = ["push", snapshot, "--repo-id", "acme/x", "--base-model", "acme/src", "--license", "mit"]
    args += ["--measurements", measurements, "--dry-run", "--skip-eval", "--work-dir", work]
    env = {"HF_TOKEN": SECRET, "HF_HOME": str(fake_home), "HF_HUB_CACHE": str(tmp_path / "real-cache")}
    assert_refused(run_cli(*args, env=env), "vocab.txt")
    assert SECRET.encode() not in _all_bytes(work)

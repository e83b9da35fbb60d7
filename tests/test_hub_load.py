"""Loading hpu-fp8 checkpoints from the Hub cache: `hpu_fp8_loader.checks.load.load` and `hpu-fp8 pull`, run
as users run them, against a Hugging Face cache laid out by the test and HF_HUB_OFFLINE=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.hub_cache import add_to_cache

pytestmark = pytest.mark.slow  # a real Hub cache per module and console-script subprocesses


LOAD = """
import json, sys
from hpu_fp8_loader.checks.load import load
loaded = load(sys.argv[1])
print(json.dumps({"path": str(loaded.path), "target": loaded.quantization_config.target.value}))
"""


def _run(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(args, capture_output=True, text=True, env=env, check=False)


def pull(repo: str, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    return _run([str(Path(sys.executable).with_name("hpu-fp8")), "pull", repo, *extra], cache)


def test_load_returns_the_checked_snapshot(tmp_path, spec_factory):
    snapshot = add_to_cache(tmp_path / "hub", "acme/ernie-fp8", spec_factory())
    result = _run([sys.executable, "-c", LOAD, "acme/ernie-fp8"], tmp_path / "hub")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert Path(data["path"]) == snapshot and data["target"] == "gaudi2"
    cli = pull("acme/ernie-fp8", tmp_path / "hub")
    assert cli.returncode == 0 and cli.stdout.strip() == str(snapshot) and "checked" in cli.stderr


def test_a_corrupt_cached_file_fails_the_sha256_check(tmp_path, spec_factory):
    snapshot = add_to_cache(tmp_path / "hub", "acme/ernie-fp8", spec_factory())
    blob = (snapshot / "model.safetensors.index.json").resolve()
    os.chmod(blob, 0o644)
    text = blob.read_text()
    blob.write_text(text.replace('"metadata"', '"metadatA"'))  # same size, other bytes
    result = pull("acme/ernie-fp8", tmp_path / "hub")
    assert result.returncode == 1 and "sha256 differs" in result.stderr and "Traceback" not in result.stderr


def test_not_cached_while_offline(tmp_path):
    (tmp_path / "hub").mkdir()
    result = pull("acme/missing", tmp_path / "hub")
    assert result.returncode == 1 and "not in the local Hugging Face cache" in result.stderr
    assert f"cache at {tmp_path / 'hub'}" in result.stderr and "HF_HUB_OFFLINE is set" in result.stderr


def test_a_legacy_fastdeploy_checkpoint_points_to_import_legacy(tmp_path, spec_factory):
    from hpu_fp8_loader.fastdeploy.legacy import export_legacy

    export_legacy(spec_factory(), tmp_path / "legacy")
    add_to_cache(tmp_path / "hub", "acme/legacy", tmp_path / "legacy")
    result = pull("acme/legacy", tmp_path / "hub")
    assert result.returncode == 1 and "import-legacy" in result.stderr


def test_another_format_version_is_refused_naming_both(tmp_path, spec_copy):
    root = spec_copy()
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"]["format_version"] = 2
    (root / "config.json").write_text(json.dumps(config))
    add_to_cache(tmp_path / "hub", "acme/future", root)
    result = pull("acme/future", tmp_path / "hub")
    assert result.returncode == 1 and "format_version is 2" in result.stderr and "format_version 1" in result.stderr


def test_a_bf16_source_is_not_an_hpu_fp8_checkpoint(tmp_path, source_factory):
    add_to_cache(tmp_path / "hub", "acme/bf16", source_factory())
    result = pull("acme/bf16", tmp_path / "hub")
    assert result.returncode == 1 and "hpu-fp8 convert" in result.stderr


def test_a_cached_file_linked_out_of_the_snapshot_is_refused_naming_it(tmp_path, spec_factory):
    """Only the cache's own links into its blob store are followed; one elsewhere is never read as the checkpoint's."""
    snapshot = add_to_cache(tmp_path / "hub", "acme/linked", spec_factory())
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (snapshot / "generation_config.json").unlink()
    (snapshot / "generation_config.json").symlink_to(outside)
    result = pull("acme/linked", tmp_path / "hub")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "generation_config.json" in lines[0] and "no link into the repository's blobs" in lines[0]


def test_a_revision_not_in_the_cache_while_offline_is_one_line(tmp_path, spec_factory):
    add_to_cache(tmp_path / "hub", "acme/ernie-fp8", spec_factory())
    result = pull("acme/ernie-fp8", tmp_path / "hub", "--revision", "nope")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "acme/ernie-fp8" in lines[0] and "Traceback" not in result.stderr

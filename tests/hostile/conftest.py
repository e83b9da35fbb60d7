"""Fixtures the hostile-input tests share: one private input per kind of command (tests/hostile/writers.py)."""

from __future__ import annotations

import shutil

import pytest
from helpers.block_fp8 import hf_block_checkpoint

from hostile.refusal import run_cli
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements


@pytest.fixture
def ckpt(tmp_path, spec_factory):
    """A private hpu-fp8 checkpoint (qwen2-tiny) for the commands that read one."""
    root = tmp_path / "project" / "ckpt"
    shutil.copytree(spec_factory("qwen2-tiny"), root)
    return root


@pytest.fixture
def measurements(tmp_path):
    """A measurement file of qwen2-tiny, ``m.json`` beside the test's other files."""
    path = tmp_path / "m.json"
    write_measurements(path, synthetic_measurements(preset_config("qwen2-tiny")))
    return path


@pytest.fixture
def src(tmp_path, source_factory, measurements):
    """A private BF16 source (qwen2-tiny); its measurement file is ``measurements``."""
    root = tmp_path / "project" / "src"
    shutil.copytree(source_factory("qwen2-tiny"), root)
    return root


@pytest.fixture
def legacy(tmp_path, ckpt):
    """A checkpoint of FastDeploy's legacy layout, for import-legacy (written by export-legacy)."""
    out = tmp_path / "project" / "legacy"
    assert run_cli("export-legacy", ckpt, out).exit_code == 0
    return out


@pytest.fixture
def block(tmp_path, source_factory):
    """A block-wise FP8 checkpoint (Hugging Face layout) of qwen2-tiny, for import."""
    return hf_block_checkpoint(source_factory("qwen2-tiny", "torch"), tmp_path / "project" / "block")

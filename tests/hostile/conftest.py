"""Fixtures the hostile-input tests share."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture
def ckpt(tmp_path, spec_factory):
    """A private hpu-fp8 checkpoint (qwen2-tiny) for the commands that read one."""
    root = tmp_path / "project" / "ckpt"
    shutil.copytree(spec_factory("qwen2-tiny"), root)
    return root

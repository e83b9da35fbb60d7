"""Shared fixtures: real checkpoints made by `synth` and `convert`, never hand-written stand-ins."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import settings
from threadpoolctl import threadpool_limits

from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements

PRESETS = ("ernie-moe-tiny", "ernie-dense-tiny", "qwen2-tiny")

# Property-based tests (hypothesis): few examples in the inner loop (-m "not slow"), many in the whole suite that
# CI runs. A test's own @settings(max_examples=...) wins; HPU_FP8_HYPOTHESIS names a profile to force one.
settings.register_profile("inner-loop", max_examples=15, deadline=None)
settings.register_profile("whole-suite", max_examples=150, deadline=None)


def pytest_configure(config) -> None:
    inner_loop = "not slow" in (config.getoption("markexpr") or "")
    settings.load_profile(os.environ.get("HPU_FP8_HYPOTHESIS") or ("inner-loop" if inner_loop else "whole-suite"))


@pytest.fixture
def one_blas_thread():
    """BLAS held to one thread for the test: BLAS's own thread count can change a product's last bit (OpenBLAS
    0.3.31 on an AMD EPYC, 2 threads against 1), so two runs compared to the bit that would give BLAS different
    thread counts (one run's chunks on threads, the other's not) hold it fixed; the engine never raises it."""
    with threadpool_limits(1):
        yield


@pytest.fixture(scope="session")
def source_factory(tmp_path_factory):
    """(preset, layout) -> a synthesized BF16 source checkpoint, built once per session."""
    made: dict[tuple[str, str], Path] = {}

    def make(preset: str = "ernie-moe-tiny", layout: str = "paddle") -> Path:
        key = (preset, layout)
        if key not in made:
            out = tmp_path_factory.mktemp("src") / f"{preset}-{layout}"
            synthesize(out, preset_config(preset), layout, seed=7, max_shard_bytes=64_000)
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def spec_factory(tmp_path_factory, source_factory):
    """(preset, kv_cache) -> a converted hpu-fp8 checkpoint, built once per session. Treat as read-only."""
    made: dict[tuple[str, str], Path] = {}

    def make(preset: str = "ernie-moe-tiny", kv_cache: str = "fp8") -> Path:
        key = (preset, kv_cache)
        if key not in made:
            out = tmp_path_factory.mktemp("spec") / f"{preset}-{kv_cache}"
            options = ConvertOptions(kv_cache=kv_cache, max_shard_bytes=64_000)
            convert(source_factory(preset), out, [synthetic_measurements(preset_config(preset))], options)
            made[key] = out
        return made[key]

    return make


@pytest.fixture
def spec_copy(tmp_path, spec_factory):
    """A private copy of the default spec checkpoint that a test may damage."""

    def make(preset: str = "ernie-moe-tiny", kv_cache: str = "fp8") -> Path:
        target = tmp_path / "ckpt"
        shutil.copytree(spec_factory(preset, kv_cache), target)
        return target

    return make


def pytest_terminal_summary(terminalreporter) -> None:
    """How many hostile inputs were refused cleanly: one named line each, no traceback, nothing accepted silently."""
    refusal = sys.modules.get("hostile.refusal")
    if refusal is not None and refusal.REFUSED:
        distinct = len(set(refusal.REFUSED))
        terminalreporter.write_line(
            f"hostile inputs: {len(refusal.REFUSED)} refusals asserted, each one named line ({distinct} distinct messages)"
        )

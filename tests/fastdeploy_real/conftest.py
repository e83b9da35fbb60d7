"""The suite's FastDeploy environment, built once per session, or a skip that says why there is none (a failure
where HPU_FP8_REQUIRE_FASTDEPLOY=1, as .ci/run sets it wherever a FastDeploy source is configured)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from fd_environment import OVERLAY, RUNTIME, FastDeployEnvironment, FastDeployUnavailableError, overlaid, prepare, write_case

REQUIRE = "HPU_FP8_REQUIRE_FASTDEPLOY"


@pytest.fixture(scope="session")
def fastdeploy_env() -> dict:
    """The environment, and the package versions before and after this package was installed into it."""
    try:
        environment, before, after = prepare()
    except FastDeployUnavailableError as reason:
        if os.environ.get(REQUIRE) == "1":  # CI: a green run must have run FastDeploy's code
            pytest.fail(f"FastDeploy conformance suite cannot run and {REQUIRE}=1 requires it: {reason}", pytrace=False)
        print(f"\n[fastdeploy_real] skipped: {reason}", file=sys.stderr)
        pytest.skip(f"FastDeploy conformance suite: {reason}")
    return {"environment": environment, "before": before, "after": after}


def native_moe_layout(environment: FastDeployEnvironment) -> str:
    """The MoE layout the source under test builds itself, read from its files: "parameter" from PR 5855 (fbcccaa7,
    2026-01-15: its runner pads the ``[E, 1]`` parameter after loading), else "list"."""
    runner = environment.source / "fastdeploy/worker/hpu_model_runner.py"
    return "parameter" if "process_scales_alignment_after_loading" in runner.read_text() else "list"


@pytest.fixture(scope="session")
def moe_layouts(fastdeploy_env) -> dict[str, str]:
    """A case's ``moe_layout`` -> the layout FastDeploy then holds: ``develop`` is the source's own, ``pr5855`` its
    re-creation on a source without it (runtime/pr5855_moe.py) or, from fbcccaa7, the source's own."""
    return {"develop": native_moe_layout(fastdeploy_env["environment"]), "pr5855": "parameter"}


@pytest.fixture(scope="session")
def overlay_env(fastdeploy_env) -> FastDeployEnvironment:
    """FastDeploy's source with PR 5855's files: itself from fbcccaa7 on, else with the upstream files
    HPU_FP8_FASTDEPLOY_OVERLAY holds laid over it, or a skip saying so."""
    if native_moe_layout(fastdeploy_env["environment"]) == "parameter":
        return fastdeploy_env["environment"]
    given = os.environ.get(OVERLAY)
    if not given:
        pytest.skip(f"{OVERLAY} is not set: name a directory holding the files tests/fastdeploy_real/pr5855_overlay.json lists")
    return overlaid(fastdeploy_env["environment"], Path(given))


def case_runner(environment: FastDeployEnvironment, tmp_path: Path):
    """Run one case (runtime/conformance.py, or the runtime ``script`` named) in ``environment``; its JSON report."""

    def run(case: dict, plugins: str = "hpu_fp8", script: str = "conformance.py") -> dict:
        work = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
        done = environment.run([str(RUNTIME / script), "case.json"], cwd=work, **write_case(work, case, plugins))
        lines = done.stdout.strip().splitlines()
        assert done.returncode == 0 and lines, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        report = json.loads(lines[-1])
        report["stderr"] = done.stderr
        return report

    return run


@pytest.fixture
def run_case(fastdeploy_env, tmp_path):
    """A case in FastDeploy's environment (case_runner)."""
    return case_runner(fastdeploy_env["environment"], tmp_path)


@pytest.fixture
def run_overlay_case(overlay_env, tmp_path):
    """A case in FastDeploy's environment with the overlay's upstream files (case_runner)."""
    return case_runner(overlay_env, tmp_path)

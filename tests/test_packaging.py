"""What installing the package brings with it: its requirements, and a wheel that works without this checkout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import requires
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# a PYTHONPATH naming a checkout would show pip and the interpreter that checkout instead of the wheel
_WITHOUT_PYTHONPATH = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_paddle_is_never_a_runtime_requirement():
    """FastDeploy's Gaudi environment pins its own paddle with a PaddleCustomDevice wheel built against it;
    a requirement on paddle would let pip replace it. Only the dev extra (tests) pins one."""
    runtime = [r for r in requires("hpu-fp8-loader") or [] if "extra ==" not in r]
    assert runtime  # the metadata is there: numpy, safetensors, ...
    assert not [r for r in runtime if r.lower().startswith("paddle")], runtime
    dev = [r for r in requires("hpu-fp8-loader") or [] if 'extra == "dev"' in r]
    assert any(r.lower().startswith("paddlepaddle") for r in dev)


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> Path:
    """The wheel built from this checkout, installed into a fresh virtual environment that borrows only the
    dependencies of the test environment (a plain path in a .pth file, so its editable install stays out)."""
    work = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(work)],
        check=True,
        capture_output=True,
    )
    (wheel,) = work.glob("hpu_fp8_loader-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], check=True, capture_output=True, text=True
    ).stdout.strip()
    install = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "--no-deps",
        "--force-reinstall",
        "-q",
        str(wheel),
    ]
    subprocess.run(install, check=True, env=_WITHOUT_PYTHONPATH)
    (Path(site) / "borrowed_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return wheel


@pytest.mark.slow
def test_the_wheel_ships_the_templates_the_tiny_models_and_py_typed(installed_wheel: Path):
    names = set(zipfile.ZipFile(installed_wheel).namelist())
    assert {"hpu_fp8_loader/py.typed", "hpu_fp8_loader/model_cards/hpu_fp8.md.j2"} <= names
    for model in ("ernie-moe-bytes", "qwen2-bytes"):
        assert {
            f"hpu_fp8_loader/tiny_models/{model}/config.json",
            f"hpu_fp8_loader/tiny_models/{model}/model.safetensors",
        } <= names
    packages = {name.rsplit("/", 1)[0] for name in names if name.endswith("/__init__.py")}
    on_disk = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "hpu_fp8_loader").rglob("__init__.py")}
    assert on_disk <= packages, "a package is missing from pyproject's package list"


@pytest.mark.slow
def test_the_demo_runs_from_the_installed_wheel(installed_wheel: Path, tmp_path: Path):
    venv = installed_wheel.parent / "venv"
    env = _WITHOUT_PYTHONPATH
    where = subprocess.run(
        [venv / "bin" / "python", "-c", "import hpu_fp8_loader; print(hpu_fp8_loader.__file__)"],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout  # the wheel's copy, not this checkout
    result = subprocess.run(
        [venv / "bin" / "hpu-fp8", "demo", "--model", "qwen2-bytes", "--out", "demo", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["validation"]["valid"] and {row["variant"] for row in report["evaluation"]["rows"]} == {
        "fp8",
        "weights-only",
        "no-kv-fp8",
    }
    card = subprocess.run(
        [
            venv / "bin" / "python",
            "-c",
            "from hpu_fp8_loader.hub.cards import _environment; print(_environment().list_templates())",
        ],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    assert "hpu_fp8.md.j2" in card.stdout  # found inside the installed package, not in a checkout


def test_contributing_says_what_the_conformance_suite_reads_and_needs_no_tool_a_contributor_cannot_get():
    """Every HPU_FP8_FASTDEPLOY_* variable the suite reads is documented for contributors, with the Python 3.10 it
    needs; the workplace's `duplicates` tool is offered only beside a public alternative."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    read = set(re.findall(r"HPU_FP8_FASTDEPLOY_[A-Z]+", (ROOT / "tests/fastdeploy_real/fd_environment.py").read_text()))
    assert read >= {"HPU_FP8_FASTDEPLOY_SRC", "HPU_FP8_FASTDEPLOY_PYTHON"}
    assert read <= set(re.findall(r"HPU_FP8_FASTDEPLOY_[A-Z]+", text)), read
    assert "Python 3.10" in text and "python3.10" in text
    for line in (line for line in text.splitlines() if "duplicates --change" in line):
        assert "where the workplace provides" in line, line
    assert "pip install pylint" in text and "symilar -d 6" in text

"""What installing the package brings with it: its requirements, the hook's footprint in FastDeploy's environment,
the extras a command names when it lacks one, and a wheel that works without this checkout."""

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
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from hpu_fp8_loader.errors import OPTIONAL_DEPENDENCIES
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS

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


def _requirements(extra: str = "") -> list[Requirement]:
    """The package's requirements that apply with ``extra`` ("" for a plain install)."""
    found = [Requirement(text) for text in requires("hpu-fp8-loader") or []]
    return [r for r in found if r.marker is None or r.marker.evaluate({**default_environment(), "extra": extra})]


def _closure(names: set[str]) -> set[str]:
    """These distributions and everything they require here, by canonical name."""
    from importlib.metadata import PackageNotFoundError

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [r.name for r in map(Requirement, requires(name) or []) if r.marker is None or r.marker.evaluate()]
        except PackageNotFoundError:
            continue
    return seen


def test_the_extras_are_what_commands_name_when_one_is_missing():
    """errors.OPTIONAL_DEPENDENCIES (what a command's one-line refusal names) and pyproject's extras agree, and
    none of them is a plain requirement."""
    plain = {canonicalize_name(r.name) for r in _requirements()}
    for module, extra in OPTIONAL_DEPENDENCIES.items():
        assert canonicalize_name(module) not in plain, module
        assert canonicalize_name(module) in {canonicalize_name(r.name) for r in _requirements(extra)}, (module, extra)
    (everything,) = [r for r in _requirements("all") if r.marker is not None]
    assert canonicalize_name(everything.name) == "hpu-fp8-loader" and everything.extras == set(OPTIONAL_DEPENDENCIES.values())


# Run as FastDeploy runs the hook, on the stand-in of its module chain (tests/doubles/fastdeploy.py) and the tests'
# paddle: FastDeploy's side is imported first, then the plugin registered and one model filled; what the second
# half imports is the hook's own footprint in FastDeploy's environment.
_HOOK_IN_FASTDEPLOY = """
import json, sys
from types import SimpleNamespace
import paddle
import fastdeploy.worker.hpu_model_runner as runner_module
before = set(sys.modules)
from hpu_fp8_loader.fastdeploy import plugin
plugin.register()
checkpoint = sys.argv[1]
config = json.load(open(checkpoint + "/config.json"))
fd_config = SimpleNamespace(
    load_config=SimpleNamespace(load_choices="hpu_fp8"),
    model_config=SimpleNamespace(model=checkpoint, architectures=config["architectures"], config=config, lm_head_fp32=False),
    parallel_config=SimpleNamespace(tensor_parallel_size=1, tensor_parallel_rank=0, expert_parallel_size=1,
                                    expert_parallel_rank=0),
)
runner_module.HPUModelRunner(fd_config).load_model()
print(json.dumps(sorted({name.split(".")[0] for name in set(sys.modules) - before})))
"""

# The same work without FastDeploy or paddle: the plugin imported, then every parameter of one rank mapped from the
# checkpoint (numpy arithmetic): what the hook needs even where FastDeploy's side imported nothing yet.
_HOOK_ALONE = """
import json, sys
before = set(sys.modules)
from hpu_fp8_loader.fastdeploy import plugin
from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.checks.load import load
from hpu_fp8_loader.fastdeploy.mapping import Parallelism, map_rank
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.spec.config import parse_quantization_config
checkpoint = Checkpoint.open(load(sys.argv[1], hashes=False).path)
pieces = list(map_rank(checkpoint, parse_quantization_config(checkpoint.config), describe(checkpoint.config), Parallelism(1, 0)))
assert pieces and "paddle" not in sys.modules
print(json.dumps(sorted({name.split(".")[0] for name in set(sys.modules) - before})))
"""


def _distributions_imported(script: str, checkpoint: Path, tmp_path: Path) -> set[str]:
    """The third-party distributions (canonical names) whose modules ``script`` imported after its start."""
    from importlib.metadata import packages_distributions

    from doubles.fastdeploy import write_standin

    standin = write_standin(tmp_path / "fd")
    env = {**_WITHOUT_PYTHONPATH, "PYTHONPATH": os.pathsep.join([str(standin), str(ROOT / "tests")]), "FD_PLUGINS": ""}
    done = subprocess.run([sys.executable, "-c", script, str(checkpoint)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = set(json.loads(done.stdout.strip().splitlines()[-1]))
    standard = set(sys.stdlib_module_names) | {m for m in imported if m.startswith("_sysconfigdata")}  # the build's own
    third_party = imported - standard - {"hpu_fp8_loader", "_distutils_hack"}
    assert not third_party & set(OPTIONAL_DEPENDENCIES), third_party & set(OPTIONAL_DEPENDENCIES)
    return {canonicalize_name(d) for module in third_party for d in packages_distributions().get(module, [module])}


@pytest.mark.slow
def test_the_hooks_footprint_is_its_plain_requirements(tmp_path: Path, spec_factory):
    """Everything the hook imports, alone or while FastDeploy loads a model through it, belongs to the plain
    requirements (or what they require, or the standard library); none of the extras (tokenizers, pyarrow, ...)."""
    allowed = _closure({r.name for r in _requirements()})
    alone = _distributions_imported(_HOOK_ALONE, spec_factory(), tmp_path / "alone")
    assert alone <= allowed, alone - allowed
    assert {"numpy", "ml-dtypes", "pydantic"} <= alone  # the measurement sees what the hook does use
    in_fastdeploy = _distributions_imported(_HOOK_IN_FASTDEPLOY, spec_factory(), tmp_path / "in-fastdeploy")
    assert in_fastdeploy <= allowed, in_fastdeploy - allowed
    print("the hook imports:", ", ".join(sorted(alone)), "| beyond FastDeploy's and paddle's:", ", ".join(sorted(in_fastdeploy)))


def test_a_missing_extra_is_named_in_one_line_before_any_work(tmp_path: Path, monkeypatch):
    """calibrate --report without matplotlib: refused before calibrating, naming the extra that brings it."""
    from hostile.refusal import assert_refused, run_cli

    from hpu_fp8_loader.sources.tiny_models import TINY_MODELS

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what Python does for a module that is not installed
    result = run_cli(
        "calibrate", TINY_MODELS["qwen2-bytes"], "-o", tmp_path / "m.json", "--report", tmp_path / "rep", "--samples", "1"
    )
    line = assert_refused(result, "rep", "matplotlib", "pip install 'hpu-fp8-loader[report]'")
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "rep").exists(), line


def test_a_tokenizer_library_that_is_missing_is_named_with_its_extra(tmp_path: Path, monkeypatch):
    from hpu_fp8_loader.errors import MissingDependencyError
    from hpu_fp8_loader.quality.tokenizer import load_tokenizer

    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(MissingDependencyError, match=r"tokenizer\.json: reading it needs tokenizers, which is not installed: "
                       r"pip install 'hpu-fp8-loader\[calibrate\]'"):  # fmt: skip
        load_tokenizer(tmp_path, 1000)


@pytest.mark.slow
def test_the_demo_needs_no_extra(tmp_path: Path):
    """`pip install -e . && hpu-fp8 demo`, the README's first command, works without any extra: the demo runs with
    every optional module absent (a None in sys.modules is how Python answers for a module that is not installed)."""
    script = (
        "import sys; from hpu_fp8_loader.errors import OPTIONAL_DEPENDENCIES\n"
        "for module in OPTIONAL_DEPENDENCIES: sys.modules[module] = None\n"
        "from hpu_fp8_loader.cli.main import main; sys.argv = ['hpu-fp8', 'demo', '--out', 'demo', '--json']; main()"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["validation"]["valid"]


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
    for model in TINY_MODELS:  # every model demo --model offers
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

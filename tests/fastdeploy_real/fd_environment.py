"""Where the conformance suite finds FastDeploy's source and the Python environment it runs it in.

FastDeploy is not on PyPI and its setup builds CUDA ops, so the suite never installs it: its source
goes on ``PYTHONPATH`` of a Python 3.10 virtual environment (FastDeploy's Gaudi image runs 3.10)
holding FastDeploy's own ``requirements.txt`` at the commit under test (every package of it from
PyPI as listed; ``fastdeploy_requirements_skipped.txt`` says what replaces each one pinned at a URL,
which this machine cannot reach, and why) plus the suite's few pins where that list is not enough on a
CPU (``requirements.txt``: paddle itself, protobuf), then this package, installed the way a user installs it into
FastDeploy's environment. Nothing of FastDeploy is copied into this repository.

Where the source comes from (the first that is set):

* ``HPU_FP8_FASTDEPLOY_SRC``: a FastDeploy checkout (a directory holding ``fastdeploy/``), or a git
  directory (bare or not) whose ``HPU_FP8_FASTDEPLOY_REF`` (default ``develop``) is extracted;
* nothing: the suite is skipped, saying so.

Newer upstream files no git history here holds (PR 5855's, read one file at a time in the public search
index) come as an *overlay*: ``HPU_FP8_FASTDEPLOY_OVERLAY`` names a directory holding them at their repository
paths; ``pr5855_overlay.json`` (committed) names each file, where it comes from and its sha256, which must match.
``overlaid`` copies the source under test and lays them over it. The files themselves are FastDeploy's and are not
committed here; the cases that need them are skipped, saying so, without the variable.

The environment is built once and kept under ``HPU_FP8_FASTDEPLOY_CACHE`` (default
``~/.cache/hpu-fp8-loader/fastdeploy``), keyed by a hash of FastDeploy's requirements, the suite's
two files and the Python version; the extracted source is keyed by its commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
REQUIREMENTS = HERE / "requirements.txt"
SKIPPED = HERE / "fastdeploy_requirements_skipped.txt"
RUNTIME = HERE / "runtime"


class FastDeployUnavailableError(Exception):
    """FastDeploy's source or a Python 3.10 is not on this machine: the suite is skipped with this reason."""


@dataclass(frozen=True)
class FastDeployEnvironment:
    python: Path  # the environment's interpreter
    source: Path  # the directory holding fastdeploy/
    commit: str  # 8 hex digits, or "checkout" for a directory given as is

    def env(self, **extra: str) -> dict[str, str]:
        """Environment variables for a run: FastDeploy's source and the runtime helpers first on the path."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FD_", "PYTHON"))}
        env["PYTHONPATH"] = os.pathsep.join([str(self.source), str(RUNTIME)])
        env["PYTHONNOUSERSITE"] = "1"
        env.update(extra)
        return env

    def run(self, args: list[str], cwd: Path, timeout: float = 600, **extra_env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.python), *args], cwd=cwd, env=self.env(**extra_env), capture_output=True, text=True, timeout=timeout
        )


def write_case(run: Path, case: dict, plugins: str = "hpu_fp8") -> dict[str, str]:
    """Make ``run`` a case's working directory (``case.json``, a Prometheus directory FastDeploy's metrics need);
    the variables a case runs with: the plugins FastDeploy loads, its HPU attention backend, that directory."""
    (run / "prometheus").mkdir(parents=True)
    (run / "case.json").write_text(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in case.items()}))
    return {"FD_PLUGINS": plugins, "FD_ATTENTION_BACKEND": "HPU_ATTN", "PROMETHEUS_MULTIPROC_DIR": str(run / "prometheus")}


def _cache() -> Path:
    return Path(os.environ.get("HPU_FP8_FASTDEPLOY_CACHE", Path.home() / ".cache/hpu-fp8-loader/fastdeploy"))


def _python310() -> Path:
    candidates = [os.environ.get("HPU_FP8_FASTDEPLOY_PYTHON"), shutil.which("python3.10")]
    candidates += sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.10*/bin/python3.10"))
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            found = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 10))"],
                                   capture_output=True, text=True)  # fmt: skip
            if found.stdout.strip() == "True":
                return Path(candidate)
    raise FastDeployUnavailableError(
        "no Python 3.10 found (FastDeploy's Gaudi image runs 3.10 and its v0 TP split keys misformat on 3.11+); "
        "set HPU_FP8_FASTDEPLOY_PYTHON"
    )


def _git(git_dir: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(git_dir), *args], capture_output=True, text=True, check=True).stdout


def _source() -> tuple[Path, str]:
    given = os.environ.get("HPU_FP8_FASTDEPLOY_SRC")
    if not given:
        raise FastDeployUnavailableError(
            "no FastDeploy source: set HPU_FP8_FASTDEPLOY_SRC to a FastDeploy checkout or git directory"
        )
    path = Path(given)
    if (path / "fastdeploy" / "__init__.py").is_file():
        return path, "checkout"
    git_dir = path / ".git" if (path / ".git").is_dir() else path
    if not (git_dir / "HEAD").is_file():
        raise FastDeployUnavailableError(f"HPU_FP8_FASTDEPLOY_SRC={given} is neither a FastDeploy checkout nor a git directory")
    ref = os.environ.get("HPU_FP8_FASTDEPLOY_REF", "develop")
    commit = _git(git_dir, "rev-parse", f"{ref}^{{commit}}").strip()
    target = _cache() / f"src-{commit[:12]}"
    if not ((target / ".complete").is_file() and (target / "requirements.txt").is_file()):
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "--git-dir", str(git_dir), "archive", commit, "fastdeploy", "requirements.txt"],
            capture_output=True,
            check=True,
        )
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
        # what FastDeploy's build.sh writes, so that `hpu-fp8 doctor` can name the commit
        (target / "fastdeploy" / "version.txt").write_text(f"fastdeploy GIT COMMIT ID: {commit}\nfastdeploy version: develop\n")
        (target / ".complete").write_text(commit)
    return target, commit[:8]


OVERLAY = "HPU_FP8_FASTDEPLOY_OVERLAY"
OVERLAY_MANIFEST = HERE / "pr5855_overlay.json"


def overlay_files(overlay: Path) -> dict[str, dict]:
    """The committed manifest's files, each found in ``overlay`` with its sha256: a changed or missing file fails."""
    manifest = json.loads(OVERLAY_MANIFEST.read_text())["files"]
    for relative, entry in manifest.items():
        path = overlay / relative
        if not path.is_file():
            raise RuntimeError(f"{OVERLAY}={overlay}: {relative} is missing ({OVERLAY_MANIFEST.name}: {entry['source']})")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != entry["sha256"]:
            raise RuntimeError(f"{OVERLAY}: {relative} has sha256 {digest}, {OVERLAY_MANIFEST.name} says {entry['sha256']}")
    return manifest


def overlaid(environment: FastDeployEnvironment, overlay: Path) -> FastDeployEnvironment:
    """``environment`` with its source copied once and the overlay's files laid over it (same interpreter); only over
    the commit the manifest names as its base (a checkout given as a directory cannot be told apart and is taken)."""
    base = json.loads(OVERLAY_MANIFEST.read_text())["base"]
    if environment.commit not in (base, "checkout"):
        raise RuntimeError(f"{OVERLAY}: its files are laid over FastDeploy {base}; the source under test is {environment.commit}")
    manifest = overlay_files(overlay)
    key = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:12]
    target = _cache() / f"{environment.source.name}-overlay-{key}"
    if not (target / ".complete").is_file():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(environment.source, target)
        for relative in manifest:
            if not (target / relative).is_file():
                raise RuntimeError(f"{OVERLAY}: {relative} replaces no file of FastDeploy's source at {environment.commit}")
            shutil.copyfile(overlay / relative, target / relative)
        (target / ".complete").write_text(json.dumps(manifest))
    return FastDeployEnvironment(environment.python, target, environment.commit)


@dataclass(frozen=True)
class Replacement:
    """What the suite installs for a FastDeploy requirement pinned at a URL: a PyPI requirement, or nothing."""

    instead: str  # a requirement from PyPI; "" installs nothing
    why: str


def url_replacements() -> dict[str, Replacement]:
    """FastDeploy requirements pinned at a URL, by canonical name, as SKIPPED lists them."""
    replacements = {}
    for line in SKIPPED.read_text().splitlines():
        listed, _, why = line.partition("#")
        if listed.strip():
            name, _, instead = listed.strip().partition(" ")
            replacements[canonicalize_name(name)] = Replacement(instead.strip(), why.strip())
    return replacements


def fastdeploy_requirements(source: Path) -> list[Requirement]:
    """FastDeploy's own requirements.txt at the source under test (a checkout's, or the one extracted with it)."""
    listed = source / "requirements.txt"
    if not listed.is_file():
        raise FastDeployUnavailableError(f"{source} has no requirements.txt beside fastdeploy/ (FastDeploy's own list)")
    lines = [line.split("#", 1)[0].strip() for line in listed.read_text().splitlines()]
    return [Requirement(line) for line in lines if line]


def installed_requirements(source: Path) -> tuple[list[Requirement], dict[str, Replacement]]:
    """(what the environment installs of FastDeploy's list at ``source``, the URL requirements replaced): every
    requirement from PyPI as listed; each one at a URL as SKIPPED says, and one SKIPPED does not name is an error."""
    replacements = url_replacements()
    installed, replaced = [], {}
    for requirement in fastdeploy_requirements(source):
        name = canonicalize_name(requirement.name)
        if requirement.url is None:
            installed.append(requirement)
        elif name in replacements:
            replaced[name] = replacements[name]
            if replacements[name].instead:
                installed.append(Requirement(replacements[name].instead))
        else:
            raise RuntimeError(
                f"FastDeploy's requirements.txt pins {requirement} at a URL this machine cannot reach, and "
                f"{SKIPPED.name} does not say what to install instead"
            )
    return installed, replaced


def _venv(python: Path, source: Path) -> Path:
    """The environment: FastDeploy's requirements but the skipped ones, with the suite's pins, in one pip resolution."""
    listed = "\n".join(str(r) for r in installed_requirements(source)[0]) + "\n"
    key = hashlib.sha256(
        listed.encode() + REQUIREMENTS.read_bytes() + SKIPPED.read_bytes() + str(python.resolve()).encode()
    ).hexdigest()[:16]
    venv = _cache() / f"venv-{key}"
    interpreter = venv / "bin" / "python"
    if (venv / ".complete").is_file():
        return interpreter
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([str(python), "-m", "venv", str(venv)], check=True)
    (venv / "fastdeploy-requirements.txt").write_text(listed)
    # Python 3.10's bundled pip (23.0) backtracks for tens of minutes over FastDeploy's unpinned list; a current one does not
    subprocess.run([str(interpreter), "-m", "pip", "install", "-q", "--upgrade", "pip>=25"], check=True, capture_output=True)
    print(f"[fastdeploy_real] building {venv} from FastDeploy's requirements.txt (once; several minutes)", file=sys.stderr)
    install = subprocess.run(
        [
            str(interpreter),
            "-m",
            "pip",
            "install",
            "-q",
            "-r",
            str(venv / "fastdeploy-requirements.txt"),
            "-r",
            str(REQUIREMENTS),
        ],
        capture_output=True,
        text=True,
    )
    if install.returncode:
        raise RuntimeError(
            f"pip install of FastDeploy's requirements failed:\n{install.stdout[-4000:]}\n{install.stderr[-4000:]}"
        )
    (venv / ".complete").write_text("ok")
    return interpreter


def freeze(python: Path) -> dict[str, str]:
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True)
    return dict(line.split("==", 1) for line in listed.stdout.splitlines() if "==" in line)


def install_this_package(python: Path) -> tuple[dict[str, str], dict[str, str]]:
    """``pip install`` this repository as a user would into FastDeploy's environment; (before, after) versions."""
    before = freeze(python)
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(REPO)], capture_output=True, text=True
    )
    if install.returncode == 0:  # with its dependencies too: pip must find every one already satisfied
        install = subprocess.run([str(python), "-m", "pip", "install", "-q", str(REPO)], capture_output=True, text=True)
    if install.returncode:
        raise RuntimeError(f"pip install {REPO} failed:\n{install.stdout[-4000:]}\n{install.stderr[-4000:]}")
    return before, freeze(python)


def prepare() -> tuple[FastDeployEnvironment, dict[str, str], dict[str, str]]:
    """The environment with this package installed, and the package versions before and after installing it."""
    source, commit = _source()
    python = _venv(_python310(), source)
    before, after = install_this_package(python)
    return FastDeployEnvironment(python, source, commit), before, after

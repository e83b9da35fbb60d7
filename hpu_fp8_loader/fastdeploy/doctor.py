"""``hpu-fp8 doctor``: will ``--load-choices hpu_fp8`` work in this environment, and if not, what to do.

Run on the Gaudi box, in FastDeploy's environment, before starting the server: FastDeploy only logs a
plugin it could not import and never runs one ``FD_PLUGINS`` does not name, so a broken setup shows
up as FastDeploy's own loader failing on an hpu-fp8 checkpoint. Each check is a :class:`Check` with
what was found and, where something is wrong, the fix.

FastDeploy's version, commit and MoE layout are read from its files (``version.txt``, its sources)
without importing it, and compared with the supported range (:mod:`.support`). Everything that runs
paddle's or FastDeploy's code (paddle and what FastDeploy calls of it, ``import fastdeploy``, the
routing through its own ``get_model_loader``, building a checkpoint's model) runs in a child process
with a deadline (:mod:`.isolation`), so that no behaviour of FastDeploy's can end, hang or garble
this one. The MoE layout reported here is informational: the hook itself decides on the model
FastDeploy builds (docs/fastdeploy.md section 5, "Two MoE layouts").
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

from hpu_fp8_loader.console import human_bytes
from hpu_fp8_loader.errors import HpuFp8Error
from hpu_fp8_loader.fastdeploy import support
from hpu_fp8_loader.fastdeploy.isolation import Step, StepOutcome, run_steps

__all__ = ["DEFAULT_TIMEOUT", "INSTALL_HINT", "PLUGIN_GROUP", "Check", "DoctorReport", "doctor", "fastdeploy_moe_layout"]

PLUGIN_GROUP = "fastdeploy.model_register_plugins"
OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"
DEFAULT_TIMEOUT = 300.0
"""Seconds paddle's and FastDeploy's import, the routing and the model build may take together (``--timeout``)."""
INSTALL_HINT = (
    "with FastDeploy's python: pip install /path/to/hpu-fp8-loader (a clone), or a wheel built from one "
    "(pip install build; python -m build; pip install dist/hpu_fp8_loader-*.whl); it leaves paddle and FastDeploy's "
    "requirements alone"
)
"""How to install what exists: no package index holds hpu-fp8-loader yet."""


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok, warn, fail or info
    detail: str
    fix: str = ""


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.status != FAIL for check in self.checks)

    def add(self, name: str, status: str, detail: str, fix: str = "") -> None:
        self.checks.append(Check(name, status, detail, fix))

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checks": [asdict(check) for check in self.checks]}


def _fastdeploy_root() -> Path | None:
    """Where ``fastdeploy`` would be imported from, found without importing it (its ``__init__`` runs code)."""
    try:
        spec = importlib.util.find_spec("fastdeploy")
    except (ImportError, ValueError):  # a broken sys.modules entry or path hook: as if absent, the child says more
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass(frozen=True)
class _BuildInfo:
    version: str  # "unknown" without version.txt
    commit: str  # full or short hex; "" when unknown
    paddle: str  # the paddle FastDeploy was built with; "" when unknown


def _git(root: Path, *args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", "-C", str(root.parent), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None


def _in_fastdeploy_checkout(root: Path) -> bool:
    """Whether ``root`` is the ``fastdeploy/`` of a FastDeploy git checkout (not a package that merely lies in some repo)."""
    found = _git(root, "rev-parse", "--show-toplevel")
    return found is not None and found.returncode == 0 and Path(found.stdout.strip()).resolve() == root.parent.resolve()


def _build_info(root: Path) -> _BuildInfo:
    """From the ``version.txt`` FastDeploy's build writes (``build.sh``, ``setup.py``), else git for a source checkout."""
    values = {}
    text = (root / "version.txt").read_text(errors="replace") if (root / "version.txt").is_file() else ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        values[key.strip().lower()] = value.strip()
    commit = values.get("fastdeploy git commit id", "")
    if not commit and _in_fastdeploy_checkout(root):
        found = _git(root, "rev-parse", "HEAD")
        commit = found.stdout.strip() if found is not None and found.returncode == 0 else ""
    commit = commit.lower() if len(commit) >= 7 and all(c in "0123456789abcdefABCDEF" for c in commit) else ""
    return _BuildInfo(values.get("fastdeploy version") or "unknown", commit, values.get("paddle version", ""))


def fastdeploy_moe_layout(root: Path) -> str | None:
    """The MoE layout FastDeploy's sources at ``root`` build: "PR 5855", "PR 5324", or None without the HPU FP8 MoE method."""
    from hpu_fp8_loader.fastdeploy.plugin import MOE_LIST_LAYOUT, MOE_PARAMETER_LAYOUT

    backend = root / "model_executor/layers/backends/intel_hpu/moe/fused_moe_hpu_backend.py"
    runner = root / "worker/hpu_model_runner.py"
    backend_text = backend.read_text(errors="replace") if backend.is_file() else ""
    if "HpuTensorWiseFP8MoEMethod" not in backend_text:
        return None
    runner_text = runner.read_text(errors="replace") if runner.is_file() else ""
    # from PR 5855 on, convert_model pads the [E, 1] parameter to the kernel's alignment
    return MOE_PARAMETER_LAYOUT if "process_scales_alignment_after_loading" in runner_text else MOE_LIST_LAYOUT


def _check_python(report: DoctorReport) -> None:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] == (3, 10):
        report.add("python", OK, f"Python {version} (FastDeploy's Gaudi image runs 3.10)")
    else:
        report.add(
            "python", INFO, f"Python {version}; FastDeploy's Gaudi image runs 3.10",
            "the hook does not depend on it; FastDeploy's own v0 tensor-parallel split keys misformat on 3.11+",
        )  # fmt: skip


_RUN_DOCTOR_ON_A_CHECKPOINT = "`hpu-fp8 doctor CKPT` has this FastDeploy build the model and compares every parameter"


def _check_out() -> str:
    """The fix for a FastDeploy outside the checked builds: the recommended one, built as its guide builds it."""
    take = support.RECOMMENDED_BUILD
    return (
        f"build FastDeploy {take.name} at {take.commit.short} from source (git checkout {take.commit.commit}; "
        "bash build.sh, as its Gaudi guide does)"
    )


def _ancestor(root: Path, older: str, newer: str) -> bool | None:
    """Whether ``older`` is an ancestor of ``newer`` in FastDeploy's checkout; None when git cannot tell."""
    found = _git(root, "merge-base", "--is-ancestor", older, newer)
    return None if found is None else {0: True, 1: False}.get(found.returncode)


def _has_commit(root: Path, commit: str) -> bool:
    found = _git(root, "cat-file", "-e", f"{commit}^{{commit}}")
    return found is not None and found.returncode == 0


def _carried(root: Path, commit: str) -> tuple[list[str], list[str]] | None:
    """(the CHANGES ``commit`` carries, those it lacks), as short hashes, by git ancestry (a cherry-pick counts); None
    when git cannot tell for one of them."""
    carried, lacking = [], []
    for change in support.CHANGES:
        # a cherry-pick lives on its release branch, which a clone of another branch may not hold: then it is no ancestor
        picks = [_ancestor(root, c, commit) if _has_commit(root, c) else False for c in change.cherry_picks]
        found = [_ancestor(root, change.commit.commit, commit), *picks]
        if True in found:
            carried.append(change.commit.short)
        elif None in found:
            return None
        else:
            lacking.append(change.commit.short)
    return carried, lacking


def _known_build(commit: str) -> support.FastDeployBuild | None:
    return next((b for b in support.BUILDS if b.commit.commit.startswith(commit)), None) if commit else None


def _check_commit(report: DoctorReport, root: Path, info: _BuildInfo) -> None:
    """A checked build, too old, or placed among support.CHANGES by git; without a commit, by the version it reports."""
    short, first = info.commit[:8], support.FIRST_SUPPORTED_COMMIT
    known = _known_build(info.commit)
    if known is not None:
        report.add(
            "fastdeploy commit", OK,
            f"{known.name} at {known.commit.short} ({known.commit.date}, version {known.version}): {known.commit.why}",
        )  # fmt: skip
        return
    if info.commit:
        in_checkout = _in_fastdeploy_checkout(root)
        has_5324 = _ancestor(root, first.commit, info.commit) if in_checkout else None
        placed = _carried(root, info.commit) if has_5324 else None
        if has_5324 is False:
            report.add(
                "fastdeploy commit", FAIL, f"commit {short} predates PR 5324 ({first.short}, {first.date}): no HPU FP8 path",
                _check_out(),
            )  # fmt: skip
        elif placed is not None:
            carried, lacking = placed
            report.add(
                "fastdeploy commit", WARN,
                f"commit {short} is none of the checked builds; it has the HPU FP8 path, carries "
                f"{', '.join(carried) or 'none'} and lacks {', '.join(lacking) or 'none'} of the changes docs/fastdeploy.md "
                "section 1 lists",
                f"{_RUN_DOCTOR_ON_A_CHECKPOINT}; or {_check_out()}",
            )  # fmt: skip
        else:
            report.add(
                "fastdeploy commit", WARN,
                f"commit {short} is none of the checked builds, and without FastDeploy's git history doctor cannot "
                "place it",
                f"{_RUN_DOCTOR_ON_A_CHECKPOINT}; or {_check_out()}",
            )  # fmt: skip
        return
    verdict, release = support.release_verdict(info.version)
    build = support.build_for_version(info.version)
    if release is not None and not release.carries_pr_5324:
        report.add(
            "fastdeploy commit", FAIL,
            f"FastDeploy {info.version}: release {release.version} does not carry PR 5324 ({release.evidence})", _check_out(),
        )  # fmt: skip
    elif verdict == "older":
        report.add("fastdeploy commit", FAIL, f"FastDeploy {info.version} predates the HPU FP8 path (PR 5324)", _check_out())
    else:
        said = {
            "release": f"a {build.name} build; its head {build.commit.short} is checked" if build else "a release",
            "newer": "a release newer than any this package knows",
            "develop": "a develop build",
        }.get(verdict, "a version this package does not know")
        report.add(
            "fastdeploy commit", WARN,
            f"FastDeploy {info.version}, commit unknown (no commit in version.txt, no git checkout): {said}; not checked",
            f"{_RUN_DOCTOR_ON_A_CHECKPOINT}; or {_check_out()}",
        )  # fmt: skip


def _check_fastdeploy(report: DoctorReport, root: Path | None) -> _BuildInfo | None:
    if root is None:
        report.add(
            "fastdeploy", FAIL, "FastDeploy is not importable in this environment",
            "run doctor in FastDeploy's environment (its Gaudi guide builds and installs it)",
        )  # fmt: skip
        return None
    info = _build_info(root)
    report.add("fastdeploy", OK, f"FastDeploy {info.version}, commit {info.commit[:8] or 'unknown'}, at {root}")
    _check_commit(report, root, info)
    layout = fastdeploy_moe_layout(root)
    if layout is None:
        report.add(
            "moe layout", FAIL, "this FastDeploy has no HPU tensor-wise FP8 MoE method (it predates PR 5324)", _check_out()
        )
    else:
        report.add("moe layout", OK, layout)
    return info


def _paddle_calls(root: Path | None) -> list[support.PaddleCall]:
    """The calls of support.PADDLE_CALLS that this FastDeploy's sources make."""
    if root is None:
        return []
    calls = []
    for call in support.PADDLE_CALLS:
        source = root / call.fastdeploy_file
        if source.is_file() and call.attribute in source.read_text(errors="replace"):
            calls.append(call)
    return calls


_PADDLE_FIX = (
    f"install paddlepaddle>={support.PADDLE_MINIMUM} with a PaddleCustomDevice intel_hpu build made against it "
    "(FastDeploy's Gaudi guide still names 3.1.1, which lacks it; docs/fastdeploy.md section 1)"
)


def _torch_version() -> str | None:
    """torch's version where a torch distribution is installed, as FastDeploy asks (``importlib.metadata``); else None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def _check_paddle(report: DoctorReport, outcome: StepOutcome | None, calls: list, info: _BuildInfo | None) -> None:
    """paddle, its intel_hpu device, and what this FastDeploy calls of it."""
    if outcome is None or not outcome.ok:
        what = outcome.error or outcome.ended if outcome is not None else "it was not run"
        report.add("paddle", FAIL, f"import paddle failed: {what}", "repair FastDeploy's paddle install")
        return
    facts = outcome.result or {}
    if not facts.get("installed"):
        report.add("paddle", FAIL, "paddle is not installed", _PADDLE_FIX)
        return
    version = str(facts.get("version"))
    report.add("paddle", OK, f"paddle {version}")
    if info is not None and info.paddle and info.paddle != version:
        report.add(
            "paddle build", WARN, f"FastDeploy was built against paddle {info.paddle}; this environment has {version}",
            f"rebuild FastDeploy (bash build.sh) with this paddle, or install paddle {info.paddle}",
        )  # fmt: skip
    torch = _torch_version()
    for call in calls:
        where = f"fastdeploy/{call.fastdeploy_file}, from commit {call.since}"
        if call.without_torch_only and torch is not None:
            has = "has it" if facts.get("attributes", {}).get(call.attribute) else "lacks it"
            report.add(
                call.attribute, OK,
                f"this FastDeploy calls it only where torch is not installed ({where}); torch {torch} is, so it is not "
                f"called (paddle {version} {has})",
            )  # fmt: skip
        elif facts.get("attributes", {}).get(call.attribute):
            report.add(call.attribute, OK, f"paddle {version} has it; this FastDeploy calls it ({where})")
        else:
            report.add(
                call.attribute, FAIL,
                f"paddle {version} has no {call.attribute}, which this FastDeploy calls on import ({where}); "
                f"paddle >= {call.paddle_minimum} has it",
                _PADDLE_FIX,
            )  # fmt: skip
    devices = [str(device) for device in facts.get("custom_devices") or []]
    if "intel_hpu" in devices:
        report.add("hpu device", OK, "paddle's custom device intel_hpu is available")
    else:
        report.add(
            "hpu device", WARN, f"no intel_hpu custom device (custom devices: {', '.join(devices) or 'none'})",
            "on a Gaudi box install PaddleCustomDevice backends/intel_hpu as FastDeploy's Gaudi guide says",
        )  # fmt: skip


def _check_plugin_setup(report: DoctorReport, environ: Mapping[str, str]) -> None:
    points = [point for point in entry_points(group=PLUGIN_GROUP) if point.name == "hpu_fp8"]
    if not points:
        report.add("entry point", FAIL, f"no hpu_fp8 entry point in {PLUGIN_GROUP}", INSTALL_HINT)
    else:
        report.add("entry point", OK, f"hpu_fp8 -> {points[0].value}")
    named = [name.strip() for name in environ.get("FD_PLUGINS", "").split(",") if name.strip()]
    if "hpu_fp8" in named:
        report.add("FD_PLUGINS", OK, f"FD_PLUGINS={environ['FD_PLUGINS']}")
    else:
        report.add(
            "FD_PLUGINS", FAIL,
            "FD_PLUGINS does not name hpu_fp8: FastDeploy loads no plugin it does not name, and "
            "--load-choices hpu_fp8 then reaches its own v0 loader",
            "export FD_PLUGINS=hpu_fp8 (comma-separated with any other plugins) before starting FastDeploy",
        )  # fmt: skip
    backend = environ.get("FD_ATTENTION_BACKEND", "")
    if backend == "HPU_ATTN":
        report.add("FD_ATTENTION_BACKEND", OK, "HPU_ATTN")
    else:
        report.add(
            "FD_ATTENTION_BACKEND", WARN, f"FD_ATTENTION_BACKEND is {backend or 'unset'}",
            "export FD_ATTENTION_BACKEND=HPU_ATTN, as FastDeploy's Gaudi guide does",
        )  # fmt: skip


def _check_usage_reporting(report: DoctorReport, root: Path, environ: Mapping[str, str]) -> None:
    """FastDeploy from ``93b7675a`` (releases 2.5 and 2.6) has worker rank 0 post its whole config, the model path
    included, to its usage server as it starts and every 10 minutes, unless ``DO_NOT_TRACK`` is exactly ``1``
    (``fastdeploy/usage/usage_lib.py``, ``envs.py``; read from its code, not run). Known from the sources present."""
    usage = root / "usage" / "usage_lib.py"
    if not (usage.is_file() and "DO_NOT_TRACK" in usage.read_text(errors="replace")):
        report.add("usage reporting", OK, "this FastDeploy has no usage reporting (fastdeploy/usage)")
    elif environ.get("DO_NOT_TRACK") == "1":
        report.add("usage reporting", OK, "DO_NOT_TRACK=1: this FastDeploy's usage reporting is off")
    else:
        value = environ.get("DO_NOT_TRACK")
        report.add(
            "usage reporting", WARN,
            f"DO_NOT_TRACK is {'unset' if value is None else repr(value)}: this FastDeploy's worker rank 0 sends its "
            "config, the model path included, to FastDeploy's usage server every 10 minutes (and writes "
            "usage_stats.json under FD_CONFIG_ROOT); only DO_NOT_TRACK=1, exactly, turns it off",
            "export DO_NOT_TRACK=1 before starting FastDeploy",
        )  # fmt: skip


def _failed_step(outcome: StepOutcome) -> str:
    return outcome.error or outcome.ended or "it gave no result"


def _check_fastdeploy_steps(report: DoctorReport, outcomes: dict[str, StepOutcome]) -> None:
    """The import of FastDeploy and the routing through its own get_model_loader, as its worker does them."""
    imported = outcomes.get("fastdeploy import")
    if imported is None:
        return  # not run: paddle failed first, and says so
    if not imported.ok:
        report.add(
            "fastdeploy import", FAIL, f"import fastdeploy failed: {_failed_step(imported)}",
            "fix FastDeploy's environment first: every FastDeploy process starts with this import",
        )  # fmt: skip
        return
    report.add("fastdeploy import", OK, f"import fastdeploy works ({(imported.result or {}).get('file', '')})")
    routed = outcomes.get("routing")
    if routed is None:
        return
    if not routed.ok:
        report.add(
            "routing", FAIL, f"importing FastDeploy's model loader and asking it for hpu_fp8 failed: {_failed_step(routed)}",
            "fix FastDeploy's environment first (this is the import its worker does); "
            "if it persists, report it with `hpu-fp8 doctor --json`",
        )  # fmt: skip
        return
    result = routed.result or {}
    if result.get("ours"):
        report.add("routing", OK, "get_model_loader(load_choices='hpu_fp8') returns the hpu_fp8 loader")
    else:
        report.add(
            "routing", FAIL, f"get_model_loader(load_choices='hpu_fp8') returned {result.get('loader') or 'None'}",
            "this FastDeploy builds loaders the hook does not know; report it with `hpu-fp8 doctor --json`",
        )  # fmt: skip


def _check_checkpoint(report: DoctorReport, checkpoint: str, tp: int, ep: int, revision: str | None) -> Path | None:
    """Quick validation, TP x EP and the 240 bound; the checkpoint's local path when FastDeploy could serve it."""
    from hpu_fp8_loader.arch import describe
    from hpu_fp8_loader.checks.load import load
    from hpu_fp8_loader.fastdeploy.mapping import FASTDEPLOY_FP8_MAX, Parallelism, check_parallelism
    from hpu_fp8_loader.fastdeploy.plan import plan_deployment
    from hpu_fp8_loader.io.checkpoint import read_config

    try:
        loaded = load(checkpoint, revision=revision, hashes=False)
        qc = loaded.quantization_config
        descriptor = describe(read_config(loaded.path))
        check_parallelism(descriptor, Parallelism(tp, 0, ep, 0))
    except HpuFp8Error as exc:
        report.add("checkpoint", FAIL, str(exc))
        return None
    report.add("checkpoint", OK, f"{loaded.path}: hpu-fp8 v1, {descriptor.model_type}, quick validation passed")
    if qc.fp8_max != FASTDEPLOY_FP8_MAX:
        report.add(
            "fp8 range", FAIL, f"fp8_max is {qc.fp8_max:g}; FastDeploy's HPU path assumes 240",
            f"hpu-fp8 retarget {checkpoint} OUT --target gaudi2",
        )  # fmt: skip
    plan = plan_deployment(descriptor, tp, ep, qc.kv_cache_scheme)
    report.add(
        "plan", INFO,
        f"TP {tp} x EP {ep}: {human_bytes(plan.total_bytes_per_rank)} of parameters per rank, "
        f"KV cache {plan.kv_bytes_per_token_per_rank} bytes per token per rank ({qc.kv_cache_scheme.value})",
    )  # fmt: skip
    return Path(loaded.path) if qc.fp8_max == FASTDEPLOY_FP8_MAX else None


def _check_router_gate(report: DoctorReport, root: Path, checkpoint: Path) -> None:
    """Qwen3-MoE on a FastDeploy from 53aaac69 (release 2.6): its router gate is built in bf16 unless --moe-gate-fp32,
    and no Gaudi run has shown the HPU MoE kernel to take a bf16 gate (docs/fastdeploy.md section 14)."""
    from hpu_fp8_loader.io.checkpoint import read_config

    block = root / "model_executor" / "models" / "qwen3moe.py"
    if read_config(checkpoint).get("model_type") != "qwen3_moe" or not block.is_file():
        return
    if "moe_gate_fp32" in block.read_text(errors="replace"):
        report.add(
            "router gate", WARN,
            "this FastDeploy builds Qwen3-MoE's router gate in bf16 unless --moe-gate-fp32 (from 53aaac69); the hook "
            "fills either, but FastDeploy's HPU MoE kernel was always handed a float32 gate before, and a bf16 one has "
            "not been seen on a Gaudi",
            "add --moe-gate-fp32 to the server command (or serve with FastDeploy release/2.5)",
        )  # fmt: skip


def _check_model(report: DoctorReport, outcome: StepOutcome | None, tp: int) -> None:
    """FastDeploy builds the model at meta shapes; every parameter must be one the hook fills, alike."""
    if outcome is None:
        return  # not run: an earlier step failed, and says so
    if not outcome.ok:
        report.add(
            "model", FAIL, f"FastDeploy could not build the model: {_failed_step(outcome)}",
            "run doctor where FastDeploy's worker runs (its environment and device settings)",
        )  # fmt: skip
        return
    result = outcome.result or {}
    problems = [str(problem) for problem in result.get("problems") or []]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        report.add(
            "model", FAIL, f"FastDeploy's model and the hook disagree on {len(problems)} parameter(s): {shown}",
            "report it with `hpu-fp8 doctor --json`: this FastDeploy builds what the hook does not know",
        )  # fmt: skip
    else:
        moe = f"; MoE {result['layout']}" if result.get("layout") else ""
        report.add(
            "model", OK, f"FastDeploy builds {result.get('built')} parameters at TP {tp} rank 0; the hook fills each of them{moe}"
        )


_PROBE = "hpu_fp8_loader.fastdeploy.probe"


def doctor(
    checkpoint: str | Path | None = None,
    tp: int = 1,
    ep: int = 1,
    revision: str | None = None,
    environ: Mapping[str, str] | None = None,
    build: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
) -> DoctorReport:
    """Check this environment (and optionally a checkpoint at TP x EP) for serving with ``--load-choices hpu_fp8``.

    paddle, FastDeploy's import, the routing and (with a checkpoint and ``build``) FastDeploy building the model at
    meta shapes run in one child process (:mod:`.isolation`) that must finish within ``timeout`` seconds: whatever
    FastDeploy does there (exit, raise, print, hang) is a failed check, never this process's end.
    """
    environ = os.environ if environ is None else environ
    report = DoctorReport()
    _check_python(report)
    root = _fastdeploy_root()
    calls = _paddle_calls(root)
    checkpoint_report = DoctorReport()
    servable = _check_checkpoint(checkpoint_report, str(checkpoint), tp, ep, revision) if checkpoint is not None else None
    steps = [Step("paddle", f"{_PROBE}:paddle_step", {"attributes": [call.attribute for call in calls]})]
    if root is not None:
        steps += [Step("fastdeploy import", f"{_PROBE}:fastdeploy_step", {}), Step("routing", f"{_PROBE}:routing_step", {})]
        if servable is not None and build:
            steps.append(Step("model", f"{_PROBE}:model_step", {"checkpoint": str(servable), "tp": tp}))
    outcomes = run_steps(steps, timeout)
    fastdeploy_report = DoctorReport()
    info = _check_fastdeploy(fastdeploy_report, root)
    _check_paddle(report, outcomes.get("paddle"), calls, info)
    report.checks += fastdeploy_report.checks
    _check_plugin_setup(report, environ)
    if root is not None:
        _check_usage_reporting(report, root, environ)
        _check_fastdeploy_steps(report, outcomes)
    report.checks += checkpoint_report.checks
    if root is not None and servable is not None:
        _check_router_gate(report, root, servable)
    _check_model(report, outcomes.get("model"), tp)
    return report

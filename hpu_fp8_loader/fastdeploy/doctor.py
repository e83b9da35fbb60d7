"""``hpu-fp8 doctor``: will ``--load-choices hpu_fp8`` work in this environment, and if not, what to do.

Run on the Gaudi box, in FastDeploy's environment, before starting the server: FastDeploy only logs a
plugin it could not import and never runs one ``FD_PLUGINS`` does not name, so a broken setup shows
up as FastDeploy's own loader failing on an hpu-fp8 checkpoint. Each check is a :class:`Check` with
what was found and, where something is wrong, the fix.

FastDeploy's version, commit and MoE layout are read from its files (``version.txt``, its sources)
without importing it; only the routing check imports FastDeploy's loader package, as its worker does.
The MoE layout reported here is informational: the hook itself decides on the model FastDeploy builds
(docs/fastdeploy.md section 5, "Two MoE layouts").
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

from hpu_fp8_loader.console import human_bytes
from hpu_fp8_loader.errors import HpuFp8Error

__all__ = ["PLUGIN_GROUP", "Check", "DoctorReport", "doctor", "fastdeploy_moe_layout"]

PLUGIN_GROUP = "fastdeploy.model_register_plugins"
OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"


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
    spec = importlib.util.find_spec("fastdeploy")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _version_and_commit(root: Path) -> tuple[str, str]:
    """From the ``version.txt`` FastDeploy's build writes, else from git for a source checkout."""
    version, commit = "unknown", "unknown"
    text = (root / "version.txt").read_text(errors="replace") if (root / "version.txt").is_file() else ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == "fastdeploy version":
            version = value.strip()
        elif key.strip().lower() == "fastdeploy git commit id":
            commit = value.strip()
    if commit == "unknown":
        try:
            found = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "--short=8", "HEAD"], capture_output=True, text=True, timeout=10
            )
            commit = found.stdout.strip() if found.returncode == 0 and found.stdout.strip() else commit
        except (OSError, subprocess.SubprocessError):
            pass
    return version, commit


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


def _check_paddle(report: DoctorReport) -> None:
    if importlib.util.find_spec("paddle") is None:
        report.add("paddle", FAIL, "paddle is not installed", "install FastDeploy's paddle (its Gaudi guide: paddlepaddle 3.1.1)")
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # paddle's "No ccache found" on import
            import paddle

        devices = list(paddle.device.get_all_custom_device_type() or [])
    except Exception as exc:  # a broken paddle install: say what it raised
        report.add("paddle", FAIL, f"import paddle failed: {type(exc).__name__}: {exc}", "repair FastDeploy's paddle install")
        return
    report.add("paddle", OK, f"paddle {paddle.__version__}")
    if "intel_hpu" in devices:
        report.add("hpu device", OK, "paddle's custom device intel_hpu is available")
    else:
        report.add(
            "hpu device", WARN, f"no intel_hpu custom device (custom devices: {', '.join(devices) or 'none'})",
            "on a Gaudi box install PaddleCustomDevice backends/intel_hpu as FastDeploy's Gaudi guide says",
        )  # fmt: skip


def _check_fastdeploy(report: DoctorReport) -> Path | None:
    root = _fastdeploy_root()
    if root is None:
        report.add(
            "fastdeploy", FAIL, "FastDeploy is not importable in this environment",
            "run doctor in FastDeploy's environment (its Gaudi guide builds and installs it)",
        )  # fmt: skip
        return None
    version, commit = _version_and_commit(root)
    report.add("fastdeploy", OK, f"FastDeploy {version}, commit {commit}, at {root}")
    layout = fastdeploy_moe_layout(root)
    if layout is None:
        report.add(
            "moe layout", FAIL, "this FastDeploy has no HPU tensor-wise FP8 MoE method (it predates PR 5324)",
            "use a FastDeploy that includes PR 5324 (develop from 2025-12-17); see docs/fastdeploy.md section 1",
        )  # fmt: skip
    else:
        report.add("moe layout", OK, layout)
    return root


def _check_plugin_setup(report: DoctorReport, environ: Mapping[str, str]) -> None:
    points = [point for point in entry_points(group=PLUGIN_GROUP) if point.name == "hpu_fp8"]
    if not points:
        report.add(
            "entry point", FAIL, f"no hpu_fp8 entry point in {PLUGIN_GROUP}",
            "pip install hpu-fp8-loader into FastDeploy's environment (it does not touch paddle)",
        )  # fmt: skip
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


def _check_routing(report: DoctorReport) -> None:
    """Import FastDeploy's loader package as its worker does and ask it for the ``hpu_fp8`` loader."""
    from hpu_fp8_loader.fastdeploy import plugin

    try:
        plugin.register()
        from fastdeploy.model_executor.model_loader import get_model_loader

        loader = get_model_loader(SimpleNamespace(load_choices=plugin.LOAD_CHOICE))
    except HpuFp8Error as exc:
        report.add("routing", FAIL, str(exc))
        return
    except Exception as exc:  # FastDeploy's own import failed: report it, do not hide it
        report.add(
            "routing", FAIL, f"importing FastDeploy's model loader failed: {type(exc).__name__}: {exc}",
            "fix FastDeploy's environment first (this is the import its worker does)",
        )  # fmt: skip
        return
    if isinstance(loader, plugin.loader_class()):
        report.add("routing", OK, "get_model_loader(load_choices='hpu_fp8') returns the hpu_fp8 loader")
    else:
        report.add(
            "routing", FAIL, f"get_model_loader(load_choices='hpu_fp8') returned {type(loader).__name__}",
            "this FastDeploy builds loaders the hook does not know; report it with `hpu-fp8 doctor --json`",
        )  # fmt: skip


def _check_checkpoint(report: DoctorReport, checkpoint: str, tp: int, ep: int, revision: str | None) -> bool:
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
        return False
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
    return qc.fp8_max == FASTDEPLOY_FP8_MAX


def _check_model(report: DoctorReport, checkpoint: str, tp: int) -> None:
    """FastDeploy builds the model at meta shapes here; every parameter must be one the hook fills, alike."""
    from hpu_fp8_loader.checks.load import load
    from hpu_fp8_loader.fastdeploy.probe import mismatches

    path = load(checkpoint, hashes=False).path
    try:
        problems, layout, built = mismatches(path, tp, 0)
    except Exception as exc:  # FastDeploy's own config or model code failed: report it, do not hide it
        report.add(
            "model", FAIL, f"FastDeploy could not build the model: {type(exc).__name__}: {exc}",
            "run doctor where FastDeploy's worker runs (its environment and device settings)",
        )  # fmt: skip
        return
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        report.add(
            "model", FAIL, f"FastDeploy's model and the hook disagree on {len(problems)} parameter(s): {shown}",
            "report it with `hpu-fp8 doctor --json`: this FastDeploy builds what the hook does not know",
        )  # fmt: skip
    else:
        moe = f"; MoE {layout}" if layout else ""
        report.add("model", OK, f"FastDeploy builds {built} parameters at TP {tp} rank 0; the hook fills each of them{moe}")


def doctor(
    checkpoint: str | Path | None = None,
    tp: int = 1,
    ep: int = 1,
    revision: str | None = None,
    environ: Mapping[str, str] | None = None,
    build: bool = True,
) -> DoctorReport:
    """Check this environment (and optionally a checkpoint at TP x EP) for serving with ``--load-choices hpu_fp8``.

    With a checkpoint and FastDeploy importable, ``build`` has FastDeploy build the model at meta shapes
    (no weight memory) and compares every parameter with what the hook fills (:mod:`.probe`).
    """
    environ = os.environ if environ is None else environ
    report = DoctorReport()
    _check_python(report)
    _check_paddle(report)
    root = _check_fastdeploy(report)
    _check_plugin_setup(report, environ)
    if root is not None:
        _check_routing(report)
    if checkpoint is not None:
        servable = _check_checkpoint(report, str(checkpoint), tp, ep, revision)
        if servable and root is not None and build:
            _check_model(report, str(checkpoint), tp)
    return report

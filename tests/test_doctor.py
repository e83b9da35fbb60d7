"""`hpu-fp8 doctor` without FastDeploy, with FastDeploy's module chain (the stand-in), and on a checkpoint.
Against real FastDeploy it runs in tests/fastdeploy_real/."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner
from doubles.fastdeploy import forget_standin, write_broken_fastdeploy, write_paddle_standin, write_standin

from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.fastdeploy import plugin, support
from hpu_fp8_loader.fastdeploy.doctor import DoctorReport, _check_usage_reporting, doctor, fastdeploy_moe_layout


def by_name(report) -> dict:
    return {check.name: check for check in report.checks}


@pytest.fixture
def no_fastdeploy(monkeypatch, tmp_path):
    """No FastDeploy; paddle stood in (doctor's checks here are about the hook's own setup, not paddle)."""
    forget_standin()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "fd" not in p.rsplit("/", 1)[-1]])
    monkeypatch.syspath_prepend(str(write_paddle_standin(tmp_path / "paddle-standin")))


def test_without_fastdeploy_every_problem_is_named_with_its_fix(no_fastdeploy):
    checks = by_name(doctor(environ={}))
    assert checks["fastdeploy"].status == "fail" and "FastDeploy's environment" in checks["fastdeploy"].fix
    assert checks["entry point"].status == "ok"  # this package is installed here
    assert checks["FD_PLUGINS"].status == "fail" and "export FD_PLUGINS=hpu_fp8" in checks["FD_PLUGINS"].fix
    assert checks["FD_ATTENTION_BACKEND"].status == "warn"
    assert "routing" not in checks  # nothing to route without FastDeploy


def test_fd_plugins_is_read_as_a_comma_separated_list(no_fastdeploy):
    assert by_name(doctor(environ={"FD_PLUGINS": "other, hpu_fp8"}))["FD_PLUGINS"].status == "ok"
    assert by_name(doctor(environ={"FD_PLUGINS": "hpu_fp8x"}))["FD_PLUGINS"].status == "fail"


def test_a_checkpoint_is_validated_and_its_parallelism_checked(no_fastdeploy, spec_factory):
    good = by_name(doctor(spec_factory(), tp=2, environ={}))
    assert good["checkpoint"].status == "ok" and re.search(r"TP 2 x EP 1: [\d.]+ KiB of parameters per rank", good["plan"].detail)
    refused = by_name(doctor(spec_factory(), tp=4, environ={}))["checkpoint"]
    assert refused.status == "fail" and "num_key_value_heads // tp = 0" in refused.detail and "valid: 1, 2" in refused.detail
    missing = by_name(doctor("/nonexistent/ckpt", environ={}))["checkpoint"]
    assert missing.status == "fail" and "/nonexistent/ckpt" in missing.detail


def test_the_moe_layout_is_read_from_fastdeploys_sources(tmp_path):
    backend = tmp_path / "model_executor/layers/backends/intel_hpu/moe/fused_moe_hpu_backend.py"
    runner = tmp_path / "worker/hpu_model_runner.py"
    assert fastdeploy_moe_layout(tmp_path) is None  # no HPU FP8 MoE method: before PR 5324
    backend.parent.mkdir(parents=True)
    runner.parent.mkdir(parents=True)
    backend.write_text("class HpuTensorWiseFP8MoEMethod: ...\n")
    runner.write_text("def convert_model(model): ...\n")
    assert fastdeploy_moe_layout(tmp_path) == plugin.MOE_LIST_LAYOUT
    runner.write_text("def process_scales_alignment_after_loading(layer, alignment=0x80): ...\n")
    assert fastdeploy_moe_layout(tmp_path) == plugin.MOE_PARAMETER_LAYOUT


def test_routing_is_checked_through_fastdeploys_own_get_model_loader(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(write_standin(tmp_path / "fd")))
    monkeypatch.setattr(plugin, "_LOADER", None)
    forget_standin()
    finders = list(sys.meta_path)
    try:
        checks = by_name(doctor(environ={"FD_PLUGINS": "hpu_fp8"}))
    finally:
        sys.meta_path[:] = finders
        forget_standin()
    assert checks["fastdeploy"].status == "ok" and "commit unknown" in checks["fastdeploy"].detail
    assert checks["routing"].status == "ok", checks["routing"]
    assert checks["moe layout"].status == "fail"  # the stand-in has no HPU MoE source: doctor says so


def test_cli_doctor_exits_1_when_not_ready_and_prints_json(no_fastdeploy, monkeypatch):
    monkeypatch.delenv("FD_PLUGINS", raising=False)
    result = CliRunner().invoke(main, ["doctor", "--json"])
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["ok"] is False and {c["name"] for c in data["checks"]} >= {"fastdeploy", "FD_PLUGINS", "entry point"}
    text = CliRunner().invoke(main, ["doctor"])
    assert text.exit_code == 1 and "[fail] FD_PLUGINS" in text.stdout and "not ready" in text.stdout


# ----------------------------------------------------------------------------- a broken FastDeploy

CHECKED = support.CHECKED_COMMITS[-1]


@pytest.fixture
def fastdeploy_with(tmp_path, monkeypatch):
    """Put a FastDeploy with one fault (tests/doubles/fastdeploy.py) and a paddle stand-in on sys.path."""
    forget_standin()
    monkeypatch.setenv("FD_PLUGINS", "hpu_fp8")
    monkeypatch.setenv("FD_ATTENTION_BACKEND", "HPU_ATTN")

    def make(fault: str, paddle_compat: bool = True, version_txt: str | None = None):
        root = tmp_path / fault
        monkeypatch.syspath_prepend(str(write_broken_fastdeploy(root / "fd", fault, version_txt)))
        monkeypatch.syspath_prepend(str(write_paddle_standin(root / "paddle", compat=paddle_compat)))
        return root / "fd" / "fastdeploy"

    yield make
    forget_standin()


def doctor_json(*args: str) -> tuple[int, dict]:
    """`hpu-fp8 doctor --json`: its exit status and the JSON on stdout (which must parse, whatever FastDeploy printed)."""
    result = CliRunner().invoke(main, ["doctor", "--json", *args])
    return result.exit_code, {c["name"]: c for c in json.loads(result.stdout)["checks"]}


def test_a_sound_fastdeploy_passes_every_check_in_the_child(fastdeploy_with):
    fastdeploy_with("none", version_txt=f"fastdeploy GIT COMMIT ID: {CHECKED.commit}\nfastdeploy version: 2.4.0-dev\n")
    status, checks = doctor_json()
    assert status == 0, checks
    assert checks["fastdeploy import"]["status"] == "ok" and checks["routing"]["status"] == "ok"
    assert checks["fastdeploy commit"]["status"] == "ok" and CHECKED.short in checks["fastdeploy commit"]["detail"]


def test_fastdeploy_calling_sys_exit_on_import_is_a_failed_check(fastdeploy_with):
    fastdeploy_with("exit-on-import")
    status, checks = doctor_json()
    assert status == 1
    assert checks["fastdeploy import"]["status"] == "fail"
    assert "import fastdeploy failed: it called sys.exit(0)" in checks["fastdeploy import"]["detail"]
    assert "routing" not in checks  # not run: the import it needs failed, and says so


def test_fastdeploy_printing_on_import_leaves_json_and_text_output_clean(fastdeploy_with):
    fastdeploy_with("print-on-import")
    status, checks = doctor_json()
    assert status == 0 and checks["fastdeploy import"]["status"] == "ok"
    text = CliRunner().invoke(main, ["doctor"])
    assert text.exit_code == 0 and "banner" not in text.output and "a warning" not in text.output


@pytest.mark.slow
def test_fastdeploy_hanging_on_import_is_stopped_at_the_deadline(fastdeploy_with):
    fastdeploy_with("hang-on-import")
    status, checks = doctor_json("--timeout", "3")
    assert status == 1
    assert checks["fastdeploy import"]["detail"] == "import fastdeploy failed: did not finish within 3 s and was stopped"


@pytest.mark.slow
def test_fastdeploy_killing_its_process_on_import_is_a_failed_check(fastdeploy_with):
    fastdeploy_with("killed-on-import")
    status, checks = doctor_json()
    assert status == 1 and checks["fastdeploy import"]["detail"] == "import fastdeploy failed: was killed by SIGKILL"


def test_get_model_loader_returning_none_is_a_failed_routing_check(fastdeploy_with):
    fastdeploy_with("loader-none")
    status, checks = doctor_json()
    assert status == 1 and checks["routing"]["status"] == "fail"
    assert "returned None" in checks["routing"]["detail"] and "hpu-fp8 doctor --json" in checks["routing"]["fix"]


def test_a_base_exception_from_fastdeploy_is_a_failed_routing_check(fastdeploy_with):
    fastdeploy_with("base-exception")
    status, checks = doctor_json()
    assert status == 1
    assert checks["routing"]["detail"].endswith("failed: FastDeployStop: the worker was told to stop")


def test_a_half_imported_base_loader_is_a_failed_routing_check(fastdeploy_with):
    fastdeploy_with("half-imported-base-loader")
    status, checks = doctor_json()
    assert status == 1 and checks["routing"]["status"] == "fail"
    assert "base_loader is only half-imported while FastDeploy runs its plugins" in checks["routing"]["detail"]


def test_a_paddle_without_what_fastdeploy_calls_is_named_with_its_fix(fastdeploy_with):
    """FastDeploy's __init__ calls paddle.compat.enable_torch_proxy; the paddle of its Gaudi guide (3.1.1) lacks it."""
    fastdeploy_with("torch-proxy", paddle_compat=False)
    status, checks = doctor_json()
    assert status == 1
    call = checks["paddle.compat.enable_torch_proxy"]
    assert call["status"] == "fail" and "paddle 3.3.0 has no paddle.compat.enable_torch_proxy" in call["detail"]
    assert f"paddlepaddle>={support.PADDLE_MINIMUM}" in call["fix"]
    assert "AttributeError" in checks["fastdeploy import"]["detail"]  # the import itself fails the same way


def test_a_paddle_with_what_fastdeploy_calls_passes_that_check(fastdeploy_with):
    fastdeploy_with("torch-proxy", paddle_compat=True)
    status, checks = doctor_json()
    assert status == 0 and checks["paddle.compat.enable_torch_proxy"]["status"] == "ok"


def test_a_fastdeploy_calling_enable_compat_only_without_torch_needs_it_only_without_torch(fastdeploy_with, monkeypatch):
    """From 8b6bbb35 FastDeploy's __init__ calls paddle.enable_compat only where no torch distribution is installed
    (Gaudi images ship torch): with torch, a paddle without it passes that check (and the import runs); without torch
    it fails, naming the fix. The tests' environment has torch; its absence is doctor's answer stubbed, named so."""
    from importlib.metadata import version

    from hpu_fp8_loader.fastdeploy import doctor as doctor_module

    fastdeploy_with("enable-compat", paddle_compat=False)
    status, checks = doctor_json()
    call = checks["paddle.enable_compat"]
    assert status == 0 and call["status"] == "ok", checks
    assert f"torch {version('torch')} is, so it is not called (paddle 3.3.0 lacks it)" in call["detail"]
    assert "paddle.compat.enable_torch_proxy" not in checks  # this FastDeploy no longer calls it
    monkeypatch.setattr(doctor_module, "_torch_version", lambda: None)
    status, checks = doctor_json()
    assert checks["paddle.enable_compat"]["status"] == "fail" and status == 1
    assert f"paddlepaddle>={support.PADDLE_MINIMUM}" in checks["paddle.enable_compat"]["fix"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("version_txt", "status", "says"),
    [
        (f"fastdeploy GIT COMMIT ID: {CHECKED.commit}\n", "ok", f"develop at {CHECKED.short}"),
        ("fastdeploy GIT COMMIT ID: 0123456789abcdef0123456789abcdef01234567\n", "warn", "doctor cannot place it"),
        *[(f"fastdeploy GIT COMMIT ID: {b.commit.commit}\n", "ok", f"{b.name} at {b.commit.short}") for b in support.BUILDS],
        ("fastdeploy version: 2.4.1\n", "fail", "release 2.4 does not carry PR 5324"),
        ("fastdeploy version: 2.3.2\n", "fail", "release 2.3 does not carry PR 5324"),
        ("fastdeploy version: 2.2.0\n", "fail", "predates the HPU FP8 path"),
        ("fastdeploy version: 2.5.0\n", "warn", f"a release/2.5 build; its head {support.BUILDS[1].commit.short} is checked"),
        ("fastdeploy version: 2.6.1\n", "warn", f"a release/2.6 build; its head {support.BUILDS[2].commit.short} is checked"),
        ("fastdeploy version: 2.7.0\n", "warn", "a release newer than any this package knows"),
        ("fastdeploy version: 2.4.0-dev\n", "warn", "a develop build; not checked"),
        (None, "warn", "FastDeploy unknown, commit unknown"),
    ],
)
def test_fastdeploys_version_or_commit_is_compared_with_the_supported_range(fastdeploy_with, version_txt, status, says):
    root = fastdeploy_with("none", version_txt=version_txt)
    checks = {check.name: check for check in doctor(environ={}, build=False).checks}
    assert checks["fastdeploy commit"].status == status and says in checks["fastdeploy commit"].detail, checks[
        "fastdeploy commit"
    ]
    assert str(root) in checks["fastdeploy"].detail


def _git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.slow
def test_in_a_fastdeploy_checkout_git_places_the_commit_among_the_changes(fastdeploy_with, monkeypatch):
    """A FastDeploy source checkout without version.txt: git history places HEAD against PR 5324, a checked build
    and the changes after it, a cherry-pick counting as its change (here a made-up history standing for them)."""
    package = fastdeploy_with("none")
    repo = package.parent
    _git(repo, "init", "-q")
    commits = {}
    for name in ("older", "pr5324", "between", "change", "checked", "newer"):
        (repo / "history.txt").write_text(name)
        _git(repo, "add", "-A")
        _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", name)
        commits[name] = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-q", "-b", "release", commits["between"])
    (repo / "history.txt").write_text("picked")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-am", "cherry-pick of change")
    commits["picked"] = _git(repo, "rev-parse", "HEAD")
    commit = support.FastDeployCommit
    monkeypatch.setattr(support, "FIRST_SUPPORTED_COMMIT", commit(commits["pr5324"], "", "", (), ""))
    build = support.BUILDS[0].__class__("develop", commit(commits["checked"], "d", "t", (), "checked"), "v", "", "", "")
    monkeypatch.setattr(support, "BUILDS", (build,))
    changes = (
        support.FastDeployChange(commit(commits["change"], "d", "t", (), "c"), cherry_picks=("0" * 40,)),
        support.FastDeployChange(commit(commits["newer"], "d", "t", (), "n"), cherry_picks=(commits["picked"],)),
    )
    monkeypatch.setattr(support, "CHANGES", changes)
    change, newer = commits["change"][:8], commits["newer"][:8]
    expected = {
        "older": ("fail", "predates PR 5324"),
        "between": ("warn", f"carries none and lacks {change}, {newer}"),
        "checked": ("ok", "checked"),
        "newer": ("warn", f"carries {change}, {newer} and lacks none"),
        "picked": ("warn", f"carries {newer} and lacks {change}"),
    }
    for name, (status, says) in expected.items():
        _git(repo, "checkout", "-q", commits[name])
        check = {c.name: c for c in doctor(environ={}, build=False).checks}["fastdeploy commit"]
        assert check.status == status and says in check.detail, (name, check)


@pytest.mark.parametrize(("preset", "model_type"), [("qwen3-tiny", "qwen3"), ("qwen3-moe-tiny", "qwen3_moe")])
def test_a_qwen3_checkpoint_is_checked_like_the_others(no_fastdeploy, spec_factory, preset, model_type):
    good = by_name(doctor(spec_factory(preset), tp=2, environ={}))
    assert good["checkpoint"].status == "ok" and f"hpu-fp8 v1, {model_type}" in good["checkpoint"].detail
    assert "TP 2 x EP 1" in good["plan"].detail
    refused = by_name(doctor(spec_factory(preset), tp=4, environ={}))["checkpoint"]  # 2 KV heads
    assert refused.status == "fail" and f"cannot serve this {model_type} model" in refused.detail


@pytest.mark.parametrize(
    ("usage_module", "do_not_track", "status"),
    [(False, None, "ok"), (True, None, "warn"), (True, "true", "warn"), (True, "0", "warn"), (True, "1", "ok")],
    ids=["no usage reporting", "unset", "true is not 1", "0", "1"],
)
def test_usage_reporting_is_named_where_fastdeploy_has_it_and_do_not_track_is_not_1(tmp_path, usage_module, do_not_track, status):
    """A stand-in for FastDeploy's sources (2.5 and later carry fastdeploy/usage/usage_lib.py, which reads
    DO_NOT_TRACK; 8c3513a4 has none): the check reads only that file and the environment."""
    if usage_module:
        (tmp_path / "usage").mkdir()
        (tmp_path / "usage" / "usage_lib.py").write_text("do_not_track = envs.DO_NOT_TRACK\n")
    report = DoctorReport()
    _check_usage_reporting(report, tmp_path, {} if do_not_track is None else {"DO_NOT_TRACK": do_not_track})
    (check,) = report.checks
    assert (check.name, check.status) == ("usage reporting", status)
    if status == "warn":
        assert "model path included" in check.detail and check.fix == "export DO_NOT_TRACK=1 before starting FastDeploy"


@pytest.mark.parametrize(("block", "status"), [("weight_dtype='float32' if moe_gate_fp32 else ''", "warn"), ("", None)])
def test_qwen3_moe_on_a_fastdeploy_with_a_bf16_gate_is_told_to_pass_moe_gate_fp32(fastdeploy_with, spec_factory, block, status):
    """From 53aaac69 FastDeploy's Qwen3MoeBlock builds its gate in bf16 unless moe_gate_fp32 (its source here is the
    stand-in's, holding only that word or not); a dense checkpoint is never told."""
    root = fastdeploy_with("none")
    (root / "model_executor" / "models" / "qwen3moe.py").write_text(block + "\n")
    checks = by_name(doctor(spec_factory("qwen3-moe-tiny"), environ={}, build=False))
    assert (checks["router gate"].status if "router gate" in checks else None) == status, checks.get("router gate")
    if status:
        assert "--moe-gate-fp32" in checks["router gate"].fix
    assert "router gate" not in by_name(doctor(spec_factory("qwen3-tiny"), environ={}, build=False))

"""`hpu-fp8 doctor` without FastDeploy, with FastDeploy's module chain (the stand-in), and on a checkpoint.
Against real FastDeploy it runs in tests/fastdeploy_real/."""

from __future__ import annotations

import json
import re
import sys

import pytest
from click.testing import CliRunner
from doubles.fastdeploy import forget_standin, write_standin

from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.fastdeploy import plugin
from hpu_fp8_loader.fastdeploy.doctor import doctor, fastdeploy_moe_layout


def by_name(report) -> dict:
    return {check.name: check for check in report.checks}


@pytest.fixture
def no_fastdeploy(monkeypatch):
    forget_standin()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "fd" not in p.rsplit("/", 1)[-1]])


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

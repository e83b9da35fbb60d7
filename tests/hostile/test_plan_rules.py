"""``plan`` refuses what ``convert`` refuses, and a config.json that contradicts itself or its weights is never
planned or rewritten silently (issue 39, item 5)."""

from __future__ import annotations

import json
import shutil

import pytest

from hostile.refusal import assert_refused, run_cli, tree_digest


def _config_edited(tmp_path, source_factory, preset: str, layout: str = "paddle", **keys) -> object:
    root = tmp_path / "model"
    shutil.copytree(source_factory(preset, layout), root)
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, **keys}))
    return root


# (preset, --keep-bf16 groups, the reason both commands give): the three plan used to size
KEEP_BF16_REFUSED = [
    ("qwen2-tiny", ["experts"], "has no routed experts"),
    ("qwen3-tiny", ["dense"], "no linear is left in FP8"),
    ("ernie-moe-tiny", ["dense", "experts"], "no linear is left in FP8"),
]


@pytest.mark.parametrize(("preset", "groups", "reason"), KEEP_BF16_REFUSED)
def test_plan_refuses_the_keep_bf16_choices_convert_refuses(tmp_path, source_factory, preset, groups, reason):
    flags = [part for group in groups for part in ("--keep-bf16", group)]
    source = source_factory(preset)
    assert_refused(run_cli("plan", source, "--tp", "1", *flags), "keep_bf16", reason)
    convert = ["convert", source, tmp_path / "out", "--calibrate", "--samples", "1", "--seq-len", "8", *flags]
    assert_refused(run_cli(*convert), "keep_bf16", reason)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout", ["paddle", "torch"])
def test_plan_refuses_a_head_dim_the_weights_do_not_have(tmp_path, source_factory, layout):
    model = _config_edited(tmp_path, source_factory, "qwen3-tiny", layout, head_dim=48)  # the weights hold 24
    line = assert_refused(run_cli("plan", model, "--tp", "1"), "config.json", "head_dim 48", "has shape")
    assert ("qkv_proj" if layout == "paddle" else "q_proj") in line


def test_plan_of_an_hpu_fp8_checkpoint_checks_its_attention_shapes_too(tmp_path, spec_factory):
    root = tmp_path / "ckpt"
    shutil.copytree(spec_factory("qwen2-tiny"), root)
    config = json.loads((root / "config.json").read_text())
    assert run_cli("plan", root, "--tp", "1").exit_code == 0  # the control: as converted
    (root / "config.json").write_text(
        json.dumps({**config, "head_dim": config["hidden_size"] // config["num_attention_heads"] * 2})
    )
    assert_refused(run_cli("plan", root, "--tp", "1"), "qkv_proj", "has shape")


@pytest.mark.parametrize("command", ["plan", "convert"])
def test_architectures_of_another_supported_model_is_refused(tmp_path, source_factory, command):
    """The issue's case: ``architectures: [Qwen2ForCausalLM]`` on a qwen3 model became Qwen3ForCausalLM silently."""
    model = _config_edited(tmp_path, source_factory, "qwen3-tiny", architectures=["Qwen2ForCausalLM"])
    before = tree_digest(model)
    argv = ("plan", model, "--tp", "1") if command == "plan" else ("convert", model, tmp_path / "out", "--calibrate")
    assert_refused(run_cli(*argv), "architectures names Qwen2ForCausalLM (a qwen2 model)", "model_type is 'qwen3'")
    assert tree_digest(model) == before and not (tmp_path / "out").exists()


def test_an_architecture_name_of_no_supported_model_is_rewritten_with_a_warning(tmp_path, source_factory):
    model = _config_edited(tmp_path, source_factory, "qwen3-tiny", architectures=["MyQwen3Finetune"])
    result = run_cli("convert", model, tmp_path / "out", "--calibrate", "--samples", "1", "--seq-len", "8", "-q")
    assert result.exit_code == 0, result.stderr
    assert "architectures [\"MyQwen3Finetune\"] is written as ['Qwen3ForCausalLM']" in result.stderr
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]

"""Hub repo ids (and the shipped tiny models' names) wherever a command names a model or checkpoint: calibrate,
convert, eval, validate, inspect, plan, map.

Run in-process against a Hugging Face cache laid out by the test, with huggingface_hub's offline switch and cache
location set as ``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE`` set them. Each repository holds one model at ``main`` and
another at the tag ``v1``, so a command that honours ``--revision`` gives a visibly different answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.hub_cache import add_to_cache

from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS

MAIN, V1 = "0" * 39 + "1", "0" * 39 + "2"
MISSING = "acme/not-cached"


@pytest.fixture
def hub(tmp_path, monkeypatch, source_factory, spec_factory) -> Path:
    """An offline cache: acme/src and acme/fp8 hold qwen2 at main and the ERNIE MoE at v1."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    for repo, made in (("acme/src", source_factory), ("acme/fp8", spec_factory)):
        add_to_cache(cache, repo, made("qwen2-tiny"), MAIN, "main")
        add_to_cache(cache, repo, made("ernie-moe-tiny"), V1, "v1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # relative names in the tests are no local directories
    return cache


def run(*args: str):
    return CliRunner().invoke(main, [*args])


def one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code != 0 and len(lines) == 1 and "Traceback" not in result.stderr, result.output
    return lines[0]


def test_validate_resolves_a_repo_id_and_its_revision(hub):
    main_report = json.loads(run("validate", "acme/fp8", "--quick", "--json").stdout)
    tagged = run("validate", "acme/fp8", "--quick", "--json", "--revision", "v1")
    assert tagged.exit_code == 0, tagged.output
    v1_report = json.loads(tagged.stdout)
    assert main_report["valid"] and v1_report["valid"]
    assert Path(main_report["root"]).name == MAIN and Path(v1_report["root"]).name == V1
    assert main_report["tensors"] != v1_report["tensors"]  # qwen2 and the ERNIE MoE


@pytest.mark.parametrize(("command", "repo_id"), [("inspect", "acme/fp8"), ("plan", "acme/src")])
def test_inspect_and_plan_resolve_a_repo_id_and_its_revision(hub, command, repo_id):
    at_main = run(command, repo_id, "--json")
    at_v1 = run(command, repo_id, "--json", "--revision", "v1")
    assert at_main.exit_code == 0 and at_v1.exit_code == 0, at_main.output + at_v1.output
    assert json.loads(at_main.stdout)["model_type"] == "qwen2"
    assert json.loads(at_v1.stdout)["model_type"] == "ernie4_5_moe"


def test_map_resolves_a_repo_id_and_its_revision(hub, tmp_path):
    at_main = run("map", "acme/fp8", "-o", str(tmp_path / "main.safetensors"), "--json")
    at_v1 = run("map", "acme/fp8", "--revision", "v1", "-o", str(tmp_path / "v1.safetensors"), "--json")
    assert at_main.exit_code == 0 and at_v1.exit_code == 0, at_main.output + at_v1.output
    from hpu_fp8_loader.io.safetensors_file import read_header

    def prefixes(file: str) -> set[str]:
        return {name.split(".")[0] for name in read_header(tmp_path / file)[0]}

    assert prefixes("main.safetensors") == {"qwen2", "lm_head"} and prefixes("v1.safetensors") == {"ernie", "lm_head"}


def test_calibrate_resolves_a_repo_id_and_its_revision(hub, tmp_path):
    small = ("--samples", "1", "--seq-len", "8", "--batch-size", "1", "-q")
    at_main = run("calibrate", "acme/src", "-o", str(tmp_path / "main.json"), *small)
    at_v1 = run("calibrate", "acme/src", "--revision", "v1", "-o", str(tmp_path / "v1.json"), *small)
    assert at_main.exit_code == 0 and at_v1.exit_code == 0, at_main.output + at_v1.output
    assert json.loads((tmp_path / "main.json").read_text())["model"]["model_type"] == "qwen2"
    assert json.loads((tmp_path / "v1.json").read_text())["model"]["model_type"] == "ernie4_5_moe"


def test_eval_resolves_both_repo_ids_each_with_its_own_revision(hub):
    small = ("--samples", "1", "--seq-len", "8", "--weights-only", "--json")
    both_main = run("eval", "acme/src", "acme/fp8", *small)
    assert both_main.exit_code == 0, both_main.output
    assert json.loads(both_main.stdout)["rows"]
    both_v1 = run("eval", "acme/src", "acme/fp8", "--source-revision", "v1", "--revision", "v1", *small)
    assert both_v1.exit_code == 0, both_v1.output
    mixed = run("eval", "acme/src", "acme/fp8", "--revision", "v1", *small)  # a qwen2 source, an ERNIE checkpoint
    assert "model_type qwen2 vs ernie4_5_moe" in one_error_line(mixed)


@pytest.mark.parametrize(
    ("command", "code"),
    [
        (["validate", MISSING], 2),
        (["inspect", MISSING], 2),
        (["plan", MISSING], 1),
        (["map", MISSING, "-o", "out.safetensors"], 1),
        (["calibrate", MISSING, "-o", "m.json"], 1),
        (["eval", MISSING, "acme/fp8"], 1),
        (["eval", "acme/src", MISSING], 1),
        (["validate", "acme/fp8", "--revision", "v2"], 2),
    ],
)
def test_an_offline_miss_is_one_named_line(hub, tmp_path, command, code):
    result = run(*command)
    line = one_error_line(result)
    assert result.exit_code == code
    assert ("acme/fp8" if "v2" in command else MISSING) in line and "not in the local Hugging Face cache" in line
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "out.safetensors").exists()


def test_a_local_directory_wins_over_a_repo_id_of_the_same_spelling(hub, tmp_path, spec_factory):
    import shutil

    shutil.copytree(spec_factory("ernie-moe-tiny"), tmp_path / "acme" / "fp8")  # the cache's main holds qwen2
    result = run("inspect", "acme/fp8", "--json", "--revision", "main")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model_type"] == "ernie4_5_moe"
    assert "revision 'main' (for Hub repo ids) is ignored" in result.stderr


def test_a_shipped_tiny_model_name_works_wherever_a_model_is_named(hub, tmp_path):
    """calibrate, convert, eval and plan take ``qwen2-bytes`` as demo --model does, offline and without a path."""
    planned = run("plan", "qwen2-bytes", "--json")
    assert planned.exit_code == 0 and json.loads(planned.stdout)["model_type"] == "qwen2", planned.output
    calibrated = run("calibrate", "qwen2-bytes", "-o", "m.json", "--samples", "2", "--seq-len", "16", "-q")
    assert calibrated.exit_code == 0 and (tmp_path / "m.json").is_file(), calibrated.output
    converted = run("convert", "qwen2-bytes", "fp8", "--measurements", "m.json", "--workers", "1", "-q")
    assert converted.exit_code == 0 and (tmp_path / "fp8" / "config.json").is_file(), converted.output
    evaluated = run("eval", "qwen2-bytes", "fp8", "--samples", "1", "--seq-len", "16", "--json")
    assert evaluated.exit_code == 0 and json.loads(evaluated.stdout)["rows"], evaluated.output
    assert not (tmp_path / "qwen2-bytes").exists()  # resolved to the package's copy, nothing made here


def test_a_local_path_wins_over_a_tiny_model_name_and_a_revision_is_ignored_with_a_warning(hub, tmp_path, source_factory):
    import shutil

    shutil.copytree(source_factory("ernie-moe-tiny"), tmp_path / "qwen2-bytes")
    assert json.loads(run("plan", "qwen2-bytes", "--json").stdout)["model_type"] == "ernie4_5_moe"
    shutil.rmtree(tmp_path / "qwen2-bytes")
    result = run("plan", "qwen2-bytes", "--json", "--revision", "v1")
    assert result.exit_code == 0 and json.loads(result.stdout)["model_type"] == "qwen2"
    assert "qwen2-bytes: a tiny model shipped with hpu-fp8, so revision 'v1' (for Hub repo ids) is ignored" in result.stderr
    pushed = run("push", "qwen2-bytes", "--repo-id", "a/b", "--calibrate", "--license", "mit", "--dry-run")
    assert "the base model's Hub id is unknown: pass --base-model" in one_error_line(pushed)  # a local model, not a Hub id


def test_an_unknown_name_lists_the_tiny_models_and_every_model_argument_documents_the_order():
    line = one_error_line(run("convert", "qwen4-bytes", "out", "--measurements", "m.json"))
    assert (
        "'qwen4-bytes': no such directory, no shipped tiny model (ernie-moe-bytes, qwen2-bytes, qwen3-bytes, qwen3-moe-bytes)"
        in line
    )
    for command in ("calibrate", "convert", "eval", "plan", "push"):  # the --help text, before click wraps it
        text = " ".join((main.commands[command].help or "").split())
        assert all(name in text for name in TINY_MODELS) and "tried in that order" in text, command
    assert "a local path, then a shipped tiny model's name, wins" in " ".join(run("plan", "--help").stdout.split())


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["validate", "./nowhere"], "nowhere: no such checkpoint directory"),
        (["inspect", "nowhere"], "nowhere: no such checkpoint directory"),
        (["map", "nowhere", "-o", "out.safetensors"], "nowhere: no such checkpoint directory"),
        (["plan", "nowhere"], "nowhere"),
    ],
)
def test_a_missing_local_path_that_is_no_repo_id_keeps_its_not_found_error(hub, command, message):
    line = one_error_line(run(*command))
    assert message in line and "Hugging Face" not in line


@pytest.mark.slow  # console-script subprocesses against the Hub double
def test_each_command_downloads_only_what_it_reads(tmp_path, source_factory):
    """Against the Hub double (online): plan fetches config.json alone, calibrate a source's weights and configs
    (SOURCE_PATTERNS) at the branch --revision names, never a file no command reads."""
    import os
    import subprocess
    import sys

    from doubles.hub import HubTestDouble, Repo, StoredFile

    def files_of(source: Path) -> dict[str, StoredFile]:
        stored = {p.name: StoredFile(p.read_bytes(), p.suffix == ".safetensors") for p in source.iterdir()}
        return {**stored, "notes.bin": StoredFile(b"\0" * 64, False)}

    double = HubTestDouble().start()
    try:
        double.repos["acme/src"] = Repo(
            private=False,
            branches={"main": MAIN, "v1": V1},
            files={MAIN: files_of(source_factory("qwen2-tiny")), V1: files_of(source_factory("ernie-moe-tiny"))},
        )
        env = {
            **os.environ,
            "HF_HUB_DISABLE_XET": "1",
            "HF_HOME": str(tmp_path / "hf-home"),
            "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
            "HF_ENDPOINT": double.url,
        }
        cli = [str(Path(sys.executable).with_name("hpu-fp8"))]
        plan = subprocess.run([*cli, "plan", "acme/src", "--json"], capture_output=True, text=True, env=env, check=False)
        assert plan.returncode == 0, plan.stderr
        assert json.loads(plan.stdout)["model_type"] == "qwen2"
        snapshots = tmp_path / "hf-cache" / "models--acme--src" / "snapshots"
        assert sorted(p.name for p in (snapshots / MAIN).iterdir()) == ["config.json"]
        out = tmp_path / "m.json"
        args = ["calibrate", "acme/src", "--revision", "v1", "-o", str(out), "--samples", "1", "--seq-len", "8", "-q"]
        calibrate = subprocess.run([*cli, *args], capture_output=True, text=True, env=env, check=False)
        assert calibrate.returncode == 0, calibrate.stderr
        assert json.loads(out.read_text())["model"]["model_type"] == "ernie4_5_moe"
        fetched = {p.name for p in (snapshots / V1).iterdir()}
        assert "config.json" in fetched and any(n.endswith(".safetensors") for n in fetched) and "notes.bin" not in fetched
    finally:
        double.stop()
    assert double.unknown_routes == []

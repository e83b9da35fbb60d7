"""Hostile inputs to `hpu-fp8 push` and `pull` (issue 14 items 2 and 15): a work directory that overlaps the
source or holds someone else's directory, invalid or hostile repo ids, licenses and measurement provenance.
Each is refused by name before any conversion, with nothing deleted; what is accepted is escaped in the card."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.synth import preset_config, synthetic_measurements

PRESET = "qwen2-tiny"


@pytest.fixture(scope="module")
def measurement_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("measurements") / "amax.json"
    path.write_text(synthetic_measurements(preset_config(PRESET)).model_dump_json(exclude_none=True))
    return path


@pytest.fixture
def source(tmp_path, source_factory) -> Path:
    """A private copy of a BF16 source, so that a test may place it anywhere."""
    target = tmp_path / "model"
    shutil.copytree(source_factory(PRESET, "torch"), target)
    return target


def push(src: Path | str, work: Path | None, measurements: Path, *extra: str):
    """`push --dry-run`: everything but the upload, so no Hub is needed."""
    args = ["push", src, "--repo-id", "acme/tiny-fp8", "--measurements", measurements, "--license", "mit"]
    args += ["--base-model", "acme/tiny", "--kv-cache", "none", "--skip-eval", "--dry-run", *extra]
    return run_cli(*args, *(["--work-dir", work] if work is not None else []))


def _place_source_at_staging(source: Path) -> tuple[Path, Path]:
    work = source.parent / "work"
    work.mkdir()
    return source.rename(work / "checkpoint"), work


def _work_is_source(source: Path) -> tuple[Path, Path]:
    return source, source


def _work_inside_source(source: Path) -> tuple[Path, Path]:
    return source, source / "sub"


def _work_is_source_parent_of_link(source: Path) -> tuple[Path, Path]:
    """The source reached through a link at WORK/checkpoint: resolved, it is still the source."""
    work = source.parent / "work"
    work.mkdir()
    (work / "checkpoint").symlink_to(source)
    return work / "checkpoint", work


@pytest.mark.parametrize(
    "arrange",
    [_place_source_at_staging, _work_is_source, _work_inside_source, _work_is_source_parent_of_link],
    ids=["source-at-work-checkpoint", "work-is-source", "work-inside-source", "source-linked-at-work-checkpoint"],
)
def test_a_work_dir_overlapping_the_source_is_refused_and_nothing_is_deleted(source, measurement_file, arrange):
    src, work = arrange(source)
    before = tree_digest(source.parent)
    assert_refused(push(src, work, measurement_file), "--work-dir", "source")
    assert tree_digest(source.parent) == before


def _foreign_directory(staged: Path) -> None:
    staged.mkdir(parents=True)
    (staged / "notes.txt").write_text("mine, not the tool's")


def _foreign_file(staged: Path) -> None:
    staged.parent.mkdir(parents=True)
    staged.write_text("a file where the staging directory goes")


def _link_elsewhere(staged: Path) -> None:
    _foreign_directory(staged.parent.parent / "elsewhere")
    staged.parent.mkdir(parents=True)
    staged.symlink_to(staged.parent.parent / "elsewhere")


@pytest.mark.parametrize("plant", [_foreign_directory, _foreign_file, _link_elsewhere], ids=["directory", "file", "link"])
def test_an_existing_work_checkpoint_the_tool_did_not_stage_is_never_deleted(tmp_path, source, measurement_file, plant):
    work = tmp_path / "work"
    plant(work / "checkpoint")
    before = tree_digest(tmp_path)
    assert_refused(push(source, work, measurement_file), str(work / "checkpoint"))
    assert tree_digest(tmp_path) == before


def test_a_measurement_file_inside_the_staging_directory_is_refused(tmp_path, source, measurement_file):
    work = tmp_path / "work"
    (work / "checkpoint").mkdir(parents=True)
    (work / ".hpu-fp8-push").write_text("")  # even a directory a push staged is not replaced while it holds an input
    inside = shutil.copy(measurement_file, work / "checkpoint" / "amax.json")
    before = tree_digest(tmp_path)
    assert_refused(push(source, work, inside), "--work-dir", "amax.json")
    assert tree_digest(tmp_path) == before


def test_a_work_dir_a_push_staged_is_replaced_and_the_source_kept(tmp_path, source, measurement_file):
    work = tmp_path / "work"
    source_before = tree_digest(source)
    first = push(source, work, measurement_file)
    assert first.exit_code == 0, first.output
    (work / "checkpoint" / "stale.txt").write_text("left from the first run")
    second = push(source, work, measurement_file)
    assert second.exit_code == 0, second.output
    assert not (work / "checkpoint" / "stale.txt").exists() and tree_digest(source) == source_before


HOSTILE_REPO_IDS = [
    "org/..",
    "a/b/c",
    "/name",
    "org/",
    "",
    "x" * 97 + "/name",
    "org/" + "x" * 97,
    "org/<script>",
    "org/name\n# heading",
    "org/näme",
    "org--x/name",
    "org/name.git",
    "-org/name",
    "org/name.",
    "org/na me",
    "name-without-org",
    "../../etc",
]


@pytest.mark.parametrize("repo_id", HOSTILE_REPO_IDS)
def test_an_invalid_repo_id_is_refused_before_any_work(tmp_path, source, measurement_file, repo_id):
    before = tree_digest(tmp_path)
    result = run_cli("push", source, "--repo-id", repo_id, "--measurements", measurement_file, "--license", "mit",
                     "--base-model", "acme/tiny", "--dry-run", "--work-dir", tmp_path / "work")  # fmt: skip
    assert_refused(result, "--repo-id")
    assert tree_digest(tmp_path) == before  # not even the work directory was made


@pytest.mark.parametrize("base_model", ["org/..", "a/b/c", "org/[x](javascript:alert(1))", "org/name\n# heading", ""])
def test_an_invalid_base_model_is_refused_before_any_work(tmp_path, source, measurement_file, base_model):
    before = tree_digest(tmp_path)
    result = run_cli("push", source, "--repo-id", "acme/tiny-fp8", "--measurements", measurement_file, "--license", "mit",
                     "--base-model", base_model, "--dry-run", "--work-dir", tmp_path / "work")  # fmt: skip
    assert_refused(result, "--base-model")
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("license_", ["mit\n# heading", "<script>alert(1)</script>", "apache 2.0", "-x", "[x](y)"])
def test_a_license_that_is_not_an_identifier_is_refused_before_any_work(tmp_path, source, measurement_file, license_):
    before = tree_digest(tmp_path)
    result = run_cli("push", source, "--repo-id", "acme/tiny-fp8", "--measurements", measurement_file, "--license", license_,
                     "--base-model", "acme/tiny", "--dry-run", "--work-dir", tmp_path / "work")  # fmt: skip
    assert_refused(result, "license")
    assert tree_digest(tmp_path) == before


def test_measurements_and_calibrate_together_are_refused(tmp_path, source, measurement_file):
    before = tree_digest(tmp_path)
    assert_refused(push(source, tmp_path / "work", measurement_file, "--calibrate"), "--measurements", "--calibrate")
    assert tree_digest(tmp_path) == before


def test_create_pr_with_a_revision_is_refused_before_any_work(tmp_path, source, measurement_file):
    before = tree_digest(tmp_path)
    assert_refused(push(source, tmp_path / "work", measurement_file, "--create-pr", "--revision", "fp8"), "--create-pr")
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("repo_id", ["org/..", "a/b/c", "../x", "org/name/../..", "org/name\x00", "org/<script>", "a" * 200])
def test_pull_refuses_an_invalid_repo_id_by_name(tmp_path, monkeypatch, repo_id):
    monkeypatch.chdir(tmp_path)  # no directory here that a relative id could name
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert_refused(run_cli("pull", repo_id), "not a Hugging Face repo id")
    assert os.listdir(tmp_path) == []


HOSTILE_TEXT = {
    "heading": "x\n# Pwned heading",
    "script": "<script>alert(1)</script>",
    "link": "[click](javascript:alert(1))",
    "image": "![t](http://evil.example/t.png)",
    "table": "a | b | c",
    "fence": "x\n```\n# out of the code block",
    "html-comment": "<!-- hidden -->",
    "emphasis": "**bold** _it_",
}


@pytest.mark.parametrize("field", ["tool", "tool_version", "date", "dataset"])
@pytest.mark.parametrize("text", list(HOSTILE_TEXT.values()), ids=list(HOSTILE_TEXT))
def test_hostile_provenance_is_escaped_in_the_card(tmp_path, source, measurement_file, field, text):
    data = json.loads(measurement_file.read_text())
    data["provenance"][field] = text
    hostile = tmp_path / "hostile.json"
    hostile.write_text(json.dumps(data))
    result = push(source, tmp_path / "work", hostile)
    assert result.exit_code == 0, result.output
    card = (tmp_path / "work" / "checkpoint" / "README.md").read_text()
    body = ModelCard(card).text
    assert "<script" not in card and "<!--" not in card
    assert re.findall(r"(?<!\\)\]\(", body) == ["]("]  # the template's one link to the base model; a hostile one is escaped
    assert [line for line in body.splitlines() if line.startswith("#")] == [
        "# tiny-fp8", "## Quantization", "## Calibration", "## Accuracy", "## Serving with FastDeploy", "## Reproduce", "## Files",
    ]  # fmt: skip
    assert body.count("```") == 4  # the two code blocks the template writes, still closed where it closes them
    assert "| a | b | c" not in card


def test_the_card_names_no_local_path_and_cites_the_uploaded_measurements(tmp_path, source, measurement_file):
    data = json.loads(measurement_file.read_text())
    data["provenance"]["dataset"] = str(tmp_path / "private" / "corpus.txt")
    data["provenance"]["files"] = [str(tmp_path / "private" / "rank_0.txt")]
    local = tmp_path / "secret-dir" / "measured.json"
    local.parent.mkdir()
    local.write_text(json.dumps(data))
    result = push(source, tmp_path / "work", local)
    assert result.exit_code == 0, result.output
    staged = tmp_path / "work" / "checkpoint"
    for name in ("README.md", "config.json", "hpu_fp8_measurements.json"):
        assert str(tmp_path) not in (staged / name).read_text(), name
    card = (staged / "README.md").read_text()
    assert "hpu-fp8 push acme/tiny --repo-id acme/tiny-fp8 --measurements hpu_fp8_measurements.json" in card
    assert "dataset corpus.txt" in card
    uploaded = json.loads((staged / "hpu_fp8_measurements.json").read_text())
    assert uploaded["amax"] == data["amax"] and uploaded["provenance"]["files"] == ["rank_0.txt"]
    assert "hpu_fp8_measurements.json" in json.loads((staged / "hpu_fp8_manifest.json").read_text())["files"]
    assert run_cli("validate", staged, "--hashes").exit_code == 0

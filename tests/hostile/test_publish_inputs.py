"""Hostile inputs to `hpu-fp8 push` and `pull` (issue 14 items 2 and 15): a work directory that overlaps the
source or holds someone else's directory, invalid or hostile repo ids, licenses and measurement provenance.
Each is refused by name before any conversion, with nothing deleted; what is accepted is escaped in the card."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements

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


def push(src: Path | str, work: Path | None, measurements: Path, *extra: str, license_: str | None = "mit"):
    """`push --dry-run`: everything but the upload, so no Hub is needed; ``license_=None`` reads it from SRC's card."""
    args = ["push", src, "--repo-id", "acme/tiny-fp8", "--measurements", measurements, "--base-model", "acme/tiny"]
    args += ["--kv-cache", "none", "--skip-eval", "--dry-run", *(["--license", license_] if license_ else []), *extra]
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
    (work / "checkpoint" / "notes.txt").write_text("a user's, put in the staged checkpoint")
    staged = tree_digest(work / "checkpoint")
    assert_refused(push(source, work, measurement_file), "checkpoint", "notes.txt is not a file listed", "nothing was removed")
    assert tree_digest(work / "checkpoint") == staged
    (work / "notes.txt").write_text("beside it, in the work directory: not the staged checkpoint's")
    (work / "checkpoint" / "notes.txt").unlink()
    second = push(source, work, measurement_file)
    assert second.exit_code == 0, second.output
    assert (work / "notes.txt").exists() and tree_digest(source) == source_before


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
    prose = re.sub(r"^```.*?^```", "", body, flags=re.S | re.M)  # the serving block's shell comments start with # too
    assert [line for line in prose.splitlines() if line.startswith("#")] == [
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


UNREADABLE_CARDS = {
    "unclosed-flow-list": b"---\nlicense: [unclosed\n---\n# Model\n",
    "number": b"---\nlicense: 5\n---\n",
    "mapping": b"---\nlicense: {name: mit}\n---\n",
    "two-licenses": b"---\nlicense: [mit, apache-2.0]\n---\n",
    "not-an-identifier": b"---\nlicense: mit or apache\n---\n",
    "front-matter-is-a-list": b"---\n- license\n- mit\n---\n",
    "front-matter-is-text": b"---\njust words\n---\n",
    "binary": b"\xff\xfe\x00\x01binary\x80",
    "latin-1": b"---\nlicense: mit\nauthor: Jos\xe9\n---\n",
    "tab-indented-yaml": b"---\nlicense:\n\t- mit\n---\n",
    "unclosed-front-matter": b"---\nlicense: mit\n" + b"x: y\n" * 300_000,  # no closing --- within the part read
}


@pytest.mark.parametrize("content", list(UNREADABLE_CARDS.values()), ids=list(UNREADABLE_CARDS))
def test_a_source_card_whose_license_cannot_be_read_is_refused_naming_it(tmp_path, source, measurement_file, content):
    """Without --license the base model's license comes from SRC/README.md: front matter that is not YAML, not a
    mapping, not UTF-8, or a license that is not one identifier is refused by name, asking for --license."""
    (source / "README.md").write_bytes(content)
    before = tree_digest(tmp_path)
    assert_refused(push(source, tmp_path / "work", measurement_file, license_=None), "README.md", "--license")
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize(
    ("content", "license_"),
    [
        (b"---\nlicense: [apache-2.0]\n---\n", "apache-2.0"),  # a list of one license is that license
        ("\ufeff---\r\nlicense: mit\r\n---\r\n# Model\r\n".encode(), "mit"),  # a byte-order mark and CRLF line ends
        (b"---\nlicense: mit\n---\n" + b"# A very long card\n" * 200_000, "mit"),  # huge: only its head is read
    ],
    ids=["list-of-one", "bom-crlf", "huge"],
)
def test_the_license_is_read_from_the_source_card(tmp_path, source, measurement_file, content, license_):
    (source / "README.md").write_bytes(content)
    result = push(source, tmp_path / "work", measurement_file, license_=None)
    assert result.exit_code == 0, result.output
    card = ModelCard((tmp_path / "work" / "checkpoint" / "README.md").read_text())
    assert card.data.license == license_


@pytest.mark.parametrize(
    "content",
    ["# Model\n\nno front matter\n", "---\n---\n", "---\nlicense:\n---\n", "---\nlicense: []\n---\n", "---\ntags: [x]\n---\n"],
    ids=["no-front-matter", "empty", "null", "empty-list", "no-license-key"],
)
def test_a_source_card_without_a_license_asks_for_one(tmp_path, source, measurement_file, content):
    (source / "README.md").write_text(content)
    assert_refused(push(source, tmp_path / "work", measurement_file, license_=None), "--license")


def _card_is_a_directory(source: Path) -> None:
    (source / "README.md").mkdir()


def _card_links_out_of_the_source(source: Path) -> None:
    outside = source.parent / "elsewhere.md"
    outside.write_text("---\nlicense: mit\n---\n")
    (source / "README.md").symlink_to(outside)


def _card_is_a_dangling_link(source: Path) -> None:
    (source / "README.md").symlink_to(source / "missing.md")


@pytest.mark.parametrize(
    "plant", [_card_is_a_directory, _card_links_out_of_the_source, _card_is_a_dangling_link], ids=["dir", "link-out", "dangling"]
)
def test_a_source_card_that_is_not_a_file_inside_the_source_is_refused(tmp_path, source, measurement_file, plant):
    plant(source)
    before = tree_digest(tmp_path)
    assert_refused(push(source, tmp_path / "work", measurement_file, license_=None), "README.md")
    assert tree_digest(tmp_path) == before


BAD_REVISIONS = [
    "../../etc", "a..b", "/main", "main/", "-main", "a b", "a~1", "a^", "a:b", "a?", "a*", "a[0]", "a\\b", "x.lock",
    "x/y.lock", "a@{1}", "@", "a//b", ".hidden", "a/.b", "main.", "", "a\x00b", "a\nb", "a\x1bb", "a\x7fb", "a\u2028b",
]  # fmt: skip


@pytest.mark.parametrize("revision", BAD_REVISIONS)
def test_push_refuses_a_revision_git_would_not_take_before_any_work(tmp_path, source, measurement_file, revision):
    before = tree_digest(tmp_path)
    assert_refused(push(source, tmp_path / "work", measurement_file, "--revision", revision), "--revision")
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("revision", ["../../etc", "refs/pr/../../x", "a b", "", "@"])
def test_pull_refuses_a_revision_git_would_not_take(tmp_path, monkeypatch, revision):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert_refused(run_cli("pull", "acme/x", "--revision", revision), "--revision")
    assert os.listdir(tmp_path) == []


def test_git_ref_names_are_accepted():
    from hpu_fp8_loader.sources.resolve import check_revision

    for revision in ["main", "fp8", "v1.0", "refs/pr/12", "release/2024-06", "a" * 40, "feature_x+y", "naïve"]:
        assert check_revision(revision) == revision


@pytest.mark.parametrize("message", ["a\x00b", "title\x1b[31m red", "carriage\rreturn", "a\x7f", "a\u2028b", "", "  \n "])
def test_a_commit_message_with_control_characters_or_blank_is_refused(tmp_path, source, measurement_file, message):
    before = tree_digest(tmp_path)
    assert_refused(push(source, tmp_path / "work", measurement_file, "--commit-message", message), "--commit-message")
    assert tree_digest(tmp_path) == before


def test_a_commit_message_may_have_several_lines(tmp_path, source, measurement_file):
    result = push(source, tmp_path / "work", measurement_file, "--commit-message", "FP8 weights\n\n\tmeasured on gaudi2")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("field", ["dataset", "files"])
@pytest.mark.parametrize("text", ["x" * 5000, "a/" + "b" * 300 + "/c.txt"], ids=["long-name", "long-component"])
def test_provenance_too_long_to_be_a_path_is_published_as_it_is(tmp_path, source, measurement_file, field, text):
    """A provenance string is tested for being a local path (then only its base name is published): one the OS
    cannot even look up (too long) is not a local path, not a failure."""
    data = json.loads(measurement_file.read_text())
    data["provenance"][field] = [text] if field == "files" else text
    hostile = tmp_path / "long.json"
    hostile.write_text(json.dumps(data))
    result = push(source, tmp_path / "work", hostile)
    assert result.exit_code == 0, result.output


def test_an_empty_license_option_is_refused_not_replaced_by_the_cards(tmp_path, source, measurement_file):
    (source / "README.md").write_text("---\nlicense: mit\n---\n")
    before = tree_digest(tmp_path)
    assert_refused(push(source, tmp_path / "work", measurement_file, "--license", ""), "license")
    assert tree_digest(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["http://user:hf_SECRET123@127.0.0.1:9", "ftp://user:hf_SECRET123@127.0.0.1:9"])
def test_credentials_in_hf_endpoint_are_never_repeated(endpoint):
    """In a process of its own: huggingface_hub reads HF_ENDPOINT once, when it is imported."""
    cli = shutil.which("hpu-fp8", path=os.path.dirname(sys.executable))
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0"}
    done = subprocess.run([cli, "pull", "acme/model"], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 1 and "hf_SECRET123" not in done.stdout + done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "***@127.0.0.1:9" in done.stderr, done.stderr

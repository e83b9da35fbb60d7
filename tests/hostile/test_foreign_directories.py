"""A directory the tool did not write is never emptied or replaced (issue 39, items 1 and 2).

``OUT.partial`` is the tool's only when it carries the marker the tool put there as it made it; ``--force`` replaces
an ``OUT`` only when its manifest accounts for everything in it. Anything else is refused in one line naming it,
``--force`` or not, and every file in it is left as it was, with no complete-looking output beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hostile.refusal import assert_refused, left_staging, run_cli, tree_digest
from hostile.writers import STAGING_WRITERS, run_writer
from hpu_fp8_loader.io.manifest import MANIFEST_FILE, foreign_entry, write_manifest
from hpu_fp8_loader.io.writer import STAGING_MARKER


def _nothing_published(out: Path) -> None:
    """No output that looks complete: OUT absent, and no staging directory holding a manifest."""
    assert not out.exists()
    assert not (out.with_name(out.name + ".partial") / MANIFEST_FILE).exists()


@pytest.mark.parametrize("command", sorted(STAGING_WRITERS))
@pytest.mark.parametrize("force", [False, True], ids=["", "--force"])
def test_a_users_directory_at_the_staging_path_is_refused_and_kept(request, tmp_path, command, force):
    """The issue's first case: ``mkdir x.partial && echo mine > x.partial/thesis.tex`` used to be emptied, exit 0."""
    out = tmp_path / "x"
    partial = tmp_path / "x.partial"
    partial.mkdir()
    (partial / "thesis.tex").write_text("mine")
    (partial / "figures").mkdir()
    (partial / "figures" / "plot.pdf").write_bytes(b"%PDF")
    before = tree_digest(partial)
    line = assert_refused(run_writer(request, command, out, *(["--force"] if force else [])), str(partial), "did not make")
    assert STAGING_MARKER in line and "nothing in it was touched" in line
    assert tree_digest(partial) == before
    assert not out.exists()


@pytest.mark.parametrize(
    "marker",
    [
        "garbage",
        "empty",
        "another OUT's marker",
        "another format",
        "a link to a real marker",
    ],
)
def test_a_staging_marker_that_is_not_ours_for_this_out_is_refused(request, tmp_path, marker):
    out = tmp_path / "out"
    real = left_staging(tmp_path / "other")  # a true marker, of another OUT
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / "thesis.tex").write_text("mine")
    path = partial / STAGING_MARKER
    genuine = json.loads((real / STAGING_MARKER).read_text())
    if marker == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif marker == "empty":
        path.write_bytes(b"")
    elif marker == "another OUT's marker":
        shutil.copy(real / STAGING_MARKER, path)
    elif marker == "another format":
        path.write_text(json.dumps({**genuine, "out": "out", "format": "hpu-fp8-manifest"}))
    else:  # the right content, but not a regular file of the directory: anyone may link to one
        (tmp_path / "marker.json").write_text(json.dumps({**genuine, "out": "out"}))
        path.symlink_to(tmp_path / "marker.json")
    before = tree_digest(partial)
    assert_refused(run_writer(request, "synth", out), str(partial), "did not make")
    assert tree_digest(partial) == before


def test_a_staging_directory_the_tool_left_is_resumed_then_published_without_its_marker(request, tmp_path):
    out = tmp_path / "out"
    left_staging(out)
    result = run_writer(request, "convert", out)
    assert result.exit_code == 0, result.stderr
    assert not (tmp_path / "out.partial").exists()
    assert not (out / STAGING_MARKER).exists() and STAGING_MARKER not in (out / MANIFEST_FILE).read_text()
    assert run_cli("validate", "--hashes", out).exit_code == 0


def test_the_staging_directory_gets_the_permissions_mkdir_would_give(request, tmp_path):
    """It is built under mkdtemp (mode 0700) and renamed: published as it was, OUT would be private to its owner."""
    old = os.umask(0o022)
    try:
        assert run_writer(request, "synth", tmp_path / "out").exit_code == 0
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755


def _earlier_checkpoint(request, out: Path) -> Path:
    result = run_writer(request, "synth", out)
    assert result.exit_code == 0, result.stderr
    return out


# What may lie at OUT when --force is given, and the entry each refusal must name (issue 39, item 2).
def _manifest_empty(out: Path) -> None:
    (out / MANIFEST_FILE).write_bytes(b"")


def _manifest_garbage(out: Path) -> None:
    (out / MANIFEST_FILE).write_text("{not json")


def _manifest_other_format(out: Path) -> None:
    (out / MANIFEST_FILE).write_text(json.dumps({"format": "something", "files": {}}))


def _manifest_of_nothing(out: Path) -> None:
    (out / "empty-subset").mkdir()
    write_manifest(out / "empty-subset")  # a well-formed manifest of no files, beside a user's files
    shutil.move(out / "empty-subset" / MANIFEST_FILE, out / MANIFEST_FILE)
    (out / "empty-subset").rmdir()


# name -> (what is made at OUT, given a fresh directory with thesis.tex; is it an earlier checkpoint; the entry named)
FORCE_CASES = {
    "an empty manifest": (_manifest_empty, False, MANIFEST_FILE),
    "a garbage manifest": (_manifest_garbage, False, MANIFEST_FILE),
    "a manifest of another format": (_manifest_other_format, False, MANIFEST_FILE),
    "a manifest listing none of its files": (_manifest_of_nothing, False, "thesis.tex"),
    "a checkpoint with a user's file beside it": (lambda out: None, True, "thesis.tex"),
    "a checkpoint with a user's directory in it": (lambda out: (out / "notes").mkdir(), True, "notes"),
    "a checkpoint with a link in it": (lambda out: (out / "latest").symlink_to(out.parent / "elsewhere"), True, "latest"),
    "a checkpoint missing a listed file": (lambda out: (out / "generation_config.json").unlink(), True, "generation_config.json"),
    "a checkpoint whose config was edited": (
        lambda out: (out / "config.json").write_text((out / "config.json").read_text().replace("2", "3")),
        True,
        "config.json",
    ),
    "a checkpoint whose shard grew": (
        lambda out: os.truncate(
            out / "model-00001-of-00001.safetensors", (out / "model-00001-of-00001.safetensors").stat().st_size + 1
        ),
        True,
        "model-00001-of-00001.safetensors",
    ),
}
# every case with convert, and two with each other command (they share the rule: io/writer.py)
FORCE_RUNS = [("convert", case) for case in sorted(FORCE_CASES)] + [
    (command, case)
    for command in sorted(set(STAGING_WRITERS) - {"convert"})
    for case in ("an empty manifest", "a checkpoint with a user's file beside it")
]


@pytest.mark.parametrize(("command", "case"), FORCE_RUNS)
def test_force_refuses_a_directory_its_manifest_does_not_account_for(request, tmp_path, command, case):
    """The issue's second case: ``: > u/hpu_fp8_manifest.json`` made ``--force`` delete u/thesis.tex."""
    make, earlier, named = FORCE_CASES[case]
    out = tmp_path / "u"
    if earlier:
        _earlier_checkpoint(request, out)
    else:
        out.mkdir()
    if named == "thesis.tex" or not earlier:
        (out / "thesis.tex").write_text("mine")
    make(out)
    before = tree_digest(out)
    line = assert_refused(run_writer(request, command, out, "--force"), str(out), named, "--force replaces only")
    assert "nothing was removed" in line
    assert tree_digest(out) == before
    assert not (tmp_path / "u.partial" / MANIFEST_FILE).exists()


def test_force_replaces_an_empty_directory_and_an_untouched_checkpoint(request, tmp_path):
    (tmp_path / "empty").mkdir()
    assert run_writer(request, "convert", tmp_path / "empty", "--force").exit_code == 0
    out = _earlier_checkpoint(request, tmp_path / "earlier")
    assert foreign_entry(out) is None
    assert run_writer(request, "convert", out, "--force").exit_code == 0
    assert run_cli("validate", "-q", out).exit_code == 0 and foreign_entry(out) is None


def test_a_nested_checkpoints_manifest_is_accounted_for(request, tmp_path):
    """``map --all-ranks`` writes a checkpoint per rank, each with its own manifest, listed in OUT's."""
    out = tmp_path / "ranks"
    assert run_writer(request, "map --all-ranks", out).exit_code == 0
    assert f"rank0/{MANIFEST_FILE}" in json.loads((out / MANIFEST_FILE).read_text())["files"]
    assert foreign_entry(out) is None
    (out / "rank0" / "notes.txt").write_text("mine")
    assert foreign_entry(out) == f"rank0/notes.txt is not a file listed in {MANIFEST_FILE}"


# ------------------------------------------------------------------------------------ the property, over many trees

_NAMES = st.sampled_from(
    [
        "thesis.tex",
        MANIFEST_FILE,
        STAGING_MARKER,
        ".hpu_fp8_lock",
        ".hpu_fp8_progress.json",
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "notes",
    ]
) | st.text(string.ascii_letters + string.digits + "._-", min_size=1, max_size=12).filter(lambda n: n not in (".", ".."))
_CONTENT = st.sampled_from(
    [b"", b"mine", b"{}", b'{"format": "hpu-fp8-manifest", "version": 1, "files": {}}', b'{"format": "hpu-fp8-staging"}']
) | st.binary(max_size=64)
# a tree: name -> file content, or a subtree (one level deeper at most)
_TREE = st.dictionaries(_NAMES, _CONTENT | st.dictionaries(_NAMES, _CONTENT, max_size=3), max_size=5)


def _plant(root: Path, tree: dict) -> None:
    root.mkdir()
    for name, content in tree.items():
        if isinstance(content, dict):
            _plant(root / name, content)
        else:
            (root / name).write_bytes(content)


def _users_files(root: Path) -> dict[str, str]:
    return {name: digest for name, digest in tree_digest(root).items() if digest != "dir"}


@pytest.mark.parametrize("command", ["synth", pytest.param("convert", marks=pytest.mark.slow)])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    at_out=st.none() | _TREE,
    at_partial=st.none() | _TREE,
    beside=_TREE,
    force=st.booleans(),
)
def test_no_file_the_tool_did_not_write_is_ever_removed(request, tmp_path_factory, command, at_out, at_partial, beside, force):
    """Directories of users' files generated at OUT, at OUT.partial and beside them (names of the tool's own files
    among theirs, manifests and markers of any content): whatever the tool answers, every one of those files is still
    there with its bytes; it publishes only where OUT was absent or an empty directory and OUT.partial absent."""
    place = tmp_path_factory.mktemp("trees")
    out, partial = place / "out", place / "out.partial"
    for root, tree in ((out, at_out), (partial, at_partial)):
        if tree is not None:
            _plant(root, tree)
    for name, content in beside.items():
        target = place / f"beside-{name}"
        _plant(target, content) if isinstance(content, dict) else target.write_bytes(content)
    planted = {root: _users_files(root) for root in (out, partial)} | {place: _users_files(place)}
    result = run_writer(request, command, out, *(["--force"] if force else []))
    for name, digest in planted[place].items():
        if not name.startswith(("out/", "out.partial/")):
            assert tree_digest(place).get(name) == digest, f"{name} beside OUT was changed or removed"
    for root in (out, partial):
        left = _users_files(root) if root.exists() else {}
        for name, digest in planted[root].items():
            assert left.get(name) == digest, f"{root.name}/{name} was removed or changed (exit {result.exit_code})"
    may_publish = (at_out is None or (at_out == {} and force)) and at_partial is None
    assert (result.exit_code == 0) == may_publish, result.stderr
    event("published" if result.exit_code == 0 else "refused")
    if result.exit_code == 0:
        assert foreign_entry(out) is None  # what the command wrote, whole, and nothing else
    shutil.rmtree(place)

"""Nothing leaked through a link, nothing written through one (issue 28, items 1-3).

A source laid out like a Hugging Face cache snapshot outside the real cache must not get its links into
``../../blobs`` followed (they may lead to ``/proc/self/environ`` or ``$HF_HOME/token``); a link or FIFO planted
under a fixed name in a staging or work directory is never written through, read as ours, or waited on; and an
OUT that appears while a command runs is never deleted at publish without ``--force``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.hub_cache import add_to_cache

from hostile.refusal import assert_refused, left_staging, run_cli, tree_digest
from hostile.writers import STAGING_WRITERS, run_writer
from hpu_fp8_loader.io import writer
from hpu_fp8_loader.io.fingerprint import file_fingerprint
from hpu_fp8_loader.io.manifest import write_manifest

SECRET = "hf_secret_do_not_leak_0123456789"
CLI = str(Path(sys.executable).with_name("hpu-fp8"))


def _all_bytes(root: Path) -> bytes:
    """Every byte of every regular file under ``root``, links not followed: where a token would be if it leaked."""
    if not root.exists():
        return b""
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink())


@pytest.fixture
def fake_home(tmp_path):
    """A stand-in for $HF_HOME holding a token file, as `hf auth login` leaves it."""
    home = tmp_path / "hf-home"
    home.mkdir()
    (home / "token").write_text(SECRET)
    return home


def cache_shaped(tmp_path: Path, source: Path, blobs: Path, link_to: str) -> Path:
    """``source`` copied to ``x/snapshots/model`` with ``x/blobs`` a link to ``blobs`` and its tokenizer side file
    ``vocab.txt`` a link to ``../../blobs/<link_to>``: shaped like a cache snapshot, but not in the cache."""
    root = tmp_path / "x"
    snapshot = root / "snapshots" / "model"
    shutil.copytree(source, snapshot)
    (root / "blobs").symlink_to(blobs)
    (snapshot / "vocab.txt").symlink_to(f"../../blobs/{link_to}")
    return snapshot


BLOB_TARGETS = {"proc-self-environ": ("/proc/self", "environ"), "hf-home-token": (None, "token")}


@pytest.mark.parametrize("target", sorted(BLOB_TARGETS))
def test_convert_of_a_cache_shaped_source_outside_the_cache_copies_no_secret(
    tmp_path, source_factory, fake_home, measurements, target
):
    blobs, name = BLOB_TARGETS[target]
    snapshot = cache_shaped(tmp_path, source_factory("qwen2-tiny"), Path(blobs) if blobs else fake_home, name)
    out = tmp_path / "out"
    env = {"HF_TOKEN": SECRET, "HF_HOME": str(fake_home), "HF_HUB_CACHE": str(tmp_path / "real-cache")}
    assert_refused(run_cli("convert", snapshot, out, "--measurements", measurements, "-q", env=env), "vocab.txt")
    assert SECRET.encode() not in _all_bytes(tmp_path / "out") + _all_bytes(tmp_path / "out.partial")
    assert not out.exists()


@pytest.mark.slow
def test_convert_in_a_process_whose_environment_holds_the_token_leaks_nothing(tmp_path, source_factory, measurements):
    """The issue's exact run: HF_TOKEN in the process's own environment, read back through /proc/self/environ."""
    snapshot = cache_shaped(tmp_path, source_factory("qwen2-tiny"), Path("/proc/self"), "environ")
    out = tmp_path / "out"
    env = {**os.environ, "HF_TOKEN": SECRET, "HF_HUB_CACHE": str(tmp_path / "real-cache")}
    done = subprocess.run(
        [CLI, "convert", str(snapshot), str(out), "--measurements", str(measurements), "-q"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "vocab.txt" in done.stderr, done.stderr
    assert SECRET not in done.stderr + done.stdout
    assert SECRET.encode() not in _all_bytes(tmp_path)  # nowhere: not in OUT, its staging, or anything else written


def test_validate_hashes_refuses_a_checkpoint_whose_manifest_lists_a_cache_shaped_link(tmp_path, spec_factory, fake_home):
    """An OUT made before the fix (the token copied in) must not be called valid: here its vocab.txt links to the
    token through a fake blob store, and the manifest lists the token's very bytes."""
    snapshot = cache_shaped(tmp_path, spec_factory("qwen2-tiny"), fake_home, "token")
    write_manifest(snapshot)  # records vocab.txt with the sha256 of the token, as a copied file would be
    result = run_cli("validate", "--hashes", snapshot, env={"HF_HUB_CACHE": str(tmp_path / "real-cache")})
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "vocab.txt" in result.output and SECRET not in result.output


def test_push_dry_run_of_a_cache_shaped_source_stages_no_secret(tmp_path, source_factory, fake_home, measurements):
    snapshot = cache_shaped(tmp_path, source_factory("qwen2-tiny"), fake_home, "token")
    work = tmp_path / "work"
    args = ["push", snapshot, "--repo-id", "acme/x", "--base-model", "acme/src", "--license", "mit"]
    args += ["--measurements", measurements, "--dry-run", "--skip-eval", "--work-dir", work]
    env = {"HF_TOKEN": SECRET, "HF_HOME": str(fake_home), "HF_HUB_CACHE": str(tmp_path / "real-cache")}
    assert_refused(run_cli(*args, env=env), "vocab.txt")
    assert SECRET.encode() not in _all_bytes(work)


def test_a_resume_trusts_a_blob_name_only_in_the_real_cache(tmp_path, source_factory, monkeypatch):
    """The resume fingerprint took any ``.../blobs/<hex>`` link target's name as a hash of its content: a
    cache-shaped source outside the cache, its blob rewritten with other weights, would have resumed from shards
    of the old ones. Now only the cache's own links name their content; the rest is sampled."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    source = source_factory("qwen2-tiny")
    shard = next(p for p in sorted(source.iterdir()) if p.suffix == ".safetensors")
    snapshot = add_to_cache(tmp_path / "cache", "acme/qwen", source)
    assert file_fingerprint(snapshot / shard.name) == "blob:" + hashlib.sha256(shard.read_bytes()).hexdigest()
    shaped = tmp_path / "x" / "snapshots" / "model"
    shaped.mkdir(parents=True)
    (tmp_path / "x" / "blobs").mkdir()
    blob = tmp_path / "x" / "blobs" / ("ab" * 32)
    blob.write_bytes(shard.read_bytes())
    (shaped / shard.name).symlink_to(f"../../blobs/{blob.name}")
    before = file_fingerprint(shaped / shard.name)
    assert not before.startswith("blob:")
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # other weights, same size and the same blob name (the tail is always sampled)
    blob.write_bytes(bytes(data))
    assert file_fingerprint(shaped / shard.name) != before


# ---------------------------------------------------------------------------------------------- item 2: planted names


@pytest.mark.parametrize("command", sorted(STAGING_WRITERS))
def test_a_lock_note_planted_as_a_link_in_staging_is_replaced_never_written_through(request, tmp_path, measurements, command):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out"
    partial = left_staging(out)
    (partial / ".hpu_fp8_lock").unlink()
    (partial / ".hpu_fp8_lock").symlink_to(victim)
    result = run_writer(request, command, out)
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "keep me"
    assert (out / "hpu_fp8_manifest.json").is_file() and not os.path.lexists(out / ".hpu_fp8_lock")


@pytest.mark.parametrize("command", sorted(STAGING_WRITERS))
def test_a_planted_link_or_fifo_in_staging_is_never_published_or_followed(request, tmp_path, measurements, command):
    """Whatever a staging directory held that this run did not write is gone before publishing: a link to a secret
    (it would be copied into OUT and hashed into its manifest), a FIFO (opening it to fsync would block)."""
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    out = tmp_path / "out"
    partial = left_staging(out)
    (partial / "vocab.txt").symlink_to(secret)
    os.mkfifo(partial / "notes.fifo")
    result = run_writer(request, command, out)
    assert result.exit_code == 0, result.output
    assert SECRET.encode() not in _all_bytes(out)
    assert not os.path.lexists(out / "notes.fifo") and not (out / "vocab.txt").is_symlink()
    assert secret.read_text() == SECRET


def test_a_fifo_planted_as_the_resume_journal_does_not_hang_convert(tmp_path, src, measurements):
    out = tmp_path / "out"
    os.mkfifo(left_staging(out) / ".hpu_fp8_progress.json")
    result = run_cli(
        "convert", src, out, "--measurements", measurements, "-q", "--workers", "1"
    )  # before the fix: blocked forever
    assert result.exit_code == 0, result.output
    assert run_cli("validate", "-q", out).exit_code == 0


def test_a_journal_planted_as_a_link_is_replaced_and_its_target_kept(tmp_path, src, measurements):
    victim = tmp_path / "victim.json"
    victim.write_text('{"fingerprint": "not this one", "shards": {}}')
    (left_staging(tmp_path / "out") / ".hpu_fp8_progress.json").symlink_to(victim)
    result = run_cli("convert", src, tmp_path / "out", "--measurements", measurements, "-q", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert victim.read_text() == '{"fingerprint": "not this one", "shards": {}}'


def test_a_planted_shard_link_under_a_journal_that_vouches_for_it_is_not_reused(tmp_path, src, measurements):
    """A journal with this conversion's very fingerprint naming a shard that is a link to a file of the same
    sha256: reusing it would publish a link to the user's file. It is made again instead."""
    out = tmp_path / "out"
    assert (
        run_cli("convert", src, out, "--measurements", measurements, "-q", "--max-shard-size", "40KB", "--workers", "1").exit_code
        == 0
    )
    kept = tmp_path / "kept"
    shutil.copytree(out, kept)
    partial = left_staging(tmp_path / "again")
    first = sorted(p.name for p in kept.glob("*.safetensors"))[0]
    (partial / first).symlink_to(kept / first)

    staged: dict[str, str] = {}
    original = writer.finish_output

    def remember(staging, *args, **kwargs):
        staged.update({p.name: "link" if p.is_symlink() else "file" for p in staging.iterdir()})
        return original(staging, *args, **kwargs)

    import hpu_fp8_loader.conversion.convert as convert_module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(convert_module, "finish_output", remember)
        patch.setattr(convert_module, "reusable_shards", _vouching(convert_module.reusable_shards, kept, first))
        result = run_cli(
            "convert", src, tmp_path / "again", "--measurements", measurements, "-q", "--max-shard-size", "40KB", "--workers", "1"
        )
    assert result.exit_code == 0, result.output
    assert staged[first] == "file" and not (tmp_path / "again" / first).is_symlink()
    assert (kept / first).read_bytes() == (tmp_path / "again" / first).read_bytes()


def _vouching(reusable_shards, kept: Path, shard: str):
    """``reusable_shards`` after a journal was planted that records ``shard`` with the fingerprint of this very
    conversion and the sha256 of the file the planted link reaches."""
    import json

    from hpu_fp8_loader.io.manifest import file_digest

    def planted(staging, fingerprint, shards):
        size, sha = file_digest(kept / shard)
        entry = {"fingerprint": fingerprint, "shards": {shard: {"size": size, "sha256": sha}}}
        (staging / ".hpu_fp8_progress.json").write_text(json.dumps(entry))
        return reusable_shards(staging, fingerprint, shards)

    return planted


# ------------------------------------------------------------------------------------------- item 2: markers


def test_demo_never_writes_its_marker_through_a_planted_link_nor_trusts_one(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    (work / ".hpu-fp8-demo").symlink_to(victim)  # a link to any file must not pass for the demo's marker
    assert_refused(run_cli("demo", "--out", work), str(work), "was not made by the demo", "nothing was removed")
    assert (work / "notes.txt").read_text() == "mine" and victim.read_text() == "keep me"
    (work / ".hpu-fp8-demo").unlink()
    (work / ".hpu-fp8-demo").write_text("some file of the user's that happens to have this name\n")
    assert_refused(run_cli("demo", "--out", work), str(work), "was not made by the demo", "nothing was removed")
    assert (work / "notes.txt").read_text() == "mine"


PUSH_MARKERS = {
    "a link to a file": lambda work, victim: (work / ".hpu-fp8-push").symlink_to(victim),
    "a link to a marker-like file": lambda work, victim: (work / ".hpu-fp8-push").symlink_to(_marker_copy(work)),
    "a file that is not ours": lambda work, victim: (work / ".hpu-fp8-push").write_text("mine\n"),
    "a FIFO": lambda work, victim: os.mkfifo(work / ".hpu-fp8-push"),
}


def _marker_copy(work: Path) -> Path:
    """A regular file holding exactly what push writes into its marker, elsewhere: a link to it is still no marker."""
    from hpu_fp8_loader.hub import publish

    copy = work.parent / "marker-copy"
    copy.write_bytes(publish._MARKER_TEXT)
    return copy


@pytest.mark.parametrize("planted", sorted(PUSH_MARKERS))
def test_a_planted_push_marker_never_authorises_replacing_the_work_dirs_checkpoint(tmp_path, src, measurements, planted):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    work = tmp_path / "work"
    (work / "checkpoint").mkdir(parents=True)
    (work / "checkpoint" / "thesis.tex").write_text("years of work")
    PUSH_MARKERS[planted](work, victim)
    before = tree_digest(tmp_path / "work") if planted != "a FIFO" else None
    args = ["push", src, "--repo-id", "acme/x", "--base-model", "acme/src", "--license", "mit"]
    args += ["--measurements", measurements, "--dry-run", "--skip-eval", "--work-dir", work]
    assert_refused(run_cli(*args), str(work / "checkpoint"), "not staged by hpu-fp8 push")
    assert (work / "checkpoint" / "thesis.tex").read_text() == "years of work" and victim.read_text() == "keep me"
    if before is not None:
        assert tree_digest(tmp_path / "work") == before


def test_push_replaces_a_planted_marker_link_instead_of_writing_through_it(tmp_path, src, measurements):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    work = tmp_path / "work"
    work.mkdir()
    (work / ".hpu-fp8-push").symlink_to(victim)
    args = ["push", src, "--repo-id", "acme/x", "--base-model", "acme/src", "--license", "mit"]
    args += ["--measurements", measurements, "--dry-run", "--skip-eval", "--work-dir", work]
    result = run_cli(*args)
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "keep me" and not (work / ".hpu-fp8-push").is_symlink()
    assert run_cli(*args).exit_code == 0  # its own marker (a regular file it wrote) lets the next push replace it


# --------------------------------------------------------------------------- item 3: an OUT made while a command ran


def _make_out_while_running(monkeypatch, out: Path, hook: str = "hpu_fp8_loader.io.writer._sync_tree") -> None:
    """Make ``out`` (a user's directory with a file) just before staging is published: as if the user made it
    while the command ran."""
    import importlib

    module_name, _, name = hook.rpartition(".")
    module = importlib.import_module(module_name)
    original = getattr(module, name)

    def then_make(path, *args, **kwargs):
        if Path(path).name.lstrip(".").split(".")[0] == out.name:  # this command's OUT or its staging, not a fixture's
            out.mkdir(exist_ok=True)
            (out / "thesis.tex").write_text("years of work")
        return original(path, *args, **kwargs)

    monkeypatch.setattr(module, name, then_make)


@pytest.mark.parametrize("command", sorted(STAGING_WRITERS))
def test_an_out_that_appears_while_a_command_runs_is_never_deleted_without_force(
    request, tmp_path, measurements, monkeypatch, command
):
    out = tmp_path / "out"
    _make_out_while_running(monkeypatch, out)
    result = run_writer(request, command, out)
    assert_refused(result, str(out), "appeared while this command ran")
    assert (out / "thesis.tex").read_text() == "years of work" and sorted(p.name for p in out.iterdir()) == ["thesis.tex"]
    assert (tmp_path / "out.partial").is_dir()  # the finished work is kept for the same command to run again


def test_convert_refused_at_publish_resumes_once_the_out_is_moved_away(tmp_path, src, measurements, monkeypatch):
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        _make_out_while_running(patch, out, "hpu_fp8_loader.conversion.convert.check_publishable")
        assert_refused(run_cli("convert", src, out, "--measurements", measurements, "-q", "--workers", "1"), str(out), "appeared")
    assert (out / "thesis.tex").read_text() == "years of work"
    out.rename(tmp_path / "moved")
    result = run_cli("convert", src, out, "--measurements", measurements, "--workers", "1")
    assert result.exit_code == 0, result.output
    assert "resum" in result.output and run_cli("validate", "-q", out).exit_code == 0


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        ("hpu_fp8_loader.conversion.convert.check_publishable", "--force replaces only"),  # before the last check
        ("hpu_fp8_loader.io.writer._sync_tree", "appeared while this command ran"),  # after it: the rename refuses
    ],
    ids=["before-the-check", "after-the-check"],
)
def test_with_force_an_out_that_appears_is_replaced_only_if_this_tool_wrote_it(
    tmp_path, src, measurements, monkeypatch, hook, message
):
    out = tmp_path / "out"
    _make_out_while_running(monkeypatch, out, hook)
    result = run_cli("convert", src, out, "--measurements", measurements, "-q", "--force", "--workers", "1")
    assert_refused(result, str(out), message)
    assert (out / "thesis.tex").read_text() == "years of work"


@pytest.mark.slow  # the report's plots take seconds
def test_calibrate_report_that_appears_while_it_runs_is_kept(tmp_path, src, monkeypatch):
    report = tmp_path / "report"
    _make_out_while_running(monkeypatch, report)
    result = run_cli("calibrate", src, "-o", tmp_path / "m2.json", "--report", report, "--samples", "2", "--seq-len", "16")
    assert_refused(result, str(report))
    assert sorted(p.name for p in report.iterdir()) == ["thesis.tex"]

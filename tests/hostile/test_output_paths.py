"""Where a command writes: never over its source, never through a planted link, never over what it did not
write, never two writers in one staging directory, and only options that make sense (issue 14, items 3-6, 16)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.cli.group import interrupted_line
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements


@pytest.fixture
def src(tmp_path, source_factory):
    """A private BF16 source (qwen2-tiny) with its measurement file beside it."""
    root = tmp_path / "project" / "src"
    shutil.copytree(source_factory("qwen2-tiny"), root)
    write_measurements(tmp_path / "m.json", synthetic_measurements(preset_config("qwen2-tiny")))
    return root


def convert_args(src, out, tmp_path, *extra):
    return ("convert", src, out, "--measurements", tmp_path / "m.json", "-q", *extra)


# Every command that writes a checkpoint directory from a source, as (argv builder, fixture it reads).
WRITERS = {
    "convert": (lambda s, o, t: convert_args(s, o, t), "src"),
    "export-legacy": (lambda s, o, t: ("export-legacy", s, o), "ckpt"),
    "retarget": (lambda s, o, t: ("retarget", s, o, "--target", "gaudi3"), "ckpt"),
    "map --all-ranks": (lambda s, o, t: ("map", s, "--all-ranks", "--tp", "1", "-o", o), "ckpt"),
}


def _overlapping_outs(source):
    return {
        "OUT is SRC": (source, "it is the source"),
        "OUT inside SRC": (source / "fp8", "inside the source"),
        "OUT contains SRC": (source.parent, "contains the source"),
    }


@pytest.mark.parametrize("command", sorted(WRITERS))
@pytest.mark.parametrize("overlap", ["OUT is SRC", "OUT inside SRC", "OUT contains SRC"])
@pytest.mark.parametrize("force", [False, True])
def test_an_output_overlapping_the_source_is_refused_and_the_source_survives(request, tmp_path, command, overlap, force):
    build, fixture = WRITERS[command]
    source = request.getfixturevalue(fixture)
    if fixture == "ckpt":
        request.getfixturevalue("src")  # the measurement file, for uniform argv
    out, reason = _overlapping_outs(source)[overlap]
    before = tree_digest(source.parent)
    argv = build(source, out, tmp_path) + (("--force",) if force else ())
    assert_refused(run_cli(*argv), str(out), reason)
    assert tree_digest(source.parent) == before


@pytest.mark.parametrize("command", sorted(WRITERS))
@pytest.mark.parametrize("planted", ["link to a directory", "regular file"])
def test_a_planted_staging_path_is_refused_and_never_written_through(request, tmp_path, command, planted):
    build, fixture = WRITERS[command]
    source = request.getfixturevalue(fixture)
    request.getfixturevalue("src")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"
    if planted == "regular file":
        partial.write_text("keep me too")
    else:
        partial.symlink_to(victim)
    before = tree_digest(tmp_path / "victim") | {"partial": partial.read_text() if planted == "regular file" else ""}
    assert_refused(run_cli(*build(source, out, tmp_path)), "out.partial", "staging path")
    assert not out.exists()
    after = tree_digest(tmp_path / "victim") | {"partial": partial.read_text() if planted == "regular file" else ""}
    assert after == before


@pytest.mark.slow
def test_an_output_reached_through_a_linked_directory_is_published(tmp_path, src):
    """OUT's own directory may be a link a user made (it is not a planted staging path): the final fsync of
    that directory used to refuse to follow it and report a failure after OUT was already in place."""
    (tmp_path / "real").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    result = run_cli(*convert_args(src, tmp_path / "linked" / "out", tmp_path))
    assert result.exit_code == 0, result.stderr
    assert run_cli("validate", "-q", tmp_path / "real" / "out").exit_code == 0


def test_a_planted_staging_link_is_refused_by_synth(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    (tmp_path / "out.partial").symlink_to(victim)
    assert_refused(run_cli("synth", tmp_path / "out", "--preset", "qwen2-tiny", "-q"), "out.partial")
    assert (victim / "precious.txt").read_text() == "keep me" and not (tmp_path / "out").exists()


def test_map_to_a_file_never_writes_through_a_planted_partial_link(tmp_path, ckpt):
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"keep me")
    out = tmp_path / "rank0.safetensors"
    out.with_name(out.name + ".partial").symlink_to(victim)
    result = run_cli("map", ckpt, "-o", out)
    assert result.exit_code == 0, result.stderr
    assert victim.read_bytes() == b"keep me"
    with safe_open(out, "np") as rank_file:  # the library FastDeploy reads with
        held = rank_file.keys()
    assert any(name.endswith("qkv_proj.weight_scale") for name in held)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "project",
        "rank0.safetensors",
        "rank0.safetensors.partial",
        "victim.bin",
    ]


def test_map_to_a_file_refuses_an_existing_one_and_replaces_a_link_not_its_target(tmp_path, ckpt):
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"keep me")
    out = tmp_path / "rank0.safetensors"
    out.symlink_to(victim)
    assert_refused(run_cli("map", ckpt, "-o", out), str(out), "--force")
    assert run_cli("map", ckpt, "-o", out, "--force").exit_code == 0
    assert victim.read_bytes() == b"keep me" and not out.is_symlink() and out.stat().st_size > 1000


@pytest.mark.slow
def test_map_to_a_file_over_the_file_size_limit_names_that_file_and_leaves_nothing(tmp_path, ckpt):
    out = tmp_path / "rank0.safetensors"
    cli = shutil.which("hpu-fp8", path=os.path.dirname(sys.executable))
    done = subprocess.run(
        [cli, "map", str(ckpt), "-o", str(out)],
        capture_output=True,
        text=True,
        check=False,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000)),
    )
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"hpu-fp8: error: {out}: writing failed") and "resume" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]


def test_map_refuses_a_rank_file_inside_the_checkpoint(tmp_path, ckpt):
    before = tree_digest(ckpt)
    assert_refused(run_cli("map", ckpt, "-o", ckpt / "rank0.safetensors"), "inside the source")
    assert tree_digest(ckpt) == before


def test_pre_sharded_ranks_can_be_replaced_with_force(tmp_path, ckpt):
    out = tmp_path / "ranks"
    assert run_cli("map", ckpt, "--all-ranks", "--tp", "2", "-o", out).exit_code == 0
    assert_refused(run_cli("map", ckpt, "--all-ranks", "--tp", "2", "-o", out), str(out), "--force")
    result = run_cli("map", ckpt, "--all-ranks", "--tp", "1", "-o", out, "--force")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "hpu_fp8_manifest.json", "rank0"]


@pytest.mark.parametrize(
    "existing",
    ["a user's directory", "a regular file", "a link to a user's directory"],
)
def test_force_replaces_only_a_checkpoint_this_tool_wrote(tmp_path, src, existing):
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    out = tmp_path / "out"
    if existing == "a user's directory":
        shutil.copytree(user, out)
    elif existing == "a regular file":
        out.write_text("a file")
    else:
        out.symlink_to(user)
    before = tree_digest(tmp_path / "user"), tree_digest(out) if not out.is_symlink() else str(out.readlink())
    assert_refused(run_cli(*convert_args(src, out, tmp_path, "--force")), str(out), "--force replaces only")
    after = tree_digest(tmp_path / "user"), tree_digest(out) if not out.is_symlink() else str(out.readlink())
    assert after == before
    assert not (tmp_path / "out.partial").exists() or not any(
        p.suffix == ".safetensors" for p in (tmp_path / "out.partial").iterdir()
    )


@pytest.mark.slow
def test_force_replaces_an_earlier_checkpoint_and_leaves_a_users_out_replaced_alone(tmp_path, src):
    out = tmp_path / "out"
    assert run_cli(*convert_args(src, out, tmp_path)).exit_code == 0
    (tmp_path / "out.replaced").mkdir()
    (tmp_path / "out.replaced" / "mine.txt").write_text("not the tool's")
    (out / "notes.txt").write_text("a user's, put beside the first run's files")
    before = tree_digest(out)
    assert_refused(run_cli(*convert_args(src, out, tmp_path, "--force")), str(out), "notes.txt is not a file listed")
    assert tree_digest(out) == before  # a user's file makes the directory theirs: nothing of it goes
    (out / "notes.txt").unlink()
    result = run_cli(*convert_args(src, out, tmp_path, "--force"))
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "out.replaced" / "mine.txt").read_text() == "not the tool's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "out", "out.replaced", "project"]
    assert run_cli("validate", "-q", out).exit_code == 0


def _hold_staging_lock(out) -> subprocess.Popen:
    """Another process that prepared OUT's staging directory and keeps it locked, as a running convert does."""
    code = (
        "import sys, time; from hpu_fp8_loader.io.writer import prepare_output_dir; "
        "prepare_output_dir(sys.argv[1]); print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


@pytest.mark.slow
def test_a_second_run_on_the_same_output_is_refused_naming_the_holder_then_runs_once_it_is_gone(tmp_path, src):
    out = tmp_path / "out"
    holder = _hold_staging_lock(out)
    try:
        line = assert_refused(run_cli(*convert_args(src, out, tmp_path)), str(out), "another hpu-fp8 run", f"pid {holder.pid}")
        assert "wait for it" in line
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    result = run_cli(*convert_args(src, out, tmp_path))  # the lock died with its process: no stale lock
    assert result.exit_code == 0, result.stderr
    assert not (out / ".hpu_fp8_lock").exists() and run_cli("validate", out).exit_code == 0


@pytest.mark.slow
def test_an_output_name_that_is_not_utf8_converts(tmp_path, src):
    """A path of bytes that are no UTF-8 (legal on Linux) used to end in a UnicodeEncodeError traceback."""
    out = os.fsencode(tmp_path) + b"/out-\xff"
    cli = os.fsencode(shutil.which("hpu-fp8", path=os.path.dirname(sys.executable)))
    argv = [cli, b"convert", os.fsencode(src), out, b"--measurements", os.fsencode(tmp_path / "m.json"), b"-q"]
    done = subprocess.run(argv, capture_output=True, check=False)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr
    assert run_cli("validate", os.fsdecode(out)).exit_code == 0


@pytest.mark.parametrize("size", ["inf", "nan", "0", "-5GB", "0.4", "5XB", "", "1e400"])
def test_a_nonsense_shard_size_is_a_usage_error(tmp_path, src, size):
    assert_refused(run_cli(*convert_args(src, tmp_path / "out", tmp_path, "--max-shard-size", size)), "--max-shard-size", code=2)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("workers", ["0", "-1", "two"])
def test_a_nonsense_worker_count_is_a_usage_error(tmp_path, src, workers):
    assert_refused(run_cli(*convert_args(src, tmp_path / "out", tmp_path, "--workers", workers)), "--workers", code=2)


def test_demo_refuses_to_replace_a_directory_it_did_not_make(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    assert_refused(run_cli("demo", "--out", work), str(work), "was not made by the demo", "nothing was removed")
    assert (work / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("where", ["the shipped models", "around the package", "the current directory", "the home directory"])
def test_demo_never_deletes_its_own_models_the_working_or_the_home_directory(tmp_path, monkeypatch, where):
    package = tmp_path / "site" / "hpu_fp8_loader"  # stands in for the installed package: a broken check must not
    (package / "tiny_models" / "qwen2-bytes").mkdir(parents=True)  # delete the real one while this test runs
    (package / "tiny_models" / "qwen2-bytes" / "config.json").write_text("{}")
    monkeypatch.setattr("hpu_fp8_loader.cli.demo._PACKAGE", package)
    home = tmp_path / "home"
    (home / "project").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home / "project")
    out = {
        "the shipped models": package / "tiny_models",
        "around the package": package.parent,
        "the current directory": home / "project",
        "the home directory": home,
    }[where]
    (out / ".hpu-fp8-demo").write_bytes(b"made by hpu-fp8 demo; replaced on each run\n")  # even the demo's marker
    before = tree_digest(tmp_path)
    assert_refused(run_cli("demo", "--out", out), str(out))
    assert tree_digest(tmp_path) == before


def _running_in_group(group: int) -> list[int]:
    """Processes of a process group that still run (zombies excluded: this container's init does not reap)."""
    running = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_bytes().rpartition(b")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != b"Z":
            running.append(int(stat.parent.name))
    return running


# Big enough (~40 MB of BF16) that a signal lands while the workers convert, even on a loaded CI machine.
SLOW = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 6}


@pytest.fixture(scope="module")
def slow_src(tmp_path_factory):
    root = tmp_path_factory.mktemp("slow")
    synthesize(root / "src", preset_config("qwen2-tiny", SLOW), "paddle", seed=3, max_shard_bytes=8_000_000)
    write_measurements(root / "m.json", synthetic_measurements(preset_config("qwen2-tiny", SLOW)))
    return root


def _start_convert(slow_src, out) -> subprocess.Popen:
    cli = shutil.which("hpu-fp8", path=os.path.dirname(sys.executable))
    argv = [
        "convert",
        slow_src / "src",
        out,
        "--measurements",
        slow_src / "m.json",
        "-q",
        "--workers",
        "2",
        "--max-shard-size",
        "1MB",
    ]
    return subprocess.Popen(
        [cli, *map(str, argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # a terminal's Ctrl-C raises KeyboardInterrupt; a test run in the background inherits SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for_first_shard(process: subprocess.Popen, out: Path) -> None:
    """Until the journal records a finished shard: the workers are converting, the output is unfinished."""
    journal = out.with_name(out.name + ".partial") / ".hpu_fp8_progress.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if json.loads(journal.read_text())["shards"]:
                return
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.002)
    pytest.fail("the conversion finished (or hung) before a shard was recorded; make SLOW larger")


@pytest.mark.slow
def test_two_real_converts_to_one_output_one_refused_the_other_publishes_a_sound_checkpoint(tmp_path, slow_src):
    """The race the issue measured (6 of 20 corrupt): both started for real, the second while the first writes."""
    out = tmp_path / "out"
    first = _start_convert(slow_src, out)
    _wait_for_first_shard(first, out)
    os.killpg(first.pid, signal.SIGSTOP)  # held mid-write, so the second surely meets it however slow its start
    try:
        second = _start_convert(slow_src, out)
        _, second_err = second.communicate(timeout=60)
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    _, first_err = first.communicate(timeout=120)
    assert first.returncode == 0, first_err
    assert second.returncode == 1 and second_err.count("\n") == 1, second_err
    assert f"pid {first.pid}" in second_err and "another hpu-fp8 run is writing it" in second_err
    assert run_cli("validate", "--hashes", out).exit_code == 0


def _worker_pids(process: subprocess.Popen) -> list[int]:
    """The convert's worker processes: children of its forkserver, itself a child of the convert."""
    group = _running_in_group(process.pid)
    parents = {}
    for pid in group:
        try:
            parents[pid] = int(Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[1])
        except (OSError, ValueError):
            continue
    return [pid for pid, parent in parents.items() if parent != process.pid and parent in parents]


@pytest.mark.slow
def test_ctrl_c_mid_convert_is_one_line_and_the_same_command_resumes(tmp_path, slow_src):
    out = tmp_path / "out"
    process = _start_convert(slow_src, out)
    _wait_for_first_shard(process, out)
    os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert [line for line in stderr.splitlines() if line.strip()] == [f"hpu-fp8: error: {interrupted_line('convert')}"]
    assert "resume" in interrupted_line("convert")
    assert not out.exists()
    result = run_cli("convert", slow_src / "src", out, "--measurements", slow_src / "m.json", "-q", "--max-shard-size", "1MB")
    assert result.exit_code == 0, result.stderr
    assert "resumed" in result.stdout and run_cli("validate", out).exit_code == 0


@pytest.mark.slow
def test_a_worker_killed_mid_convert_is_one_line_naming_the_tensor(tmp_path, slow_src):
    out = tmp_path / "out"
    process = _start_convert(slow_src, out)
    _wait_for_first_shard(process, out)
    os.kill(_worker_pids(process)[0], signal.SIGKILL)  # what the out-of-memory killer does
    _, stderr = process.communicate(timeout=30)
    if process.returncode == 0:
        pytest.fail("the conversion finished before the worker was killed; make the source larger")
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert (
        lines[0].startswith("hpu-fp8: error: a worker process died while converting the tensors of ")
        and "run the same command again" in lines[0]
    )
    assert not out.exists()


@pytest.mark.slow
def test_a_source_truncated_mid_convert_is_one_line_naming_the_file(tmp_path, slow_src):
    source = tmp_path / "src"
    shutil.copytree(slow_src / "src", source)
    shutil.copy(slow_src / "m.json", tmp_path / "m.json")
    out = tmp_path / "out"
    process = _start_convert(tmp_path, out)
    _wait_for_first_shard(process, out)
    for shard in source.glob("*.safetensors"):
        os.truncate(shard, 5000)
    _, stderr = process.communicate(timeout=30)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert process.returncode == 1 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert ".safetensors" in lines[0] and "truncated" in lines[0]
    assert not out.exists()


@pytest.mark.slow
def test_an_interrupted_converts_workers_die_with_it_and_release_the_callers_pipes(tmp_path, slow_src):
    """kill -9 of convert: no worker survives holding memory or the caller's stdout/stderr."""
    out = tmp_path / "out"
    process = _start_convert(slow_src, out)
    _wait_for_first_shard(process, out)
    assert _worker_pids(process)
    process.kill()
    process.communicate(timeout=20)  # end-of-file on both pipes: no orphan holds them
    deadline = time.monotonic() + 10
    while _running_in_group(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running_in_group(process.pid) == [], "processes of the killed convert are still running"

"""kill -9 while `convert --workers 2` starts its workers: one line naming what died, nothing published, and the same
command resumes; and nothing the helper processes print reaches the caller's stderr.

Found by a hostile run (issue 28 item 5): a process killed during worker start-up printed a child's traceback into the
caller's stderr. The processes killed here are the ones a convert has while its workers start: multiprocessing's
forkserver (whose death was an EOFError from ``pool.submit``, which click printed as "Aborted!"), the first worker,
and the convert itself (whose resource tracker then warned about leaked semaphores on the caller's stderr).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hostile.refusal import run_cli
from hpu_fp8_loader.conversion.convert import _workers_not_started
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements

pytestmark = pytest.mark.slow  # real worker pools and kill -9


@pytest.fixture
def work(tmp_path, source_factory) -> Path:
    shutil.copytree(source_factory("ernie-moe-tiny", "torch"), tmp_path / "src")
    write_measurements(tmp_path / "m.json", synthetic_measurements(preset_config("ernie-moe-tiny")))
    return tmp_path


def _convert(work: Path) -> list[str]:
    return ["convert", str(work / "src"), str(work / "out"), "--measurements", str(work / "m.json"), "--workers", "2", "-q"]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_bytes().rpartition(b")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == pid:
                found.append(int(entry.name))
    return found


def _command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# How often a kill is tried before the test gives up: the forkserver forks both workers within a few milliseconds of
# starting, so a kill "at first sight" lands after that now and then (2 of 9 runs of this module on the 2-core
# machine, one CI run among them), and the conversion then rightly finishes. Such a run says nothing of the kill.
_TRIES = 5


def _kill_once(work: Path, victim: str) -> subprocess.CompletedProcess:
    """Start the convert, kill -9 ``victim`` ("forkserver", "worker" or "convert") the moment it exists, and wait."""
    cli = str(Path(sys.executable).with_name("hpu-fp8"))
    process = subprocess.Popen(
        [cli, *_convert(work)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:
        servers = [pid for pid in _children(process.pid) if b"forkserver" in _command_line(pid)]
        if servers and victim == "forkserver":
            os.kill(servers[0], signal.SIGKILL)
            break
        workers = [pid for server in servers for pid in _children(server)]
        if workers and victim == "worker":
            os.kill(workers[0], signal.SIGKILL)
            break
        if workers and victim == "convert":
            process.kill()
            break
        time.sleep(0.001)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _kill_at_first_sight(work: Path, victim: str) -> subprocess.CompletedProcess:
    """:func:`_kill_once` until the kill lands before the conversion can finish (at most ``_TRIES`` times); a
    conversion that finished anyway is removed before the next try, so each try starts from nothing."""
    for _ in range(_TRIES):
        result = _kill_once(work, victim)
        if result.returncode != 0:
            return result
        shutil.rmtree(work / "out")
    pytest.fail(f"the conversion finished before the {victim} was killed, {_TRIES} times")


@pytest.mark.parametrize(
    ("victim", "message"),
    [
        ("forkserver", "the worker processes could not be started: multiprocessing's forkserver, which starts them, died"),
        ("worker", "a worker process died while converting the tensors of "),
    ],
)
def test_a_helper_killed_while_workers_start_is_one_line_and_the_same_command_resumes(work, victim, message):
    result = _kill_at_first_sight(work, victim)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"hpu-fp8: error: {message}") and "run the same command again" in lines[0]
    assert "Traceback" not in result.stderr and not (work / "out").exists()
    again = run_cli(*_convert(work))
    assert again.exit_code == 0, again.stderr
    assert run_cli("validate", "--hashes", work / "out").exit_code == 0


def test_a_convert_killed_while_workers_start_leaves_nothing_on_the_callers_stderr(work):
    result = _kill_at_first_sight(work, "convert")
    assert result.returncode == -signal.SIGKILL
    assert result.stderr == ""  # no resource tracker warning, no worker traceback
    again = run_cli(*_convert(work))
    assert again.exit_code == 0, again.stderr


@pytest.mark.parametrize("exc", [EOFError(), BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "reset")])
def test_a_dead_forkserver_reads_as_died_whichever_side_of_the_pipe_saw_it(exc):
    """The kill lands between our write and our read at random: both are the same death, one message (a CI run saw
    "failed: Broken pipe" where the same kill usually reads "died")."""
    assert "forkserver, which starts them, died (killed by a signal?)" in str(_workers_not_started(exc))
    assert "failed: Permission denied" in str(_workers_not_started(PermissionError(13, "Permission denied")))

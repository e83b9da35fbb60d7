"""Peak memory and bytes read of a process tree, sampled from /proc.

PSS (proportional set size, /proc/<pid>/smaps_rollup) charges each shared page to the processes that
map it in equal parts, so summing it over a parent and its workers counts shared libraries once, not
once per process. Bytes read are ``rchar`` (every byte a read call returned, page cache or not) of each thread of the
tree, its last sample, summed: a thread's own counter, since /proc/<pid>/io adds in the reaped children, and
summing that, as this did before, counted a worker twice once its parent (a forkserver) had reaped it: convert
with 2 workers showed its source read twice where it was read once. A thread's last 0.2 s before it exits can
be missed. Bytes
read from the disk itself are the block reads wait4 reports for the process and every descendant it reaped.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path


def _children(pid: int) -> list[int]:
    found = []
    with contextlib.suppress(OSError):  # the process or one of its tasks may exit meanwhile
        for task in Path(f"/proc/{pid}/task").glob("*"):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _pss_kib(pid: int) -> int:
    with contextlib.suppress(OSError):  # the process may have exited meanwhile
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def tree_pss_bytes(root: int) -> int:
    total, stack, seen = 0, [root], set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += _pss_kib(pid)
        stack += _children(pid)
    return total * 1024


def _thread_read_chars(pid: int) -> list[tuple[int, int]]:
    """(thread id, rchar) of each thread of ``pid``: a thread's own reads, which, unlike /proc/<pid>/io, hold
    neither its exited threads' nor its reaped children's (those a sample of the child itself already counts)."""
    found = []
    with contextlib.suppress(OSError):  # the process may exit meanwhile
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                for line in (task / "io").read_text().splitlines():
                    if line.startswith("rchar:"):
                        found.append((int(task.name), int(line.split()[1])))
    return found


def tree_pids(root: int) -> list[int]:
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        if pid not in found:
            found.append(pid)
            stack += _children(pid)
    return found


@dataclass
class Measured:
    seconds: float
    peak_pss: int
    returncode: int
    bytes_read: int = 0  # rchar of the process and its reaped descendants
    disk_bytes_read: int = 0  # block reads of the process and its reaped descendants (wait4)


def run_measured(command: list[str], interval: float = 0.05, **popen) -> Measured:
    """Run ``command`` (``popen``: e.g. ``env``, ``cwd``, ``stdout``); wall time, the peak of the summed PSS of its
    process tree and the bytes it read."""
    start = time.perf_counter()
    process = subprocess.Popen(command, **popen)
    peak = 0
    read: dict[tuple[int, int], int] = {}
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, tree_pss_bytes(process.pid))
            for pid in tree_pids(process.pid):
                for tid, chars in _thread_read_chars(pid):
                    read[(pid, tid)] = max(read.get((pid, tid), 0), chars)
            time.sleep(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    return Measured(seconds, peak, process.returncode, sum(read.values()), usage.ru_inblock * 512)

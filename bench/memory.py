"""Peak memory of a process tree: the sum of every live process's PSS, sampled from /proc/<pid>/smaps_rollup.

PSS (proportional set size) charges each shared page to the processes that map it in equal parts,
so summing it over a parent and its workers counts shared libraries once, not once per process.
"""

from __future__ import annotations

import contextlib
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


@dataclass
class Measured:
    seconds: float
    peak_pss: int
    returncode: int


def run_measured(command: list[str], interval: float = 0.05) -> Measured:
    """Run ``command``; wall time and the peak of the summed PSS of its process tree."""
    start = time.perf_counter()
    process = subprocess.Popen(command)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, tree_pss_bytes(process.pid))
            time.sleep(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    returncode = process.wait()
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    return Measured(seconds, peak, returncode)

"""How much memory this process may still use: what a weight cache meant to fit in RAM is sized by, and what an
allocation that failed is reported against.

MemAvailable alone overstates it inside a container or under a ulimit, and a cache sized from it makes the
run die mid-way, hours in. A ``MemoryError`` (numpy's ``_ArrayMemoryError`` included) is turned into one line by
:func:`out_of_memory`: the step, what was being allocated, and the memory the process saw.
"""

from __future__ import annotations

import math
import os
import resource
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hpu_fp8_loader.errors import OutOfMemoryError

__all__ = ["memory_budget", "memory_seen", "out_of_memory", "reserve_blas_buffers"]

# (limit, usage) files of a cgroup, v2 then v1's memory controller; v1 writes "no limit" as a huge number.
_CGROUP_MEMORY = (("", "memory.max", "memory.current"), ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes"))


def _read_int(path: Path) -> int | None:
    """The number in a one-number kernel file; None when absent, unreadable or ``max`` (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdecimal() else None


def _kib_field(path: Path, key: str) -> int:
    """Bytes of a ``Key:  N kB`` line of /proc/meminfo or /proc/self/status; 0 when it cannot be read."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def _cgroup_headroom(proc: Path, cgroup_root: Path) -> Iterator[int]:
    """Limit minus usage of every memory limit over this process: its cgroup and each ancestor, v2 or v1.

    The process's cgroup path comes from ``/proc/self/cgroup``; inside a container the mount's root is the
    container's own cgroup, so the walk goes up to, and includes, the root of the mount.
    """
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, _, rest = line.partition(":")
        controllers, _, relative = rest.partition(":")
        for mount, limit_file, usage_file in _CGROUP_MEMORY:
            if controllers != mount and mount not in controllers.split(","):
                continue
            base = cgroup_root / mount
            directory = base / relative.lstrip("/")
            for level in [directory, *directory.parents]:
                limit = _read_int(level / limit_file)
                if limit is not None:
                    yield max(limit - (_read_int(level / usage_file) or 0), 0)
                if level == base:
                    break


def _rlimit_headroom(proc: Path) -> Iterator[int]:
    """What ``ulimit -v`` (RLIMIT_AS) and ``ulimit -d`` (RLIMIT_DATA) still allow beyond what this process uses."""
    for limit, used in ((resource.RLIMIT_AS, "VmSize"), (resource.RLIMIT_DATA, "VmData")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY:
            yield max(soft - _kib_field(proc / "self" / "status", used), 0)


def memory_budget(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes this process may still allocate: the least of the machine's available memory, the headroom
    under ``ulimit -v``/``-d``, and under every cgroup memory limit above it (a container's, a job's).

    Sized from MemAvailable alone, a cache meant to fit in RAM overruns a container or a ulimit and the
    run dies mid-way; 0 when nothing can be read (then nothing is cached).
    """
    available = _kib_field(proc / "meminfo", "MemAvailable")
    return min([available, *_rlimit_headroom(proc), *_cgroup_headroom(proc, cgroup_root)])


def _size(count: int) -> str:
    """Bytes as a person reads them: ``256 MiB``, ``1.2 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:,.1f} {unit}"
    return f"{count} bytes"


def memory_seen(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> str:
    """The memory this process could use, in words: RAM available, ``ulimit -v`` and how much of it is in use, and
    the least headroom under a cgroup memory limit when that is less (cgroup v1 writes "no limit" as 8 EiB)."""
    available = _kib_field(proc / "meminfo", "MemAvailable")
    seen = [f"{_size(available)} of RAM available"]
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        in_use = _kib_field(proc / "self" / "status", "VmSize")
        seen.append(f"ulimit -v (RLIMIT_AS) is {_size(soft)}, {_size(in_use)} of it in use")
    cgroups = list(_cgroup_headroom(proc, cgroup_root))
    if cgroups and min(cgroups) < available:
        seen.append(f"{_size(min(cgroups))} left under the cgroup memory limit")
    return "; ".join(seen)


def out_of_memory(doing: str, exc: MemoryError) -> OutOfMemoryError:
    """One line for a failed allocation: ``doing`` (the step), what was being allocated (numpy says an array's shape
    and dtype; a plain MemoryError says nothing) and :func:`memory_seen`."""
    shape, dtype = getattr(exc, "shape", None), getattr(exc, "dtype", None)
    what = ""
    if shape is not None and dtype is not None:
        dimensions = [int(n) for n in shape]
        what = f" allocating {_size(math.prod(dimensions) * dtype.itemsize)} for an array of shape {dimensions} ({dtype})"
    return OutOfMemoryError(
        f"{doing}: out of memory{what} ({memory_seen()}); free memory or raise the limit, or ask for less "
        "(fewer --samples or --workers, a smaller --seq-len)"
    )


def _blas_products(threads: int) -> None:
    """``threads`` float32 matrix products at once, each large enough for OpenBLAS to take its work buffers, which it
    reserves on the first product that needs them and keeps for every later one."""
    import numpy as np

    matrix = np.ones((512, 512), np.float32)
    if threads == 1:  # on this thread: the engine's own product runs here too
        matrix @ matrix
        return
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: matrix @ matrix, range(threads)))


# How long a forked child's few products may take: milliseconds when they fit; what outlasts this is taken as failed.
_PROBE_SECONDS = 30


def _child_products(threads: int) -> bool:
    """Whether ``threads`` products at once run in a forked child, silently and to the end.

    The child's stdout and stderr are a pipe: OpenBLAS's failure is a line it prints, after which its exit can hang
    (its own lock, held in the child), so the first byte read is a failure and the child is killed then; so is one
    that outlasts :data:`_PROBE_SECONDS`."""
    import select
    import signal

    read_end, write_end = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns of fork in a threaded process: a child that hangs is killed
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:  # pragma: no cover (the child's own coverage is not collected)
        code = 1
        try:
            os.close(read_end)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            _blas_products(threads)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], _PROBE_SECONDS)
        quiet = bool(ready) and os.read(read_end, 1) == b""  # end of file, nothing said: the child has finished
    finally:
        os.close(read_end)
    if not quiet:
        os.kill(child, signal.SIGKILL)
    _, status = os.waitpid(child, 0)
    return quiet and os.waitstatus_to_exitcode(status) == 0


def reserve_blas_buffers(doing: str, threads: int = 1) -> None:
    """Have the BLAS library take its work buffers now, for ``threads`` products at once, before the weights take the
    memory, or refuse in one line.

    Where they do not fit under ``ulimit -v``, OpenBLAS prints its own line ("Memory allocation still failed after 10
    retries, giving up") and exits the process from inside a product, past every handler of ours. So under such a
    limit the products are tried first in a forked child (which has this process's limit and address space:
    :func:`_child_products`), and its failure becomes an :class:`OutOfMemoryError` naming ``doing`` and the memory
    seen. Without a limit, nothing is forked.
    """
    if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY and not _child_products(threads):
        raise OutOfMemoryError(
            f"{doing}: out of memory for the work buffers of the BLAS library (OpenBLAS, {threads} product(s) at "
            f"once) ({memory_seen()}); raise ulimit -v by a few hundred MB or free memory"
        )
    _blas_products(threads)

"""The fixed-name files this tool writes and trusts in directories someone else may write to as well.

A staging directory (``OUT.partial``), a push's ``--work-dir`` or the demo's ``--out`` may hold, under a name we
use (``.hpu_fp8_lock``, ``.hpu_fp8_progress.json``, ``.hpu-fp8-push``, ``config.json``), a link planted to a file
the user cares about, or a FIFO. So such a name is never opened for writing: a new file is created under a random
name beside it (``mkstemp``: ``O_CREAT|O_EXCL``, no link followed) and renamed over it, which replaces a link,
never its target. It is read back only as a regular file reached without a link (``O_NOFOLLOW``), opened without
blocking (``O_NONBLOCK``, then ``fstat``), and only up to a size it can have.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["copy_new", "hidden_temporary", "read_own", "under_umask", "write_new"]

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def under_umask(mode: int) -> int:
    """The permissions a file or directory created with ``mode`` gets under the current umask: what ``mkstemp`` and
    ``mkdtemp`` (0600, 0700) are set to, so that what they make is published as an ``open`` or ``mkdir`` would."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def hidden_temporary(path: Path) -> tuple[int, Path]:
    """A new, empty file beside ``path`` under a random hidden name (open descriptor, path), with the permissions
    a file created under the current umask gets (``mkstemp`` makes it 0600)."""
    descriptor, name = tempfile.mkstemp(dir=path.absolute().parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        os.fchmod(descriptor, under_umask(0o666))
    except OSError:
        os.close(descriptor)
        os.unlink(name)
        raise
    return descriptor, Path(name)


def _replace_with(path: Path, fill: Callable[[BinaryIO], object]) -> None:
    """Create a hidden file beside ``path``, let ``fill(file)`` write it, rename it over ``path``."""
    descriptor, temporary = hidden_temporary(path)
    try:
        with open(descriptor, "wb") as file:
            fill(file)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_new(path: str | Path, data: bytes) -> None:
    """``path`` becomes a new regular file holding ``data``; whatever was there (a link included) is replaced, not
    written through. Raises OSError like ``open``."""
    _replace_with(Path(path), lambda file: file.write(data))


def copy_new(source: str | Path, path: str | Path) -> None:
    """``path`` becomes a new regular file holding the bytes of ``source``, which must be a regular file reached
    without a final link (a FIFO or device there would block or never end: OSError, as for any unreadable file)."""
    descriptor = os.open(source, _READ_FLAGS)
    with open(descriptor, "rb") as origin:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise IsADirectoryError(f"{source}: not a regular file")
        _replace_with(Path(path), lambda file: shutil.copyfileobj(origin, file))


def read_own(path: str | Path, limit: int) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (not a link, FIFO or device) of at most ``limit`` bytes, else
    None: what a file this tool wrote can be, and nothing else is trusted as one."""
    try:
        with open(os.open(path, _READ_FLAGS), "rb") as file:
            data = file.read(limit + 1) if stat.S_ISREG(os.fstat(file.fileno()).st_mode) else None
    except OSError:  # missing, a link (ELOOP), unreadable
        return None
    return data if data is not None and len(data) <= limit else None

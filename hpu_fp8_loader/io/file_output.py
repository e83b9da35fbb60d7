"""Single-file outputs (a measurement file, FastDeploy's text file, one rank's parameters for ``map -o``):
checked before any work, written atomically, never through a planted name.

A predictable staging name such as ``FILE.partial`` can be planted as a link to a file the user cares
about; the staging file here is created exclusively under a random name beside ``FILE`` (``mkstemp``), so
nothing is ever written through a link, and ``FILE`` holds either what it held before or all of the new
content, even after a crash.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hpu_fp8_loader.errors import OutputExistsError, WriteFailedError, force_flag
from hpu_fp8_loader.io.own_files import hidden_temporary
from hpu_fp8_loader.io.writer import check_apart, fsync_path

__all__ = ["atomic_file", "check_output_file", "write_text_atomically"]


def _exists(path: Path, when: str = "") -> OutputExistsError:
    return OutputExistsError(f"{path}: already exists{when}; pass {force_flag()} to replace it")


def check_output_file(path: str | Path, force: bool, sources: Iterable[str | Path] = ()) -> None:
    """Refuse, before any work, a file output that could not or must not be written: one of ``sources`` or
    inside one, a directory, an existing file without ``force``, a directory that is missing or read-only."""
    path = Path(path)
    check_apart(path, sources)
    if path.is_dir():
        raise OutputExistsError(f"{path}: is a directory; name a file to write")
    if os.path.lexists(path) and not force:
        raise _exists(path)
    parent = path.absolute().parent
    if not parent.is_dir():
        why = "is not a directory" if parent.exists() else "does not exist"
        raise WriteFailedError(f"{path}: {parent} {why}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise WriteFailedError(f"{path}: the directory {parent} is not writable")


def _publish(temporary: Path, path: Path, replace: bool) -> None:
    """Rename the finished file into place; without ``replace`` a hard link, which fails if ``path`` appeared meanwhile."""
    if replace:
        os.replace(temporary, path)
        return
    try:
        os.link(temporary, path)
    except FileExistsError:
        raise _exists(path, " (created while this ran)") from None
    os.unlink(temporary)


@contextmanager
def atomic_file(path: str | Path, replace: bool) -> Iterator[Path]:
    """A fresh, empty staging file beside ``path`` for the caller to fill; synced and renamed onto ``path``
    when the block ends, removed when it raises. A link at ``path`` itself is replaced, not written through."""
    path = Path(path)
    if not replace and os.path.lexists(path):
        raise _exists(path)
    try:
        descriptor, temporary = hidden_temporary(path)
    except OSError as exc:
        raise WriteFailedError(f"{path}: cannot create a file beside it: {exc.strerror or exc}") from None
    try:
        os.close(descriptor)
        yield temporary
        fsync_path(temporary)
        _publish(temporary, path, replace)
        fsync_path(path.absolute().parent)
    except OSError as exc:
        raise WriteFailedError(f"{path}: writing failed: {exc.strerror or exc}; nothing was written") from None
    except WriteFailedError as exc:  # named for the file asked for, not the hidden staging file; nothing resumes
        raise WriteFailedError(f"{path}: writing failed: {exc.reason}; nothing was written") from None
    finally:
        temporary.unlink(missing_ok=True)


def write_text_atomically(path: str | Path, text: str, replace: bool) -> None:
    """``path`` holds either what it held before or all of ``text``, never a part (see :func:`atomic_file`)."""
    with atomic_file(path, replace) as temporary:
        temporary.write_text(text, encoding="utf-8")

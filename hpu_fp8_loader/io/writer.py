"""Sharded safetensors output, planned up front and written at known offsets.

A safetensors header needs only names, dtypes and shapes, which are known before any weight is read.
So every shard is created at its final size with its header in place, and tensors (or blocks of
rows, or column segments of a transposed tensor) are written with ``pwrite`` at their offsets, in
any order. A shard written in file order by one process is hashed as it is written (:meth:`ShardFile.digest`),
so its sha256 needs no second read of it; one written otherwise is hashed from disk when finished. Output goes
into ``OUT.partial`` and is renamed only when the index and the manifest are written: a directory without
``hpu_fp8_manifest.json`` was never finished, and a ``.partial`` directory is never mistaken for output.

Only what this tool made is ever emptied or replaced. ``OUT.partial`` appears with a marker already inside
(``.hpu_fp8_staging.json``, naming OUT), and a directory there without it is a user's and refused, ``--force`` or
not. ``--force`` replaces an ``OUT`` only when its manifest accounts for everything in it
(``io.manifest.foreign_entry``), never for a file of that name alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import stat
import struct
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpu_fp8_loader.errors import OutputExistsError, OutputLockedError, UnsafePathError, WriteFailedError, force_flag, one_line
from hpu_fp8_loader.io.checkpoint import CONFIG_FILE, INDEX_FILE, copied_source_files, resolve_path
from hpu_fp8_loader.io.jsonfile import parse_json
from hpu_fp8_loader.io.manifest import foreign_entry, write_manifest
from hpu_fp8_loader.io.own_files import copy_new, read_own, under_umask, write_new
from hpu_fp8_loader.io.safetensors_file import ITEMSIZES, dtype_name

__all__ = [
    "PARTIAL_SUFFIX",
    "STAGING_MARKER",
    "PlannedTensor",
    "Shard",
    "ShardFile",
    "check_apart",
    "check_publishable",
    "clear_staging",
    "fsync_path",
    "plan_shards",
    "prepare_output_dir",
    "publish_output_dir",
    "write_index",
]

PARTIAL_SUFFIX = ".partial"
# Inside OUT.partial: who holds the staging lock (pid and command line), for the message a second run gets.
_HOLDER_FILE = ".hpu_fp8_lock"
# The longest note of ours read back from a staging directory (the lock holder's, the staging marker): a pid, a command
# line, a path; anything longer was not written by us.
_NOTE_LIMIT = 64 << 10
# Inside OUT.partial from the moment it exists until it is published: the proof that this tool made it, for this OUT.
STAGING_MARKER = ".hpu_fp8_staging.json"
_STAGING_FORMAT = "hpu-fp8-staging"


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZES[self.dtype]


@dataclass(frozen=True)
class Shard:
    file_name: str
    tensors: tuple[PlannedTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_shards(
    tensors: Iterable[PlannedTensor], max_shard_bytes: int, with_previous: Callable[[PlannedTensor], bool] | None = None
) -> list[Shard]:
    """Group tensors, in order, into shards of at most ``max_shard_bytes`` (a bigger tensor gets its own).

    A tensor ``with_previous`` names stays in the shard of the one before it, a few bytes over the bound if need be
    (a weight's scale with its weight: one process then writes both, in order). File names carry the exact shard
    count, unlike the legacy converter's estimate.
    """
    groups: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        kept_together = with_previous is not None and with_previous(t)
        if groups[-1] and size + t.nbytes > max_shard_bytes and not kept_together:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    total = len(groups)
    return [Shard(f"model-{i + 1:05d}-of-{total:05d}.safetensors", tuple(g)) for i, g in enumerate(groups)]


def _header_bytes(shard: Shard, metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for t in shard.tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_failed(path: Path, exc: OSError, what: str) -> WriteFailedError:
    known = {
        errno.ENOSPC: "no space left on the device",
        errno.EFBIG: "the file would exceed the file-size limit",
        errno.EDQUOT: "the disk quota is exhausted",
    }
    reason = known[exc.errno] if exc.errno in known else exc.strerror or str(exc)
    return WriteFailedError(
        f"{path}: {what} failed: {reason}. Nothing was published; fix that and run the same command again to resume.",
        reason,
    )


class ShardFile:
    """One planned shard on disk. ``create`` makes it at full size; ``write*`` fill it in from any process."""

    def __init__(self, directory: Path, shard: Shard, metadata: dict[str, str] | None = None):
        self.path = Path(directory) / shard.file_name
        self.shard = shard
        self._header = _header_bytes(shard, metadata)
        self._begin: dict[str, int] = {}
        self._planned: dict[str, PlannedTensor] = {}
        offset = len(self._header)
        for t in shard.tensors:
            self._begin[t.name], self._planned[t.name] = offset, t
            offset += t.nbytes
        self.size = offset
        self._fd: int | None = None
        self._sha = hashlib.sha256()
        self._hashed = 0  # the file's bytes hashed so far, all of them in order: its first _hashed bytes
        self._in_order = True

    def create(self) -> None:
        """(Re)create the file: header written, data region allocated (sparse until written). A link at its
        name (planted in a staging directory) is refused, never written through."""
        try:
            with open(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666), "wb") as f:
                f.write(self._header)
                f.truncate(self.size)
        except OSError as exc:
            raise _write_failed(self.path, exc, "creating the shard") from exc
        self._sha, self._hashed, self._in_order = hashlib.sha256(self._header), len(self._header), True

    def digest(self) -> tuple[int, str] | None:
        """(size, sha256 hex) of the shard, from what this object wrote, when it wrote every byte of it in file order
        since :meth:`create`; None otherwise (other processes wrote parts of it, or blocks came out of order)."""
        return (self.size, self._sha.hexdigest()) if self._in_order and self._hashed == self.size else None

    def _pwrite(self, data: np.ndarray, offset: int) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_NOFOLLOW)
        view = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data  # .data: the bytes as a memoryview
        if self._in_order and offset == self._hashed:
            self._sha.update(view)
            self._hashed += len(view)
        else:
            self._in_order = False
        try:
            while len(view):
                n = os.pwrite(self._fd, view, offset)
                view, offset = view[n:], offset + n
        except OSError as exc:
            raise _write_failed(self.path, exc, f"writing {data.nbytes} bytes at offset {offset}") from exc

    def planned(self, name: str) -> PlannedTensor:
        return self._planned[name]

    def _check(self, name: str, array: np.ndarray) -> PlannedTensor:
        planned = self._planned[name]
        if dtype_name(array.dtype) != planned.dtype:
            raise ValueError(f"{self.path}: {name} is {dtype_name(array.dtype)}, planned {planned.dtype}")
        return planned

    def write(self, name: str, array: np.ndarray, first_row: int = 0) -> None:
        """Write whole rows of ``name`` starting at row ``first_row`` (the whole tensor by default)."""
        planned = self._check(name, array)
        row_bytes = math.prod(planned.shape[1:]) * ITEMSIZES[planned.dtype] if planned.shape else 0
        if first_row * row_bytes + array.nbytes > planned.nbytes:
            raise ValueError(f"{self.path}: {name} rows {first_row}+{len(array)} exceed shape {list(planned.shape)}")
        self._pwrite(array, self._begin[name] + first_row * row_bytes)

    def write_columns(self, name: str, block: np.ndarray, first_row: int, first_column: int) -> None:
        """Write a 2-D ``block`` into rows ``first_row:`` and columns ``first_column:`` of a 2-D tensor.

        This is how a transposed source lands in the spec's ``[in, out]`` layout without ever holding
        the whole tensor: one pwrite per row segment, or one for the block when it spans full rows.
        """
        planned = self._check(name, block)
        rows, columns = planned.shape if len(planned.shape) == 2 else (1, planned.shape[0])  # a 1-D tensor is one row
        item = ITEMSIZES[planned.dtype]
        if first_column == 0 and block.shape[1] == columns:
            self._pwrite(block, self._begin[name] + first_row * columns * item)
            return
        if first_row + block.shape[0] > rows or first_column + block.shape[1] > columns:
            raise ValueError(
                f"{self.path}: {name} block {block.shape} at ({first_row}, {first_column}) exceeds {list(planned.shape)}"
            )
        base = self._begin[name] + (first_row * columns + first_column) * item
        for i in range(block.shape[0]):
            self._pwrite(block[i], base + i * columns * item)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_index(directory: Path, shards: list[Shard]) -> None:
    weight_map = {t.name: s.file_name for s in shards for t in s.tensors}
    index = {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": weight_map}
    write_new(Path(directory) / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())


def check_apart(out: str | Path, sources: Iterable[str | Path]) -> None:
    """Refuse an ``OUT`` equal to, inside, or containing a source: writing there, or replacing it with
    ``--force``, would destroy the input, which is never modified. A link loop in either is refused naming it."""
    target = resolve_path(out)
    for source in sources:
        src = resolve_path(source)
        if target == src:
            raise UnsafePathError(f"{out}: it is the source {source}; the source is never modified, choose another OUT")
        if target.is_relative_to(src):
            raise UnsafePathError(f"{out}: it lies inside the source {source}; the source is never modified, choose another OUT")
        if src.is_relative_to(target):
            raise UnsafePathError(f"{out}: it contains the source {source}; replacing it would delete the source")


def _check_replaceable(out: Path) -> None:
    """``--force`` replaces only an empty directory or one this tool published, whole and unchanged (its manifest
    accounts for every entry in it: :func:`foreign_entry`), never a regular file or a link's target: a typo'd OUT, a
    user's file put beside a checkpoint, or a manifest file made by hand must never get a user's files deleted."""
    if out.is_symlink() or not out.is_dir():
        raise OutputExistsError(
            f"{out}: exists and is not a directory; {force_flag()} replaces only a checkpoint this tool wrote"
        )
    if any(out.iterdir()) and (reason := foreign_entry(out)) is not None:
        raise OutputExistsError(
            f"{out}: {reason}; {force_flag()} replaces only a directory this tool wrote, as its manifest lists it: "
            "nothing was removed, remove it yourself if it should go"
        )


def _printable(text: str) -> str:
    """``text`` as UTF-8 can hold it: a path's bytes that are no UTF-8 kept visible as ``\\x`` escapes, never an error
    (and never a lone surrogate, which strict JSON refuses to read back)."""
    return os.fsencode(text).decode("utf-8", "backslashreplace")


def _staging_marker(out: Path) -> bytes:
    """What ``OUT.partial`` holds to prove this tool made it for ``out``: the format, OUT's name (checked) and, for a
    reader, OUT's full path and the command that made it."""
    marker = {
        "format": _STAGING_FORMAT,
        "version": 1,
        "out": _printable(out.name),
        "path": _printable(str(out.absolute())),
        "made_by": f"pid {os.getpid()}: {_printable(' '.join(sys.argv))}",
    }
    return (json.dumps(marker, indent=2) + "\n").encode()


def _made_for(partial: Path, out: Path) -> bool:
    """Whether ``partial`` carries the marker this tool writes for ``out`` (a regular file of ours, never a link)."""
    data = read_own(partial / STAGING_MARKER, _NOTE_LIMIT)
    try:
        marker = parse_json(data) if data is not None else None
    except ValueError:
        return False
    return (
        isinstance(marker, dict)
        and marker.get("format") == _STAGING_FORMAT
        and marker.get("version") == 1
        and marker.get("out") == _printable(out.name)
    )


def _create_staging(partial: Path, out: Path) -> None:
    """Make ``OUT.partial`` with its marker already inside: built under a random name beside it, then renamed, so that
    it never exists without the marker. Whatever appeared at that name meanwhile is left as it is (the rename replaces
    nothing but an empty directory) for :func:`_check_staging` to judge."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    built = Path(tempfile.mkdtemp(dir=partial.parent, prefix=f".{partial.name}.", suffix=".new"))
    try:
        os.chmod(built, under_umask(0o777))
        write_new(built / STAGING_MARKER, _staging_marker(out))
        os.rename(built, partial)
    except OSError as exc:
        shutil.rmtree(built, ignore_errors=True)
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise


def _check_staging(partial: Path, out: Path) -> None:
    """Refuse a staging path this tool did not make for ``out``: a link, a file, or a directory without its marker
    (a user's, which is never emptied, ``--force`` or not)."""
    if partial.is_symlink() or not partial.is_dir():
        raise UnsafePathError(f"{partial}: the staging path is a link or a file, not a directory this tool made; remove it")
    if not _made_for(partial, out):
        raise UnsafePathError(
            f"{partial}: a directory this tool did not make for {out.name} (it holds no {STAGING_MARKER} of ours); "
            "nothing in it was touched: move it away or remove it yourself, then run again"
        )


# Staging directories this process holds the lock of: path -> the open descriptor carrying the flock.
_held_locks: dict[Path, int] = {}


def _lock_staging(partial: Path, out: Path) -> None:
    """An exclusive ``flock`` on ``OUT.partial``, held until it is published or the process ends.

    A second run on the same OUT is refused at once, naming the holder, instead of writing shards the
    first run is writing too. The lock dies with its process, so a killed run never leaves a stale lock.
    """
    key = partial.resolve()
    held = _held_locks.get(key)
    if held is not None:
        if os.fstat(held).st_ino == partial.stat().st_ino:
            return  # this process holds it already (a retry after a failure, in the same process)
        _release_lock(partial)  # the directory was removed and made again: the old lock guards nothing
    fd = os.open(partial, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        note = read_own(partial / _HOLDER_FILE, _NOTE_LIMIT)  # never through a planted link, never a FIFO
        holder = one_line(note.decode("utf-8", "backslashreplace")) if note else "unknown"
        raise OutputLockedError(
            f"{out}: another hpu-fp8 run is writing it ({holder}); wait for it to finish or stop it, then run again"
        ) from None
    _held_locks[key] = fd
    # argv may hold bytes that are no UTF-8 (a path named so): kept visible as \x escapes, never an error
    holder_line = f"pid {os.getpid()}: {' '.join(sys.argv)}\n".encode("utf-8", "backslashreplace")
    write_new(partial / _HOLDER_FILE, holder_line)  # a link planted at that name is replaced, never written through


def _release_lock(partial: Path) -> None:
    fd = _held_locks.pop(partial.resolve(), None)
    if fd is not None:
        os.close(fd)


def clear_staging(partial: Path, keep: Iterable[str] = ()) -> None:
    """Empty ``OUT.partial`` (made by :func:`prepare_output_dir`, which proved it ours) for a fresh start, keeping only
    its marker, the lock holder's note and the entries named in ``keep`` (a link is removed, never followed)."""
    kept = {STAGING_MARKER, _HOLDER_FILE, *keep}
    for child in partial.iterdir():
        if child.name not in kept:
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def prepare_output_dir(out: str | Path, force: bool = False, sources: Iterable[str | Path] = ()) -> Path:
    """``OUT.partial``, locked for this process (kept if present and made by this tool for ``out``, for resuming).

    Refused before any work: an existing ``OUT`` unless ``force`` (and then only one this tool wrote, as its manifest
    lists it), an ``OUT`` overlapping a source, a staging path this tool did not make (a planted link, a file, a
    user's directory), and a staging directory another run is writing.
    """
    out = Path(out)
    check_apart(out, sources)
    if out.exists() or out.is_symlink():
        if not force:
            raise OutputExistsError(f"{out}: already exists; pass {force_flag()} to replace it")
        _check_replaceable(out)
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    try:
        if not os.path.lexists(partial):
            _create_staging(partial, out)
        _check_staging(partial, out)
        _lock_staging(partial, out)
    except OSError as exc:
        raise _write_failed(partial, exc, "creating the output directory") from exc
    return partial


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory by name. A link is followed: OUT's directory may be reached through one
    (``_sync_tree`` skips the links inside a staging directory itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``: the rename that publishes must not outrun the data. Only
    regular files and directories (a link is not followed, a FIFO would block the open)."""
    for path in [*sorted(root.rglob("*")), root]:
        if stat.S_ISREG(mode := path.lstat().st_mode) or stat.S_ISDIR(mode):
            fsync_path(path)


def check_publishable(out: str | Path, force: bool, replaceable: Callable[[Path], None] = _check_replaceable) -> None:
    """Asked again when the work is done, since ``OUT`` may have appeared while it ran (a user's directory made
    meanwhile): without ``force`` an existing ``OUT`` is refused, with it only what ``replaceable`` allows (by
    default a checkpoint this tool wrote). The staging directory is kept, so the same command runs again."""
    out = Path(out)
    if not os.path.lexists(out):
        return
    if not force:
        raise OutputExistsError(
            f"{out}: appeared while this command ran and was left as it is; the finished output is kept in "
            f"{out.name}{PARTIAL_SUFFIX}: move {out.name} away and run the same command again, or pass {force_flag()}"
        )
    replaceable(out)


def _rename_onto_nothing(partial: Path, out: Path) -> None:
    """``partial`` renamed to ``out``, which was absent a moment ago: a directory that holds files, or a file, that
    appeared since makes the rename fail (it replaces only an empty directory), and is refused by name."""
    try:
        partial.rename(out)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise OutputExistsError(f"{out}: appeared while this command ran and was left as it is") from None
        raise


@contextlib.contextmanager
def _unmarked(partial: Path, out: Path) -> Iterator[None]:
    """The staging marker removed (durably) for the renames that publish: it is no part of the output. Put back if
    they fail, so that the staging directory is still this tool's and the same command resumes."""
    marker = partial / STAGING_MARKER
    if not os.path.lexists(marker):  # a report's staging, made by mkdtemp, has none
        yield
        return
    marker.unlink()
    fsync_path(partial)
    try:
        yield
    except BaseException:
        if partial.is_dir() and not partial.is_symlink():
            write_new(marker, _staging_marker(out))
        raise


def publish_output_dir(
    partial: Path,
    out: str | Path,
    manifest: bool = False,
    force: bool = False,
    replaceable: Callable[[Path], None] = _check_replaceable,
) -> Path:
    """Replace ``OUT`` with the finished ``OUT.partial`` by renames, so ``OUT`` is never half-written.

    ``OUT`` is checked again first (:func:`check_publishable`): one that appeared while the command ran is never
    deleted without ``force``. Without it the final rename cannot replace anything either (a directory that
    appears in the last instant makes it fail, unless empty). With ``manifest``, every staged file is first
    recorded in ``hpu_fp8_manifest.json`` (for outputs that :func:`finish_output` does not write), which also lets
    ``--force`` replace the output later. An ``OUT`` being replaced is first moved into a fresh hidden directory
    beside it (never a fixed name such as ``OUT.replaced``, which may hold a user's files) and deleted only after
    the new one is in place.
    """
    out = Path(out)
    try:
        check_publishable(out, force, replaceable)
        replacing = os.path.lexists(out)  # checked as replaceable just now; anything appearing later is not
        (partial / _HOLDER_FILE).unlink(missing_ok=True)
        if manifest:
            write_manifest(partial, leave_out=[STAGING_MARKER])
        _sync_tree(partial)
        with _unmarked(partial, out):
            if replacing:
                retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
                out.rename(retired / out.name)
                partial.rename(out)
                shutil.rmtree(retired)
            else:
                _rename_onto_nothing(partial, out)
        fsync_path(out.parent)
    except OSError as exc:
        raise _write_failed(out, exc, "publishing") from exc
    finally:
        _release_lock(partial)
    return out


def finish_output(
    staging: Path,
    out: str | Path,
    shards: list[Shard],
    config: dict,
    copy_from: Path | None = None,
    digests: dict[str, tuple[int, str]] | None = None,
    files: Mapping[str, bytes] | None = None,
    force: bool = False,
) -> Path:
    """Index, config.json, the source's other files, ``files`` (name -> content), the manifest (last), then publish
    ``OUT``.

    ``copy_from``'s tokenizer and generation files (``spec.names.COPIED_SOURCE_FILES``, by name) are
    copied unchanged, never through a link out of the source. ``digests`` are shard sha256s already computed.
    """
    (staging / _HOLDER_FILE).unlink(missing_ok=True)  # not part of the checkpoint; the flock still guards it
    try:
        write_index(staging, shards)
        write_new(staging / CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode())
        for name, data in (files or {}).items():
            write_new(staging / name, data)
        if copy_from is not None:
            for name, source in copied_source_files(Path(copy_from)).items():
                copy_new(source, staging / name)
        write_manifest(staging, digests, leave_out=[STAGING_MARKER])
    except OSError as exc:
        raise _write_failed(Path(exc.filename or staging), exc, "writing the index, config and manifest") from exc
    return publish_output_dir(staging, out, force=force)


class CheckpointWriter:
    """A new checkpoint written tensor by tensor (or row block by row block) in one process.

    For the tools that rewrite a checkpoint (import, export, retarget, synth): plan, write, finish.
    Nothing is resumed: a leftover ``OUT.partial`` is cleared first. ``progress`` (e.g. ``Progress.show``) is called
    after each write with the bytes written so far and the planned total.
    """

    def __init__(
        self,
        out: str | Path,
        planned: list[PlannedTensor],
        max_shard_bytes: int,
        force: bool = False,
        metadata: dict[str, str] | None = None,
        sources: Iterable[str | Path] = (),
        progress: Callable[[int, int], None] | None = None,
    ):
        self.out = Path(out)
        self.force = force
        self.staging = prepare_output_dir(self.out, force, sources)
        clear_staging(self.staging)
        self.shards = plan_shards(planned, max_shard_bytes)
        self._files = [ShardFile(self.staging, shard, metadata) for shard in self.shards]
        self._owner = {t.name: f for f in self._files for t in f.shard.tensors}
        self._progress, self._written, self._total = progress, 0, sum(t.nbytes for t in planned)
        for f in self._files:
            f.create()

    def write(self, name: str, array: np.ndarray, first_row: int = 0) -> None:
        """Write rows of ``name`` (see :meth:`ShardFile.write`); ``progress`` hears the bytes written of the total."""
        self._owner[name].write(name, array, first_row)
        if self._progress is not None:
            self._written += array.nbytes
            self._progress(self._written, self._total)

    def finish(self, config: dict, copy_from: Path | None = None) -> Path:
        for f in self._files:
            f.close()
        digests = {f.shard.file_name: digest for f in self._files if (digest := f.digest()) is not None}
        return finish_output(self.staging, self.out, self.shards, config, copy_from, digests, force=self.force)

"""hpu_fp8_manifest.json: every file of a checkpoint with its size and sha256, written last.

Its presence marks a finished checkpoint; resume, push and pull verify files against it, and ``--force`` replaces a
directory only when the manifest accounts for everything in it (:func:`foreign_entry`): a file of that name alone
proves nothing, since anyone can make one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from hpu_fp8_loader.errors import HpuFp8Error, UnsafePathError
from hpu_fp8_loader.io.checkpoint import safe_member
from hpu_fp8_loader.io.jsonfile import parse_json, read_json_object
from hpu_fp8_loader.io.own_files import read_own, write_new

__all__ = ["MANIFEST_FILE", "check_manifest", "file_digest", "foreign_entry", "well_formed_entry", "write_manifest"]

MANIFEST_FILE = "hpu_fp8_manifest.json"
_FORMAT = "hpu-fp8-manifest"
_READ_BYTES = 8 << 20
# The largest manifest read back before a replacement: ours take about 150 bytes a file.
_MANIFEST_LIMIT = 64 << 20
# Files up to this size are checked by sha256 too before a replacement (config.json, the index, the tokenizer, the
# measurements: a few MB in all, read in well under a second); the shards, by size, so that --force on a 600 GB
# checkpoint does not read it first.
_HASHED_UP_TO = 64 << 20


def file_digest(path: Path) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in 8 MiB blocks."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_READ_BYTES):
            sha.update(block)
            size += len(block)
    return size, sha.hexdigest()


def _members(root: Path) -> list[str]:
    """Every file under ``root`` but its own manifest (a nested checkpoint's, as in ``map --all-ranks``, is listed)."""
    members = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(name for name in members if name != MANIFEST_FILE)


def write_manifest(root: Path, known: dict[str, tuple[int, str]] | None = None, leave_out: Iterable[str] = ()) -> dict:
    """Record every file under ``root`` but those named in ``leave_out`` (a staging directory's own files, removed
    before it is published); digests in ``known`` (computed while writing) are reused."""
    root = Path(root)
    known = known or {}
    left_out = set(leave_out)
    files = {}
    for name in (name for name in _members(root) if name not in left_out):
        size, sha = known.get(name) or file_digest(root / name)
        files[name] = {"size": size, "sha256": sha}
    manifest = {"format": _FORMAT, "version": 1, "files": files}
    write_new(root / MANIFEST_FILE, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


def well_formed_entry(entry: object) -> bool:
    """A manifest entry: an object with an integer size (not a JSON boolean) and a sha256 hex digest."""
    return (
        isinstance(entry, dict)
        and type(entry.get("size")) is int
        and isinstance(entry.get("sha256"), str)
        and re.fullmatch("[0-9a-f]{64}", entry["sha256"]) is not None
    )


def _listed(manifest: object) -> dict | None:
    """The ``files`` object of a parsed manifest of ours (the format :func:`write_manifest` writes), else None."""
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT or not isinstance(manifest.get("files"), dict):
        return None
    return manifest["files"]


def check_manifest(root: Path, hashes: bool, known: dict[str, str] | None = None) -> list[str]:
    """Every disagreement between the manifest and the files; sha256 only when ``hashes``.

    ``known`` holds sha256 digests the caller already computed (relative name -> hex), so a full
    validation reads each shard once.
    """
    known = known or {}
    root = Path(root)
    try:
        manifest = read_json_object(
            root / MANIFEST_FILE, HpuFp8Error, "missing: the checkpoint was never finished, or was not written by hpu-fp8"
        )
    except HpuFp8Error as exc:
        return [str(exc)]
    listed = _listed(manifest)
    if listed is None:
        return [f"{MANIFEST_FILE} is not an {_FORMAT} file"]
    problems = []
    for name, entry in listed.items():
        try:
            target = safe_member(root, name)
        except UnsafePathError as exc:
            problems.append(f"{MANIFEST_FILE} lists {name!r}, which is not a file inside the checkpoint ({exc})")
            continue
        if not well_formed_entry(entry):
            problems.append(f"{MANIFEST_FILE}: entry {name!r} is not {{size: integer, sha256: 64 hex digits}}")
            continue
        if not target.is_file():
            problems.append(f"{name}: listed in {MANIFEST_FILE} but missing")
            continue
        size = target.stat().st_size
        if size != entry["size"]:
            problems.append(f"{name}: {size} bytes, manifest says {entry['size']}")
        elif hashes and (known.get(name) or file_digest(target)[1]) != entry["sha256"]:
            problems.append(f"{name}: sha256 differs from {MANIFEST_FILE} (file changed or corrupt)")
    for name in _members(root):
        if name not in listed:
            problems.append(f"{name}: present but not in {MANIFEST_FILE}")
    return problems


def _raise(error: OSError) -> None:
    raise error


def _listed_files(root: Path) -> dict[str, dict] | str:
    """The files a manifest of ours in ``root`` lists, or why there is none to trust: missing, not a regular file,
    not JSON, not the shape :func:`write_manifest` writes."""
    data = read_own(root / MANIFEST_FILE, _MANIFEST_LIMIT)
    if data is None:
        return f"no {MANIFEST_FILE} (or one that is a link, not a regular file, or over {_MANIFEST_LIMIT >> 20} MiB)"
    try:
        manifest = parse_json(data)
    except ValueError:
        return f"{MANIFEST_FILE} is not valid JSON"
    listed = _listed(manifest)
    if listed is None:
        return f"{MANIFEST_FILE} is not an {_FORMAT} file"
    malformed = next((name for name, entry in listed.items() if not well_formed_entry(entry)), None)
    if malformed is not None:
        return f"{MANIFEST_FILE}: entry {malformed!r} is not {{size: integer, sha256: 64 hex digits}}"
    return listed


def foreign_entry(root: str | Path) -> str | None:
    """Why ``root`` is not, whole and unchanged, a directory this tool published; None when it is.

    It is when its manifest is a regular file of ours that parses, lists every file present (each a regular file of
    its listed size; those up to 64 MiB also of their listed sha256), every file it lists is present, and nothing else
    lies there: no other file, link, FIFO, or directory holding no listed file. The reason names the first entry at
    fault. ``--force`` deletes only such a directory, so that a user's file beside a checkpoint, or an empty or stale
    manifest in a user's directory, never makes that directory deletable.
    """
    root = Path(root)
    listed = _listed_files(root)
    if isinstance(listed, str):
        return listed
    holders = {parent.as_posix() for name in listed for parent in Path(name).parents if parent != Path(".")}
    found = set()
    try:
        for directory, subdirectories, files in os.walk(root, onerror=_raise):  # links are listed, never followed
            for path in sorted(Path(directory) / name for name in (*subdirectories, *files)):
                relative = path.relative_to(root).as_posix()
                found_here = path.lstat()
                if relative == MANIFEST_FILE or (stat.S_ISDIR(found_here.st_mode) and relative in holders):
                    continue
                entry = listed.get(relative)
                if entry is None or not stat.S_ISREG(found_here.st_mode):
                    return f"{relative} is not a file listed in {MANIFEST_FILE}"
                size = found_here.st_size
                if size != entry["size"]:
                    return f"{relative} is {size} bytes, {MANIFEST_FILE} says {entry['size']}"
                if size <= _HASHED_UP_TO and file_digest(path)[1] != entry["sha256"]:
                    return f"{relative} differs from the sha256 in {MANIFEST_FILE}"
                found.add(relative)
    except OSError as exc:
        return f"{exc.filename or root} cannot be read ({exc.strerror or exc})"
    missing = sorted(set(listed) - found)
    return f"{missing[0]} is listed in {MANIFEST_FILE} but missing" if missing else None

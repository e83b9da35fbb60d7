"""hpu_fp8_manifest.json: every file of a checkpoint with its size and sha256, written last.

Its presence marks a finished checkpoint; resume, push and pull verify files against it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from hpu_fp8_loader.errors import HpuFp8Error, UnsafePathError
from hpu_fp8_loader.io.checkpoint import safe_member
from hpu_fp8_loader.io.jsonfile import read_json_object
from hpu_fp8_loader.io.own_files import write_new

__all__ = ["MANIFEST_FILE", "check_manifest", "file_digest", "well_formed_entry", "write_manifest"]

MANIFEST_FILE = "hpu_fp8_manifest.json"
_FORMAT = "hpu-fp8-manifest"
_READ_BYTES = 8 << 20


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
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def write_manifest(root: Path, known: dict[str, tuple[int, str]] | None = None) -> dict:
    """Record every file under ``root``; digests in ``known`` (computed while writing) are reused."""
    root = Path(root)
    known = known or {}
    files = {}
    for name in _members(root):
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
    if manifest.get("format") != _FORMAT or not isinstance(manifest.get("files"), dict):
        return [f"{MANIFEST_FILE} is not an {_FORMAT} file"]
    problems = []
    listed = manifest["files"]
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

"""hpu_fp8_manifest.json: every file of a checkpoint with its size and sha256, written last.

Its presence marks a finished checkpoint; resume, push and pull verify files against it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import UnsafePathError
from .checkpoint import safe_member

__all__ = ["MANIFEST_FILE", "check_manifest", "file_digest", "write_manifest"]

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
    (root / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def check_manifest(root: Path, hashes: bool, known: dict[str, str] | None = None) -> list[str]:
    """Every disagreement between the manifest and the files; sha256 only when ``hashes``.

    ``known`` holds sha256 digests the caller already computed (relative name -> hex), so a full
    validation reads each shard once.
    """
    known = known or {}
    root = Path(root)
    path = root / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [f"{MANIFEST_FILE} is missing: the checkpoint was never finished, or was not written by hpu-fp8"]
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return [f"{MANIFEST_FILE} is not valid JSON ({exc})"]
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT or not isinstance(manifest.get("files"), dict):
        return [f"{MANIFEST_FILE} is not an {_FORMAT} file"]
    problems = []
    listed = manifest["files"]
    for name, entry in listed.items():
        try:
            target = safe_member(root, name)
        except UnsafePathError:
            problems.append(f"{MANIFEST_FILE} lists {name!r}, outside the checkpoint")
            continue
        if not target.is_file():
            problems.append(f"{name}: listed in {MANIFEST_FILE} but missing")
            continue
        size = target.stat().st_size
        if not isinstance(entry, dict) or size != entry.get("size"):
            problems.append(f"{name}: {size} bytes, manifest says {entry.get('size') if isinstance(entry, dict) else entry}")
        elif hashes and (known.get(name) or file_digest(target)[1]) != entry.get("sha256"):
            problems.append(f"{name}: sha256 differs from {MANIFEST_FILE} (file changed or corrupt)")
    for name in _members(root):
        if name not in listed:
            problems.append(f"{name}: present but not in {MANIFEST_FILE}")
    return problems

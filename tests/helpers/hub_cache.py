"""A Hugging Face Hub cache laid out on disk the way huggingface_hub lays it out, for offline tests.

blobs/<sha256> hold the bytes; snapshots/<commit>/<file> link to them; refs/main names the commit
(huggingface_hub 1.33 and 2.4 resolve such a cache offline: ``snapshot_download(...,
local_files_only=True)``, ``hf_hub_download``, ``try_to_load_from_cache``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_to_cache(
    cache: Path, repo_id: str, source: Path, commit: str = "0" * 39 + "1", ref: str = "main", repo_type: str = "model"
) -> Path:
    """``source``'s files as ``repo_id``'s snapshot at ``commit`` (named by ``refs/<ref>``), a model or a dataset repository."""
    repo = cache / (f"{repo_type}s--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        blob.write_bytes(file.read_bytes())
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)  # a branch or tag naming the commit, as --revision REF finds it offline
    return snapshot

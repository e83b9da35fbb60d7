"""The resume journal of a conversion: which shards an interrupted run finished, and from what.

``OUT.partial/.hpu_fp8_progress.json`` records each finished shard's size and sha256 under a fingerprint
of the source files, the plan, the config and every amax; a re-run reuses a shard only when the
fingerprint is equal and the shard's bytes still hash to what was recorded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.io.fingerprint import file_fingerprint
from hpu_fp8_loader.io.jsonfile import JsonFormatError, parse_json
from hpu_fp8_loader.io.manifest import file_digest
from hpu_fp8_loader.io.writer import Shard, clear_staging
from hpu_fp8_loader.spec.config import QuantizationConfig

__all__ = ["JOURNAL", "conversion_fingerprint", "reusable_shards", "save_journal"]

JOURNAL = ".hpu_fp8_progress.json"


def conversion_fingerprint(checkpoint: Checkpoint, shards: list[Shard], qc: QuantizationConfig, act: dict[str, float]) -> str:
    """Identity of a conversion: the source files' content (io/fingerprint.py), the plan, the config and every
    amax. Resume requires equality."""
    source = sorted((str(p), file_fingerprint(p)) for p in checkpoint.files)
    plan = [(s.file_name, [(t.name, t.dtype, list(t.shape)) for t in s.tensors]) for s in shards]
    identity = {
        "source": source,
        "config": checkpoint.config,
        "plan": plan,
        "qc": qc.model_dump(mode="json", exclude={"producer"}),
        "act": act,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def reusable_shards(staging: Path, fingerprint: str) -> dict[str, dict]:
    """Finished shards an interrupted run left in ``staging`` whose sha256 still matches; clears the rest.

    A journal that is not strict JSON (cut short, a 5,000-digit integer) vouches for nothing: everything is redone.
    """
    journal = staging / JOURNAL
    try:
        recorded = parse_json(journal.read_bytes())
    except (FileNotFoundError, JsonFormatError):
        recorded = {}
    if not isinstance(recorded, dict):
        recorded = {}
    if recorded.get("fingerprint") != fingerprint:
        clear_staging(staging)
        return {}
    reusable = {}
    for name, entry in recorded.get("shards", {}).items():
        path = staging / name
        if path.is_file() and path.stat().st_size == entry.get("size") and file_digest(path)[1] == entry.get("sha256"):
            reusable[name] = entry
    return reusable


def save_journal(staging: Path, fingerprint: str, done: dict[str, dict]) -> None:
    temporary = staging / (JOURNAL + ".tmp")
    temporary.write_text(json.dumps({"fingerprint": fingerprint, "shards": done}))
    temporary.replace(staging / JOURNAL)

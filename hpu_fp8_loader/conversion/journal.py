"""The resume journal of a conversion: which shards an interrupted run finished, and from what.

``OUT.partial/.hpu_fp8_progress.json`` records each finished shard's size and sha256 under a fingerprint
of the source files, the plan, the config and every amax; a re-run reuses a shard only when the
fingerprint is equal and the shard's bytes still hash to what was recorded. A one-step conversion
(``quantize``) keeps its calibration there too (``CALIBRATION``), under its own key, so that a re-run
after an interruption neither calibrates again nor loses it when the conversion itself starts afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.io.fingerprint import file_fingerprint
from hpu_fp8_loader.io.jsonfile import parse_json
from hpu_fp8_loader.io.manifest import file_digest, well_formed_entry
from hpu_fp8_loader.io.own_files import read_own, write_new
from hpu_fp8_loader.io.writer import Shard, clear_staging
from hpu_fp8_loader.spec.config import QuantizationConfig

__all__ = ["CALIBRATION", "JOURNAL", "STAGING_ONLY", "conversion_fingerprint", "reusable_shards", "save_journal"]

JOURNAL = ".hpu_fp8_progress.json"
CALIBRATION = ".hpu_fp8_calibration.json"
# What OUT.partial holds besides the checkpoint: removed before it is published.
STAGING_ONLY = (JOURNAL, CALIBRATION)
# The most a journal of ours can hold: its fingerprint, and per planned shard a name, a size and a sha256.
_JOURNAL_BYTES, _ENTRY_BYTES = 1024, 1024


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


def _recorded(staging: Path, fingerprint: str, shards: list[Shard]) -> dict[str, dict]:
    """The planned shards the journal records as finished under ``fingerprint``; nothing when it records another
    conversion, or is no journal this tool wrote: not a regular file (a link, a FIFO), too big, not JSON, not an
    object of the shape :func:`save_journal` writes. An entry naming no planned shard, or not ``{size, sha256}``,
    is left out: that shard is simply made again."""
    data = read_own(staging / JOURNAL, _JOURNAL_BYTES + _ENTRY_BYTES * len(shards))
    try:
        recorded = parse_json(data) if data is not None else None
    except ValueError:  # JsonFormatError, and whatever else a damaged journal makes the parser refuse
        return {}
    if (
        not isinstance(recorded, dict)
        or recorded.get("fingerprint") != fingerprint
        or not isinstance(recorded.get("shards"), dict)
    ):
        return {}
    planned = {s.file_name for s in shards}
    return {name: entry for name, entry in recorded["shards"].items() if name in planned and well_formed_entry(entry)}


def reusable_shards(staging: Path, fingerprint: str, shards: list[Shard]) -> dict[str, dict]:
    """Finished shards an interrupted run left in ``staging`` whose size and sha256 still match the journal; every
    other entry of ``staging`` is removed (a shard of another conversion, a file or link planted there), so that
    only what this conversion writes is published. A one-step conversion's calibration (``CALIBRATION``) is kept:
    it is keyed on its own and outlives a changed conversion."""
    reusable = {}
    for name, entry in _recorded(staging, fingerprint, shards).items():
        path = staging / name
        found = path.lstat() if os.path.lexists(path) else None
        if (
            found is not None
            and stat.S_ISREG(found.st_mode)
            and found.st_size == entry["size"]
            and file_digest(path)[1] == entry["sha256"]
        ):
            reusable[name] = entry
    clear_staging(staging, keep={*reusable, CALIBRATION})
    return reusable


def save_journal(staging: Path, fingerprint: str, done: dict[str, dict]) -> None:
    """Record the finished shards (written anew and renamed over the journal: never through a planted link)."""
    write_new(staging / JOURNAL, json.dumps({"fingerprint": fingerprint, "shards": done}).encode())

"""What a resumed conversion trusts about its source: a cheap fingerprint of each file's content.

Size and mtime are not enough: a file rewritten in place with the same size and its mtime restored
(``cp -p``, ``rsync -t``, a re-download) would let a resume reuse shards made from other weights. Hashing
every byte would cost a full read of a 20-600 GB model before any work. So a source file is identified by
its size, its whole safetensors header (every name, dtype, shape and offset) and 64 blocks of 4 KiB spread
evenly over its data: any rewrite with other weights changes them. A file in the Hugging Face cache is a
link into ``blobs/`` whose name is the sha256 (or git sha1) of the whole content, so that name is used.
What this cannot see is an edit confined to bytes between the sampled blocks.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

from hpu_fp8_loader.io.hub_cache import cache_blob

__all__ = ["SAMPLED_BLOCKS", "SAMPLE_BYTES", "file_fingerprint"]

SAMPLED_BLOCKS = 64
SAMPLE_BYTES = 4096


def _hub_blob_name(path: Path) -> str | None:
    """The content hash a Hugging Face cache snapshot link points at, if ``path`` is one of the cache's own links.

    Only a link of a snapshot that really lies in huggingface_hub's cache, onto its repository's own blob
    (:func:`~hpu_fp8_loader.io.hub_cache.cache_blob`): a directory merely shaped like one elsewhere
    (``x/snapshots/model/f -> ../../blobs/<64 hex digits>``) names nothing about its content, so it is sampled.
    """
    blob = cache_blob(path.parent, path)
    return None if blob is None else blob.name


def file_fingerprint(path: str | Path) -> str:
    """sha256 over the size, the safetensors header and evenly spaced samples of the data (or the Hub blob hash)."""
    path = Path(path)
    blob = _hub_blob_name(path)
    if blob is not None:
        return f"blob:{blob}"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(struct.pack("<Q", size))
        prefix = f.read(8)
        header_length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        start = min(8 + header_length, size)  # a checkpoint's headers were checked when it was opened
        digest.update(prefix)
        digest.update(f.read(max(start - len(prefix), 0)))
        span = size - start
        step = max(span // SAMPLED_BLOCKS, 1)
        for offset in range(start, size, step)[:SAMPLED_BLOCKS]:
            digest.update(os.pread(f.fileno(), SAMPLE_BYTES, offset))
        digest.update(os.pread(f.fileno(), SAMPLE_BYTES, max(size - SAMPLE_BYTES, start)))  # the tail, always
    return digest.hexdigest()

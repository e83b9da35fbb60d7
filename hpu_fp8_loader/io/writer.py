"""Streaming sharded safetensors output, written into ``OUT.partial`` and renamed when complete.

The header of a safetensors file only needs names, dtypes and shapes, so a shard is planned up
front and each tensor's bytes are appended as soon as it is ready: nothing holds more than one
tensor. The index and the manifest are written last; a directory without ``hpu_fp8_manifest.json``
was never finished, and a ``.partial`` directory is never mistaken for output.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import HpuFp8Error, OutputExistsError
from .checkpoint import INDEX_FILE
from .safetensors_file import DTYPES, dtype_name

__all__ = ["PlannedTensor", "Shard", "ShardWriter", "atomic_output_dir", "plan_shards", "write_index"]

PARTIAL_SUFFIX = ".partial"


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Shard:
    file_name: str
    tensors: tuple[PlannedTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_shards(tensors: Iterable[PlannedTensor], max_shard_bytes: int) -> list[Shard]:
    """Group tensors, in order, into shards of at most ``max_shard_bytes`` (a bigger tensor gets its own).

    File names carry the exact shard count, unlike the legacy converter's estimate.
    """
    groups: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard_bytes:
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


class ShardWriter:
    """Writes one planned shard; tensors must arrive in plan order. Hashes the bytes as they go."""

    def __init__(self, directory: Path, shard: Shard, metadata: dict[str, str] | None = None):
        self.path = Path(directory) / shard.file_name
        self.shard = shard
        self._next = 0
        self._sha = hashlib.sha256()
        self._file = open(self.path, "wb")  # noqa: SIM115 - held open across add() calls, closed in close()
        self._write(_header_bytes(shard, metadata))

    def _write(self, data: bytes | memoryview) -> None:
        try:
            self._file.write(data)
        except OSError as exc:
            self._file.close()
            raise HpuFp8Error(f"{self.path}: write failed ({exc.strerror or exc}); nothing was published") from exc
        self._sha.update(data)

    def add(self, name: str, array: np.ndarray) -> None:
        planned = self.shard.tensors[self._next]
        if name != planned.name or dtype_name(array.dtype) != planned.dtype or tuple(array.shape) != planned.shape:
            raise ValueError(
                f"{self.path}: got {name} {dtype_name(array.dtype)}{list(array.shape)}, "
                f"planned {planned.name} {planned.dtype}{list(planned.shape)}"
            )
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self._write(memoryview(data))
        self._next += 1

    def close(self) -> tuple[int, str]:
        """Flush to disk; returns (size, sha256)."""
        if self._next != len(self.shard.tensors):
            raise ValueError(f"{self.path}: closed after {self._next} of {len(self.shard.tensors)} tensors")
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise HpuFp8Error(f"{self.path}: flush failed ({exc.strerror or exc}); nothing was published") from exc
        finally:
            self._file.close()
        return self.path.stat().st_size, self._sha.hexdigest()


def write_index(directory: Path, shards: list[Shard]) -> None:
    weight_map = {t.name: s.file_name for s in shards for t in s.tensors}
    index = {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": weight_map}
    (Path(directory) / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


@contextmanager
def atomic_output_dir(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield ``OUT.partial``; on success replace ``OUT`` with it in one rename.

    On failure the partial directory stays (a later run may resume from it) and ``OUT`` is untouched.
    """
    out = Path(out)
    if out.exists() and not force:
        raise OutputExistsError(f"{out}: already exists; pass --force to replace it")
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    partial.mkdir(parents=True, exist_ok=True)
    yield partial
    if out.exists():
        retired = out.with_name(out.name + ".replaced")
        shutil.rmtree(retired, ignore_errors=True)
        out.rename(retired)
        partial.rename(out)
        shutil.rmtree(retired)
    else:
        partial.rename(out)

"""Damage a checkpoint in place for tests of the errors it must cause."""

from __future__ import annotations

from pathlib import Path

from hpu_fp8_loader.io.safetensors_file import read_header


def overwrite_tensor_bytes(root: Path, name: str, data: bytes) -> Path:
    """Replace the bytes of one tensor in place (same length); returns the shard path."""
    for shard in sorted(root.glob("*.safetensors")):
        tensors, _ = read_header(shard)
        if name in tensors:
            info = tensors[name]
            assert len(data) == info.nbytes
            with open(shard, "r+b") as f:
                f.seek(info.begin)
                f.write(data)
            return shard
    raise KeyError(name)

"""A checkpoint directory: config.json, the shard index, and the shards it names.

Every path that comes from a file (the index) is checked to stay inside the directory before it is
opened, so a hostile index cannot make us read /etc/passwd or follow a symlink out of the tree.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpu_fp8_loader.errors import CheckpointIndexError, CheckpointNotFoundError, ConfigError, UnsafePathError
from hpu_fp8_loader.io.hub_cache import cache_blob
from hpu_fp8_loader.io.jsonfile import printable, read_json_object
from hpu_fp8_loader.io.safetensors_file import SafetensorsFile, TensorInfo
from hpu_fp8_loader.spec.names import COPIED_SOURCE_FILES

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "Checkpoint",
    "read_config",
    "read_index",
    "resolve_path",
    "safe_member",
]

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"


def read_config(root: Path) -> dict:
    """config.json as a dict, or :class:`ConfigError` naming the file and the JSON error.

    NaN and Infinity are let through here only: transformers writes them for a non-finite float in a key
    we may never read; the keys we do read are type-checked by their schema.
    """
    return read_json_object(
        Path(root) / CONFIG_FILE, ConfigError, "missing; every checkpoint needs a config.json", allow_non_finite=True
    )


def resolve_path(path: str | Path) -> Path:
    """``path`` absolute, with every link followed; a link loop is :class:`UnsafePathError` naming it (Python 3.11's
    ``resolve`` raises RuntimeError). For every user path that is resolved: an output, a report, a dataset."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError):
        raise UnsafePathError(f"{path}: its symbolic links cannot be followed (a link loop?)") from None


def _inside(root: Path, path: Path) -> Path | None:
    """What ``path`` (a member of the checkpoint ``root``) is read from, or None when that lies outside it.

    Its links followed, it must stay inside ``root``; or it is a Hugging Face cache snapshot's own link into its
    blob store (:func:`~hpu_fp8_loader.io.hub_cache.cache_blob`: only in huggingface_hub's real cache, checked
    without following a link out of it). Any other link out of the tree is not followed.
    """
    resolved = resolve_path(path)
    if resolved.is_relative_to(resolve_path(Path(root))):
        return resolved
    return cache_blob(root, path) if os.path.islink(path) else None


def safe_member(root: Path, relative: str) -> Path:
    """``root / relative`` after checking it stays inside ``root`` (no absolute path, ``..`` or symlink escape).

    A NUL or other control character is refused too: the OS cannot open such a name, and printed in a
    message it would forge a second line.
    """
    if not isinstance(relative, str) or not relative or Path(relative).is_absolute() or "\\" in relative:
        raise UnsafePathError(f"{root}: {json.dumps(relative)} is not a relative path inside the checkpoint")
    if not printable(relative):
        raise UnsafePathError(f"{root}: {relative!r} holds a control character (a NUL byte?)")
    if any(part == ".." for part in Path(relative).parts):
        raise UnsafePathError(f"{root}: {relative!r} climbs out of the checkpoint with '..'")
    path = Path(root).absolute() / relative
    if _inside(root, path) is None:
        raise UnsafePathError(f"{root}: {relative!r} resolves to {resolve_path(path)}, outside the checkpoint")
    return path


def source_file(root: Path, name: str) -> Path | None:
    """The file ``name`` of a source checkpoint, resolved, or None when absent.

    Refused, naming it: a link that leaves the source (a snapshot's links into its blob store in the real
    Hugging Face cache excepted), or anything but a regular file, so that e.g. ``tokenizer_config.json ->
    /proc/self/environ`` never carries a token into a published checkpoint.
    """
    path = Path(root) / name
    if not os.path.lexists(path):
        return None
    resolved = _inside(root, path)
    if resolved is None:
        raise UnsafePathError(f"{path}: a link to {resolve_path(path)}, outside the source checkpoint; refusing to copy it")
    if not resolved.is_file():  # a directory, a FIFO or device, a link to nothing (resolved holds no link)
        raise UnsafePathError(f"{path}: not a regular file; refusing to copy it")
    return resolved


def copied_source_files(root: Path) -> dict[str, Path]:
    """The source's tokenizer and generation files that an output carries (``spec.names.COPIED_SOURCE_FILES``),
    each resolved by :func:`source_file`; a JSON one must parse, so that a corrupt tokenizer file is refused
    before hours of work instead of being published beside the weights."""
    found = {}
    for name in COPIED_SOURCE_FILES:
        path = source_file(root, name)
        if path is not None:
            if name.endswith(".json"):
                read_json_object(path, ConfigError)
            found[name] = path
    return found


def read_index(root: Path) -> tuple[dict[str, str], dict]:
    """(weight_map, metadata) of model.safetensors.index.json, shape-checked."""
    path = Path(root) / INDEX_FILE
    index = read_json_object(path, CheckpointIndexError)
    if not isinstance(index.get("weight_map"), dict):
        raise CheckpointIndexError(f"{path}: no 'weight_map' object")
    weight_map = index["weight_map"]
    for name, file in weight_map.items():
        if not printable(name):
            raise CheckpointIndexError(f"{path}: tensor name {name!r} holds a control character (a NUL byte?)")
        if not isinstance(file, str) or not file:
            raise CheckpointIndexError(f"{path}: tensor '{name}' maps to {json.dumps(file)}, not a file name")
        if not printable(file):
            raise CheckpointIndexError(f"{path}: tensor '{name}' maps to {file!r}, which holds a control character (a NUL byte?)")
    metadata = index.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise CheckpointIndexError(f"{path}: 'metadata' is {type(metadata).__name__}, not an object")
    return weight_map, metadata


@dataclass
class Checkpoint:
    """An opened checkpoint: config, the tensor -> file map and the checked shard headers.

    ``open`` raises on the first defect; the validator uses the lower-level functions instead so it
    can list every defect at once.
    """

    root: Path
    config: dict
    files: dict[Path, SafetensorsFile] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @classmethod
    def open(cls, root: str | Path) -> Checkpoint:
        root = Path(root)
        if not root.is_dir():
            raise CheckpointNotFoundError(f"{root}: no such checkpoint directory")
        checkpoint = cls(root, read_config(root))
        weight_map = read_index(root)[0] if os.path.lexists(root / INDEX_FILE) else None  # a FIFO or loop there is refused
        shards = {relative: checkpoint._add_file(relative) for relative in _shard_names(root, weight_map)}
        if weight_map is not None:
            listed: dict[str, set[str]] = {}
            for name, relative in weight_map.items():
                listed.setdefault(relative, set()).add(name)
            for relative, listed_names in listed.items():
                absent = sorted(listed_names - shards[relative].tensors.keys())
                if absent:
                    raise CheckpointIndexError(f"{root / INDEX_FILE}: tensor '{absent[0]}' is not in {relative}")
            unlisted = sorted(checkpoint.tensors.keys() - weight_map.keys())
            if unlisted:
                more = f" and {len(unlisted) - 1} more" if len(unlisted) > 1 else ""
                raise CheckpointIndexError(
                    f"{root / INDEX_FILE}: the shards hold tensor '{unlisted[0]}'{more}, which the index omits"
                )
        return checkpoint

    def _add_file(self, relative: str) -> SafetensorsFile:
        path = safe_member(self.root, relative)
        if not path.is_file():
            what = "not a regular file" if os.path.lexists(path) else "missing"
            raise CheckpointNotFoundError(f"{self.root}: shard {relative} is {what}")
        shard = SafetensorsFile(path)
        for name, info in shard.tensors.items():
            if name in self.tensors:
                raise CheckpointIndexError(f"{self.root}: tensor '{name}' appears in two shards")
            self.tensors[name] = info
        self.files[shard.path] = shard  # the very key object the TensorInfos hold: lookups skip Path.__eq__
        return shard

    def get(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of a tensor."""
        info = self.tensors[name]
        return self.files[info.file].get(name)


def _shard_names(root: Path, weight_map: dict[str, str] | None) -> list[str]:
    """The shard files of a checkpoint: those the index names, else ``model.safetensors``, else every ``*.safetensors``."""
    if weight_map is not None:
        names = sorted(set(weight_map.values()))
        for name in names:
            safe_member(root, name)
        if SINGLE_FILE not in names and os.path.lexists(root / SINGLE_FILE):
            # transformers loads model.safetensors first, we would load the index: two different models
            raise CheckpointIndexError(
                f"{root}: holds both {SINGLE_FILE} and {INDEX_FILE}, which does not name it; which weights are "
                "the model is ambiguous (remove the one that is stale)"
            )
        return names
    if (root / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    names = sorted(p.name for p in root.glob("*.safetensors"))
    if not names:
        raise CheckpointNotFoundError(f"{root}: no *.safetensors files and no {INDEX_FILE}")
    return names

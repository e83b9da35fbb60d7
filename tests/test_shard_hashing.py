"""Shards hashed while they are written (issue 41): no byte of a shard is read back for its sha256.

A shard written whole, in file order, by one process carries its sha256 from the writes themselves
(``ShardFile.digest``); convert writes every shard that way, one worker a shard, each weight's scale right after it
and a transposed source put together in memory. Only a tensor too big for the worker's share of memory is written
where its column segments go, and that shard alone is hashed from disk.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from hpu_fp8_loader.conversion import convert as convert_module
from hpu_fp8_loader.conversion import worker as worker_module
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.io import manifest as manifest_module
from hpu_fp8_loader.io.manifest import MANIFEST_FILE
from hpu_fp8_loader.io.writer import PlannedTensor, ShardFile, plan_shards
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def shard(tmp_path):
    tensors = (PlannedTensor("a", "F32", (4, 3)), PlannedTensor("b", "F32", (2,)))
    return ShardFile(tmp_path, plan_shards(tensors, 1 << 20)[0])


def test_a_shard_written_in_file_order_knows_its_sha256(shard):
    shard.create()
    shard.write("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    shard.write("a", np.arange(6, 12, dtype=np.float32).reshape(2, 3), first_row=2)
    assert shard.digest() is None  # "b" not written yet: the file's last bytes are not the hashed ones
    shard.write("b", np.ones(2, np.float32))
    shard.close()
    assert shard.digest() == (shard.path.stat().st_size, _sha256(shard.path))


@pytest.mark.parametrize(
    "writes",
    [
        [("b", np.ones(2, np.float32), 0), ("a", np.zeros((4, 3), np.float32), 0)],  # tensors out of order
        [("a", np.zeros((2, 3), np.float32), 2), ("a", np.zeros((2, 3), np.float32), 0), ("b", np.ones(2, np.float32), 0)],
        [("a", np.zeros((4, 3), np.float32), 0), ("a", np.ones((2, 3), np.float32), 0), ("b", np.ones(2, np.float32), 0)],
    ],
    ids=["tensors-swapped", "rows-backwards", "rows-written-twice"],
)
def test_a_shard_written_out_of_order_has_no_digest_of_its_own(shard, writes):
    shard.create()
    for name, array, first_row in writes:
        shard.write(name, array, first_row)
    shard.close()
    assert shard.digest() is None


def test_column_segments_written_in_place_give_no_digest(shard):
    shard.create()
    shard.write_columns("a", np.zeros((4, 1), np.float32), 0, 0)
    shard.write_columns("a", np.zeros((4, 2), np.float32), 0, 1)
    shard.write("b", np.ones(2, np.float32))
    assert shard.digest() is None


def test_a_weight_scale_stays_in_the_shard_of_its_weight():
    tensors = [PlannedTensor("x.weight", "F8_E4M3", (10, 10)), PlannedTensor("x.weight_scale", "F32", (1,))]
    assert len(plan_shards(tensors, 100)) == 2  # by size alone the scale would start a shard
    kept = plan_shards(tensors, 100, with_previous=lambda t: t.name.endswith(".weight_scale"))
    assert [[t.name for t in s.tensors] for s in kept] == [["x.weight", "x.weight_scale"]]


def _watch_hashing(monkeypatch) -> list[str]:
    """The files hashed from disk during a conversion, in this process (where shards would be read back)."""
    hashed: list[str] = []
    read = manifest_module.file_digest

    def recording(path):
        hashed.append(Path(path).name)
        return read(path)

    monkeypatch.setattr(manifest_module, "file_digest", recording)
    monkeypatch.setattr(convert_module, "file_digest", recording)
    return hashed


def _manifest_matches_the_bytes(out: Path) -> list[str]:
    files = json.loads((out / MANIFEST_FILE).read_text())["files"]
    shards = sorted(name for name in files if name.endswith(".safetensors"))
    assert shards and all(files[name]["sha256"] == _sha256(out / name) for name in shards), files
    assert all(files[name]["size"] == (out / name).stat().st_size for name in shards)
    return shards


@pytest.mark.parametrize("layout", ["paddle", "torch"])
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "row-blocks"])
def test_convert_hashes_every_shard_as_it_writes_it(tmp_path, source_factory, monkeypatch, layout, streamed):
    """Several shards, each its manifest sha256 equal to sha256 of its bytes, none read back; row blocks of a torch
    source are column segments of the spec tensor, put together in memory."""
    hashed = _watch_hashing(monkeypatch)
    streaming = {"whole_tensor_bytes": 0, "block_elements": 1000} if streamed else {}
    options = ConvertOptions(max_shard_bytes=64_000, **streaming)
    convert(
        source_factory("ernie-moe-tiny", layout),
        tmp_path / "o",
        [synthetic_measurements(preset_config("ernie-moe-tiny"))],
        options,
    )
    shards = _manifest_matches_the_bytes(tmp_path / "o")
    assert len(shards) > 3 and not [name for name in hashed if name.endswith(".safetensors")], hashed


def test_a_tensor_too_big_to_put_together_is_written_in_place_and_its_shard_hashed_from_disk(
    tmp_path, source_factory, monkeypatch
):
    """kept_tensor_bytes=0 leaves a worker no memory for a transposed tensor: its column segments go straight to the
    shard, which is then hashed from disk (and only such shards); the checkpoint is the same either way."""
    hashed = _watch_hashing(monkeypatch)
    source = source_factory("ernie-moe-tiny", "torch")
    measurements = [synthetic_measurements(preset_config("ernie-moe-tiny"))]
    options = ConvertOptions(max_shard_bytes=64_000, whole_tensor_bytes=0, block_elements=1000, kept_tensor_bytes=0)
    convert(source, tmp_path / "in-place", measurements, options)
    shards = _manifest_matches_the_bytes(tmp_path / "in-place")
    from_disk = [name for name in hashed if name.endswith(".safetensors")]
    assert from_disk and set(from_disk) < set(shards)  # a shard of norms and act tensors only is still in order
    assembled = ConvertOptions(max_shard_bytes=64_000, whole_tensor_bytes=0, block_elements=1000)
    convert(source, tmp_path / "assembled", measurements, assembled)
    for name in shards:
        assert (tmp_path / "in-place" / name).read_bytes() == (tmp_path / "assembled" / name).read_bytes(), name


def test_an_interrupted_convert_resumes_from_its_finished_shards_byte_identically(tmp_path, source_factory, monkeypatch):
    """The third shard fails mid-conversion (as a kill would leave it: the first two finished, hashed, journalled);
    the same command then reuses those two, writes the rest, and publishes the same bytes as an uninterrupted run."""
    source = source_factory("qwen2-tiny", "torch")
    measurements = [synthetic_measurements(preset_config("qwen2-tiny"))]
    options = ConvertOptions(max_shard_bytes=64_000)
    convert(source, tmp_path / "reference", measurements, options)
    written: list[str] = []
    real = worker_module.convert_shard

    def failing(file_name, weights):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(file_name)
        return real(file_name, weights)

    monkeypatch.setattr(convert_module, "convert_shard", failing)
    with pytest.raises(KeyboardInterrupt):
        convert(source, tmp_path / "o", measurements, options)
    assert not (tmp_path / "o").exists() and (tmp_path / "o.partial").is_dir()
    monkeypatch.setattr(convert_module, "convert_shard", real)
    result = convert(source, tmp_path / "o", measurements, options)
    assert result.reused_shards == 2
    names = sorted(p.name for p in (tmp_path / "reference").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "o").iterdir())
    for name in names:
        assert (tmp_path / "o" / name).read_bytes() == (tmp_path / "reference" / name).read_bytes(), name


@pytest.mark.slow
def test_two_workers_hash_every_shard_as_they_write_it(tmp_path, source_factory, monkeypatch):
    """Each worker writes whole shards: with two of them too no shard is hashed from disk, and the bytes are those
    of one worker."""
    hashed = _watch_hashing(monkeypatch)
    source = source_factory("ernie-moe-tiny", "torch")
    measurements = [synthetic_measurements(preset_config("ernie-moe-tiny"))]
    streamed = {"max_shard_bytes": 64_000, "whole_tensor_bytes": 0, "block_elements": 1000}
    convert(source, tmp_path / "two", measurements, ConvertOptions(workers=2, **streamed))
    shards = _manifest_matches_the_bytes(tmp_path / "two")
    assert not [name for name in hashed if name.endswith(".safetensors")], hashed
    convert(source, tmp_path / "one", measurements, ConvertOptions(**streamed))
    for name in shards:
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name

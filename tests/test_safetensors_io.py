"""Our safetensors reader and streaming writer, with the safetensors library as the oracle."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from hpu_fp8_loader.errors import CheckpointIndexError, SafetensorsFormatError, UnsafePathError
from hpu_fp8_loader.io.checkpoint import Checkpoint, safe_member
from hpu_fp8_loader.io.safetensors_file import SafetensorsFile, dtype_name, read_header
from hpu_fp8_loader.io.writer import PlannedTensor, ShardFile, plan_shards

np.float8_e4m3fn = ml_dtypes.float8_e4m3fn  # safetensors issue 682: its numpy path needs this alias


def _arrays():
    rng = np.random.default_rng(0)
    return {
        "a.weight": rng.standard_normal((5, 7)).astype(ml_dtypes.bfloat16),
        "b.weight": np.clip(rng.standard_normal((3, 4)) * 50, -240, 240).astype(ml_dtypes.float8_e4m3fn),
        "b.weight_scale": np.array([0.5], np.float32),
        "c.transposed": np.asfortranarray(rng.standard_normal((4, 6)).astype(np.float32)),
    }


def _write(tmp_path, arrays, max_bytes=10**9):
    planned = [PlannedTensor(n, dtype_name(a.dtype), a.shape) for n, a in arrays.items()]
    shards = plan_shards(planned, max_bytes)
    for shard in shards:
        writer = ShardFile(tmp_path, shard, metadata={"format": "pd"})
        writer.create()
        for t in reversed(shard.tensors):  # any order: each tensor lands at its planned offset
            writer.write(t.name, arrays[t.name])
        writer.close()
    return shards


def test_streaming_writer_output_reads_back_identically_through_the_library(tmp_path):
    arrays = _arrays()
    shards = _write(tmp_path, arrays)
    with safe_open(tmp_path / shards[0].file_name, framework="numpy") as f:
        assert f.metadata() == {"format": "pd"}
        for name, array in arrays.items():
            got = f.get_tensor(name)
            assert got.dtype == array.dtype
            np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(array).view(np.uint8))


def test_non_contiguous_arrays_are_written_in_logical_order(tmp_path):
    arrays = _arrays()
    shards = _write(tmp_path, arrays)
    got = SafetensorsFile(tmp_path / shards[0].file_name).get("c.transposed")
    np.testing.assert_array_equal(got, arrays["c.transposed"])


def test_our_reader_reads_library_files_zero_copy_and_read_only(tmp_path):
    arrays = {k: np.ascontiguousarray(v) for k, v in _arrays().items()}
    save_file(arrays, tmp_path / "x.safetensors")
    f = SafetensorsFile(tmp_path / "x.safetensors")
    for name, array in arrays.items():
        got = f.get(name)
        np.testing.assert_array_equal(got.view(np.uint8), array.view(np.uint8))
        assert not got.flags.writeable


def test_column_segments_land_where_a_transpose_would_put_them(tmp_path):
    full = np.arange(6 * 10, dtype=np.float32).reshape(6, 10)
    shard = plan_shards([PlannedTensor("t", "F32", (6, 10))], 10**6)[0]
    writer = ShardFile(tmp_path, shard)
    writer.create()
    writer.write_columns("t", full[:, 4:], 0, 4)
    writer.write_columns("t", full[2:, :4], 2, 0)
    writer.write_columns("t", full[:2, :4], 0, 0)
    writer.close()
    np.testing.assert_array_equal(SafetensorsFile(tmp_path / shard.file_name).get("t"), full)


def test_shards_are_named_with_the_exact_count_and_respect_the_limit(tmp_path):
    planned = [PlannedTensor(f"t{i}", "F32", (100,)) for i in range(10)]
    shards = plan_shards(planned, 1000)
    assert [s.file_name for s in shards][-1] == "model-00005-of-00005.safetensors"
    assert all(s.nbytes <= 1000 for s in shards)


@pytest.fixture
def good_file(tmp_path):
    save_file({"x": np.arange(16, dtype=np.float32), "y": np.ones(4, np.float32)}, tmp_path / "g.safetensors")
    return tmp_path / "g.safetensors"


def test_truncated_file_is_named(good_file):
    data = good_file.read_bytes()
    good_file.write_bytes(data[:-8])
    with pytest.raises(SafetensorsFormatError, match=r"g\.safetensors.*truncated"):
        read_header(good_file)


def test_file_shorter_than_the_length_prefix(good_file):
    good_file.write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsFormatError, match="too short"):
        read_header(good_file)


def test_header_length_beyond_the_file(good_file):
    data = bytearray(good_file.read_bytes())
    data[:8] = struct.pack("<Q", 10**6)
    good_file.write_bytes(bytes(data))
    with pytest.raises(SafetensorsFormatError, match="header claims 1000000 bytes"):
        read_header(good_file)


def _rewrite_header(path, edit):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def test_offsets_beyond_the_end_of_the_file(good_file):
    _rewrite_header(good_file, lambda h: h["y"].update(data_offsets=[64, 64 + 16 * 100], shape=[400]))
    with pytest.raises(SafetensorsFormatError, match="tensor 'y' ends at byte .* \\(truncated\\)"):
        read_header(good_file)


def test_offsets_that_do_not_match_the_shape(good_file):
    _rewrite_header(good_file, lambda h: h["x"].update(shape=[15]))
    with pytest.raises(SafetensorsFormatError, match="tensor 'x': 64 bytes for shape \\[15\\]"):
        read_header(good_file)


def test_overlapping_tensors(good_file):
    _rewrite_header(good_file, lambda h: h["y"].update(data_offsets=[0, 16]))
    with pytest.raises(SafetensorsFormatError, match="overlaps"):
        read_header(good_file)


def test_unknown_dtype_and_non_json_header(good_file):
    _rewrite_header(good_file, lambda h: h["y"].update(dtype="F5"))
    with pytest.raises(SafetensorsFormatError, match="unknown dtype 'F5'"):
        read_header(good_file)
    data = bytearray(good_file.read_bytes())
    data[8:12] = b"\xff\xfe{{"
    good_file.write_bytes(bytes(data))
    with pytest.raises(SafetensorsFormatError, match="header: not UTF-8 text"):
        read_header(good_file)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda h: h.update(y=[1, 2]), "tensor 'y': header entry lacks dtype/shape/data_offsets"),
        (lambda h: h["y"].pop("shape"), "tensor 'y': header entry lacks dtype/shape/data_offsets"),
        (lambda h: h["y"].update(dtype=["F32"]), "tensor 'y': unknown dtype \\['F32'\\]"),
        (lambda h: h["y"].update(shape=[-4, -4]), "tensor 'y': shape \\[-4, -4\\] is not a list of non-negative"),
        (lambda h: h["y"].update(shape=[4.0, 4]), "tensor 'y': shape \\[4.0, 4\\] is not a list"),
        (lambda h: h["y"].update(shape=[True, 16]), "tensor 'y': shape \\[true, 16\\] is not a list"),
        (lambda h: h["y"].update(shape="16"), 'tensor \'y\': shape "16" is not a list'),
        (lambda h: h["y"].update(data_offsets=[64]), "tensor 'y': data_offsets \\[64\\] are not \\[begin, end\\]"),
        (lambda h: h["y"].update(data_offsets=[128, 64]), "tensor 'y': data_offsets \\[128, 64\\] are not"),
        (lambda h: h["y"].update(data_offsets=[-64, 0]), "tensor 'y': data_offsets \\[-64, 0\\] are not"),
    ],
    ids=["entry-not-object", "no-shape", "dtype-not-string", "negative-dims", "float-dims", "bool-dims", "shape-string",
         "one-offset", "reversed-offsets", "negative-offset"],
)  # fmt: skip
def test_malformed_header_entries_are_named(good_file, edit, message):
    _rewrite_header(good_file, edit)
    with pytest.raises(SafetensorsFormatError, match=message):
        read_header(good_file)


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/etc/passwd", "a/../../b.safetensors", "..\\x.safetensors"])
def test_index_entries_outside_the_directory_are_refused(tmp_path, entry):
    with pytest.raises(UnsafePathError, match="inside the checkpoint|climbs out|outside"):
        safe_member(tmp_path, entry)


def test_symlink_escaping_the_directory_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (tmp_path / "secret.safetensors").write_bytes(b"x")
    os.symlink(tmp_path / "secret.safetensors", root / "model.safetensors")
    with pytest.raises(UnsafePathError, match="outside the checkpoint"):
        safe_member(root, "model.safetensors")


def _moved_to_another_shard(weight_map: dict) -> str:
    name = next(iter(weight_map))
    weight_map[name] = next(file for file in sorted(set(weight_map.values())) if file != weight_map[name])
    return f"'{name}' is not in {weight_map[name]}"


def _left_out(weight_map: dict) -> str:
    files = list(weight_map.values())
    name = next(name for name in sorted(weight_map) if files.count(weight_map[name]) > 1)  # its shard stays listed
    del weight_map[name]
    return f"tensor '{name}', which the index omits"


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(
            lambda weight_map: weight_map.update({"ghost.weight": next(iter(weight_map.values()))}) or "'ghost.weight'",
            id="unknown-tensor",
        ),
        pytest.param(_moved_to_another_shard, id="wrong-shard"),
        pytest.param(_left_out, id="omitted"),
    ],
)
def test_checkpoint_open_checks_index_against_shards(spec_copy, damage):
    root = spec_copy()
    index = json.loads((root / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # the wrong-shard case needs a second shard
    expected = damage(index["weight_map"])
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointIndexError, match=expected):
        Checkpoint.open(root)

"""Hostile safetensors files, with the safetensors library (FastDeploy's reader) as the oracle.

Every damaged file is first shown to the library: each case here asserts that the library refuses it, and
then that our reader refuses it too, naming the file and the defect; so ``validate`` can never pass a shard
FastDeploy would refuse (issue 14 item 9). Valid files, the library's own among them, must be accepted by
both with the same tensors. Where we are stricter on purpose, the test says so and asserts it.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.errors import SafetensorsFormatError
from hpu_fp8_loader.io.manifest import write_manifest
from hpu_fp8_loader.io.safetensors_file import SafetensorsFile, read_header

Damage = Callable[[dict, bytes], bytes]
LIBRARY_HEADER_LIMIT = 100_000_000


def _pack(header: dict | str | bytes, data: bytes) -> bytes:
    """A safetensors file: little-endian u64 header length, the header, the data."""
    raw = json.dumps(header) if isinstance(header, dict) else header
    raw = raw.encode() if isinstance(raw, str) else raw
    return struct.pack("<Q", len(raw)) + raw + data


def _split(blob: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _last(header: dict) -> str:
    """The name of the tensor whose data comes last."""
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def _first(header: dict) -> str:
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def _edit(change: Callable[[dict, dict], None]) -> Damage:
    """Damage that edits the header (given the header and its last tensor's entry) and keeps the data."""

    def damage(header: dict, data: bytes) -> bytes:
        change(header, header[_last(header)])
        return _pack(header, data)

    return damage


def _text(render: Callable[[str, str], str]) -> Damage:
    """Damage written as JSON text: ``render(header_text_without_last_tensor, last_tensor_name)``, in which
    ``<fields>`` stands for the last tensor's own fields."""

    def damage(header: dict, data: bytes) -> bytes:
        name = _last(header)
        fields = json.dumps(header.pop(name))[1:-1]
        rest = json.dumps(header)[:-1]
        return _pack(render(rest, name).replace("<fields>", fields), data)

    return damage


def _renamed(header: dict, name: str) -> dict:
    """The header with its last tensor renamed to ``name``."""
    entry = header.pop(_last(header))
    return {**header, name: entry}


def _rename_bytes(suffix: bytes) -> Damage:
    """Damage that appends raw bytes to the last tensor's name in the encoded header."""

    def damage(header: dict, data: bytes) -> bytes:
        raw = json.dumps(header).encode()
        name = json.dumps(_last(header)).encode()
        return _pack(raw.replace(name, name[:-1] + suffix + b'"', 1), data)

    return damage


def _shift_last(header: dict, data: bytes) -> bytes:
    """Eight unused bytes between the last two tensors."""
    entry = header[_last(header)]
    begin = entry["data_offsets"][0]
    entry["data_offsets"] = [begin + 8, entry["data_offsets"][1] + 8]
    return _pack(header, data[:begin] + bytes(8) + data[begin:])


def _shift_all(header: dict, data: bytes) -> bytes:
    """Eight unused bytes before the first tensor."""
    for name, entry in header.items():
        if name != "__metadata__":
            entry["data_offsets"] = [o + 8 for o in entry["data_offsets"]]
    return _pack(header, bytes(8) + data)


def _add(name: str, entry: Callable[[dict, int], dict], extra: bytes = b"") -> Damage:
    """Damage that adds a tensor entry computed from the header and the data length (and appends ``extra``)."""

    def damage(header: dict, data: bytes) -> bytes:
        header[name] = entry(header, len(data))
        return _pack(header, data + extra)

    return damage


def _padded_to(length: int) -> Damage:
    def damage(header: dict, data: bytes) -> bytes:
        raw = json.dumps(header).encode()
        return _pack(raw + b" " * (length - len(raw)), data)

    return damage


def _length_field(value: Callable[[int, int], int]) -> Damage:
    """Damage that writes ``value(header_bytes, data_bytes)`` into the length prefix."""

    def damage(header: dict, data: bytes) -> bytes:
        raw = json.dumps(header).encode()
        return struct.pack("<Q", value(len(raw), len(data))) + raw + data

    return damage


def _nested(depth: int) -> Damage:
    return _text(lambda rest, name: rest + f', "{name}": {{<fields>, "note": ' + "[" * depth + "]" * depth + "}}")


def _meta_free(header: dict) -> dict:
    return {k: v for k, v in header.items() if k != "__metadata__"}


def _deep(key: str, value: object) -> Callable[[dict, dict], None]:
    return lambda header, entry: entry.update({key: value})


def _meta(value: object) -> Callable[[dict, dict], None]:
    return lambda header, entry: header.update(__metadata__=value)


# id, damage, what our message must say. The library refuses every one (asserted below).
REFUSED_BY_BOTH: list[tuple[str, Damage, str]] = [
    ("utf16-header", lambda h, d: _pack(json.dumps(h).encode("utf-16"), d), "header: not UTF-8 text"),
    ("utf16le-header", lambda h, d: _pack(json.dumps(h).encode("utf-16-le"), d), "NUL bytes: UTF-16 text"),
    ("utf32-header", lambda h, d: _pack(json.dumps(h).encode("utf-32"), d), "header: not UTF-8 text"),
    ("latin1-name", lambda h, d: _pack(json.dumps(_renamed(h, "\xe9"), ensure_ascii=False).encode("latin-1"), d),
     "header: not UTF-8 text"),
    ("invalid-byte-in-name", _rename_bytes(b"\xff"), "not UTF-8 text"),
    ("utf8-encoded-surrogate", _rename_bytes(b"\xed\xa0\x80"), "not UTF-8 text"),
    ("overlong-utf8", _rename_bytes(b"\xc0\xaf"), "not UTF-8 text"),
    ("raw-control-char-in-name", _rename_bytes(b"\x01"), "not valid JSON"),
    ("utf8-bom", lambda h, d: _pack(b"\xef\xbb\xbf" + json.dumps(h).encode(), d), "not valid JSON"),
    ("lone-surrogate-escape", lambda h, d: _pack(_renamed(h, "\ud800"), d), "lone UTF-16 surrogate"),
    ("metadata-int-value", _edit(_meta({"format": 1})), '__metadata__["format"] is 1, not a string'),
    ("metadata-bool-value", _edit(_meta({"format": True})), '__metadata__["format"] is true'),
    ("metadata-null-value", _edit(_meta({"format": None})), '__metadata__["format"] is null'),
    ("metadata-object-value", _edit(_meta({"format": {"a": "b"}})), '__metadata__["format"] is {"a": "b"}'),
    ("metadata-list", _edit(_meta([])), "__metadata__ is list, not an object"),
    ("metadata-string", _edit(_meta("pt")), "__metadata__ is str"),
    ("metadata-number", _edit(_meta(0)), "__metadata__ is int"),
    ("duplicate-metadata", lambda h, d: _pack('{"__metadata__": {"a": "b"}, ' + json.dumps({"__metadata__": {}, **h})[1:], d),
     "duplicate key '__metadata__'"),
    ("duplicate-entry-field", _text(lambda rest, name: rest + f', "{name}": {{"dtype": "F32", <fields>}}}}'), "duplicate key 'dtype'"),
    ("nan-in-entry", _text(lambda rest, name: rest + f', "{name}": {{<fields>, "note": NaN}}}}'), "NaN is not a JSON value"),
    ("infinity-in-entry", _text(lambda rest, name: rest + f', "{name}": {{<fields>, "note": -Infinity}}}}'), "-Infinity is not"),
    ("trailing-comma", _text(lambda rest, name: rest + f', "{name}": {{<fields>}},}}'), "not valid JSON"),
    ("nested-128-deep", _nested(126), "nested deeper than the safetensors library parses"),
    ("nested-100000-deep", _nested(100_000), "nested too deeply"),
    ("nul-padding", lambda h, d: _pack(json.dumps(h).encode() + b"\0\0\0\0", d), "or NUL padding?"),
    ("form-feed-padding", lambda h, d: _pack(json.dumps(h).encode() + b"\x0c", d), "not valid JSON"),
    ("vertical-tab-padding", lambda h, d: _pack(json.dumps(h).encode() + b"\x0b", d), "not valid JSON"),
    ("header-is-list", lambda h, d: _pack(json.dumps(list(h.items())), d), "header is not a JSON object"),
    ("header-is-string", lambda h, d: _pack('"tensors"', d), "header is not a JSON object"),
    ("header-empty", lambda h, d: _pack(b"", d), "not valid JSON"),
    ("header-over-library-limit", _padded_to(LIBRARY_HEADER_LIMIT + 1), "over the format's limit of 100000000"),
    ("header-length-max-u64", _length_field(lambda header, data: 2**64 - 1), "over the format's limit"),
    ("header-length-past-eof", _length_field(lambda header, data: header + data + 1), "(truncated or corrupt)"),
    ("file-of-three-bytes", lambda h, d: b"\x01\x02\x03", "too short for a safetensors header"),
    ("gap-between-tensors", _shift_last, "8 unused bytes before tensor"),
    ("gap-before-first-tensor", _shift_all, "8 unused bytes before tensor"),
    ("trailing-bytes", lambda h, d: _pack(h, d + bytes(8)), "8 bytes after the last tensor's data"),
    ("one-trailing-byte", lambda h, d: _pack(h, d + b"\0"), "1 bytes after the last tensor's data"),
    ("trailing-bytes-no-tensors", lambda h, d: _pack({}, b"\0"), "1 bytes after the last tensor's data"),
    ("truncated", lambda h, d: _pack(h, d[:-4]), "(truncated)"),
    ("same-range-twice", _add("copy", lambda h, n: dict(h[_last(h)])), "overlaps"),
    ("partial-overlap", _add("tail", lambda h, n: {"dtype": "U8", "shape": [2], "data_offsets": [n - 1, n + 1]}, b"\0"),
     "overlaps"),
    ("empty-tensor-inside-another", _add("empty", lambda h, n: {"dtype": "F32", "shape": [0],
                                                                 "data_offsets": [h[_first(h)]["data_offsets"][0] + 1] * 2}),
     "overlaps"),
    ("dtype-lowercase", _edit(lambda h, e: e.update(dtype=e["dtype"].lower())), "unknown dtype 'f32'"),
    ("dtype-unknown", _edit(lambda h, e: e.update(dtype="F5")), "unknown dtype 'F5'"),
    ("dtype-number", _edit(lambda h, e: e.update(dtype=4)), "unknown dtype 4"),
    ("shape-size-mismatch", _edit(lambda h, e: e.update(shape=[*e["shape"], 2])), "bytes for shape"),
    ("shape-float", _edit(lambda h, e: e.update(shape=[float(x) for x in e["shape"]])), "is not a list of non-negative integers"),
    ("shape-negative", _edit(lambda h, e: e.update(shape=[-x for x in e["shape"]])), "is not a list of non-negative integers"),
    ("shape-bool", _edit(lambda h, e: e.update(shape=[True] * len(e["shape"]))), "shape [true] is not a list of non-negative integers"),
    ("shape-minus-zero", lambda h, d: _pack(json.dumps(h)[:-1] + f', "z": {{"dtype": "F32", "shape": [-0], '
                                            f'"data_offsets": [{len(d)}, {len(d)}]}}}}', d), "shape [-0.0]"),
    ("shape-overflows-u64", _add("huge", lambda h, n: {"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [n, n]}),
     "bytes for shape"),
    ("shape-beyond-u64", _add("huge", lambda h, n: {"dtype": "F32", "shape": [2**64], "data_offsets": [n, n]}), "bytes for shape"),
    ("offsets-three", _edit(lambda h, e: e.update(data_offsets=[*e["data_offsets"], e["data_offsets"][1]])), "are not [begin, end]"),
    ("offsets-reversed", _edit(lambda h, e: e.update(data_offsets=e["data_offsets"][::-1])), "are not [begin, end]"),
    ("offsets-strings", _edit(lambda h, e: e.update(data_offsets=[str(o) for o in e["data_offsets"]])), "are not [begin, end]"),
    ("entry-null", _edit(lambda h, e: h.update({_last(h): None})), "lacks dtype/shape/data_offsets"),
    ("entry-without-offsets", _edit(lambda h, e: e.pop("data_offsets")), "lacks dtype/shape/data_offsets"),
]  # fmt: skip

# Files the library reads although they are ambiguous or unprintable: we refuse them on purpose.
REFUSED_BY_US_ONLY: list[tuple[str, Damage, str]] = [
    ("duplicate-tensor-name", _text(lambda rest, name: rest + f', "{name}": {{<fields>}}, "{name}": {{<fields>}}}}'), "duplicate key"),
    ("duplicate-metadata-key", lambda h, d: _pack('{"__metadata__": {"a": "b", "a": "c"}, ' + json.dumps(_meta_free(h))[1:], d),
     "duplicate key 'a'"),
    ("nul-in-tensor-name", lambda h, d: _pack(_renamed(h, "a\0b"), d), "holds a control character"),
    ("newline-in-tensor-name", lambda h, d: _pack(_renamed(h, "a\nhpu-fp8: error: forged"), d),
     "holds a control character"),
    ("dtype-f8-e8m0", _add("e8m0", lambda h, n: {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [n, n + 2]}, b"\0\0"),
     "unsupported dtype 'F8_E8M0'"),
    ("dtype-c64", _add("c64", lambda h, n: {"dtype": "C64", "shape": [1], "data_offsets": [n, n + 8]}, bytes(8)),
     "unsupported dtype 'C64'"),
    ("dtype-f4", _add("f4", lambda h, n: {"dtype": "F4", "shape": [4], "data_offsets": [n, n + 2]}, b"\0\0"),
     "unsupported dtype 'F4'"),
]  # fmt: skip


def _library_accepts(path: Path) -> bool:
    """The oracle: whether safe_open (FastDeploy's way in) reads the header and every tensor's dtype and shape."""
    try:
        with safe_open(path, "np") as f:
            f.metadata()
            names = f.keys()
            for name in names:
                f.get_slice(name).get_shape()
        return True
    except SafetensorError:
        return False


@pytest.fixture
def base(tmp_path) -> bytes:
    """The library's own file: three float32 tensors and metadata."""
    path = tmp_path / "base.safetensors"
    rng = np.random.default_rng(0)
    arrays = {
        "a": rng.standard_normal((4, 3)).astype(np.float32),
        "b": np.arange(16, dtype=np.float32),
        "c": np.ones(2, np.float32),
    }
    save_file(arrays, path, metadata={"format": "pt"})
    return path.read_bytes()


@pytest.fixture
def damaged(tmp_path, base):
    """damage -> the path of the damaged file; deleted afterwards (two cases write 100 MB headers)."""
    path = tmp_path / "damaged.safetensors"

    def make(damage: Damage) -> Path:
        path.write_bytes(damage(*_split(base)))
        return path

    yield make
    path.unlink(missing_ok=True)


def _marks(case_id: str) -> list:
    """The cases that write a 100 MB header are slow."""
    return [pytest.mark.slow] if case_id.endswith("library-limit") else []


def _by_id(cases: list[tuple[str, Damage, str]]) -> list:
    return [pytest.param(damage, message, id=case_id, marks=_marks(case_id)) for case_id, damage, message in cases]


@pytest.mark.parametrize(("damage", "message"), _by_id(REFUSED_BY_BOTH))
def test_what_the_library_refuses_we_refuse_naming_file_and_defect(damaged, damage, message):
    path = damaged(damage)
    assert not _library_accepts(path), "the oracle reads this file: the case does not test what it claims"
    with pytest.raises(SafetensorsFormatError) as refused:
        read_header(path)
    assert str(refused.value).startswith(f"{path}: ") and message in str(refused.value), str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(("damage", "message"), _by_id(REFUSED_BY_US_ONLY))
def test_stricter_than_the_library_where_a_file_is_ambiguous_unprintable_or_unsupported(damaged, damage, message):
    path = damaged(damage)
    assert _library_accepts(path), "the library now refuses this too: move the case to REFUSED_BY_BOTH"
    with pytest.raises(SafetensorsFormatError, match=None) as refused:
        read_header(path)
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def _zero_size(where: str) -> Damage:
    """A zero-size tensor at the start, between two tensors, or at the end of the data."""

    def damage(header: dict, data: bytes) -> bytes:
        offset = {"start": 0, "middle": header[_last(header)]["data_offsets"][0], "end": len(data)}[where]
        header[f"empty_{where}"] = {"dtype": "F32", "shape": [3, 0], "data_offsets": [offset, offset]}
        return _pack(header, data)

    return damage


ACCEPTED_BY_BOTH: list[tuple[str, Damage]] = [
    ("library-output", lambda h, d: _pack(h, d)),
    ("zero-size-at-start", _zero_size("start")),
    ("zero-size-between", _zero_size("middle")),
    ("zero-size-at-end", _zero_size("end")),
    ("no-tensors", lambda h, d: _pack({}, b"")),
    ("keys-not-in-offset-order", lambda h, d: _pack(dict(reversed(h.items())), d)),
    ("space-padding", lambda h, d: _pack(json.dumps(h) + " " * 7, d)),
    ("whitespace-around", lambda h, d: _pack(" \t\r\n" + json.dumps(h, indent=1) + "\n\t ", d)),
    ("metadata-null", _edit(_meta(None))),
    ("metadata-empty", _edit(_meta({}))),
    ("no-metadata", lambda h, d: _pack(_meta_free(h), d)),
    ("unknown-entry-field", _edit(_deep("note", "ignored"))),
    ("nested-127-deep", _nested(125)),
    ("astral-name-escape", lambda h, d: _pack(_renamed(h, "\U0001f600"), d)),
    ("header-at-library-limit", _padded_to(LIBRARY_HEADER_LIMIT)),
]


@pytest.mark.parametrize("damage", [pytest.param(d, id=i, marks=_marks(i)) for i, d in ACCEPTED_BY_BOTH])
def test_what_the_library_reads_we_read_identically(damaged, damage):
    path = damaged(damage)
    assert _library_accepts(path)
    expected = load_file(path)
    with SafetensorsFile(path) as ours:
        assert ours.tensors.keys() == expected.keys()
        for name, array in expected.items():
            got = ours.get(name)
            assert (got.dtype, got.shape) == (array.dtype, array.shape)
            np.testing.assert_array_equal(got, array)


def test_every_dtype_we_support_round_trips_from_the_library_writer(tmp_path):
    arrays = {
        str(dtype): np.arange(6).astype(dtype).reshape(2, 3)
        for dtype in (np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
                      np.float16, np.float32, np.float64)
    }  # fmt: skip
    arrays |= {"scalar": np.array(2.5, np.float32), "empty": np.zeros((0, 4), np.float16)}
    save_file(arrays, tmp_path / "all.safetensors")
    with SafetensorsFile(tmp_path / "all.safetensors") as ours:
        for name, array in arrays.items():
            np.testing.assert_array_equal(ours.get(name), array)
            assert ours.get(name).dtype == array.dtype


# The cases the issue names, carried into a real converted checkpoint (manifest rewritten to match, so only
# the shard check can catch them): validate lists the shard as invalid, inspect refuses it in one line.
CLI_CASES = ["utf16-header", "metadata-int-value", "gap-between-tensors", "trailing-bytes", "same-range-twice",
             "dtype-unknown", "shape-size-mismatch", "duplicate-entry-field", "nested-100000-deep", "nan-in-entry"]  # fmt: skip


@pytest.fixture
def damaged_checkpoint(tmp_path, spec_factory):
    def make(case_id: str) -> tuple[Path, Path, str]:
        damage, message = next((d, m) for i, d, m in REFUSED_BY_BOTH if i == case_id)
        root = tmp_path / "ckpt"
        shutil.copytree(spec_factory("ernie-dense-tiny"), root)
        shard = sorted(root.glob("*.safetensors"))[0]
        shard.write_bytes(damage(*_split(shard.read_bytes())))
        write_manifest(root)
        return root, shard, message

    return make


@pytest.mark.parametrize("case_id", CLI_CASES)
def test_validate_lists_a_shard_the_library_refuses(damaged_checkpoint, case_id):
    root, shard, message = damaged_checkpoint(case_id)
    assert not _library_accepts(shard)
    before = tree_digest(root)
    result = run_cli("validate", "--quick", root)
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert f"[container.shard] {shard.name}: " in result.stdout and message in result.stdout, result.stdout
    assert "Traceback" not in result.output
    assert tree_digest(root) == before


@pytest.mark.parametrize("case_id", CLI_CASES)
def test_inspect_refuses_a_shard_the_library_refuses(damaged_checkpoint, case_id):
    root, shard, message = damaged_checkpoint(case_id)
    before = tree_digest(root)
    assert_refused(run_cli("inspect", root), shard.name, message, code=2)
    assert tree_digest(root) == before

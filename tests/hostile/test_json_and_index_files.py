"""Hostile JSON files and shard indexes: config.json, model.safetensors.index.json, the manifest, measurements.

Python's json module takes what RFC 8259 and the safetensors library do not: UTF-16 bytes, duplicate keys
(the last silently wins), NaN, lone surrogate escapes; and it raises RecursionError on deep nesting, which
reached the user as a traceback with validate's "invalid" exit 1 (issue 14 items 12 and 14). Each case is
refused in one line naming the file (and the key or name at fault), with the input unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.io.manifest import MANIFEST_FILE, write_manifest
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements

PRESET = "ernie-dense-tiny"
INDEX = "model.safetensors.index.json"
Content = Callable[[str], bytes]


def _with_first_key_twice(text: str) -> bytes:
    data = json.loads(text)
    key = next(iter(data))
    return ("{" + json.dumps(key) + ": " + json.dumps(data[key]) + ", " + text.lstrip()[1:]).encode()


def _with_member(member: str) -> Content:
    """The object with ``member`` (raw JSON text) inserted first."""
    return lambda text: ("{" + member + ", " + text.lstrip()[1:]).encode()


# id, new content from the old text, what the message must say. Every JSON file we read must refuse each.
BAD_JSON: list[tuple[str, Content, str]] = [
    ("nested-100000-deep", lambda text: b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("nested-object-100000-deep", lambda text: b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
    ("utf16", lambda text: text.encode("utf-16"), "not UTF-8 text"),
    ("utf16le-no-bom", lambda text: text.encode("utf-16-le"), "NUL bytes: UTF-16 text"),
    ("latin1-byte", lambda text: ('{"caf\xe9": 1, ' + text.lstrip()[1:]).encode("latin-1"), "not UTF-8 text"),
    ("utf8-bom", lambda text: b"\xef\xbb\xbf" + text.encode(), "not valid JSON"),
    ("duplicate-key", _with_first_key_twice, "duplicate key"),
    ("duplicate-nested-key", _with_member('"x_nested": {"k": 1, "k": 2}'), "duplicate key 'k'"),
    ("lone-surrogate-escape", _with_member('"x_\\udc80": 1'), "lone UTF-16 surrogate"),
    ("top-level-list", lambda text: ("[" + text + "]").encode(), "top level is not a JSON object"),
    ("top-level-string", lambda text: b'"config"', "top level is not a JSON object"),
    ("empty-file", lambda text: b"", "not valid JSON"),
    ("trailing-garbage", lambda text: (text + "}").encode(), "not valid JSON"),
    ("single-quotes", lambda text: text.replace('"', "'").encode(), "not valid JSON"),
    # int() of more than 4,300 digits raised a bare ValueError, a traceback in every reader (issue 28 item 5)
    ("integer-of-5000-digits", _with_member('"x_huge": ' + "1" * 5000), "an integer of 5000 digits"),
    ("negative-integer-of-4301-digits", _with_member('"x_huge": [-' + "9" * 4301 + "]"), "an integer of 4301 digits"),
]
# Never JSON: refused in every file but config.json (see test_config_json_may_hold_infinity_in_a_key_nobody_reads).
NON_FINITE: list[tuple[str, Content, str]] = [
    ("nan", _with_member('"x_nan": NaN'), "NaN is not a JSON value"),
    ("infinity", _with_member('"x_inf": Infinity'), "Infinity is not a JSON value"),
    ("minus-infinity", _with_member('"x_inf": [-Infinity]'), "-Infinity is not a JSON value"),
    ("number-beyond-float-range", _with_member('"x_big": 1e999'), "1e999 is out of range of a 64-bit float"),
]


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _self_loop(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.name)


def _two_link_loop(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.name + ".other")
    path.with_name(path.name + ".other").symlink_to(path.name)


def _dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


# A JSON file replaced by something that is not a regular file: a FIFO would block, /dev/zero never end.
NOT_A_FILE: list[tuple[str, Callable[[Path], None], str]] = [
    ("fifo", _fifo, "not a regular file"),
    ("directory", _directory, "cannot be read"),
    ("symlink-loop", _self_loop, "cannot be read"),
    ("two-link-loop", _two_link_loop, "cannot be read"),
    ("link-to-dev-zero", _dev_zero, "not a regular file"),
]


def _contents(cases: list[tuple[str, Content, str]]) -> list:
    return [pytest.param(content, message, id=case_id) for case_id, content, message in cases]


def _replacements(cases: list[tuple[str, Callable[[Path], None], str]]) -> list:
    return [pytest.param(replace, message, id=case_id) for case_id, replace, message in cases]


@pytest.fixture
def checkpoint(tmp_path, spec_factory) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(spec_factory(PRESET), root)
    return root


def _rewrite(root: Path, name: str, content: Content) -> None:
    """Replace one JSON file of the checkpoint and refresh the manifest, so only the file's own check can object."""
    path = root / name
    path.write_bytes(content(path.read_text()))
    if name != MANIFEST_FILE:
        write_manifest(root)


def _assert_validate_refuses(result: Result, *names: str) -> None:
    """validate refused without a traceback: unreadable (exit 2, one line naming ``names``) or invalid
    (exit 1, a listed violation naming them)."""
    if result.exit_code == 2:
        assert_refused(result, *names, code=2)
        return
    assert result.exit_code == 1, f"exit {result.exit_code}:\n{result.output}"
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    listed = [line for line in result.stdout.splitlines() if line.startswith("[") and all(n in line for n in names)]
    assert listed, f"no violation names {names}:\n{result.stdout}"


@pytest.mark.parametrize(("content", "message"), _contents(BAD_JSON))
def test_a_bad_config_json_is_unreadable_for_validate_and_inspect(checkpoint, content, message):
    _rewrite(checkpoint, "config.json", content)
    before = tree_digest(checkpoint)
    for command in ("validate", "inspect"):
        assert_refused(run_cli(command, checkpoint), "config.json", message, code=2)
    assert tree_digest(checkpoint) == before


@pytest.mark.parametrize(("content", "message"), _contents(BAD_JSON + NON_FINITE))
def test_a_bad_index_is_refused_by_inspect_and_validate(checkpoint, content, message):
    _rewrite(checkpoint, INDEX, content)
    before = tree_digest(checkpoint)
    assert_refused(run_cli("inspect", checkpoint), INDEX, message, code=2)
    _assert_validate_refuses(run_cli("validate", "--quick", checkpoint), INDEX, message)
    assert tree_digest(checkpoint) == before


@pytest.mark.parametrize(("content", "message"), _contents(BAD_JSON + NON_FINITE))
def test_a_bad_manifest_is_a_listed_violation(checkpoint, content, message):
    _rewrite(checkpoint, MANIFEST_FILE, content)
    before = tree_digest(checkpoint)
    _assert_validate_refuses(run_cli("validate", "--quick", checkpoint), MANIFEST_FILE, message)
    assert tree_digest(checkpoint) == before


@pytest.mark.parametrize("name", ["config.json", INDEX])
@pytest.mark.parametrize(("replace", "message"), _replacements(NOT_A_FILE))
def test_a_json_file_that_is_not_a_regular_file_is_refused_without_blocking(checkpoint, name, replace, message):
    replace(checkpoint / name)
    before = tree_digest(checkpoint)
    assert_refused(run_cli("inspect", checkpoint), name, message, code=2)
    assert tree_digest(checkpoint) == before


def test_config_json_may_hold_infinity_in_a_key_nobody_reads(checkpoint):
    """transformers' json.dump writes Infinity for an infinite float; a key we never read must not sink the model."""
    _rewrite(checkpoint, "config.json", _with_member('"x_unused_limit": Infinity'))
    result = run_cli("validate", "--quick", checkpoint)
    assert result.exit_code == 0, result.output


def _index_edit(edit: Callable[[dict], None]) -> Content:
    def content(text: str) -> bytes:
        index = json.loads(text)
        edit(index)
        return json.dumps(index).encode()

    return content


def _first_entry_to(file: object) -> Callable[[dict], None]:
    return lambda index: index["weight_map"].update({next(iter(index["weight_map"])): file})


# Index entries that used to reach os calls raw (a NUL byte is a ValueError there) or print as two lines.
BAD_INDEX: list[tuple[str, Content, str]] = [
    ("nul-in-shard-name", _index_edit(_first_entry_to("model\0.safetensors")), "'model\\x00.safetensors'"),
    ("newline-in-shard-name", _index_edit(_first_entry_to("a\nb.safetensors")), "holds a control character"),
    ("escape-in-shard-name", _index_edit(_first_entry_to("\x1b[2Ja.safetensors")), "holds a control character"),
    ("delete-char-in-shard-name", _index_edit(_first_entry_to("a\x7f.safetensors")), "holds a control character"),
    ("empty-shard-name", _index_edit(_first_entry_to("")), 'maps to "", not a file name'),
    ("number-as-shard-name", _index_edit(_first_entry_to(7)), "maps to 7, not a file name"),
    ("null-as-shard-name", _index_edit(_first_entry_to(None)), "not a file name"),
    ("list-as-shard-name", _index_edit(_first_entry_to(["a.safetensors"])), "not a file name"),
    ("nul-in-tensor-name", _index_edit(lambda i: i["weight_map"].update({"x\0y": "model.safetensors"})), "'x\\x00y'"),
    ("newline-in-tensor-name", _index_edit(lambda i: i["weight_map"].update({"x\nhpu-fp8: ok": "m.safetensors"})),
     "holds a control character"),
    ("weight-map-list", _index_edit(lambda i: i.update(weight_map=[])), "no 'weight_map' object"),
    ("weight-map-missing", _index_edit(lambda i: i.pop("weight_map")), "no 'weight_map' object"),
    ("metadata-list", _index_edit(lambda i: i.update(metadata=[])), "'metadata' is list, not an object"),
    ("metadata-string", _index_edit(lambda i: i.update(metadata="x")), "'metadata' is str, not an object"),
]  # fmt: skip


@pytest.mark.parametrize(("content", "message"), _contents(BAD_INDEX))
def test_bad_names_in_the_index_are_refused_by_name(checkpoint, content, message):
    _rewrite(checkpoint, INDEX, content)
    before = tree_digest(checkpoint)
    line = assert_refused(run_cli("inspect", checkpoint), INDEX, message, code=2)
    assert "\0" not in line
    _assert_validate_refuses(run_cli("validate", "--quick", checkpoint), INDEX, message)
    assert tree_digest(checkpoint) == before


def _first_shard(root: Path) -> Path:
    return sorted(root.glob("*.safetensors"))[0]


SHARD_REPLACEMENTS = [
    ("symlink-loop", _self_loop, "(a link loop?)"),
    ("two-link-loop", _two_link_loop, "(a link loop?)"),
    ("directory", _directory, "is not a regular file"),
    ("fifo", _fifo, "is not a regular file"),
]


@pytest.mark.parametrize(("replace", "message"), _replacements(SHARD_REPLACEMENTS))
def test_a_shard_that_is_a_link_loop_or_not_a_file_is_named(checkpoint, replace, message):
    shard = _first_shard(checkpoint)
    replace(shard)
    before = tree_digest(checkpoint)
    assert_refused(run_cli("inspect", checkpoint), shard.name, message, code=2)
    _assert_validate_refuses(run_cli("validate", "--quick", checkpoint), shard.name)
    assert tree_digest(checkpoint) == before


MANIFEST_ENTRIES = [
    ("size-as-bool", lambda entry: entry.update(size=True)),
    ("size-as-string", lambda entry: entry.update(size=str(entry["size"]))),
    ("size-as-float", lambda entry: entry.update(size=float(entry["size"]))),
    ("sha256-not-hex", lambda entry: entry.update(sha256="z" * 64)),
    ("sha256-missing", lambda entry: entry.pop("sha256")),
]


@pytest.mark.parametrize("edit", [pytest.param(edit, id=case_id) for case_id, edit in MANIFEST_ENTRIES])
def test_a_malformed_manifest_entry_is_a_listed_violation(checkpoint, edit):
    path = checkpoint / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    name = sorted(manifest["files"])[0]
    edit(manifest["files"][name])
    path.write_text(json.dumps(manifest))
    _assert_validate_refuses(run_cli("validate", "--quick", checkpoint), MANIFEST_FILE, repr(name), "is not {size: integer")


def test_a_nul_byte_in_a_manifest_name_is_a_listed_violation(checkpoint):
    path = checkpoint / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest["files"]["a\0b"] = {"size": 1, "sha256": "0" * 64}
    path.write_text(json.dumps(manifest))
    _assert_validate_refuses(run_cli("validate", "--quick", checkpoint), MANIFEST_FILE, "'a\\x00b'")


@pytest.fixture
def measurements(tmp_path) -> Path:
    path = tmp_path / "measurements.json"
    write_measurements(path, synthetic_measurements(preset_config(PRESET)))
    return path


@pytest.mark.parametrize(("content", "message"), _contents(BAD_JSON + NON_FINITE))
def test_a_bad_measurement_file_is_refused_before_any_output(tmp_path, source_factory, measurements, content, message):
    measurements.write_bytes(content(measurements.read_text()))
    source = source_factory(PRESET)
    before = tree_digest(source)
    out = tmp_path / "out"
    assert_refused(run_cli("convert", source, out, "--measurements", measurements), measurements.name, message)
    assert not out.exists() and not out.with_name("out.partial").exists()
    assert tree_digest(source) == before


def test_a_shard_the_system_cannot_read_makes_the_checkpoint_unreadable_not_invalid(checkpoint, monkeypatch):
    """Exit 2 and the file with the system's reason, not a listed violation with Python's errno repr. The kernel's
    refusal is stood in for (root reads every file whatever its mode)."""

    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("hpu_fp8_loader.checks.validate.SafetensorsFile", refused)
    line = assert_refused(run_cli("validate", checkpoint), "Permission denied", ".safetensors", code=2)
    assert "Errno" not in line

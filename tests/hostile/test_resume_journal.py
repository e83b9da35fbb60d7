"""The resume journal (``OUT.partial/.hpu_fp8_progress.json``) is trusted only as far as its design says: under the
same conversion fingerprint, a planned shard whose size and sha256 still match is reused; anything else (another
shape, a list, bytes that are no JSON, a link or FIFO in its place, an entry naming no planned shard) means a clean
restart of what it does not vouch for, never an exception, and nothing but reused shards is left in staging
(issue 28, item 5; property-based per item 8)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostile.refusal import left_staging, run_cli
from hpu_fp8_loader.conversion.journal import JOURNAL, reusable_shards, save_journal
from hpu_fp8_loader.io.manifest import file_digest
from hpu_fp8_loader.io.writer import PlannedTensor, ShardFile, plan_shards
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements

FINGERPRINT = "f" * 64
SHARDS = plan_shards([PlannedTensor(f"t{i}", "F32", (4,)) for i in range(3)], max_shard_bytes=16)
NAMES = [s.file_name for s in SHARDS]


def staged(root: Path) -> Path:
    """A fresh staging directory holding the three planned shards, written, and a journal that records them."""
    staging = Path(tempfile.mkdtemp(dir=root))
    for shard in SHARDS:
        file = ShardFile(staging, shard)
        file.create()
        file.write(shard.tensors[0].name, np.arange(4, dtype=np.float32))
        file.close()
    return staging


def true_entries(staging: Path) -> dict[str, dict]:
    return {name: dict(zip(("size", "sha256"), file_digest(staging / name), strict=True)) for name in NAMES}


def test_the_journal_a_run_wrote_reuses_every_shard(tmp_path):
    staging = staged(tmp_path)
    save_journal(staging, FINGERPRINT, true_entries(staging))
    assert sorted(reusable_shards(staging, FINGERPRINT, SHARDS)) == NAMES
    assert sorted(p.name for p in staging.iterdir()) == sorted(NAMES)  # the journal itself is rewritten by the run


@pytest.mark.parametrize(
    "content",
    [b"[]", b'[{"fingerprint": "' + FINGERPRINT.encode() + b'"}]', b"null", b"5", b'"text"', b"{", b"\xff\xfe", b""],
    ids=["empty list", "list of the object", "null", "number", "string", "truncated", "not utf-8", "empty"],
)
def test_a_journal_of_another_shape_restarts_clean(tmp_path, content):
    staging = staged(tmp_path)
    (staging / JOURNAL).write_bytes(content)
    assert reusable_shards(staging, FINGERPRINT, SHARDS) == {}
    assert list(staging.iterdir()) == []


def test_a_journal_that_is_a_json_list_lets_convert_restart_and_publish(tmp_path, source_factory):
    """What the issue saw: a list as the journal ended convert in "'list' object has no attribute 'get'"."""
    write_measurements(tmp_path / "m.json", synthetic_measurements(preset_config("qwen2-tiny")))
    (left_staging(tmp_path / "out") / JOURNAL).write_text("[]")
    argv = ("convert", source_factory("qwen2-tiny"), tmp_path / "out", "--measurements", tmp_path / "m.json")
    result = run_cli(*argv, "-q", "--workers", "1")
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert run_cli("validate", "-q", tmp_path / "out").exit_code == 0


@pytest.mark.parametrize("planted", ["a link to a journal", "a FIFO", "a directory"])
def test_a_journal_that_is_no_regular_file_is_not_read_and_goes(tmp_path, planted):
    staging = staged(tmp_path)
    real = tmp_path / "elsewhere.json"
    real.write_text(json.dumps({"fingerprint": FINGERPRINT, "shards": true_entries(staging)}))
    {"a link to a journal": lambda: (staging / JOURNAL).symlink_to(real), "a FIFO": lambda: os.mkfifo(staging / JOURNAL),
     "a directory": lambda: (staging / JOURNAL).mkdir()}[planted]()  # fmt: skip
    assert reusable_shards(staging, FINGERPRINT, SHARDS) == {}
    assert list(staging.iterdir()) == [] and real.is_file()


def test_a_shard_that_is_a_link_is_never_reused_even_when_the_journal_vouches_for_it(tmp_path):
    staging = staged(tmp_path)
    entries = true_entries(staging)
    elsewhere = tmp_path / "elsewhere.safetensors"
    os.replace(staging / NAMES[0], elsewhere)
    (staging / NAMES[0]).symlink_to(elsewhere)
    save_journal(staging, FINGERPRINT, entries)
    assert sorted(reusable_shards(staging, FINGERPRINT, SHARDS)) == NAMES[1:]
    assert not os.path.lexists(staging / NAMES[0]) and elsewhere.is_file()


# Values a journal could hold where it holds a fingerprint, a name, a size or a digest: right, wrong, or of any type.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)


@st.composite
def journals(draw) -> bytes:
    """Journal bytes: mostly JSON objects shaped like ours with some entries right and some not, or anything else."""
    kind = draw(st.sampled_from(["shaped", "any json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "any json":
        return json.dumps(draw(json_values)).encode()
    names = st.sampled_from([*NAMES, "../escape.safetensors", "/etc/passwd", JOURNAL, ""]) | st.text(max_size=8)
    entries = st.dictionaries(
        names,
        st.sampled_from(["true", "wrong size", "wrong sha"]) | json_values,
        max_size=5,
    )
    return json.dumps(
        {"fingerprint": draw(st.sampled_from([FINGERPRINT, "0" * 64]) | json_values), "shards": draw(entries | json_values)}
    ).encode()


def _materialise(content: bytes, staging: Path) -> bytes:
    """Replace the markers "true", "wrong size", "wrong sha" by entries with the real or an altered digest."""
    try:
        value = json.loads(content)
    except ValueError:
        return content
    if isinstance(value, dict) and isinstance(value.get("shards"), dict):
        real = true_entries(staging)
        for name, entry in value["shards"].items():
            base = real.get(name, {"size": 1, "sha256": "0" * 64})
            if entry == "true":
                value["shards"][name] = base
            elif entry == "wrong size":
                value["shards"][name] = {**base, "size": base["size"] + 1}
            elif entry == "wrong sha":
                value["shards"][name] = {**base, "sha256": "1" * 64}
    return json.dumps(value).encode()


@given(content=journals())
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_journal_reuses_only_planned_shards_it_vouches_for_and_never_raises(tmp_path, content):
    staging = staged(tmp_path)
    content = _materialise(content, staging)
    (staging / JOURNAL).write_bytes(content)
    real = true_entries(staging)
    reused = reusable_shards(staging, FINGERPRINT, SHARDS)
    assert set(reused) <= set(NAMES)
    assert all(_matches(reused[name], real[name]) for name in reused)  # only what still hashes as recorded
    assert sorted(p.name for p in staging.iterdir()) == sorted(reused)  # everything else is gone
    try:
        recorded = json.loads(content)
    except ValueError:
        recorded = None
    vouched = (
        recorded["shards"]
        if isinstance(recorded, dict) and recorded.get("fingerprint") == FINGERPRINT and isinstance(recorded.get("shards"), dict)
        else {}
    )
    assert set(reused) == {name for name in NAMES if _matches(vouched.get(name), real[name])}  # and all of it


def _matches(entry: object, real: dict) -> bool:
    """The oracle: an entry vouches for a shard when it is an object whose integer size and sha256 are the shard's."""
    return (
        isinstance(entry, dict)
        and type(entry.get("size")) is int
        and (entry["size"], entry.get("sha256"))
        == (
            real["size"],
            real["sha256"],
        )
    )

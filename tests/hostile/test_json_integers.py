"""JSON integers past Python's int() limit (4,300 digits), in every JSON reader, through every command reading it.

Found by a hostile run (issue 28 item 5, 45+ cases): ``json.loads`` raises a bare ValueError for such an integer,
which reached the user as a traceback from config.json, the index, a safetensors header, the manifest, measurement
files, tokenizer files, ``.jsonl`` lines and the resume journal. ``io.jsonfile.parse_json`` refuses it in one line
naming the file; a number that overflows to infinity (``1e999``) likewise, where serde_json refuses it as out of
range. config.json, the index, the manifest and measurement files are also covered by test_json_and_index_files.py's
BAD_JSON table, through inspect, validate and convert.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from hostile.refusal import assert_refused, left_staging, run_cli, tree_digest
from hpu_fp8_loader.conversion.journal import JOURNAL
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements
from hpu_fp8_loader.spec import names

HUGE = "1" * 5000
NAMED = "an integer of 5000 digits"
QUICK = ("--samples", "1", "--seq-len", "16", "-q")


def _with_huge_member(path: Path) -> None:
    """The JSON object in ``path`` with a first member holding a 5,000-digit integer."""
    text = path.read_text()
    path.write_text('{"x_huge": ' + HUGE + ", " + text.lstrip()[1:])


def _with_huge_header_member(shard: Path) -> None:
    """A safetensors shard whose header gains a member holding a 5,000-digit integer (length prefix rewritten)."""
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = b'{"x_huge": ' + HUGE.encode() + b", " + data[8 : 8 + length].lstrip()[1:]
    shard.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + length :])


def _word_tokenizer(model: Path) -> None:
    """A real tokenizers WordLevel tokenizer.json with a 256-word vocabulary (ids below qwen2-tiny's 512)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 256)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(model / "tokenizer.json"))


@pytest.fixture
def work(tmp_path, source_factory, spec_factory) -> Path:
    """tmp_path with private copies of the qwen2 source (``model/``, with a tokenizer.json) and its checkpoint
    (``fp8/``), measurements (``m.json``) and a JSONL dataset (``d.jsonl``)."""
    shutil.copytree(source_factory("qwen2-tiny", "paddle"), tmp_path / "model")
    shutil.copytree(spec_factory("qwen2-tiny"), tmp_path / "fp8")
    _word_tokenizer(tmp_path / "model")
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    write_measurements(tmp_path / "m.json", synthetic_measurements(preset_config("qwen2-tiny")))
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"text": " ".join(f"w{i}" for i in range(1, 40))}) + "\n" for _ in range(4))
    )
    return tmp_path


def _commands(work: Path) -> dict[str, list[object]]:
    return {
        "convert": ["convert", work / "model", work / "out", "--measurements", work / "m.json", "-q"],
        "calibrate": ["calibrate", work / "model", "-o", work / "m2.json", "--dataset", work / "d.jsonl", *QUICK],
        "eval": ["eval", work / "model", work / "fp8", "--dataset", work / "d.jsonl", *QUICK[:-1]],
        "plan": ["plan", work / "model"],
        "inspect": ["inspect", work / "fp8"],
        "validate": ["validate", work / "fp8"],
    }


def _first_shard(root: Path) -> Path:
    return sorted(root.glob("*.safetensors"))[0]


# (file the integer is put in, how, what reads it). Each case raised ValueError as a traceback before.
Damage = Callable[[Path], Path]
CASES: dict[str, tuple[Damage, list[str]]] = {
    "source-config": (lambda w: w / "model" / "config.json", ["convert", "calibrate", "eval", "plan"]),
    "source-shard-header": (lambda w: _first_shard(w / "model"), ["convert", "calibrate", "eval"]),
    "checkpoint-shard-header": (lambda w: _first_shard(w / "fp8"), ["inspect", "validate", "eval"]),
    "checkpoint-config": (lambda w: w / "fp8" / "config.json", ["inspect", "validate", "eval"]),
    "measurements": (lambda w: w / "m.json", ["convert"]),
    "tokenizer-json": (lambda w: w / "model" / "tokenizer.json", ["calibrate", "eval", "convert"]),
    "tokenizer-config": (lambda w: w / "model" / "tokenizer_config.json", ["calibrate", "eval", "convert"]),
    "generation-config": (lambda w: w / "model" / "generation_config.json", ["convert"]),
}
PARAMS = [pytest.param(case, command, id=f"{case}-{command}") for case, (_, commands) in CASES.items() for command in commands]


@pytest.mark.parametrize(("case", "command"), PARAMS)
def test_a_5000_digit_integer_in_a_json_file_is_one_line_naming_it(work, case, command):
    target = CASES[case][0](work)
    if target.name == "generation_config.json":
        target.write_text('{"max_length": 10}')
    if target.suffix == ".safetensors":
        _with_huge_header_member(target)
    else:
        _with_huge_member(target)
    before = tree_digest(work)
    result = run_cli(*_commands(work)[command])
    if command == "validate" and result.exit_code == 1:  # a shard validate reads is a listed violation, the rest exit 2
        listed = [line for line in result.stdout.splitlines() if target.name in line and NAMED in line]
        assert listed and "Traceback" not in result.output, result.output
    else:
        assert_refused(result, target.name, NAMED, code=2 if command in ("inspect", "validate") else None)
    assert tree_digest(work) == before  # nothing written: no OUT, no OUT.partial, no measurement file


@pytest.mark.parametrize("command", ["calibrate", "eval"])
@pytest.mark.parametrize("number", [HUGE, "-" + HUGE, "1e999"], ids=["5000-digits", "minus-5000-digits", "1e999"])
def test_a_huge_number_in_a_jsonl_line_is_one_line_naming_the_line(work, command, number):
    dataset = work / "d.jsonl"
    dataset.write_text('{"text": "w1 w2", "score": ' + number + "}\n" + dataset.read_text())
    before = tree_digest(work)
    assert_refused(run_cli(*_commands(work)[command]), "d.jsonl:1", "digits" if "e" not in number else "out of range")
    assert tree_digest(work) == before


def test_an_integer_the_tokenizers_library_cannot_hold_is_named(work):
    """Below 4,300 digits parse_json reads it; the tokenizers library refuses an id beyond 64 bits, named as its failure."""
    path = work / "model" / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    tokenizer["model"]["vocab"]["w1"] = 10**30
    path.write_text(json.dumps(tokenizer))
    assert_refused(run_cli(*_commands(work)["calibrate"]), "tokenizer.json", "tokenizers library cannot load it")


def test_a_fastdeploy_measurement_of_5000_digits_is_refused_as_not_finite(work):
    """FastDeploy's text files hold floats: 5,000 digits read as infinity, which an amax must not be."""
    text = work / "model_measurement.txt"
    key = names.fastdeploy_key_from_module(next(iter(synthetic_measurements(preset_config("qwen2-tiny")).amax)))
    text.write_text(f"{key}\t{HUGE}\n")
    result = run_cli("convert", work / "model", work / "out", "--measurements", text, "-q")
    assert_refused(result, "model_measurement.txt:1", "not a finite decimal number")
    assert not (work / "out").exists() and not (work / "out.partial").exists()


def test_synth_set_of_a_5000_digit_integer_is_refused_naming_the_key(tmp_path):
    result = run_cli("synth", tmp_path / "s", "--preset", "qwen2-tiny", "--set", f"hidden_size={HUGE}")
    assert_refused(result, "hidden_size", "should be a valid integer")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(HUGE, id="digits"),
        pytest.param('{"fingerprint": ' + HUGE + "}", id="member", marks=pytest.mark.slow),
        pytest.param("[1, 2]", id="list", marks=pytest.mark.slow),
        pytest.param("1e999", id="inf", marks=pytest.mark.slow),
    ],
)
def test_a_resume_journal_of_huge_integers_vouches_for_nothing_and_the_conversion_completes(work, spec_factory, content):
    """The journal is ours, but a crash or a hand may leave anything there: it is read strictly, and what it cannot
    vouch for is converted again, giving the shards a conversion from scratch gives."""
    partial = left_staging(work / "out")
    (partial / JOURNAL).write_text(content)
    (partial / "model-00001-of-00002.safetensors").write_bytes(b"left over")
    result = run_cli(
        "convert", work / "model", work / "out", "--measurements", work / "m.json", "--max-shard-size", "64000", "-q"
    )
    assert result.exit_code == 0, result.stderr
    assert run_cli("validate", "--hashes", work / "out").exit_code == 0

    def shards(root: Path) -> dict:
        files = json.loads((root / "hpu_fp8_manifest.json").read_text())["files"]
        return {name: entry for name, entry in files.items() if name.endswith(".safetensors")}

    assert shards(work / "out") == shards(spec_factory("qwen2-tiny"))

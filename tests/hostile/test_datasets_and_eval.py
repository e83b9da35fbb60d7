"""`calibrate` and `eval` against hostile datasets, tokenizers and model pairs: each is refused in one named line.

Found by a hostile run: a corrupt tokenizer.json, a tokenizer giving ids beyond the vocabulary (eval only), a
JSONL line holding a lone UTF-16 surrogate, `eval --seq-len 1` and `eval` of two different models ended in
tracebacks; a FIFO as --dataset made calibrate block forever; `eval` of two different models (a dense ERNIE
against an MoE one, other heads) or with a --seq-len beyond max_position_embeddings printed a table (exit 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.errors import HpuFp8Error
from hpu_fp8_loader.quality.datasets import load_documents
from hpu_fp8_loader.quality.evaluate import check_same_model, evaluate
from hpu_fp8_loader.sources.synth import preset_config, synthesize

QUICK = ("--samples", "1", "--seq-len", "16")


@pytest.fixture
def no_hang():
    """Turn a blocked read (a FIFO without a writer) into a failure after 20 s instead of a hung test session."""

    def expire(_signum, _frame):
        raise TimeoutError("blocked for 20 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def work(tmp_path, source_factory, spec_factory):
    """tmp_path with a private copy of the qwen2 source (``model/``) and its converted checkpoint (``fp8/``)."""
    shutil.copytree(source_factory("qwen2-tiny", "paddle"), tmp_path / "model")
    shutil.copytree(spec_factory("qwen2-tiny"), tmp_path / "fp8")
    return tmp_path


def run(command: str, work: Path, *extra: object):
    """`calibrate MODEL -o OUT` or `eval MODEL FP8` on the work directory, with a quick window."""
    if command == "calibrate":
        return run_cli("calibrate", work / "model", "-o", work / "m.json", *QUICK, *extra, "-q")
    return run_cli("eval", work / "model", work / "fp8", *QUICK, *extra)


COMMANDS = ["calibrate", "eval"]


def word_tokenizer(path: Path, vocab: dict[str, int]) -> None:
    """A real tokenizers WordLevel tokenizer (whitespace-split words) with exactly ``vocab``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))


# ----- tokenizer.json -----


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("content", "named"),
    [
        (b'{"not":1', ["not valid JSON"]),
        (b'{"not": 1}', ["tokenizers library cannot load it"]),
        (b"\xff\xfe{\x00}\x00", ["not UTF-8"]),
    ],
    ids=["truncated", "not-a-tokenizer", "utf-16"],
)
def test_a_corrupt_tokenizer_json_is_named(work, command, content, named):
    (work / "model" / "tokenizer.json").write_bytes(content)
    before = tree_digest(work)
    assert_refused(run(command, work), "tokenizer.json", *named)
    assert tree_digest(work) == before


@pytest.mark.parametrize("command", COMMANDS)
def test_a_tokenizer_json_that_is_a_directory_is_refused(work, command):
    (work / "model" / "tokenizer.json").mkdir()
    assert_refused(run(command, work), "tokenizer.json", "directory")


@pytest.mark.parametrize("command", COMMANDS)
def test_token_ids_beyond_the_vocabulary_are_refused_by_both_commands(work, command):
    word_tokenizer(work / "model" / "tokenizer.json", {"[UNK]": 0, "word": 700})  # vocab_size is 512
    (work / "words.txt").write_text("word " * 100)
    assert_refused(run(command, work, "--dataset", work / "words.txt"), "tokenizer.json", "700", "vocab_size 512")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_tokenizer_that_cannot_encode_the_text_is_named(work, command):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"word": 1}, unk_token="[UNK]"))  # [UNK] is not in the vocabulary
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(work / "model" / "tokenizer.json"))
    (work / "words.txt").write_text("word other " * 100)
    assert_refused(run(command, work, "--dataset", work / "words.txt"), "tokenizer.json", "cannot encode")


# ----- dataset files -----

DATASETS = {
    "lone-surrogate": ("d.jsonl", b'{"text": "fine"}\n{"text": "\\ud800 x"}\n', ["d.jsonl:2", "surrogate"]),
    "duplicate-key": ("d.jsonl", b'{"text": "a", "text": "b"}\n', ["d.jsonl:1", "duplicate key 'text'"]),
    "nan": ("d.jsonl", b'{"text": "a", "score": NaN}\n', ["d.jsonl:1", "NaN"]),
    "not-json": ("d.jsonl", b'{"text": "fine"}\nnot json\n', ["d.jsonl:2", "not valid JSON"]),
    "no-text-key": ("d.jsonl", b'{"content": "words"}\n', ["d.jsonl:1", "'text'"]),
    "text-not-a-string": ("d.jsonl", b'{"text": ["words"]}\n', ["d.jsonl:1", "'text'", "an array"]),
    "a-number": ("d.jsonl", b"42\n", ["d.jsonl:1", "'text'"]),
    "jsonl-not-utf8": ("d.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n', ["d.jsonl:2", "not UTF-8"]),
    "txt-not-utf8": ("d.txt", b"plain text\n\xff\xfe more", ["d.txt", "not UTF-8", "byte 11"]),
    "utf16-txt": ("d.txt", "text in UTF-16".encode("utf-16"), ["d.txt", "not UTF-8"]),
    "empty-txt": ("d.txt", b"", ["d.txt", "no text"]),
    "whitespace-txt": ("d.txt", b"  \n\t\n", ["d.txt", "no text"]),
    "empty-jsonl": ("d.jsonl", b"\n\n", ["d.jsonl", "no text"]),
    "blank-texts-jsonl": ("d.jsonl", b'{"text": ""}\n{"text": " "}\n', ["d.jsonl", "no text"]),
    "shorter-than-a-window": ("d.txt", b"too short", ["d.txt", "9 tokens", "seq_len 16"]),
    # Read as text before (issue 28): exit 0, calibrated on the bytes or the JSON syntax.
    "binary": ("d.bin", bytes(range(256)) * 4, ["d.bin", "a .bin file", ".txt, .jsonl, .json, .csv, .parquet"]),
    "gzipped": ("d.jsonl.gz", b"\x1f\x8b\x08\x00" + b"\x00" * 100, ["d.jsonl.gz", "a .gz file"]),
    "json-record-without-text": ("d.json", b'[\n  {"text": "fine"},\n  {"body": "x"}\n]', ["d.json:3", "'text'"]),
    "json-trailing-comma": ("d.json", b'[{"text": "fine"},\n]', ["d.json:2", "not valid JSON"]),
    "json-unclosed": ("d.json", b'[{"text": "fine words"}', ["d.json:1", "ends without ']'"]),
    "json-lone-surrogate": ("d.json", b'["fine", "\\udc00"]', ["d.json:1", "surrogate"]),
    "csv-no-column": ("d.csv", b"body\nwords\n", ["d.csv:1", "no column 'text'", "body"]),
    "csv-unbalanced-quote": ("d.csv", b'text\n"never closed\nmore words\n', ["d.csv:3", "not CSV"]),
    "csv-ragged-row": ("d.csv", b"text,n\nwords,1\nmore\n", ["d.csv:3", "1 fields"]),
    "csv-not-utf8": ("d.csv", b"text\nwords\ncaf\xe9\n", ["d.csv:3", "not UTF-8"]),
    "whitespace-json": ("d.json", b" \n\t\n", ["d.json", "no text"]),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", DATASETS)
def test_a_hostile_dataset_file_is_refused_naming_file_and_line(work, command, case):
    name, content, named = DATASETS[case]
    (work / name).write_bytes(content)
    before = tree_digest(work)
    assert_refused(run(command, work, "--dataset", work / name), *named)
    assert tree_digest(work) == before


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_dataset_that_is_not_a_regular_file_is_refused_without_blocking(work, no_hang, command, kind):
    dataset = {"fifo": work / "fifo.txt", "directory": work / "dir.txt", "device": work / "null.txt"}[kind]
    if kind == "fifo":
        os.mkfifo(dataset)
    elif kind == "directory":
        dataset.mkdir()
    else:  # a link to a device, with a dataset suffix (/dev/zero would fill the memory)
        dataset.symlink_to("/dev/null")
    assert_refused(
        run(command, work, "--dataset", dataset), str(dataset), "directory" if kind == "directory" else "not a regular file"
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_a_dataset_directory_with_a_file_of_another_kind_is_refused_naming_the_file(work, command):
    (work / "corpus").mkdir()
    (work / "corpus" / "a.txt").write_text("calibration text " * 20)
    (work / "corpus" / "b.bin").write_bytes(bytes(range(256)))
    before = tree_digest(work)
    assert_refused(run(command, work, "--dataset", work / "corpus"), "b.bin", "a .bin file", "dataset directory")
    assert tree_digest(work) == before


def test_a_missing_dataset_is_named(work):
    assert_refused(run("eval", work, "--dataset", work / "nope.txt"), "nope.txt", "no such dataset file")


def test_a_byte_order_mark_and_line_separators_inside_strings_are_text_not_errors(tmp_path):
    (tmp_path / "bom.txt").write_bytes("\ufeffplain".encode())
    (tmp_path / "bom.jsonl").write_bytes('\ufeff{"text": "one\u2028two"}\r\n"three"\n'.encode())
    assert list(load_documents(tmp_path / "bom.txt")) == ["plain"]
    assert list(load_documents(tmp_path / "bom.jsonl")) == ["one\u2028two", "three"]


def test_an_upper_case_jsonl_suffix_is_still_jsonl(tmp_path):
    (tmp_path / "d.JSONL").write_text('{"text": "words"}\n')
    assert list(load_documents(tmp_path / "d.JSONL")) == ["words"]


def test_a_bom_jsonl_dataset_calibrates(work):
    (work / "d.jsonl").write_bytes(("\ufeff" + json.dumps({"text": "calibration text " * 20}) + "\n").encode())
    result = run("calibrate", work, "--dataset", work / "d.jsonl")
    assert result.exit_code == 0, result.stderr


# ----- eval: the two models and the window -----


@pytest.fixture(scope="module")
def other_qwen2(tmp_path_factory):
    """A qwen2 source that differs from qwen2-tiny in vocab_size and num_attention_heads only."""
    out = tmp_path_factory.mktemp("other") / "qwen2"
    synthesize(out, preset_config("qwen2-tiny", {"vocab_size": 384, "num_attention_heads": 8}), "paddle", seed=3)
    return out


def test_eval_refuses_an_ernie_source_against_a_qwen2_checkpoint(source_factory, spec_factory):
    result = run_cli("eval", source_factory("ernie-dense-tiny"), spec_factory("qwen2-tiny"), *QUICK)
    assert_refused(result, "model_type", "ernie4_5", "qwen2")


def test_eval_refuses_two_qwen2_models_of_different_shapes_naming_each_field(other_qwen2, spec_factory):
    line = assert_refused(
        run_cli("eval", other_qwen2, spec_factory("qwen2-tiny"), *QUICK), "vocab_size 384", "512", "num_heads 8"
    )
    assert "model_type" not in line and "hidden_size" not in line  # only the fields that differ


def test_eval_refuses_a_dense_source_against_a_moe_checkpoint(source_factory, spec_factory):
    result = run_cli("eval", source_factory("ernie-dense-tiny"), spec_factory("ernie-moe-tiny"), *QUICK)
    assert_refused(result, "model_type ernie4_5 vs ernie4_5_moe", "moe dense vs MoE")


def test_each_moe_field_that_differs_is_named_once():
    ours = describe(preset_config("ernie-moe-tiny"))
    theirs = dataclasses.replace(ours, moe=dataclasses.replace(ours.moe, num_experts=8, top_k=4))
    with pytest.raises(HpuFp8Error) as refused:
        check_same_model("src", ours, "ckpt", theirs)
    assert "(moe.num_experts 4 vs 8, moe.top_k 2 vs 4)" in str(refused.value)
    check_same_model("src", ours, "ckpt", describe(preset_config("ernie-moe-tiny")))  # equal: no refusal


@pytest.mark.parametrize("seq_len", ["1", "0"])
def test_eval_needs_two_tokens_per_window(work, seq_len):
    assert_refused(run_cli("eval", work / "model", work / "fp8", "--seq-len", seq_len), "--seq-len", code=2)


def test_evaluate_needs_two_tokens_per_window_from_python_too(work):
    with pytest.raises(HpuFp8Error, match="seq_len 1 .* at least 2"):
        evaluate(work / "model", work / "fp8", samples=1, seq_len=1)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_window_beyond_max_position_embeddings_is_refused_by_both_commands(work, command):
    result = run(command, work, "--seq-len", "5000")  # the last --seq-len counts
    assert_refused(result, "model", "seq_len 5000", "max_position_embeddings 4096")


def test_eval_still_runs_on_a_matching_pair(work):
    result = run("eval", work, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["tokens"] == 16


@pytest.mark.slow
def test_eval_of_weights_so_large_the_arithmetic_overflows_is_one_line_naming_what(tmp_path, source_factory):
    """Finite but huge weights (3e38 in bf16) convert; their forward overflows float32. eval printed numpy's
    RuntimeWarnings and "tensor 'tensor' holds nan" before; now one line naming the model and the point."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from hpu_fp8_loader.sources.measurements import write_measurements
    from hpu_fp8_loader.sources.synth import synthetic_measurements

    source = tmp_path / "huge"
    shutil.copytree(source_factory("qwen2-tiny"), source)
    shard = next(p for p in source.glob("*.safetensors") if "qwen2.layers.0.self_attn.o_proj.weight" in load_file(p))
    tensors = load_file(shard)
    name = "qwen2.layers.0.self_attn.o_proj.weight"
    tensors[name] = np.full(tensors[name].shape, 3e38, ml_dtypes.bfloat16)
    save_file(tensors, shard)
    write_measurements(tmp_path / "m.json", synthetic_measurements(preset_config("qwen2-tiny")))
    assert run_cli("convert", source, tmp_path / "fp8", "--measurements", tmp_path / "m.json", "-q").exit_code == 0
    result = run_cli("eval", source, tmp_path / "fp8", *QUICK)
    line = assert_refused(result, "not finite")
    assert "RuntimeWarning" not in result.stderr and "'tensor'" not in line

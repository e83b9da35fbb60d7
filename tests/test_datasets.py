"""The datasets users calibrate with (`quality.datasets`): parquet, a JSONL field of their choice, a directory of
files, a Hub dataset from a Hugging Face cache laid out by the test (offline); and a synthetic model with a real
tokenizer calibrating end to end, the measurement file naming the tokenizer."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece
from click.testing import CliRunner
from helpers.hub_cache import add_to_cache

from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.errors import DatasetError, HpuFp8Error
from hpu_fp8_loader.quality import dataset_files
from hpu_fp8_loader.quality.calibrate import calibrate
from hpu_fp8_loader.quality.datasets import builtin_text, dataset_tokens, load_documents
from hpu_fp8_loader.quality.tokenizer import Continued
from hpu_fp8_loader.sources.measurements import load_measurements


def write_parquet(path: Path, columns: dict[str, list]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


# ----- parquet and JSONL fields -----


def test_parquet_rows_are_documents_of_the_chosen_column(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", {"text": ["one", " ", "two"], "body": ["b1", "b2", "b3"]})
    assert list(load_documents(path)) == ["one", "two"]  # a blank row is no document
    assert list(load_documents(path, text_field="body")) == ["b1", "b2", "b3"]


@pytest.mark.parametrize(
    ("columns", "named"),
    [
        ({"body": ["words"]}, r"d\.parquet: no column 'text' \(columns: body\)"),
        ({"text": [1, 2]}, r"d\.parquet: column 'text' holds int64, not strings"),
        ({"text": ["words", None]}, r"d\.parquet row 1: 'text' is null, not a string"),
    ],
    ids=["no-column", "not-strings", "null"],
)
def test_a_parquet_column_that_is_not_text_is_refused_naming_file_and_column(tmp_path, columns, named):
    path = write_parquet(tmp_path / "d.parquet", columns)
    with pytest.raises(DatasetError, match=named):
        list(load_documents(path))


def test_a_parquet_string_that_is_not_utf8_is_refused_naming_its_row(tmp_path):
    """Parquet does not check a string's UTF-8, and pyarrow's to_pylist raised UnicodeDecodeError (found by the
    property-based tests in tests/hostile/test_dataset_properties.py)."""
    latin1 = pa.array([b"fine", b"caf\xe9"], pa.binary()).view(pa.string())
    path = write_parquet(tmp_path / "d.parquet", {"text": latin1})
    with pytest.raises(DatasetError, match=r"d\.parquet row 1: not UTF-8 text \(0xe9 at byte 3 of the value\)"):
        list(load_documents(path))


def test_a_file_that_is_no_parquet_is_named(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"PAR1 but not really")
    with pytest.raises(DatasetError, match=r"d\.parquet: not a parquet file pyarrow can read"):
        list(load_documents(tmp_path / "d.parquet"))


def test_a_jsonl_text_field_of_ones_choice(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"body": "first"}\n{"body": "second", "text": "not this"}\n')
    assert list(load_documents(tmp_path / "d.jsonl", text_field="body")) == ["first", "second"]
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: the JSON object has no 'text' key"):
        list(load_documents(tmp_path / "d.jsonl"))


@pytest.mark.parametrize(
    ("kind", "columns"),
    [
        ("dictionary", lambda texts: pa.array(texts).dictionary_encode()),
        ("large_string", lambda texts: pa.array(texts, pa.large_string())),
        ("string_view", lambda texts: pa.array(texts, pa.string_view())),
    ],
)
def test_a_parquet_column_of_strings_in_any_arrow_encoding_is_read(tmp_path, kind, columns):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": columns(["one", "two", "one"])}), path)
    assert list(load_documents(path)) == ["one", "two", "one"]


def test_parquet_and_json_chat_records_render_as_the_same_records_in_jsonl(tmp_path):
    """--chat-template over a parquet `messages` column (list<struct<role, content>>) or a .json array gives the
    tokens the same records give from JSONL."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    chats = [
        [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi."}],
        [{"role": "user", "content": "Again"}],
    ]
    write_parquet(tmp_path / "chats.parquet", {"messages": chats, "text": ["not this", "nor this"]})
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    (tmp_path / "chats.json").write_text(json.dumps([{"messages": chat} for chat in chats], indent=2))
    from_parquet = dataset_tokens(model, 512, tmp_path / "chats.parquet", chat_template=True)
    from_jsonl = dataset_tokens(model, 512, tmp_path / "chats.jsonl", chat_template=True)
    from_json = dataset_tokens(model, 512, tmp_path / "chats.json", chat_template=True)
    assert from_parquet.ids.tobytes() == from_jsonl.ids.tobytes() == from_json.ids.tobytes()
    assert bytes(from_parquet.ids.tolist()) == b"[user]Hello there[assistant]Hi.[user]Again"
    write_parquet(tmp_path / "bad.parquet", {"messages": [chats[0], [{"role": "user"}]]})
    with pytest.raises(DatasetError, match=r"bad\.parquet row 1: messages\[0\] is not an object with 'role' and 'content'"):
        dataset_tokens(model, 512, tmp_path / "bad.parquet", chat_template=True)


# ----- .json and .csv -----

RECORDS = [{"text": "first", "n": 1}, "second", {"text": "third\nline", "meta": {"a": [1, 2]}}]
TEXTS = ["first", "second", "third\nline"]


def test_a_json_array_of_records_is_read_record_by_record(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps(RECORDS, indent=2))  # a Hugging Face-style data.json
    (tmp_path / "lines.json").write_text("\n" + "".join(json.dumps(r) + "\n" for r in RECORDS))  # JSON Lines, also .json
    (tmp_path / "body.json").write_text(json.dumps([{"body": "b1"}, {"body": "b2", "text": "not this"}]))
    assert list(load_documents(tmp_path / "d.json")) == TEXTS
    assert list(load_documents(tmp_path / "lines.json")) == TEXTS
    assert list(load_documents(tmp_path / "body.json", text_field="body")) == ["b1", "b2"]


@pytest.mark.parametrize("chunk", [1, 3, 16, 1 << 20])
def test_records_and_lines_cut_by_any_read_size_come_out_whole(tmp_path, monkeypatch, chunk):
    """The readers read a few bytes at a time here: a record, a UTF-8 character, a number or a CSV row cut
    between two reads is read whole, and a line number or byte offset counts from the start of the file."""
    monkeypatch.setattr(dataset_files, "_CHUNK", chunk)
    (tmp_path / "d.json").write_text(json.dumps([*RECORDS, {"text": "caf\u00e9 12345678901234567890", "x": 1.5e300}], indent=1))
    assert list(load_documents(tmp_path / "d.json")) == [*TEXTS, "caf\u00e9 12345678901234567890"]
    (tmp_path / "d.csv").write_text('id,text\r\n1,"multi\nline, quoted"\r\n2,caf\u00e9\r\n')
    assert list(load_documents(tmp_path / "d.csv")) == ["multi\nline, quoted", "caf\u00e9"]
    (tmp_path / "d.txt").write_bytes("plain text\ncaf\u00e9\n".encode() + b"\xff more")
    with pytest.raises(DatasetError, match=r"d\.txt:3: not UTF-8 text \(byte 17 is 0xff"):
        list(load_documents(tmp_path / "d.txt"))
    (tmp_path / "e.json").write_text('[\n  {"text": "a"},\n\n  {"text": "b"}\n  {"text": "c"}\n]')
    with pytest.raises(DatasetError, match=r"e\.json:5: expected ',' or ']' after a record"):
        list(load_documents(tmp_path / "e.json"))


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ('[\n  {"text": "fine"},\n  {"body": "x"}\n]', r"d\.json:3: the JSON object has no 'text' key"),
        ('[\n  "fine",\n  7\n]', r"d\.json:3: the record is a number"),
        ('[{"text": "a"},\n]', r"d\.json:2: not valid JSON \(Expecting value\)"),
        ('[{"text": "a"}, {"text": "b"}', r"d\.json:1: the JSON array ends without '\]'"),
        ('[{"text": "a"}]\n[{"text": "b"}]', r"d\.json:2: text after the JSON array"),
        ('[{"text": "a", "text": "b"}]', r"d\.json:1: duplicate key 'text'"),
        ('{"data": [{"text": "a"}]}', r"d\.json:1: the JSON object has no 'text' key"),  # only a plain array
        ("[" * 100_000, r"d\.json:1: not valid JSON \(nested too deeply"),
    ],
    ids=["no-text-key", "a-number", "trailing-comma", "unclosed", "text-after", "duplicate-key", "wrapped", "deep"],
)
def test_a_json_file_that_is_no_array_of_records_is_refused_naming_the_line(tmp_path, content, named):
    (tmp_path / "d.json").write_text(content)
    with pytest.raises(DatasetError, match=named):
        list(load_documents(tmp_path / "d.json"))


def test_a_csv_column_of_ones_choice_under_the_header_row(tmp_path):
    (tmp_path / "d.csv").write_bytes('\ufeffid,text,body\n1,"one, with a comma",b1\n\n2,"two ""quoted""",b2\n'.encode())
    assert list(load_documents(tmp_path / "d.csv")) == ["one, with a comma", 'two "quoted"']
    assert list(load_documents(tmp_path / "d.csv", text_field="body")) == ["b1", "b2"]


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ("body\nwords\n", r"d\.csv:1: no column 'text' \(columns: body\)"),
        ("text,text\na,b\n", r"d\.csv:1: 2 columns named 'text'"),
        ("text,n\nwords,1\nmore\n", r"d\.csv:3: 1 fields; the header row has 2"),
        ('text\n"never closed\nmore\n', r"d\.csv:3: not CSV the csv module reads \(unexpected end of data\)"),
        ('text\n"a"b\n', r"d\.csv:2: not CSV the csv module reads"),
    ],
    ids=["no-column", "two-columns", "ragged-row", "unbalanced-quote", "text-after-quote"],
)
def test_a_csv_file_that_is_not_a_table_of_text_is_refused_naming_the_line(tmp_path, content, named):
    (tmp_path / "d.csv").write_text(content)
    with pytest.raises(DatasetError, match=named):
        list(load_documents(tmp_path / "d.csv"))


@pytest.mark.parametrize("name", ["d.txt", "d.csv"])
def test_a_chat_template_over_plain_text_or_csv_is_refused(tmp_path, name):
    (tmp_path / name).write_text("text\nwords\n")
    with pytest.raises(DatasetError, match=rf"{name}: plain text without 'messages'; --chat-template needs \.jsonl, \.json"):
        list(load_documents(tmp_path / name, render=lambda messages, where: "never"))


@pytest.mark.parametrize("name", ["data.bin", "data.jsonl.gz", "README.md", "data.tsv", "corpus"])
def test_a_file_of_any_other_suffix_is_refused_naming_it_and_the_accepted_ones(tmp_path, name):
    """Read as text, a .bin or a .json.gz would calibrate on its bytes and succeed."""
    (tmp_path / name).write_bytes(b"words " * 100)
    with pytest.raises(DatasetError) as refused:
        load_documents(tmp_path / name)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / name}: a ") and ".txt, .jsonl, .json, .csv, .parquet file" in message


def test_a_hugging_face_style_data_json_calibrates_on_its_records_not_its_syntax(tmp_path, source_factory):
    """The same records as a JSON array, as JSON Lines and as CSV calibrate to the same amax; the array read as
    text (what a .json was before: its syntax) calibrates to other values."""
    texts = [builtin_text()[i : i + 300] for i in range(0, 3000, 300)]
    (tmp_path / "data.json").write_text(json.dumps([{"text": t} for t in texts], indent=2))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    with (tmp_path / "data.csv").open("w", newline="") as file:
        csv.writer(file).writerows([["text"], *([t] for t in texts)])
    shutil.copy(tmp_path / "data.json", tmp_path / "syntax.txt")
    model = source_factory("qwen2-tiny")
    amax = {name: calibrate(model, tmp_path / name, samples=2, seq_len=32).measurements.amax for name in
            ("data.json", "data.jsonl", "data.csv", "syntax.txt")}  # fmt: skip
    assert amax["data.json"] == amax["data.jsonl"] == amax["data.csv"] != amax["syntax.txt"]


# ----- reading only what the windows need -----


def bytes_read() -> int:
    """Bytes this process has read through read() and its kin so far (Linux's /proc/self/io rchar)."""
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar:")).split()[1])


SPARSE_HEADS = {
    "d.txt": lambda texts: "\n".join(texts),  # the sparse tail is NUL characters: more text, of one document
    "d.jsonl": lambda texts: "".join(json.dumps({"text": t}) + "\n" for t in texts),  # a NUL line is no JSON
    "d.json": lambda texts: "[" + ",\n".join(json.dumps({"text": t}) for t in texts) + ",\n",  # nor a NUL record
    "d.csv": lambda texts: "text\n" + "".join(f'"{t}"\n' for t in texts),  # a NUL row has no quotes
}


@pytest.mark.parametrize("name", SPARSE_HEADS)
def test_a_huge_dataset_file_is_read_only_as_far_as_the_tokens_go(tmp_path, name):
    """A 1 GiB file (sparse: a megabyte of records, then a hole of NUL bytes no reader accepts as records)
    gives its first tokens reading about a megabyte; it was read whole before (a 4 GB .txt: a MemoryError)."""
    texts = [f"record {i} " + "words " * 50 for i in range(4000)]
    path = tmp_path / name
    path.write_text(SPARSE_HEADS[name](texts))
    os.truncate(path, 1 << 30)
    before = bytes_read()
    ids = dataset_tokens(tmp_path, 512, path, tokenizer="bytes", limit=100_000).ids
    assert ids.size >= 100_000 and bytes(ids[:9].tolist()) == b"record 0 "
    assert bytes_read() - before < 8 << 20, f"read {bytes_read() - before} bytes of a 1 GiB file"


def test_a_parquet_file_is_read_a_row_group_at_a_time(tmp_path):
    texts = [os.urandom(150).hex() for _ in range(20_000)]  # incompressible: 6 MB of text in 20 row groups
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet", row_group_size=1000, compression="none")
    size = (tmp_path / "d.parquet").stat().st_size
    before = bytes_read()
    ids = dataset_tokens(tmp_path, 512, tmp_path / "d.parquet", tokenizer="bytes", limit=10_000).ids
    assert bytes(ids[:300].tolist()) == texts[0].encode()
    assert bytes_read() - before < size / 4, f"read {bytes_read() - before} of {size} bytes"


def test_a_long_txt_is_one_document_with_one_bos_however_many_pieces(tmp_path, monkeypatch, sentencepiece_model):
    monkeypatch.setattr(dataset_files, "_CHUNK", 256)
    text = builtin_text()[:5000]
    (tmp_path / "d.txt").write_text(text)
    pieces = list(load_documents(tmp_path / "d.txt"))
    assert len(pieces) > 10 and "".join(pieces) == text and not any(isinstance(p, Continued) for p in pieces[:1])
    assert all(isinstance(p, Continued) and p.endswith(("\n", " ")) for p in pieces[1:-1])  # cut at line ends or spaces
    ids = dataset_tokens(sentencepiece_model, 512, tmp_path / "d.txt").ids.tolist()
    assert ids[0] == 1 and ids.count(1) == 1  # <s>, once
    assert bytes(dataset_tokens(tmp_path, 512, tmp_path / "d.txt", tokenizer="bytes").ids.tolist()) == text.encode()


# ----- directories -----


def test_a_directory_is_its_dataset_files_sorted_by_path_each_in_order(tmp_path):
    root = tmp_path / "corpus"
    (root / "a").mkdir(parents=True)
    (root / ".cache").mkdir()
    (root / "a" / "c.jsonl").write_text('"c1"\n"c2"\n')
    (root / "b.txt").write_text("b")
    write_parquet(root / "d.parquet", {"text": ["d1", "d2"]})
    (root / "README.md").write_text("not a dataset file")
    (root / ".cache" / "x.txt").write_text("hidden")
    assert list(load_documents(root)) == ["c1", "c2", "b", "d1", "d2"]


def test_a_directory_with_any_other_file_is_refused_naming_it_not_skipped(tmp_path):
    """Calibrating on the .txt of a directory that also holds data.json.gz would use part of it, silently."""
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("words")
    (root / "data.json.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(DatasetError, match=r"corpus/data\.json\.gz: a \.gz file in the dataset directory .*corpus is no dataset"):
        load_documents(root)


def test_a_directory_without_dataset_files_is_refused_naming_it(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("words")
    with pytest.raises(
        DatasetError, match=r"empty: a directory without dataset files \(\.txt, \.jsonl, \.json, \.csv, \.parquet\)"
    ):
        list(load_documents(tmp_path / "empty"))


@pytest.mark.parametrize(
    ("dataset", "named"),
    [
        ("missing/file.jsonl", r"missing/file\.jsonl: no such dataset file"),  # a valid repo id, but a file name
        ("not a repo id", r"not a repo id: no such dataset file"),
    ],
)
def test_a_missing_local_dataset_is_not_looked_up_on_the_hub(tmp_path, monkeypatch, dataset, named):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError, match=named):
        list(load_documents(dataset))


def test_a_dataset_revision_for_a_local_path_is_refused(tmp_path):
    (tmp_path / "d.txt").write_text("words")
    with pytest.raises(DatasetError, match=r"d\.txt: --dataset-revision 'v1' is for a Hub dataset"):
        list(load_documents(tmp_path / "d.txt", revision="v1"))


# ----- Hub datasets from the cache -----


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache in tmp_path that huggingface_hub uses, offline (what HF_HUB_CACHE and
    HF_HUB_OFFLINE=1 set when the process starts; the subprocess test below sets the variables themselves)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_dataset_is_read_from_the_cache_and_a_local_path_wins(tmp_path, offline_cache, monkeypatch):
    files = tmp_path / "files"
    files.mkdir()
    write_parquet(files / "train.parquet", {"text": ["hub row 1", "hub row 2"]})
    (files / "README.md").write_text("card")
    add_to_cache(offline_cache, "acme/corpus", files, repo_type="dataset")
    assert list(load_documents("acme/corpus")) == ["hub row 1", "hub row 2"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "corpus").mkdir(parents=True)
    (tmp_path / "acme" / "corpus" / "local.txt").write_text("local")
    assert list(load_documents("acme/corpus")) == ["local"]


def test_the_commit_of_a_hub_dataset_goes_into_the_measurements_provenance(tmp_path, offline_cache, source_factory):
    files = tmp_path / "files"
    files.mkdir()
    (files / "part.txt").write_text(builtin_text()[:3000])
    add_to_cache(offline_cache, "acme/corpus", files, commit="ab" * 20, ref="v1", repo_type="dataset")
    model = source_factory("qwen2-tiny")
    hub = calibrate(model, "acme/corpus", samples=1, seq_len=16, dataset_revision="v1").measurements.provenance
    assert (hub.dataset, hub.dataset_revision) == ("acme/corpus", "ab" * 20)
    local = calibrate(model, files / "part.txt", samples=1, seq_len=16).measurements.provenance
    assert local.dataset_revision is None
    assert dataset_tokens(model, 512, "acme/corpus", dataset_revision="v1").commit == "ab" * 20


@pytest.mark.parametrize(
    ("revision", "named"),
    [(None, "acme/absent: not in the local Hugging Face cache"), ("../x", "--dataset-revision '../x' is not a git")],
)
def test_an_uncached_hub_dataset_offline_or_a_bad_revision_is_one_named_line(offline_cache, revision, named):
    with pytest.raises(HpuFp8Error, match=named):
        list(load_documents("acme/absent", revision=revision))


@pytest.mark.slow
def test_calibrate_reads_a_cached_hub_dataset_under_hf_hub_offline(tmp_path, source_factory):
    """The console script with HF_HUB_OFFLINE=1 and HF_HUB_CACHE as a user sets them: a cached dataset calibrates,
    an uncached one is one line and exit 1."""
    files = tmp_path / "files"
    files.mkdir()
    (files / "part.jsonl").write_text(
        "".join(json.dumps({"text": builtin_text()[i : i + 400]}) + "\n" for i in range(0, 4000, 400))
    )
    add_to_cache(tmp_path / "hub", "acme/corpus", files, repo_type="dataset")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    script = str(Path(sys.executable).with_name("hpu-fp8"))
    command = [script, "calibrate", str(source_factory("qwen2-tiny")), "--samples", "2", "--seq-len", "32", "-q", "-o"]
    ok = subprocess.run([*command, str(tmp_path / "m.json"), "--dataset", "acme/corpus"], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    provenance = load_measurements(tmp_path / "m.json").measurements.provenance
    assert (provenance.dataset, provenance.dataset_revision) == ("acme/corpus", "0" * 39 + "1")
    missing = subprocess.run(
        [*command, str(tmp_path / "n.json"), "--dataset", "acme/other"], capture_output=True, text=True, env=env
    )
    assert missing.returncode == 1 and "acme/other: not in the local Hugging Face cache" in missing.stderr
    assert "Traceback" not in missing.stderr and not (tmp_path / "n.json").exists()


# ----- a model with a real tokenizer, end to end -----


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory, source_factory) -> Path:
    """qwen2-tiny (vocab 512) with a 300-piece sentencepiece tokenizer.model and a BOS in tokenizer_config.json."""
    root = tmp_path_factory.mktemp("spmodel") / "model"
    shutil.copytree(source_factory("qwen2-tiny"), root)
    (root.parent / "corpus.txt").write_text(builtin_text()[:60000])
    sentencepiece.SentencePieceTrainer.train(
        input=str(root.parent / "corpus.txt"), model_prefix=str(root / "tokenizer"), vocab_size=300, minloglevel=2
    )
    (root / "tokenizer.vocab").unlink()
    (root / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<s>"}))
    return root


def test_a_model_with_a_sentencepiece_tokenizer_calibrates_and_the_file_names_it(tmp_path, sentencepiece_model):
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"text": builtin_text()[i : i + 300]}) + "\n" for i in range(0, 6000, 300))
    )
    result = CliRunner().invoke(
        main, ["calibrate", str(sentencepiece_model), "-o", str(tmp_path / "m.json"), "--dataset", str(tmp_path / "d.jsonl"),
               "--samples", "2", "--seq-len", "32", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokenizer"] == "tokenizer.model (sentencepiece)"
    provenance = load_measurements(tmp_path / "m.json").measurements.provenance
    assert provenance.tokenizer == "tokenizer.model (sentencepiece)" and provenance.tokens == 64


def test_bytes_when_asked_gives_other_statistics_than_the_models_tokenizer(sentencepiece_model):
    own = calibrate(sentencepiece_model, samples=1, seq_len=32)
    raw = calibrate(sentencepiece_model, samples=1, seq_len=32, tokenizer="bytes")
    assert (own.tokenizer, raw.tokenizer) == ("tokenizer.model (sentencepiece)", "bytes")
    assert raw.measurements.provenance.tokenizer == "bytes" and own.measurements.amax != raw.measurements.amax


def test_calibrating_a_model_without_its_tokenizer_is_refused_naming_the_files(tmp_path, source_factory):
    from hpu_fp8_loader.sources.synth import preset_config, synthesize

    synthesize(tmp_path / "big", preset_config("qwen2-tiny", {"vocab_size": 1024}), "paddle", seed=1)
    result = CliRunner().invoke(main, ["calibrate", str(tmp_path / "big"), "-o", str(tmp_path / "m.json"), "-q"])
    assert result.exit_code == 1 and "no tokenizer.json or tokenizer.model" in result.stderr and "1024" in result.stderr
    assert not (tmp_path / "m.json").exists()

"""The datasets users calibrate with (`quality.datasets`): parquet, a JSONL field of their choice, a directory of
files, a Hub dataset from a Hugging Face cache laid out by the test (offline); and a synthetic model with a real
tokenizer calibrating end to end, the measurement file naming the tokenizer."""

from __future__ import annotations

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
from hpu_fp8_loader.quality.calibrate import calibrate
from hpu_fp8_loader.quality.datasets import builtin_text, load_documents
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


def test_a_file_that_is_no_parquet_is_named(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"PAR1 but not really")
    with pytest.raises(DatasetError, match=r"d\.parquet: not a parquet file pyarrow can read"):
        list(load_documents(tmp_path / "d.parquet"))


def test_a_jsonl_text_field_of_ones_choice(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"body": "first"}\n{"body": "second", "text": "not this"}\n')
    assert list(load_documents(tmp_path / "d.jsonl", text_field="body")) == ["first", "second"]
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: the JSON object has no 'text' key"):
        list(load_documents(tmp_path / "d.jsonl"))


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
    assert load_measurements(tmp_path / "m.json").measurements.provenance.dataset == "acme/corpus"
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

"""The model's own tokenizer (`quality.tokenizer`): tiny real tokenizers trained here, offline, by the libraries
themselves; our ids must equal their own encodings, with BOS as tokenizer_config.json says and once only."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import sentencepiece
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from hpu_fp8_loader.errors import DatasetError, TokenizerError
from hpu_fp8_loader.quality.datasets import builtin_text, dataset_tokens
from hpu_fp8_loader.quality.tokenizer import load_tokenizer

TEXT = "The interpreter reads a line, parses it and runs it: print(1 + 2) </s> then waits."
SPECIALS = ["<unk>", "<s>", "</s>"]


@pytest.fixture(scope="module")
def sentencepiece_file(tmp_path_factory) -> Path:
    """A 300-piece sentencepiece BPE model trained on the built-in text (<unk> 0, <s> 1, </s> 2), in ~0.1 s."""
    folder = tmp_path_factory.mktemp("sp")
    (folder / "corpus.txt").write_text(builtin_text()[:60000])
    sentencepiece.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"), model_prefix=str(folder / "tok"), vocab_size=300, model_type="bpe", minloglevel=2
    )
    return folder / "tok.model"


@pytest.fixture(scope="module")
def bpe_tokenizer() -> Tokenizer:
    """A 300-token byte-level BPE tokenizer.json trained on the built-in text, special tokens <unk> <s> </s> first."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator([builtin_text()[:60000]], trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS))
    return tokenizer


def model_dir(tmp_path: Path, config: dict | None = None, **files: object) -> Path:
    """A model directory holding only tokenizer files: ``tokenizer_json`` (a Tokenizer), ``tokenizer_model`` (a path)."""
    folder = tmp_path / "model"
    folder.mkdir()
    if "tokenizer_json" in files:
        files["tokenizer_json"].save(str(folder / "tokenizer.json"))  # type: ignore[attr-defined]
    if "tokenizer_model" in files:
        shutil.copy(files["tokenizer_model"], folder / "tokenizer.model")  # type: ignore[arg-type]
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


# ----- the library's own encodings -----


@pytest.mark.parametrize("bos", [None, "<s>", {"content": "<s>", "lstrip": False, "__type": "AddedToken"}])
def test_sentencepiece_ids_are_sentencepieces_own_with_bos_as_configured(tmp_path, sentencepiece_file, bos):
    config = {"bos_token": bos, "add_bos_token": bos is not None, "eos_token": "</s>"}
    tokenizer = load_tokenizer(model_dir(tmp_path, config, tokenizer_model=sentencepiece_file), 300)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_file))
    head, tail = TEXT.split(" </s> ")
    # the control token </s> in the text is the token itself, as transformers matches it; the rest is sentencepiece's
    expected = [*processor.encode(head + " "), 2, *processor.encode(" " + tail)]
    assert tokenizer.name == "tokenizer.model (sentencepiece)"
    assert tokenizer.encode(TEXT) == ([1] if bos else []) + expected
    assert processor.encode("plain text") == tokenizer.encode("plain text")[1 if bos else 0 :]


@pytest.mark.parametrize("post_processor_adds_bos", [False, True])
@pytest.mark.parametrize("add_bos_token", [False, True])
def test_tokenizer_json_ids_are_the_librarys_own_and_bos_comes_once(
    tmp_path, bpe_tokenizer, post_processor_adds_bos, add_bos_token
):
    tokenizer = Tokenizer.from_str(bpe_tokenizer.to_str())
    if post_processor_adds_bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder = model_dir(tmp_path, {"add_bos_token": add_bos_token, "bos_token": "<s>"}, tokenizer_json=tokenizer)
    ours = load_tokenizer(folder, 300)
    library = tokenizer.encode(TEXT).ids
    assert ours.name == "tokenizer.json"
    assert ours.encode(TEXT) == (library if post_processor_adds_bos or not add_bos_token else [1, *library])
    assert ours.encode(TEXT).count(1) == (1 if post_processor_adds_bos or add_bos_token else 0)


def test_each_document_is_encoded_on_its_own_with_its_bos(tmp_path, sentencepiece_file):
    folder = model_dir(tmp_path, {"add_bos_token": True, "bos_token": "<s>"}, tokenizer_model=sentencepiece_file)
    tokenizer = load_tokenizer(folder, 300)
    documents = ["First document.", "Second one, longer than the first."]
    stream = tokenizer.tokens(documents)
    assert stream.dtype == np.int64
    assert stream.tolist() == tokenizer.encode(documents[0]) + tokenizer.encode(documents[1])
    assert stream.tolist().count(1) == 2 and stream[0] == 1


def test_a_limit_stops_reading_documents_once_the_stream_is_long_enough(tmp_path):
    tokenizer = load_tokenizer(model_dir(tmp_path), 512)

    def documents():
        yield "abcd"
        yield "efgh"
        raise AssertionError("read past the limit")

    assert tokenizer.tokens(documents(), limit=6).tolist() == list(b"abcdefgh")


# ----- which tokenizer -----


def test_a_byte_level_model_without_a_tokenizer_file_keeps_byte_tokens(tmp_path):
    tokenizer = load_tokenizer(model_dir(tmp_path), 512)
    assert tokenizer.name == "bytes" and tokenizer.tokens(["é"]).tolist() == list("é".encode())


def test_bytes_when_asked_even_beside_a_tokenizer_file(tmp_path, sentencepiece_file):
    folder = model_dir(tmp_path, {"add_bos_token": True, "bos_token": "<s>"}, tokenizer_model=sentencepiece_file)
    tokenizer = load_tokenizer(folder, 300, "bytes")
    assert tokenizer.name == "bytes" and tokenizer.encode("ab") == [97, 98]  # no BOS: bytes have none


def test_tokenizer_json_wins_over_tokenizer_model(tmp_path, bpe_tokenizer, sentencepiece_file):
    folder = model_dir(tmp_path, tokenizer_json=bpe_tokenizer, tokenizer_model=sentencepiece_file)
    assert load_tokenizer(folder, 300).name == "tokenizer.json"


def test_no_tokenizer_file_and_a_large_vocabulary_is_refused_listing_the_files(tmp_path):
    with pytest.raises(TokenizerError) as refused:
        load_tokenizer(model_dir(tmp_path), 103424)
    message = str(refused.value)
    assert all(
        part in message for part in (str(tmp_path / "model"), "tokenizer.json", "tokenizer.model", "103424", "--tokenizer bytes")
    )


def test_byte_tokens_need_a_vocabulary_of_256(tmp_path):
    with pytest.raises(TokenizerError, match="vocabulary of 256; the model's is 100"):
        load_tokenizer(model_dir(tmp_path), 100)


def test_an_unknown_choice_is_refused(tmp_path):
    with pytest.raises(TokenizerError, match="'words' is not one of auto, bytes"):
        load_tokenizer(model_dir(tmp_path), 512, "words")


# ----- refusals -----


def test_ids_beyond_the_vocabulary_are_refused_naming_the_tokenizer_file(tmp_path, sentencepiece_file):
    tokenizer = load_tokenizer(model_dir(tmp_path, tokenizer_model=sentencepiece_file), 256)  # the model has 300 pieces
    with pytest.raises(TokenizerError, match=r"tokenizer\.model: gives token id 2\d\d >= the model's vocab_size 256"):
        tokenizer.tokens([builtin_text()[:2000]])


@pytest.mark.parametrize(
    ("name", "content", "named"),
    [
        ("tokenizer.model", b"not a sentencepiece model", "sentencepiece cannot load it"),
        ("tokenizer.json", b'{"not": 1}', "tokenizers library cannot load it"),
        ("tokenizer_config.json", b'{"bos_token": "<s>",', "not valid JSON"),
    ],
)
def test_a_broken_tokenizer_file_is_named(tmp_path, sentencepiece_file, name, content, named):
    folder = model_dir(tmp_path, tokenizer_model=sentencepiece_file)
    (folder / name).write_bytes(content)
    with pytest.raises(TokenizerError, match=rf"{name}: .*{named}"):
        load_tokenizer(folder, 300)


def test_a_fifo_named_tokenizer_model_is_refused_without_blocking(tmp_path):
    folder = model_dir(tmp_path)
    os.mkfifo(folder / "tokenizer.model")
    with pytest.raises(TokenizerError, match=r"tokenizer\.model: not a regular file"):
        load_tokenizer(folder, 300)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"add_bos_token": True}, "add_bos_token is true but there is no bos_token"),
        ({"add_bos_token": True, "bos_token": "<bos>"}, "bos_token '<bos>' is not a token of"),
        ({"add_bos_token": "yes", "bos_token": "<s>"}, "add_bos_token is 'yes'; expected true or false"),
        ({"add_bos_token": True, "bos_token": 1}, "bos_token is 1; expected a string or an object"),
    ],
)
def test_a_bos_the_tokenizer_cannot_give_is_refused_naming_tokenizer_config(tmp_path, sentencepiece_file, config, named):
    with pytest.raises(TokenizerError, match=rf"tokenizer_config\.json: {named}"):
        load_tokenizer(model_dir(tmp_path, config, tokenizer_model=sentencepiece_file), 300)


# ----- chat templates -----

TEMPLATE = "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}</s>{% endfor %}"
CHATS = [{"messages": [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi."}]}]


def test_chat_records_are_rendered_by_the_models_template_with_its_own_special_tokens(tmp_path, sentencepiece_file):
    config = {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    folder = model_dir(tmp_path, config, tokenizer_model=sentencepiece_file)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    ids, name, _ = dataset_tokens(folder, 300, tmp_path / "chats.jsonl", chat_template=True)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_file))
    expected = [1, *processor.encode("user: Hello there"), 2, 1, *processor.encode("assistant: Hi."), 2]
    assert name == "tokenizer.model (sentencepiece)" and ids.tolist() == expected  # the template's BOS only, no second


def test_a_chat_template_jinja_file_is_used_when_tokenizer_config_has_none(tmp_path):
    folder = model_dir(tmp_path)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    render = load_tokenizer(folder, 512).chat_renderer()
    assert render(CHATS[0]["messages"], "here") == "[user]Hello there[assistant]Hi."


def test_chat_template_without_a_template_is_refused_before_reading_the_dataset(tmp_path, sentencepiece_file):
    folder = model_dir(tmp_path, {"bos_token": "<s>"}, tokenizer_model=sentencepiece_file)
    with pytest.raises(
        TokenizerError,
        match=r"model: --chat-template needs the model's chat template.*no chat_template in tokenizer_config\.json, no chat_template\.jinja",
    ):
        dataset_tokens(folder, 300, tmp_path / "never-read.jsonl", chat_template=True)


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ('{"text": "no messages here"}', r"chats\.jsonl:1: no 'messages' list"),
        ('{"messages": [{"role": "user"}]}', r"chats\.jsonl:1: messages\[0\] is not an object with 'role' and 'content'"),
    ],
)
def test_a_record_without_messages_is_refused_naming_the_line(tmp_path, sentencepiece_file, line, named):
    folder = model_dir(tmp_path, {"chat_template": TEMPLATE}, tokenizer_model=sentencepiece_file)
    (tmp_path / "chats.jsonl").write_text(line + "\n")
    with pytest.raises(DatasetError, match=named):
        dataset_tokens(folder, 300, tmp_path / "chats.jsonl", chat_template=True)


def test_a_template_runs_sandboxed_and_its_failure_names_the_record(tmp_path, sentencepiece_file):
    folder = model_dir(tmp_path, {"chat_template": "{{ messages.append(1) }}"}, tokenizer_model=sentencepiece_file)
    (tmp_path / "chats.jsonl").write_text(json.dumps(CHATS[0]) + "\n")
    with pytest.raises(
        TokenizerError, match=r"chats\.jsonl:1: the chat template of .*tokenizer_config\.json fails on this record .*unsafe"
    ):
        dataset_tokens(folder, 300, tmp_path / "chats.jsonl", chat_template=True)

"""The model's own tokenizer, for calibration and evaluation: tokens the model was trained on, or a refusal.

Calibrating on the wrong tokens does not fail, it measures other activations, so nothing falls back
silently: a model directory's ``tokenizer.json`` is read through the ``tokenizers`` library, else its
sentencepiece ``tokenizer.model`` (ERNIE-4.5 ships only that), with the special tokens of its
``tokenizer_config.json``. Byte tokens (id = UTF-8 byte) are used when asked for, or for a model with no
tokenizer file and a vocabulary of at most 512: the byte-level tiny models of this project. Any other
model without a tokenizer file is refused, naming the files looked for.

BOS is added per document as the model expects it: when tokenizer_config.json sets ``add_bos_token``, and
never twice (tokenizer.json's post-processor may add it already). A chat-rendered document gets no BOS
and no post-processor tokens: its template writes every special token itself, as ``apply_chat_template``
does. Every file is read strictly (:func:`~hpu_fp8_loader.io.jsonfile.read_regular_file`): a FIFO named
tokenizer.model would block the run.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpu_fp8_loader.errors import TokenizerError, one_line, require_optional
from hpu_fp8_loader.io.jsonfile import JsonFormatError, read_json_object, read_regular_file
from hpu_fp8_loader.quality.chat_template import ChatRenderer

__all__ = ["BYTE_VOCAB_LIMIT", "TOKENIZER_CHOICES", "Continued", "ModelTokenizer", "load_tokenizer"]

TOKENIZER_CHOICES = ("auto", "bytes")
# The largest vocabulary that byte tokens serve when a model has no tokenizer file: the project's byte-level
# tiny models (256, and the synthetic presets' 512). A real model's vocabulary is far larger.
BYTE_VOCAB_LIMIT = 512
_BYTES = 256
_JSON, _SENTENCEPIECE, _CONFIG, _TEMPLATE = "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "chat_template.jinja"


class Continued(str):
    """A piece of text that continues the document before it (a long .txt file is read in pieces, so that it is
    never held whole): encoded without the BOS or special tokens a document starts with."""

    __slots__ = ()


@dataclass(frozen=True)
class _Encoder:
    """One tokenizer library behind one signature: ``encode(text, add_special_tokens)`` and ``token_id(token)``."""

    encode: Callable[[str, bool], list[int]]
    token_id: Callable[[str], int | None]


class ModelTokenizer:
    """A model's tokenizer as calibration and evaluation use it: documents in, one token stream out.

    Attributes:
        name: which tokenizer it is, as results and measurement files name it: ``"tokenizer.json"``,
            ``"tokenizer.model (sentencepiece)"`` or ``"bytes"``.
        file: the tokenizer file (None for bytes), named by every refusal.
        bos_id: the BOS id added at the start of each document, or None.
    """

    def __init__(self, name: str, file: Path | None, encoder: _Encoder, config: dict, model_dir: Path, vocab_size: int):
        self.name, self.file, self._encoder, self._config = name, file, encoder, config
        self._model_dir, self._vocab_size = model_dir, vocab_size
        self.bos_id = self._bos_id()

    def _bos_id(self) -> int | None:
        add = self._config.get("add_bos_token", False)
        if not isinstance(add, bool):
            raise TokenizerError(f"{self._model_dir / _CONFIG}: add_bos_token is {add!r}; expected true or false")
        if not add:
            return None
        token = _special_tokens(self._config, self._model_dir).get("bos_token")
        if token is None:
            raise TokenizerError(f"{self._model_dir / _CONFIG}: add_bos_token is true but there is no bos_token")
        token_id = self._encoder.token_id(token)
        if token_id is None:
            raise TokenizerError(f"{self._model_dir / _CONFIG}: bos_token {token!r} is not a token of {self.file}")
        return token_id

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """The ids of one document: BOS once where the model expects it; a chat-rendered one exactly as written."""
        try:
            ids = self._encoder.encode(text, not chat)
        except Exception as exc:  # the tokenizers and sentencepiece libraries raise bare Exception
            raise TokenizerError(f"{self.file}: cannot encode the dataset ({one_line(exc)})") from None
        if self.bos_id is not None and not chat and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def tokens(self, documents: Iterable[str], limit: int | None = None, chat: bool = False) -> np.ndarray:
        """Each document encoded in turn and concatenated, until ``limit`` tokens (all without a limit); a
        :class:`Continued` piece goes on with the document before it, without a BOS of its own.

        Every id is checked below the model's vocab_size here, for calibrate and eval alike: a tokenizer that
        does not belong to the model gives ids its embedding does not have, which would end in numpy's
        IndexError halfway through a forward.
        """
        parts, count = [], 0
        for document in documents:
            ids = np.asarray(self.encode(document, chat or isinstance(document, Continued)), np.int64)
            parts.append(ids)
            count += ids.size
            if limit is not None and count >= limit:
                break
        stream = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if stream.size and stream.max() >= self._vocab_size:
            raise TokenizerError(
                f"{self.file or 'bytes'}: gives token id {int(stream.max())} >= the model's vocab_size {self._vocab_size}; "
                "is it the tokenizer of this model?"
            )
        return stream

    def chat_renderer(self) -> ChatRenderer:
        """``render(messages, where)``: a record's ``messages`` through the model's chat template, in a sandboxed
        child process with a deadline and limits on memory and output (:mod:`.chat_template`).

        Refused before any dataset is read when the model has no chat template or it does not parse; a template
        that fails on a record is refused naming the record (``where``).
        """
        source, origin = _chat_template(self._config, self._model_dir)
        return ChatRenderer(source, origin, _special_tokens(self._config, self._model_dir))


def load_tokenizer(model_dir: str | Path, vocab_size: int, choice: str = "auto") -> ModelTokenizer:
    """The tokenizer of the model in ``model_dir`` (``choice`` ``"auto"``), or byte tokens (``"bytes"``).

    ``auto``: tokenizer.json (the ``tokenizers`` library), else tokenizer.model (``sentencepiece``), else byte
    tokens for a vocabulary of at most :data:`BYTE_VOCAB_LIMIT`; anything else is refused naming the files
    looked for. Byte tokens need a vocabulary of at least 256.
    """
    model_dir = Path(model_dir)
    if choice not in TOKENIZER_CHOICES:
        raise TokenizerError(f"tokenizer {choice!r} is not one of {', '.join(TOKENIZER_CHOICES)}")
    if choice == "auto":
        for name, make in ((_JSON, _json_encoder), (_SENTENCEPIECE, _sentencepiece_encoder)):
            if os.path.lexists(model_dir / name):
                config = _tokenizer_config(model_dir)
                label = name if name == _JSON else f"{name} (sentencepiece)"
                return ModelTokenizer(
                    label, model_dir / name, make(model_dir / name, config, model_dir), config, model_dir, vocab_size
                )
        if vocab_size > BYTE_VOCAB_LIMIT:
            raise TokenizerError(
                f"{model_dir}: no {_JSON} or {_SENTENCEPIECE}, and a vocabulary of {vocab_size} is no byte-level model "
                f"(at most {BYTE_VOCAB_LIMIT}); copy the model's tokenizer files there, or pass --tokenizer bytes to "
                "calibrate on byte tokens anyway"
            )
    if vocab_size < _BYTES:
        raise TokenizerError(f"{model_dir}: byte tokens need a vocabulary of 256; the model's is {vocab_size} < 256")
    encoder = _Encoder(lambda text, _special: list(text.encode("utf-8")), lambda _token: None)
    return ModelTokenizer("bytes", None, encoder, {}, model_dir, vocab_size)


def _tokenizer_config(model_dir: Path) -> dict:
    """tokenizer_config.json as a strict JSON object, or {} when the model has none."""
    path = model_dir / _CONFIG
    return read_json_object(path, TokenizerError) if os.path.lexists(path) else {}


def _special_tokens(config: dict, model_dir: Path) -> dict[str, str]:
    """Every ``*_token`` of tokenizer_config.json that is set: a string, or an AddedToken object's ``content``."""
    found = {}
    for key, value in config.items():
        if not key.endswith("_token") or key.startswith("add_") or value is None:
            continue
        content = value.get("content") if isinstance(value, dict) else value
        if not isinstance(content, str):
            raise TokenizerError(
                f"{model_dir / _CONFIG}: {key} is {value!r}; expected a string or an object with a 'content' string"
            )
        found[key] = content
    return found


def _chat_template(config: dict, model_dir: Path) -> tuple[str, Path]:
    """(template source, where it came from): tokenizer_config.json's ``chat_template`` (a string, or the one
    named ``default`` of a list), else chat_template.jinja; refused naming both when there is neither."""
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(template, str):
        return template, model_dir / _CONFIG
    if template is not None:
        raise TokenizerError(f"{model_dir / _CONFIG}: chat_template is neither a string nor a list holding a 'default' one")
    path = model_dir / _TEMPLATE
    if os.path.lexists(path):
        return _read_text(path), path
    raise TokenizerError(
        f"{model_dir}: --chat-template needs the model's chat template, and there is none "
        f"(no chat_template in {_CONFIG}, no {_TEMPLATE})"
    )


def _read_bytes(path: Path) -> bytes:
    try:
        return read_regular_file(path)
    except JsonFormatError as exc:
        raise TokenizerError(f"{path}: {exc}") from None
    except OSError as exc:
        raise TokenizerError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _read_text(path: Path) -> str:
    try:
        return _read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _json_encoder(path: Path, _config: dict, _model_dir: Path) -> _Encoder:
    """tokenizer.json through the tokenizers library, read as strict JSON first: the library's own messages for a
    broken file are misleading (``{"not": 1}`` is "expected `,` or `}`")."""
    data = read_json_object(path, TokenizerError, "a link to nothing")
    require_optional("tokenizers", f"{path}: reading it")
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(json.dumps(data))
    except Exception as exc:  # the tokenizers library raises bare Exception
        raise TokenizerError(f"{path}: the tokenizers library cannot load it ({one_line(exc)})") from None
    return _Encoder(lambda text, special: tokenizer.encode(text, add_special_tokens=special).ids, tokenizer.token_to_id)


def _sentencepiece_encoder(path: Path, config: dict, model_dir: Path) -> _Encoder:
    """tokenizer.model through sentencepiece, with the special tokens of tokenizer_config.json matched in the text
    first (sentencepiece itself would split ``<|begin_of_sentence|>`` into pieces), as transformers does."""
    data = _read_bytes(path)
    require_optional("sentencepiece", f"{path}: reading it")
    import sentencepiece

    try:
        processor = sentencepiece.SentencePieceProcessor(model_proto=data)
    except Exception as exc:  # sentencepiece raises RuntimeError or OSError with C++ text
        raise TokenizerError(f"{path}: sentencepiece cannot load it ({one_line(exc)})") from None

    def piece_id(token: str) -> int | None:
        found = processor.piece_to_id(token)
        return found if found != processor.unk_id() or token == processor.id_to_piece(found) else None

    specials = {token: found for token in _special_tokens(config, model_dir).values() if (found := piece_id(token)) is not None}
    specials.update(_added_tokens(config, model_dir))
    pattern = (
        re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")") if specials else None
    )

    def encode(text: str, _special: bool) -> list[int]:
        if pattern is None:
            return processor.encode(text)
        ids: list[int] = []
        for number, part in enumerate(pattern.split(text)):
            if number % 2:
                ids.append(specials[part])
            elif part:
                ids.extend(processor.encode(part))
        return ids

    return _Encoder(encode, lambda token: specials.get(token, piece_id(token)))


def _added_tokens(config: dict, model_dir: Path) -> dict[str, int]:
    """tokenizer_config.json's ``added_tokens_decoder``: ``{"<id>": {"content": ...}}`` as content -> id."""
    added: Any = config.get("added_tokens_decoder", {})
    if not isinstance(added, dict):
        raise TokenizerError(f"{model_dir / _CONFIG}: added_tokens_decoder is not a JSON object")
    found = {}
    for key, value in added.items():
        content = value.get("content") if isinstance(value, dict) else None
        if not key.isdecimal() or not isinstance(content, str):
            raise TokenizerError(f"{model_dir / _CONFIG}: added_tokens_decoder[{key!r}] is not an id with a 'content' string")
        found[content] = int(key)
    return found

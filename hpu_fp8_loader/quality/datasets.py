"""Text for calibration and evaluation, and turning it into token ids, offline.

The built-in text is CPython's own documentation (``pydoc_data.topics``, ~465k characters, always
installed): the first 90% calibrates, the last 10% is held out for evaluation and never calibrates.
Tokens come from the model directory's ``tokenizer.json`` through the ``tokenizers`` library when
both are there; otherwise from a byte-level fallback (token id = UTF-8 byte, 0..255), which needs a
vocabulary of at least 256 and is what the tiny models of this project are trained on.

Everything read here is read strictly, because a dataset or tokenizer that is read leniently does not
fail, it calibrates on something else: a dataset must be a regular file (a FIFO would block the run
forever, /dev/zero fill the memory), UTF-8 (a BOM is dropped: it is not text), and a JSONL line must be
strict JSON (:func:`~hpu_fp8_loader.io.jsonfile.parse_json`: no lone surrogate, duplicate key or NaN).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from hpu_fp8_loader.errors import HpuFp8Error, one_line
from hpu_fp8_loader.io.jsonfile import JsonFormatError, parse_json, read_json_object, read_regular_file

__all__ = ["BUILTIN", "check_seq_len", "load_text", "token_batches", "tokenize"]

BUILTIN = "builtin"
_HELD_OUT = 0.1
_BOM = "\ufeff"
# What a JSONL record's value is, in JSON's words (never Python's: a user wrote JSON, not None or list).
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "true/false", int: "a number", float: "a number"}


def _builtin_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[key] for key in sorted(topics))


def load_text(dataset: str | Path, split: str = "calibration") -> str:
    """The text of ``dataset``: ``builtin`` (split into calibration / held-out), a .txt or a .jsonl file.

    Refuses, naming the file (and line), anything that is not a regular UTF-8 file, a JSONL line that is
    not a strict JSON string or object with a ``text`` string, and a dataset with no text at all.
    """
    if str(dataset) == BUILTIN:
        text = _builtin_text()
        cut = int(len(text) * (1 - _HELD_OUT))
        return text[:cut] if split == "calibration" else text[cut:]
    path = Path(dataset)
    text = _decode(path, _read_dataset(path))
    if path.suffix.lower() == ".jsonl":
        text = "\n\n".join(_jsonl_texts(path, text))
    if not text.strip():
        raise HpuFp8Error(f"{path}: no text in the dataset (empty, or only whitespace)")
    return text


def _read_dataset(path: Path) -> bytes:
    """The bytes of a dataset file, refusing before reading anything that is not a regular file."""
    try:
        return read_regular_file(path)
    except FileNotFoundError:
        raise HpuFp8Error(f"{path}: no such dataset file (use 'builtin', a .txt or a .jsonl file)") from None
    except JsonFormatError as exc:  # a FIFO or a device (a directory is an OSError below)
        raise HpuFp8Error(
            f"{path}: {exc}; a dataset must be a regular .txt or .jsonl file (a FIFO or device may never end)"
        ) from None
    except OSError as exc:
        raise HpuFp8Error(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _decode(path: Path, data: bytes) -> str:
    """UTF-8 text without its BOM, or an error naming the line and byte (UTF-16 or Latin-1 would tokenize as noise)."""
    try:
        return data.decode("utf-8").removeprefix(_BOM)
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise HpuFp8Error(
            f"{path}:{line}: not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}; UTF-16 or Latin-1?)"
        ) from None


def _jsonl_texts(path: Path, text: str) -> Iterator[str]:
    """The text of each non-blank JSONL line: a JSON string, or an object's ``text`` string.

    Lines end at ``\\n`` only: ``str.splitlines`` would also split at U+2028 and other characters a JSON
    string may hold, and break a valid line in two.
    """
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = parse_json(line)
        except JsonFormatError as exc:
            raise HpuFp8Error(f"{where}: {exc}") from None
        if isinstance(record, dict) and "text" not in record:
            raise HpuFp8Error(f"{where}: the JSON object has no 'text' key")
        value = record.get("text") if isinstance(record, dict) else record
        if not isinstance(value, str):
            what = "its 'text' is" if isinstance(record, dict) else "the line is"
            raise HpuFp8Error(
                f"{where}: {what} {_JSON_TYPES.get(type(value), 'null')}; expected a JSON object with a 'text' string "
                "(or a JSON string)"
            )
        yield value


def check_seq_len(seq_len: int, model: str | Path, config: dict) -> None:
    """Refuse windows longer than the model's ``max_position_embeddings``: positions it was never trained
    on give activations (calibrate) and logits (eval) that no real request produces."""
    limit = config.get("max_position_embeddings")
    if limit and seq_len > int(limit):
        raise HpuFp8Error(f"{model}: seq_len {seq_len} is beyond the model's max_position_embeddings {limit}")


def tokenize(text: str, model_dir: Path, vocab_size: int) -> tuple[np.ndarray, str]:
    """(token ids, which tokenizer was used); every id is below ``vocab_size``.

    The id check is here, for calibrate and eval alike: a tokenizer that does not belong to the model gives
    ids its embedding does not have, which would end in numpy's IndexError halfway through a forward.
    """
    tokenizer_file = Path(model_dir) / "tokenizer.json"
    tokenizer = _load_tokenizer(tokenizer_file) if os.path.lexists(tokenizer_file) else None
    if tokenizer is None:
        if vocab_size < 256:
            raise HpuFp8Error(
                f"{model_dir}: no tokenizer.json (or no `tokenizers` library) and a vocabulary of {vocab_size} < 256 bytes"
            )
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64), "bytes"
    try:
        ids = np.asarray(tokenizer.encode(text).ids, np.int64)
    except Exception as exc:  # the tokenizers library raises bare Exception
        raise HpuFp8Error(f"{tokenizer_file}: cannot encode the dataset ({one_line(exc)})") from None
    if ids.size and ids.max() >= vocab_size:
        raise HpuFp8Error(
            f"{tokenizer_file}: gives token id {int(ids.max())} >= the model's vocab_size {vocab_size}; "
            "is it the tokenizer of this model?"
        )
    return ids, "tokenizer.json"


def _load_tokenizer(path: Path):
    """The tokenizer in ``path``, or None without the ``tokenizers`` library (the byte fallback then applies).

    The file is read as strict JSON first: the library's own messages for a broken file are misleading
    (``{"not": 1}`` is "expected `,` or `}`"), and it would block on a FIFO.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    data = read_json_object(path, HpuFp8Error, "a link to nothing")
    try:
        return Tokenizer.from_str(json.dumps(data))
    except Exception as exc:  # the tokenizers library raises bare Exception
        raise HpuFp8Error(f"{path}: the tokenizers library cannot load it ({one_line(exc)})") from None


def token_batches(ids: np.ndarray, samples: int, seq_len: int, batch_size: int, dataset: str | Path = "the dataset"):
    """Up to ``samples`` consecutive windows of ``seq_len`` tokens, ``batch_size`` at a time."""
    for name, value in (("samples", samples), ("seq_len", seq_len), ("batch_size", batch_size)):
        if value < 1:
            raise HpuFp8Error(f"{name} is {value}; it must be at least 1")
    available = len(ids) // seq_len
    if available == 0:
        raise HpuFp8Error(f"{dataset}: {len(ids)} tokens, fewer than one window of seq_len {seq_len}; use a smaller --seq-len")
    windows = ids[: min(samples, available) * seq_len].reshape(-1, seq_len)
    for start in range(0, len(windows), batch_size):
        yield windows[start : start + batch_size]

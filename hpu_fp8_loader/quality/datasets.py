"""Text for calibration and evaluation, as documents, and the token stream the model's tokenizer makes of them.

A dataset is one of:

- ``builtin``: CPython's own documentation (``pydoc_data.topics``, ~465k characters, always installed, offline):
  the first 90% calibrates, the last 10% is held out for evaluation and never calibrates;
- a ``.txt`` file (one document), a ``.jsonl`` file (one document per line: a JSON string, or an object's
  ``text_field`` string) or a ``.parquet`` file (one document per row of the ``text_field`` string column);
- a directory: every .txt, .jsonl and .parquet file under it, sorted by path, each file's records in order;
- a Hub dataset repo id ``ORG/NAME`` (optionally at a revision): its .txt, .jsonl and .parquet files, through
  huggingface_hub's cache, so ``HF_HUB_OFFLINE=1`` reads the cache only. A local path that exists wins.

With a chat template, each record's ``messages`` (a list of ``{"role", "content"}`` objects) is rendered through
the model's template (:meth:`~hpu_fp8_loader.quality.tokenizer.ModelTokenizer.chat_renderer`) instead. Each
document is tokenized on its own (BOS per document where the model expects one) and the ids are concatenated
into the stream :func:`token_windows` cuts into windows; documents are read only until the stream is long enough.

Everything read here is read strictly, because a dataset that is read leniently does not fail, it calibrates
on something else: a dataset must be a regular file (a FIFO would block the run forever, /dev/zero fill the
memory), UTF-8 (a BOM is dropped: it is not text), and a JSONL line must be strict JSON
(:func:`~hpu_fp8_loader.io.jsonfile.parse_json`: no lone surrogate, duplicate key or NaN); a parquet column must
hold strings, none of them null.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from hpu_fp8_loader.errors import DatasetError, HpuFp8Error, HubError, one_line
from hpu_fp8_loader.io.checkpoint import resolve_path
from hpu_fp8_loader.io.jsonfile import JsonFormatError, parse_json, read_regular_file
from hpu_fp8_loader.quality.tokenizer import load_tokenizer
from hpu_fp8_loader.sources.resolve import check_repo_id, check_revision, download_snapshot

__all__ = [
    "BUILTIN",
    "DATASET_SUFFIXES",
    "builtin_text",
    "check_seq_len",
    "dataset_tokens",
    "load_documents",
    "token_batches",
    "token_windows",
]

BUILTIN = "builtin"
DATASET_SUFFIXES = (".txt", ".jsonl", ".parquet")
_FORMS = "'builtin', a .txt, .jsonl or .parquet file, a directory of them, or a Hub dataset ORG/NAME"
_HELD_OUT = 0.1
_BOM = "\ufeff"
# What a JSONL record's value is, in JSON's words (never Python's: a user wrote JSON, not None or list).
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "true/false", int: "a number", float: "a number"}


def builtin_text(split: str = "calibration") -> str:
    """The built-in text's ``"calibration"`` part (the first 90%) or its ``"held-out"`` part (the rest)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[key] for key in sorted(topics))
    cut = int(len(text) * (1 - _HELD_OUT))
    return text[:cut] if split == "calibration" else text[cut:]


def dataset_tokens(
    model_dir: str | Path,
    vocab_size: int,
    dataset: str | Path = BUILTIN,
    *,
    split: str = "calibration",
    limit: int | None = None,
    tokenizer: str = "auto",
    text_field: str = "text",
    chat_template: bool = False,
    dataset_revision: str | None = None,
) -> tuple[np.ndarray, str]:
    """(token ids, the tokenizer's name): ``dataset``'s documents through the model's tokenizer, until ``limit`` ids.

    The tokenizer (and the chat template, with ``chat_template``) is checked before any dataset is read.
    """
    model_tokenizer = load_tokenizer(model_dir, vocab_size, tokenizer)
    render = model_tokenizer.chat_renderer() if chat_template else None
    try:
        documents = load_documents(dataset, split, text_field, dataset_revision, render)
        return model_tokenizer.tokens(documents, limit, chat=chat_template), model_tokenizer.name
    finally:
        if render is not None:
            render.close()  # its child process


def load_documents(
    dataset: str | Path,
    split: str = "calibration",
    text_field: str = "text",
    revision: str | None = None,
    render: Callable[[list, str], str] | None = None,
) -> Iterator[str]:
    """The documents of ``dataset`` (see the module's docstring for its forms), read as they are asked for.

    ``split`` picks the built-in text's part; ``render(messages, where)`` turns each record's ``messages`` into
    text (the chat template). Blank documents are skipped; a dataset with no text at all is refused.
    """
    found = False
    for document in _records(dataset, split, text_field, revision, render):
        if document.strip():
            found = True
            yield document
    if not found:
        raise DatasetError(f"{dataset}: no text in the dataset (empty, or only whitespace)")


def _records(dataset: str | Path, split: str, field: str, revision: str | None, render) -> Iterator[str]:
    if str(dataset) == BUILTIN:
        if render is not None:
            raise DatasetError("builtin: plain text without 'messages'; --chat-template needs .jsonl or .parquet chat records")
        if revision is not None:
            raise DatasetError(f"builtin: --dataset-revision {revision!r} is for a Hub dataset")
        yield builtin_text(split)
        return
    for path in _dataset_files(dataset, revision):
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            yield from _parquet_records(path, field, render)
            continue
        text = _decode(path, _read_dataset(path))
        if suffix == ".jsonl":
            yield from _jsonl_records(path, text, field, render)
        elif render is not None:
            raise DatasetError(f"{path}: plain text without 'messages'; --chat-template needs .jsonl or .parquet chat records")
        else:
            yield text


def _dataset_files(dataset: str | Path, revision: str | None) -> list[Path]:
    """The files of a local file or directory (which wins when it exists), or of a Hub dataset's snapshot."""
    path = Path(dataset)
    if os.path.lexists(path):
        if revision is not None:
            raise DatasetError(f"{path}: --dataset-revision {revision!r} is for a Hub dataset, and this is a local path")
        return _directory_files(path, str(path)) if path.is_dir() else [path]
    resolve_path(path)  # below a link loop: named as such, not as a missing file or a Hub id
    text = str(dataset)
    try:
        check_repo_id(text, "dataset")
    except HubError:  # HF_ENDPOINT, not the id
        raise
    except HpuFp8Error:
        raise DatasetError(f"{path}: no such dataset file (use {_FORMS})") from None
    if path.suffix.lower() in DATASET_SUFFIXES:  # a file name that happens to be a valid repo id: a missing file
        raise DatasetError(f"{path}: no such dataset file (use {_FORMS})")
    if revision is not None:
        check_revision(revision, "--dataset-revision")
    patterns = [f"*{suffix}" for suffix in DATASET_SUFFIXES]
    snapshot = download_snapshot(text, revision, patterns, "dataset", DatasetError, "a local file or directory")
    return _directory_files(snapshot, f"Hub dataset {text}")


def _directory_files(root: Path, name: str) -> list[Path]:
    """Every dataset file under ``root`` (hidden ones aside), sorted by path; refused when there is none."""
    files = [
        p
        for p in root.rglob("*")
        if p.suffix.lower() in DATASET_SUFFIXES
        and not p.is_dir()
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    ]
    if not files:
        raise DatasetError(f"{name}: a directory without .txt, .jsonl or .parquet files")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_dataset(path: Path) -> bytes:
    """The bytes of a dataset file, refusing before reading anything that is not a regular file."""
    try:
        return read_regular_file(path)
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such dataset file (use {_FORMS})") from None
    except JsonFormatError as exc:  # a FIFO or a device (a directory is an OSError below)
        raise DatasetError(
            f"{path}: {exc}; a dataset must be a regular file or a directory (a FIFO or device may never end)"
        ) from None
    except OSError as exc:
        raise DatasetError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _decode(path: Path, data: bytes) -> str:
    """UTF-8 text without its BOM, or an error naming the line and byte (UTF-16 or Latin-1 would tokenize as noise)."""
    try:
        return data.decode("utf-8").removeprefix(_BOM)
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DatasetError(
            f"{path}:{line}: not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}; UTF-16 or Latin-1?)"
        ) from None


def _jsonl_records(path: Path, text: str, field: str, render) -> Iterator[str]:
    """The text of each non-blank JSONL line: a JSON string, an object's ``field`` string, or (``render``) its
    rendered ``messages``.

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
            raise DatasetError(f"{where}: {exc}") from None
        if render is not None:
            yield render(_messages(record.get("messages") if isinstance(record, dict) else None, where), where)
            continue
        if isinstance(record, dict) and field not in record:
            raise DatasetError(f"{where}: the JSON object has no {field!r} key")
        value = record.get(field) if isinstance(record, dict) else record
        if not isinstance(value, str):
            what = f"its {field!r} is" if isinstance(record, dict) else "the line is"
            raise DatasetError(
                f"{where}: {what} {_JSON_TYPES.get(type(value), 'null')}; expected a JSON object with a {field!r} string "
                "(or a JSON string)"
            )
        yield value


def _parquet_records(path: Path, field: str, render) -> Iterator[str]:
    """Each row's ``field`` string (or, with ``render``, its rendered ``messages``) of a parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = "messages" if render is not None else field
    try:
        parquet = pq.ParquetFile(pa.BufferReader(_read_dataset(path)))
        names = parquet.schema_arrow.names
        values = parquet.read(columns=[column]).column(column) if column in names else None
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise DatasetError(f"{path}: not a parquet file pyarrow can read ({one_line(exc)})") from None
    if values is None:
        raise DatasetError(f"{path}: no column {column!r} (columns: {', '.join(names) or 'none'})")
    if render is None and not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        raise DatasetError(f"{path}: column {column!r} holds {values.type}, not strings")
    for row, value in enumerate(values.to_pylist()):
        where = f"{path} row {row}"
        if render is not None:
            yield render(_messages(value, where), where)
        elif value is None:
            raise DatasetError(f"{where}: {column!r} is null, not a string")
        else:
            yield value


def _messages(value: object, where: str) -> list:
    """A record's ``messages`` if it is a list of objects with ``role`` and ``content`` strings, else refused."""
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: no 'messages' list of {{role, content}} objects, which --chat-template renders")
    for number, message in enumerate(value):
        if not isinstance(message, dict) or not all(isinstance(message.get(key), str) for key in ("role", "content")):
            raise DatasetError(f"{where}: messages[{number}] is not an object with 'role' and 'content' strings")
    return value


def check_seq_len(seq_len: int, model: str | Path, config: dict) -> None:
    """Refuse windows longer than the model's ``max_position_embeddings``: positions it was never trained
    on give activations (calibrate) and logits (eval) that no real request produces."""
    limit = config.get("max_position_embeddings")
    if limit and seq_len > int(limit):
        raise HpuFp8Error(f"{model}: seq_len {seq_len} is beyond the model's max_position_embeddings {limit}")


def token_windows(
    ids: np.ndarray, samples: int, seq_len: int, batch_size: int = 1, dataset: str | Path = "the dataset"
) -> np.ndarray:
    """Up to ``samples`` consecutive windows of ``seq_len`` tokens, ``[windows, seq_len]``: what a layer-major run
    takes whole. ``batch_size``, the windows a forward runs at a time, is checked with the other counts."""
    for name, value in (("samples", samples), ("seq_len", seq_len), ("batch_size", batch_size)):
        if value < 1:
            raise HpuFp8Error(f"{name} is {value}; it must be at least 1")
    available = len(ids) // seq_len
    if available == 0:
        raise HpuFp8Error(f"{dataset}: {len(ids)} tokens, fewer than one window of seq_len {seq_len}; use a smaller --seq-len")
    return ids[: min(samples, available) * seq_len].reshape(-1, seq_len)


def token_batches(ids: np.ndarray, samples: int, seq_len: int, batch_size: int, dataset: str | Path = "the dataset"):
    """The windows of :func:`token_windows`, ``batch_size`` at a time: what a batch-major forward takes."""
    windows = token_windows(ids, samples, seq_len, batch_size, dataset)
    for start in range(0, len(windows), batch_size):
        yield windows[start : start + batch_size]

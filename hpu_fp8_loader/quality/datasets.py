"""Text for calibration and evaluation, as documents, and the token stream the model's tokenizer makes of them.

A dataset is one of:

- ``builtin``: CPython's own documentation (``pydoc_data.topics``, ~465k characters, always installed, offline):
  the first 90% calibrates, the last 10% is held out for evaluation and never calibrates;
- a file: ``.txt`` (one document), ``.jsonl`` (one record per line), ``.json`` (an array of records, or JSON
  Lines), ``.csv`` (one record per row under a header row) or ``.parquet`` (one record per row); a record's text
  is its ``text_field`` string (a JSON record may also be a plain string). Any other suffix is refused by name:
  read as text, a ``.bin`` or ``.json.gz`` would calibrate on its syntax or bytes and succeed;
- a directory: every dataset file under it, sorted by path, each file's records in order. Hidden files and
  folders (``.git``, ``.cache``) and ``.md`` files (a README or dataset card) are passed over; any other file is
  refused by name, because calibrating on part of a directory without saying so is the silent kind of wrong;
- a Hub dataset repo id ``ORG/NAME`` (optionally at a revision): its files of those suffixes (only they are
  downloaded), through huggingface_hub's cache, so ``HF_HUB_OFFLINE=1`` reads the cache only. A local path that
  exists wins. The snapshot's commit is what :func:`dataset_tokens` reports, for the measurement's provenance.

With a chat template, each record's ``messages`` (a list of ``{"role", "content"}`` objects) is rendered through
the model's template (:meth:`~hpu_fp8_loader.quality.tokenizer.ModelTokenizer.chat_renderer`) instead. Each
document is tokenized on its own (BOS per document where the model expects one) and the ids are concatenated
into the stream :func:`token_windows` cuts into windows; files are read (:mod:`~hpu_fp8_loader.quality.dataset_files`)
only until the stream is long enough, never whole.

Everything read here is read strictly, because a dataset that is read leniently does not fail, it calibrates
on something else: a dataset must be a regular file (a FIFO would block the run forever, /dev/zero fill the
memory), UTF-8 (a BOM is dropped: it is not text), a JSON record strict JSON
(:func:`~hpu_fp8_loader.io.jsonfile.parse_json`: no lone surrogate, duplicate key or NaN); a parquet column must
hold strings, none of them null.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from hpu_fp8_loader.errors import DatasetError, HpuFp8Error, HubError
from hpu_fp8_loader.io.checkpoint import resolve_path
from hpu_fp8_loader.quality.dataset_files import CHAT_SUFFIXES, DATASET_SUFFIXES, Render, file_documents
from hpu_fp8_loader.quality.tokenizer import Continued, load_tokenizer
from hpu_fp8_loader.sources.resolve import check_repo_id, check_revision, download_snapshot

__all__ = [
    "BUILTIN",
    "DATASET_SUFFIXES",
    "DatasetTokens",
    "builtin_text",
    "check_seq_len",
    "dataset_tokens",
    "load_documents",
    "token_batches",
    "token_windows",
]

BUILTIN = "builtin"
_SUFFIX_LIST = ", ".join(DATASET_SUFFIXES)
_FORMS = f"'builtin', a {_SUFFIX_LIST} file, a directory of them, or a Hub dataset ORG/NAME"
_PASSED_OVER = (".md",)  # in a directory: a README or dataset card, never data
_COMMIT = re.compile(r"[0-9a-f]{40}")
_HELD_OUT = 0.1


class DatasetTokens(NamedTuple):
    """What :func:`dataset_tokens` made: the token ids, the tokenizer's name, and the commit of a Hub dataset's
    snapshot (None for anything else)."""

    ids: np.ndarray
    tokenizer: str
    commit: str | None


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
) -> DatasetTokens:
    """``dataset``'s documents through the model's tokenizer, until ``limit`` ids (the dataset is read no further).

    The tokenizer (and the chat template, with ``chat_template``) is checked before any dataset is read.
    """
    model_tokenizer = load_tokenizer(model_dir, vocab_size, tokenizer)
    render = model_tokenizer.chat_renderer() if chat_template else None
    try:
        files, commit = _dataset_files(dataset, dataset_revision, render)
        documents = _documents(dataset, files, split, text_field, render)
        return DatasetTokens(model_tokenizer.tokens(documents, limit, chat=chat_template), model_tokenizer.name, commit)
    finally:
        if render is not None:
            render.close()  # its child process


def load_documents(
    dataset: str | Path,
    split: str = "calibration",
    text_field: str = "text",
    revision: str | None = None,
    render: Render | None = None,
) -> Iterator[str]:
    """The documents of ``dataset`` (see the module's docstring for its forms), read as they are asked for.

    ``split`` picks the built-in text's part; ``render(messages, where)`` turns each record's ``messages`` into
    text (the chat template). A long .txt comes in pieces, each after the first a
    :class:`~hpu_fp8_loader.quality.tokenizer.Continued`. Blank documents are skipped; a dataset with no text at
    all is refused.
    """
    files, _ = _dataset_files(dataset, revision, render)
    return _documents(dataset, files, split, text_field, render)


def _documents(dataset: str | Path, files: list[Path] | None, split: str, field: str, render: Render | None) -> Iterator[str]:
    """The non-blank documents of ``files`` (of the built-in text when None); refused when there is none. A
    :class:`Continued` piece is part of a document already begun, whitespace and all."""
    found = False
    documents = [builtin_text(split)] if files is None else (d for path in files for d in file_documents(path, field, render))
    for document in documents:
        if isinstance(document, Continued) or document.strip():
            found = True
            yield document
    if not found:
        raise DatasetError(f"{dataset}: no text in the dataset (empty, or only whitespace)")


def _dataset_files(dataset: str | Path, revision: str | None, render: Render | None) -> tuple[list[Path] | None, str | None]:
    """(the files to read in order, the commit of a Hub dataset's snapshot): ``None`` files for the built-in text.

    Every refusal that needs no file's contents (a form, a suffix, a revision) comes here, before any is read.
    """
    if str(dataset) == BUILTIN:
        if render is not None:
            raise DatasetError(
                f"builtin: plain text without 'messages'; --chat-template needs {', '.join(CHAT_SUFFIXES)} chat records"
            )
        if revision is not None:
            raise DatasetError(f"builtin: --dataset-revision {revision!r} is for a Hub dataset")
        return None, None
    path = Path(dataset)
    resolve_path(path)  # a link loop (here or above) is named as such, not as a missing file, a suffix or a Hub id
    if os.path.lexists(path):
        if revision is not None:
            raise DatasetError(f"{path}: --dataset-revision {revision!r} is for a Hub dataset, and this is a local path")
        if path.is_dir():
            return _directory_files(path, str(path), hub=False), None
        if path.suffix.lower() not in DATASET_SUFFIXES:
            raise DatasetError(f"{path}: {_suffix(path)} is no dataset file this tool reads; use {_FORMS}")
        return [path], None
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
    commit = snapshot.name if _COMMIT.fullmatch(snapshot.name) else None  # huggingface_hub's snapshots/<commit>
    return _directory_files(snapshot, f"Hub dataset {text}", hub=True), commit


def _directory_files(root: Path, name: str, hub: bool) -> list[Path]:
    """Every dataset file under ``root``, sorted by path, refused when there is none; hidden files and folders
    and ``.md`` files are passed over. Any other file is refused by name in a local directory; a Hub snapshot's
    other files were not asked for (only dataset suffixes are downloaded) and are passed over too."""
    files = []
    for path in sorted(root.rglob("*"), key=lambda p: p.relative_to(root).as_posix()):
        suffix = path.suffix.lower()
        if path.is_dir() or any(part.startswith(".") for part in path.relative_to(root).parts):
            continue
        if suffix in DATASET_SUFFIXES:
            files.append(path)
        elif not hub and suffix not in _PASSED_OVER:
            raise DatasetError(
                f"{path}: {_suffix(path)} in the dataset directory {name} is no dataset file this tool reads "
                f"({_SUFFIX_LIST}; .md and hidden files are passed over); move it out of the directory, or pass one dataset file"
            )
    if not files:
        raise DatasetError(f"{name}: a directory without dataset files ({_SUFFIX_LIST})")
    return files


def _suffix(path: Path) -> str:
    """How a message names a file's kind: ``a .bin file``, ``a file without a suffix``."""
    return f"a {path.suffix} file" if path.suffix else "a file without a suffix"


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

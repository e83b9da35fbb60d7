"""Text for calibration and evaluation, and turning it into token ids, offline.

The built-in text is CPython's own documentation (``pydoc_data.topics``, ~465k characters, always
installed): the first 90% calibrates, the last 10% is held out for evaluation and never calibrates.
Tokens come from the model directory's ``tokenizer.json`` through the ``tokenizers`` library when
both are there; otherwise from a byte-level fallback (token id = UTF-8 byte, 0..255), which needs a
vocabulary of at least 256 and is what the tiny models of this project are trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .errors import HpuFp8Error

__all__ = ["BUILTIN", "load_text", "token_batches", "tokenize"]

BUILTIN = "builtin"
_HELD_OUT = 0.1


def _builtin_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[key] for key in sorted(topics))


def load_text(dataset: str | Path, split: str = "calibration") -> str:
    """The text of ``dataset``: ``builtin`` (split into calibration / held-out), a .txt or a .jsonl file."""
    if str(dataset) == BUILTIN:
        text = _builtin_text()
        cut = int(len(text) * (1 - _HELD_OUT))
        return text[:cut] if split == "calibration" else text[cut:]
    path = Path(dataset)
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HpuFp8Error(f"{path}: no such dataset file (use 'builtin', a .txt or a .jsonl file)") from None
    except UnicodeDecodeError:
        raise HpuFp8Error(f"{path}: not UTF-8 text") from None
    if path.suffix != ".jsonl":
        return raw
    texts = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        text = record.get("text") if isinstance(record, dict) else record
        if not isinstance(text, str):
            raise HpuFp8Error(f"{path}:{number}: expected a JSON object with a 'text' string (or a JSON string)")
        texts.append(text)
    return "\n\n".join(texts)


def tokenize(text: str, model_dir: Path, vocab_size: int) -> tuple[np.ndarray, str]:
    """(token ids, which tokenizer was used)."""
    tokenizer_file = Path(model_dir) / "tokenizer.json"
    if tokenizer_file.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            Tokenizer = None  # noqa: N806 - the fallback below names what is missing
        if Tokenizer is not None:
            ids = np.asarray(Tokenizer.from_file(str(tokenizer_file)).encode(text).ids, np.int64)
            return ids, "tokenizer.json"
    if vocab_size < 256:
        raise HpuFp8Error(
            f"{model_dir}: no tokenizer.json (or no `tokenizers` library) and a vocabulary of {vocab_size} < 256 bytes"
        )
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64), "bytes"


def token_batches(ids: np.ndarray, samples: int, seq_len: int, batch_size: int):
    """Up to ``samples`` consecutive windows of ``seq_len`` tokens, ``batch_size`` at a time."""
    for name, value in (("samples", samples), ("seq_len", seq_len), ("batch_size", batch_size)):
        if value < 1:
            raise HpuFp8Error(f"{name} is {value}; it must be at least 1")
    available = len(ids) // seq_len
    if available == 0:
        raise HpuFp8Error(f"the dataset has {len(ids)} tokens, fewer than one sample of seq_len {seq_len}")
    windows = ids[: min(samples, available) * seq_len].reshape(-1, seq_len)
    for start in range(0, len(windows), batch_size):
        yield windows[start : start + batch_size]

"""Generated dataset files (hypothesis, issue 28): records of any JSON shape, text of any characters and arbitrary
bytes, in every form a dataset file takes (.txt, .jsonl, .json, .csv, .parquet), each read a byte, a few bytes or
a megabyte at a time. Every file either gives the documented documents, as byte tokens, or one DatasetError line
that names the file (and the line or row of a record); never another exception, never a hang.

Example counts come from tests/conftest.py's profiles: few in the inner loop, more in the whole suite.
"""

from __future__ import annotations

import csv
import io
import json
import re
import tempfile
from pathlib import Path
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given
from hypothesis import strategies as st

from hostile.refusal import deadline
from hpu_fp8_loader.errors import DatasetError
from hpu_fp8_loader.quality import dataset_files
from hpu_fp8_loader.quality.datasets import dataset_tokens

# Read sizes: a byte at a time (every record, character and number cut between reads), a few bytes, the real one.
CHUNKS = st.sampled_from([1, 2, 3, 7, 64, 1 << 20])
TEXT = st.text(st.characters(codec="utf-8"), max_size=30)
SCALARS = st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=False, allow_infinity=False) | TEXT
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6)
# A record: a JSON string, an object with a "text" string (and other keys), or any other JSON value (refused).
RECORDS = st.lists(
    st.one_of(
        TEXT,
        st.builds(lambda text, extra: {**extra, "text": text}, TEXT, st.dictionaries(TEXT, VALUES, max_size=2)),
        VALUES,
    ),
    max_size=8,
)


def tokens_or_refusal(name: str, content: bytes, chunk: int) -> tuple[Path, bytes | str]:
    """(the file, its byte tokens or the refusal's message): ``content`` written as ``name`` and read ``chunk`` bytes at
    a time. Any exception but a DatasetError (and a hang) fails the example."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        path.write_bytes(content)
        with deadline(), mock.patch.object(dataset_files, "_CHUNK", chunk):
            try:
                return path, bytes(dataset_tokens(folder, 512, path, tokenizer="bytes").ids.tolist())
            except DatasetError as exc:
                message = str(exc)
    assert "\n" not in message and re.match(rf"{re.escape(str(path))}(:\d+| row \d+)?: \S", message), message
    return path, message


def documents_of(records: list) -> tuple[list[str], int | None]:
    """(the texts of the records before the first one without a text, that record's index or None)."""
    texts = []
    for index, record in enumerate(records):
        value = record.get("text") if isinstance(record, dict) else record
        if not isinstance(value, str):
            return texts, index
        texts.append(value)
    return texts, None


def check(result: bytes | str, path: Path, texts: list[str], refused: str | None) -> None:
    """``result`` is the refusal ``refused`` (its beginning, after the path), or the texts' bytes, or, when no
    text is more than whitespace, the refusal of an empty dataset."""
    if refused is not None:
        assert isinstance(result, str) and result.startswith(f"{path}{refused}"), (result, refused)
    elif not any(text.strip() for text in texts):
        assert result == f"{path}: no text in the dataset (empty, or only whitespace)"
    else:
        assert result == "".join(text for text in texts if text.strip()).encode()


# ----- records as documented -----


@given(RECORDS, st.booleans(), CHUNKS)
def test_jsonl_records_give_their_texts_or_name_the_line_of_the_first_without(records, ascii_only, chunk):
    content = "".join(json.dumps(record, ensure_ascii=ascii_only) + "\n" for record in records)
    path, result = tokens_or_refusal("d.jsonl", content.encode(), chunk)
    texts, bad = documents_of(records)
    check(result, path, texts, None if bad is None else f":{bad + 1}: ")


@given(RECORDS, st.booleans(), st.sampled_from([None, 0, 2]), CHUNKS)
def test_a_json_array_of_records_gives_their_texts_or_names_the_line_of_the_first_without(records, ascii_only, indent, chunk):
    body = ",\n".join(json.dumps(record, ensure_ascii=ascii_only, indent=indent) for record in records)
    path, result = tokens_or_refusal("d.json", f"[\n{body}\n]".encode(), chunk)
    texts, bad = documents_of(records)
    starts = [2 + sum(json.dumps(r, indent=indent).count("\n") + 1 for r in records[:i]) for i in range(len(records))]
    check(result, path, texts, None if bad is None else f":{starts[bad]}: ")


# How csv.writer writes rows the csv module reads back as written (with "\n" line ends it leaves a "\r" unquoted).
CSV_DIALECTS = st.sampled_from([("\r\n", csv.QUOTE_MINIMAL), ("\r\n", csv.QUOTE_ALL), ("\n", csv.QUOTE_ALL)])


@given(st.lists(TEXT, max_size=8), CSV_DIALECTS, CHUNKS)
def test_csv_rows_give_their_text_column(texts, dialect, chunk):
    out = io.StringIO()
    writer = csv.writer(out, lineterminator=dialect[0], quoting=dialect[1])
    writer.writerows([["id", "text"], *([i, t] for i, t in enumerate(texts))])
    path, result = tokens_or_refusal("d.csv", out.getvalue().encode(), chunk)
    check(result, path, texts, None)


@given(
    st.lists(st.none() | TEXT, max_size=8),
    st.sampled_from(["string", "large_string", "string_view", "dictionary"]),
    st.integers(1, 4),
)
def test_parquet_rows_give_their_text_column_or_name_the_first_null_row(texts, encoding, row_group_size):
    column = pa.array(texts, pa.string())
    column = column.dictionary_encode() if encoding == "dictionary" else column.cast(getattr(pa, encoding)())
    out = io.BytesIO()
    pq.write_table(pa.table({"text": column}), out, row_group_size=row_group_size)
    path, result = tokens_or_refusal("d.parquet", out.getvalue(), 1 << 20)
    nulls = [i for i, text in enumerate(texts) if text is None]
    check(result, path, texts[: nulls[0]] if nulls else texts, f" row {nulls[0]}: 'text' is null" if nulls else None)


@given(
    st.binary(max_size=64) | TEXT.map(str.encode) | st.tuples(TEXT, st.binary(max_size=4)).map(lambda t: t[0].encode() + t[1]),
    CHUNKS,
)
def test_a_txt_is_its_utf8_text_without_a_bom_or_names_the_line_and_byte_that_is_not(content, chunk):
    """The pieces of a .txt read a byte at a time add up to the text read whole, and a byte that is no UTF-8 is
    named by the line and offset a whole decode finds."""
    path, result = tokens_or_refusal("d.txt", content, chunk)
    try:
        text = content.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        line = content.count(b"\n", 0, exc.start) + 1
        check(result, path, [], f":{line}: not UTF-8 text (byte {exc.start} is 0x{content[exc.start]:02x};")
    else:
        check(result, path, [text], None)


# ----- arbitrary bytes: a refusal or text, never another exception -----

STRUCTURED_STARTS = [b"", b"[", b"[\n{", b'{"text": ', b'"', b"text\n", b'text\n"', b"\xef\xbb\xbf[", b"PAR1"]


@given(
    st.sampled_from(["d.jsonl", "d.json", "d.csv", "d.parquet"]),
    st.sampled_from(STRUCTURED_STARTS),
    st.binary(max_size=64),
    CHUNKS,
)
def test_arbitrary_bytes_in_any_dataset_form_are_text_or_one_named_line(name, start, rest, chunk):
    tokens_or_refusal(name, start + rest, chunk)


def valid_parquet() -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.table({"text": ["one", "two", None, "four"] * 3, "n": list(range(12))}), out, row_group_size=4)
    return out.getvalue()


PARQUET = valid_parquet()


@given(st.lists(st.tuples(st.integers(0, len(PARQUET) - 1), st.integers(0, 255)), max_size=4), st.integers(0, len(PARQUET)))
def test_a_damaged_parquet_file_is_text_or_one_named_line(changes, length):
    damaged = bytearray(PARQUET)
    for position, value in changes:
        damaged[position] = value
    tokens_or_refusal("d.parquet", bytes(damaged[:length]), 1 << 20)

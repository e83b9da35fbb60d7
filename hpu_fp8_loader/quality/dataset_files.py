"""One dataset file's documents, read as they are asked for: a calibration needs a few hundred kilobytes of text,
and a dataset file may hold gigabytes, so no reader holds more than a piece or a record of it at a time.

The suffix says how a file is read (:data:`DATASET_SUFFIXES`), the same way Hugging Face ``datasets`` reads it:

- ``.txt``: one document, in pieces of about a megabyte that end at a line end (:class:`Continued` after the
  first, so that the document gets one BOS); at each seam the tokenizer starts afresh, which may split a token
  or two differently from the whole text (sentencepiece marks a piece's first word as following a space);
- ``.jsonl``: one record per line, lines ending at ``\\n`` only (``str.splitlines`` would also split at U+2028,
  which a JSON string may hold);
- ``.json``: a JSON array of records, or else (the first character is not ``[``) JSON Lines, as ``datasets``'
  json loader takes both; the array's records are read one by one, never the whole array;
- ``.csv``: a header row naming the columns, then one record per row (Python's csv module, strict: an
  unbalanced quote is refused, not read on to the end of the file; a field holds at most the csv module's
  131,072 characters);
- ``.parquet``: one record per row of the column, a batch of rows at a time.

A record is a JSON string, or an object (a row) whose ``field`` is a string; with a chat template, its
``messages`` (a list of ``{"role", "content"}`` objects) rendered. Everything is strict: UTF-8 (a BOM is
dropped), JSON through :func:`~hpu_fp8_loader.io.jsonfile.parse_json`, a parquet column of strings (plain,
large, view or dictionary-encoded) without nulls. Each refusal names the file and the line (parquet: the row).
"""

from __future__ import annotations

import codecs
import csv
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from hpu_fp8_loader.errors import DatasetError, one_line, require_optional
from hpu_fp8_loader.io.jsonfile import JsonFormatError, open_regular_file, parse_json
from hpu_fp8_loader.quality.tokenizer import Continued

__all__ = ["DATASET_SUFFIXES", "file_documents"]

DATASET_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".parquet")
CHAT_SUFFIXES = (".jsonl", ".json", ".parquet")
_CHUNK = 1 << 20  # bytes read at a time; about the size of a .txt piece
_ROWS = 1024  # parquet rows per batch
_LEADING_SPACE = 16 << 20  # characters of whitespace a .txt may start with (held until its first text)
_BOM = "\ufeff"
_JSON_SPACE = " \t\r\n"
_SPACE = re.compile(f"[{_JSON_SPACE}]*")
# Finds where a JSON value ends, without making numbers of its digits; parse_json then judges the value strictly.
_VALUE_END = json.JSONDecoder(parse_int=str, parse_float=str, parse_constant=str)
# A JSON value cut off by the end of the buffer fails (or, a number, ends) within this many characters of it,
# except a string, which fails where it starts ("Unterminated string").
_CUT_OFF = 8
# What a record's value is, in JSON's words (never Python's: a user wrote JSON, not None or list).
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "true/false", int: "a number", float: "a number"}

Render = Callable[[list, str], str]


def file_documents(path: Path, field: str, render: Render | None) -> Iterator[str]:
    """The documents of one dataset file of a :data:`DATASET_SUFFIXES` suffix, read as they are asked for.

    ``field`` is the text's key (JSON) or column (CSV, parquet); ``render(messages, where)`` turns a record's
    ``messages`` into text instead. Blank documents are not skipped here.
    """
    suffix = path.suffix.lower()
    if render is not None and suffix not in CHAT_SUFFIXES:
        raise DatasetError(
            f"{path}: plain text without 'messages'; --chat-template needs {', '.join(CHAT_SUFFIXES)} chat records"
        )
    with _open(path) as file:
        if suffix == ".parquet":
            yield from _parquet_documents(path, file, field, render)
            return
        text = _Utf8Text(path, file)
        if suffix == ".txt":
            yield from _text_pieces(path, text)
        elif suffix == ".csv":
            yield from _csv_texts(path, text, field)
        else:
            records = _json_records(path, text) if suffix == ".json" else _jsonl_records(path, text, 1)
            for where, record in records:
                yield _record_text(record, where, field, render)


def _open(path: Path) -> BinaryIO:
    """A dataset file open for reading, refused before any read when it is not a regular file."""
    try:
        return open_regular_file(path)
    except JsonFormatError as exc:  # a FIFO or a device (a directory is an OSError below)
        raise DatasetError(
            f"{path}: {exc}; a dataset must be a regular file or a directory (a FIFO or device may never end)"
        ) from None
    except OSError as exc:
        raise DatasetError(f"{path}: cannot be read ({exc.strerror or exc})") from None


class _Utf8Text:
    """A file's text, decoded strictly as UTF-8 while it is read (a BOM dropped); a byte that is no UTF-8 is
    refused naming its line and offset (UTF-16 or Latin-1 would tokenize as noise)."""

    def __init__(self, path: Path, file: BinaryIO):
        self._path, self._file = path, file
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self._offset = 0  # bytes read so far
        self._newlines = 0  # line ends decoded so far
        self._at_start = True
        self._unread = ""

    def read(self, size: int | None = None) -> str:
        """The text of about ``size`` (default :data:`_CHUNK`) more bytes, or what :meth:`unread` gave back; "" at
        the end."""
        if self._unread:
            text, self._unread = self._unread, ""
            return text
        while True:
            block = self._file.read(size or _CHUNK)
            pending = len(self._decoder.getstate()[0])  # the start of a character the last block cut
            try:
                text = self._decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:  # exc.object is the pending bytes and this block
                line = self._newlines + exc.object.count(b"\n", 0, exc.start) + 1
                offset = self._offset - pending + exc.start
                raise DatasetError(
                    f"{self._path}:{line}: not UTF-8 text (byte {offset} is 0x{exc.object[exc.start]:02x}; UTF-16 or Latin-1?)"
                ) from None
            self._offset += len(block)
            self._newlines += text.count("\n")
            if self._at_start and text:
                text, self._at_start = text.removeprefix(_BOM), False
            if text or not block:
                return text

    def unread(self, text: str) -> None:
        """Give ``text`` back: the next :meth:`read` returns it."""
        self._unread = text

    def lines(self, first: int) -> Iterator[tuple[int, str]]:
        """(number, line) of each line, numbered from ``first``, with its ``\\n`` (the last line may lack one)."""
        number, partial = first, []
        while block := self.read():
            *complete, last = block.split("\n")
            for line in complete:
                partial.append(line)
                yield number, "".join(partial) + "\n"
                number, partial = number + 1, []
            if last:
                partial.append(last)
        if partial:
            yield number, "".join(partial)


def _text_pieces(path: Path, text: _Utf8Text) -> Iterator[str]:
    """A .txt file's one document, whole when it fits one read, else in pieces of about :data:`_CHUNK` bytes: the
    first a ``str`` that holds the first non-blank character, the rest :class:`Continued`, each ending at a line
    end after it (else at a space, else anywhere). Whitespace before the first text is kept, up to
    :data:`_LEADING_SPACE` characters: a file that is megabytes of nothing but whitespace is refused, not held."""
    rest, started = "", False
    block = text.read()
    while block:
        following = text.read()
        piece = rest + block
        if not started and following and not piece.strip():
            if len(piece) > _LEADING_SPACE:
                raise DatasetError(f"{path}: more than {_LEADING_SPACE} characters of whitespace before any text")
            rest, block = piece, following
            continue
        first = 0 if started else len(piece) - len(piece.lstrip())  # the first piece ends after its first text
        cut = (piece.rfind("\n", first) + 1 or piece.rfind(" ", first) + 1 or len(piece)) if following else len(piece)
        piece, rest = piece[:cut], piece[cut:]
        yield Continued(piece) if started else piece
        started, block = True, following


def _jsonl_records(path: Path, text: _Utf8Text, first: int) -> Iterator[tuple[str, object]]:
    """(where, value) of each non-blank line of JSON Lines, its lines numbered from ``first``."""
    for number, line in text.lines(first):
        if line.strip():
            yield f"{path}:{number}", _parse(line, f"{path}:{number}")


def _json_records(path: Path, text: _Utf8Text) -> Iterator[tuple[str, object]]:
    """(where, value) of each record of a .json file: the elements of a JSON array, or, when the file does not
    start with ``[``, each line of JSON Lines."""
    newlines = 0  # in the whitespace before the first value
    while block := text.read():
        value = block.lstrip(_JSON_SPACE)
        if value:
            newlines += block.count("\n", 0, len(block) - len(value))
            text.unread(value)
            break
        newlines += block.count("\n")
    else:
        return
    if value.startswith("["):
        yield from _JsonArray(path, text, newlines + 1).records()
    else:
        yield from _jsonl_records(path, text, newlines + 1)


class _JsonArray:
    """The records of a JSON array, read one at a time: a buffer holds the current record and what follows it."""

    def __init__(self, path: Path, text: _Utf8Text, line: int):
        self._path, self._text, self._line = path, text, line
        self._buffer, self._pos = "", 0

    def records(self) -> Iterator[tuple[str, object]]:
        self._peek()
        self._pos += 1  # the "[" _json_records found
        if self._peek() == "]":
            self._pos += 1
        else:
            while True:
                self._peek()
                where = f"{self._path}:{self._line}"
                yield where, _parse(self._value(), where)
                after = self._peek()
                if after not in (",", "]"):
                    raise self._error("the JSON array ends without ']'" if not after else "expected ',' or ']' after a record")
                self._pos += 1
                if after == "]":
                    break
        if self._peek():
            raise self._error("text after the JSON array")

    def _more(self) -> bool:
        """Read on (at least as much as the buffer holds, so that a long record costs linear time); False at the end."""
        block = self._text.read(max(_CHUNK, len(self._buffer) - self._pos))
        if block:
            self._buffer, self._pos = self._buffer[self._pos :] + block, 0
        return bool(block)

    def _peek(self) -> str:
        """The next character after JSON whitespace, "" at the end of the file."""
        while True:
            end = _SPACE.match(self._buffer, self._pos).end()  # type: ignore[union-attr]  # [...]* always matches
            self._line += self._buffer.count("\n", self._pos, end)
            self._pos = end
            if self._pos < len(self._buffer) or not self._more():
                return self._buffer[self._pos : self._pos + 1]

    def _value(self) -> str:
        """The text of the JSON value that starts at the buffer's position, read on until it is whole."""
        while True:
            try:
                _, end = _VALUE_END.raw_decode(self._buffer, self._pos)
            except json.JSONDecodeError as exc:
                if (exc.msg.startswith("Unterminated string") or exc.pos > len(self._buffer) - _CUT_OFF) and self._more():
                    continue  # cut off by the end of the buffer, not (yet) known to be wrong
                raise self._error(f"not valid JSON ({exc.msg})", exc.pos) from None
            except RecursionError:
                raise self._error("not valid JSON (nested too deeply to parse)") from None
            if end > len(self._buffer) - _CUT_OFF and self._more():
                continue  # a number (or what follows the value) may go on in the next block
            value = self._buffer[self._pos : end]
            self._line += value.count("\n")
            self._pos = end
            return value

    def _error(self, message: str, pos: int | None = None) -> DatasetError:
        line = self._line + (self._buffer.count("\n", self._pos, pos) if pos is not None else 0)
        return DatasetError(f"{self._path}:{line}: {message}")


def _parse(text: str, where: str) -> object:
    try:
        return parse_json(text)
    except JsonFormatError as exc:
        raise DatasetError(f"{where}: {exc}") from None


def _record_text(record: object, where: str, field: str, render: Render | None) -> str:
    """A JSON record's text: the record itself (a JSON string), its ``field`` string, or its rendered ``messages``."""
    if render is not None:
        return render(_messages(record.get("messages") if isinstance(record, dict) else None, where), where)
    if isinstance(record, dict) and field not in record:
        raise DatasetError(f"{where}: the JSON object has no {field!r} key")
    value = record.get(field) if isinstance(record, dict) else record
    if not isinstance(value, str):
        what = f"its {field!r} is" if isinstance(record, dict) else "the record is"
        raise DatasetError(
            f"{where}: {what} {_JSON_TYPES.get(type(value), 'null')}; expected a JSON object with a {field!r} string "
            "(or a JSON string)"
        )
    return value


def _messages(value: object, where: str) -> list:
    """A record's ``messages`` if it is a list of objects with ``role`` and ``content`` strings, else refused."""
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: no 'messages' list of {{role, content}} objects, which --chat-template renders")
    for number, message in enumerate(value):
        if not isinstance(message, dict) or not all(isinstance(message.get(key), str) for key in ("role", "content")):
            raise DatasetError(f"{where}: messages[{number}] is not an object with 'role' and 'content' strings")
    return value


def _csv_texts(path: Path, text: _Utf8Text, field: str) -> Iterator[str]:
    """The ``field`` column's value of each row of a CSV file under its header row."""
    lines = (line for _, line in text.lines(1))
    reader = csv.reader(lines, strict=True)
    try:
        header = next((row for row in reader if row), None)
        if header is None:
            return
        _check_column(f"{path}:{reader.line_num}", header, field)
        column = header.index(field)
        for row in reader:
            if not row:
                continue
            if len(row) != len(header):
                raise DatasetError(f"{path}:{reader.line_num}: {len(row)} fields; the header row has {len(header)}")
            yield row[column]
    except csv.Error as exc:
        raise DatasetError(f"{path}:{reader.line_num}: not CSV the csv module reads ({one_line(exc)})") from None


def _check_column(where: str, names: list[str], column: str) -> None:
    """Refuse a table (a CSV header, a parquet schema) without ``column``, or with two of that name."""
    if column not in names:
        raise DatasetError(f"{where}: no column {column!r} (columns: {', '.join(names) or 'none'})")
    if names.count(column) > 1:
        raise DatasetError(f"{where}: {names.count(column)} columns named {column!r}; which one is the text would be a guess")


def _parquet_documents(path: Path, file: BinaryIO, field: str, render: Render | None) -> Iterator[str]:
    """Each row's ``field`` string (or, with ``render``, its rendered ``messages``), a batch of rows at a time."""
    require_optional("pyarrow", f"{path}: reading a parquet dataset")
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = "messages" if render is not None else field
    failures = (pa.ArrowException, ValueError, OSError)
    try:
        parquet = pq.ParquetFile(file, pre_buffer=False)  # pre-buffered, iter_batches reads every row group first
        schema = parquet.schema_arrow
    except failures as exc:
        raise DatasetError(f"{path}: not a parquet file pyarrow can read ({one_line(exc)})") from None
    _check_column(str(path), schema.names, column)
    kind = schema.field(column).type
    if render is None and not _holds_strings(kind):
        raise DatasetError(f"{path}: column {column!r} holds {kind}, not strings")
    row = 0
    batches = parquet.iter_batches(batch_size=_ROWS, columns=[column])
    while True:
        try:
            batch = next(batches, None)
        except failures as exc:
            raise DatasetError(f"{path} row {row}: pyarrow cannot read on ({one_line(exc)})") from None
        if batch is None:
            return
        for value in _python_values(batch.column(0), path, row):
            where = f"{path} row {row}"
            if render is not None:
                yield render(_messages(value, where), where)
            elif value is None:
                raise DatasetError(f"{where}: {column!r} is null, not a string")
            else:
                yield value
            row += 1


def _python_values(values, path: Path, first_row: int) -> list:
    """A batch's column as Python values (dictionary-encoded strings come out decoded); a string that is not UTF-8
    (parquet does not check it, pyarrow only when asked for the value) is refused naming its row."""
    try:
        return values.to_pylist()
    except UnicodeDecodeError:
        for index in range(len(values)):
            try:
                values[index].as_py()
            except UnicodeDecodeError as exc:
                raise DatasetError(
                    f"{path} row {first_row + index}: not UTF-8 text (0x{exc.object[exc.start]:02x} at byte {exc.start} "
                    "of the value)"
                ) from None
        raise RuntimeError(f"{path}: pyarrow failed to decode a batch it decodes row by row") from None


def _holds_strings(kind) -> bool:
    """Whether an arrow type is text: a string, large string or string view, plain or dictionary-encoded."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    is_string_view = getattr(pa.types, "is_string_view", None)  # pyarrow 16 and later
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or bool(is_string_view and is_string_view(kind))

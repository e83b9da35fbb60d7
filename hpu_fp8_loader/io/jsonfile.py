"""Reading the JSON files of a checkpoint (and safetensors headers) strictly, with one message shape for every way they fail.

Python's json module is more lenient than RFC 8259 and than serde_json, which the safetensors library (and so
FastDeploy) uses: it takes bytes in UTF-16 or UTF-32, duplicate keys (the last one silently wins), the literals
NaN and Infinity, and lone UTF-16 surrogate escapes (strings that cannot even be printed), and it raises
RecursionError on deep nesting, and ValueError for an integer longer than Python's ``int()`` takes (4,300 digits).
It also reads ``1e999`` as infinity, where serde_json refuses a number out of range. :func:`parse_json` refuses each
of these with a sentence a human can act on.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from hpu_fp8_loader.errors import HpuFp8Error

__all__ = ["JsonFormatError", "open_regular_file", "parse_json", "printable", "read_json_object", "read_regular_file"]

# A \uD800-\uDFFF escape: only then can json.loads return a string holding a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_CONTROL = re.compile("[\x00-\x1f\x7f]")
# The most digits an integer of a JSON file may have: Python's default limit for int() of a string (CPython's
# sys.int_info.default_max_str_digits), or the interpreter's own when set lower. No count, size or offset of a
# checkpoint comes near it; int() of such a string is what raised ValueError before.
_MAX_INT_DIGITS = min(4300, getattr(sys, "get_int_max_str_digits", lambda: 0)() or 4300)


class JsonFormatError(ValueError):
    """Why a text is not acceptable JSON: a phrase that follows the file's name in a message."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """An object's dict, refusing a key that appears twice (json.loads would keep the last one silently)."""
    result = dict(pairs)
    if len(result) != len(pairs):
        duplicate = next(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
        raise JsonFormatError(f"duplicate key {duplicate!r} in one object (which value counts would be a guess)")
    return result


def _refuse_constant(name: str) -> float:
    raise JsonFormatError(f"{name} is not a JSON value (RFC 8259 has no NaN or Infinity)")


class _Unreadable:
    """What stands in for a number Python cannot read faithfully, so that the refusal can say where it is."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def _number_readers(parse_int: Callable[[str], object], finite: bool) -> tuple[Callable, Callable, list[_Unreadable]]:
    """(parse_int, parse_float, what they could not read) for one parse.

    An integer of more than 4,300 digits: int() raises a bare ValueError (and would take quadratic time without
    Python's limit). A number beyond float range (``1e999``) with ``finite``: Python reads infinity, which serde_json
    refuses as out of range and RFC 8259 cannot write. Each is left in place as an :class:`_Unreadable`.
    """
    unreadable: list[_Unreadable] = []

    def read_int(literal: str) -> object:
        digits = len(literal) - literal.startswith("-")
        if digits > _MAX_INT_DIGITS:
            unreadable.append(
                _Unreadable(
                    f"an integer of {digits} digits, starting {literal[:12]}... (more than {_MAX_INT_DIGITS}, the most "
                    "Python's int() reads; no count, size or id is that long)"
                )
            )
            return unreadable[-1]
        return parse_int(literal)

    def read_float(literal: str) -> object:
        value = float(literal)
        if finite and math.isinf(value):
            unreadable.append(
                _Unreadable(f"the number {literal[:24]} is out of range of a 64-bit float (it would read as infinity)")
            )
            return unreadable[-1]
        return value

    return read_int, read_float, unreadable


def _where(value: object, target: object) -> str:
    """Where ``target`` sits in ``value``, as ``key["inner key"][3]``; empty at the top. Iterative: the depth is the
    document's own."""
    stack: list[tuple[object, list[object]]] = [(value, [])]
    while stack:
        node, path = stack.pop()
        if node is target:
            plain = bool(path) and isinstance(path[0], str) and printable(path[0])  # a key as the file spells it
            return "".join(str(part) if not i and plain else f"[{json.dumps(part)}]" for i, part in enumerate(path))
        if isinstance(node, dict):
            stack.extend((child, [*path, key]) for key, child in node.items())
        elif isinstance(node, list):
            stack.extend((child, [*path, index]) for index, child in enumerate(node))
    raise RuntimeError("internal error: an unreadable number is not in the value it was read into")


def parse_json(data: bytes | str, *, allow_non_finite: bool = False, parse_int: Callable[[str], object] = int) -> object:
    """The value of a UTF-8 JSON text, or :class:`JsonFormatError` saying why not.

    ``allow_non_finite`` accepts NaN and Infinity, which Python's json.dump writes for non-finite floats
    (a transformers config.json may hold one in a key nobody reads), and a number that overflows to infinity.
    ``parse_int`` reads each integer literal, once its length is checked.
    """
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonFormatError(f"not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}; UTF-16 or Latin-1?)") from None
    read_int, read_float, unreadable = _number_readers(parse_int, finite=not allow_non_finite)
    try:
        value = json.loads(
            data,
            object_pairs_hook=_unique_keys,
            parse_int=read_int,
            parse_float=read_float,
            parse_constant=None if allow_non_finite else _refuse_constant,
        )
    except json.JSONDecodeError as exc:
        hint = "; it holds NUL bytes: UTF-16 text, or NUL padding?" if "\0" in data else ""
        raise JsonFormatError(f"not valid JSON ({exc}{hint})") from None
    except RecursionError:
        raise JsonFormatError("not valid JSON (nested too deeply to parse)") from None
    if unreadable:
        where = _where(value, unreadable[0])
        raise JsonFormatError(f"{where}: {unreadable[0].reason}" if where else unreadable[0].reason)
    if _SURROGATE_ESCAPE.search(data):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise JsonFormatError("not valid JSON (a \\u escape is a lone UTF-16 surrogate, not a character)") from None
    return value


def printable(name: str) -> bool:
    """Whether a name read from a file can be printed in a one-line message: no NUL, newline or other control character."""
    return _CONTROL.search(name) is None


def open_regular_file(path: Path) -> BinaryIO:
    """``path`` open for reading, refusing anything but a regular file: a FIFO would block and a device never end.

    The check is made on the open descriptor (O_NONBLOCK, so that opening a FIFO does not wait for a writer),
    never on the name, which another process could swap between a check and the open."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        file = open(fd, "rb")  # noqa: SIM115 -- handed to the caller, who closes it
    except BaseException:
        os.close(fd)  # open() leaves a descriptor it was given open when it fails (a directory)
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        file.close()
        raise JsonFormatError("not a regular file")
    return file


def read_regular_file(path: Path) -> bytes:
    """The bytes of ``path``, refusing anything but a regular file (see :func:`open_regular_file`)."""
    with open_regular_file(path) as file:
        return file.read()


def read_json_object(
    path: Path, error: type[HpuFp8Error], missing_hint: str = "missing", *, allow_non_finite: bool = False
) -> dict:
    """The JSON object in ``path``, or ``error`` naming the file: missing, unreadable, not strict JSON, not an object."""
    try:
        data = parse_json(read_regular_file(Path(path)), allow_non_finite=allow_non_finite)
    except FileNotFoundError:
        raise error(f"{path}: {missing_hint}") from None
    except JsonFormatError as exc:
        raise error(f"{path}: {exc}") from None
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: top level is not a JSON object")
    return data

"""Reading the small JSON files of a checkpoint, with one message shape for every way they fail."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import HpuFp8Error

__all__ = ["read_json_object"]


def read_json_object(path: Path, error: type[HpuFp8Error], missing_hint: str = "missing") -> dict:
    """The JSON object in ``path``, or ``error`` naming the file: missing, unreadable, not JSON, not an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path}: {missing_hint}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: top level is not a JSON object")
    return data

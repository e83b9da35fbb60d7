"""What the CLI writes besides its result, under one set of rules: log lines, warnings, progress bars, JSON.

- stdout holds the result only (a line, or with ``--json`` one JSON document); everything else goes to stderr.
- Warnings and log lines go through :mod:`logging` (logger ``hpu_fp8_loader``) as ``hpu-fp8: warning: ...``.
  ``-v`` adds the steps of long work, ``-vv`` debug detail; ``--log-level`` (or ``HPU_FP8_LOG_LEVEL``)
  sets the level outright, ``error`` hiding warnings too.
- Progress bars appear only where a person watches: never when stderr is not a terminal (a log file,
  a pipe, CI: no carriage-return debris), nor under ``-q`` or ``--json``, ``TQDM_DISABLE`` or
  ``HF_HUB_DISABLE_PROGRESS_BARS`` (any value but empty, ``0``, ``false``, ``no``, ``off``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import sys
from pathlib import Path

import click
import numpy as np
from tqdm import tqdm

__all__ = ["LEVELS", "LOGGER", "bars_enabled", "configure", "emit_json", "hub_bars_follow_ours", "progress_bar"]

LOGGER = "hpu_fp8_loader"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_BAR_SWITCHES = ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")
_state = {"quiet": False}


class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at the moment (click's test runner swaps it per invocation)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            click.echo(self.format(record), err=True)
        except Exception:
            self.handleError(record)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"hpu-fp8: {record.levelname.lower()}: {record.getMessage()}"


def configure(level: int, quiet: bool) -> None:
    """Route the package's log records to stderr at ``level``; ``quiet`` turns every progress bar off."""
    _state["quiet"] = quiet
    logger = logging.getLogger(LOGGER)
    for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(_Formatter())
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # FastDeploy's root handlers (when the hook runs there) do not print it twice


def _switched_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def bars_enabled(quiet: bool = False) -> bool:
    """Whether a progress bar may be drawn now (see the module docstring for the rules)."""
    if quiet or _state["quiet"] or any(_switched_on(name) for name in _BAR_SWITCHES):
        return False
    return sys.stderr.isatty()


def hub_bars_follow_ours() -> None:
    """huggingface_hub draws its own download and upload bars: off too whenever ours would be."""
    if not bars_enabled():
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


class _Bar(tqdm):
    """tqdm without its monitor thread, which every bar (a disabled one too) would start: under ``ulimit -v`` a thread
    may not start, and tqdm then prints a warning of two lines; our bars are updated often enough not to need it."""

    monitor_interval = 0


def progress_bar(desc: str, quiet: bool = False, total: int | None = None, unit: str = "B") -> tqdm:
    """A tqdm bar on stderr that draws only when :func:`bars_enabled`; bytes are shown in KiB/MiB/GiB."""
    return _Bar(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=True,
        unit_divisor=1024 if unit == "B" else 1000,
        disable=not bars_enabled(quiet),
        file=sys.stderr,
        leave=False,
    )


def _plain(value: object) -> object:
    """JSON for the values our results hold: paths and enums as their text, numpy scalars as numbers."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, np.generic):
        return value.item()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def emit_json(data: object) -> None:
    """One JSON document on stdout: the whole result of a ``--json`` command."""
    click.echo(json.dumps(data, indent=2, default=_plain))

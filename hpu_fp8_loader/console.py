"""What the CLI writes besides its result, under one set of rules: log lines, warnings, progress bars, JSON.

- stdout holds the result only (a line, or with ``--json`` one JSON document); everything else goes to stderr.
- Warnings and log lines go through :mod:`logging` (logger ``hpu_fp8_loader``) as ``hpu-fp8: warning: ...``.
  ``-v`` adds the steps of long work, ``-vv`` debug detail; ``--log-level`` (or ``HPU_FP8_LOG_LEVEL``)
  sets the level outright, ``error`` hiding warnings too.
- Progress bars appear only where a person watches: never when stderr is not a terminal (a log file,
  a pipe, CI: no carriage-return debris), nor under ``-q`` or ``--json``, ``TQDM_DISABLE`` or
  ``HF_HUB_DISABLE_PROGRESS_BARS`` (any value but empty, ``0``, ``false``, ``no``, ``off``).
- Where no bar can be drawn (stderr is not a terminal), long work writes plain progress lines instead,
  ``hpu-fp8: progress: ...``, so that a log of an 18-minute eval shows where it is. They are log output, not
  bars: ``-q`` and ``--log-level error`` silence them, ``TQDM_DISABLE`` and ``--json`` do not (they still
  only turn bars off; the lines go to stderr, never into ``--json``'s stdout). Rate (:class:`Progress`): a line
  when a stage (a layer) begins, but at most one per :data:`LINE_AT_MOST_EVERY_S`, and at least one per
  :data:`LINE_AT_LEAST_EVERY_S` while work goes on; none during the first :data:`LINE_AT_MOST_EVERY_S`, so a
  short job writes nothing; a closing line when a job that wrote lines completes.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from time import monotonic
from types import TracebackType

import click
import numpy as np
from tqdm import tqdm

__all__ = [
    "LEVELS",
    "LINE_AT_LEAST_EVERY_S",
    "LINE_AT_MOST_EVERY_S",
    "LOGGER",
    "Progress",
    "bars_enabled",
    "configure",
    "emit_json",
    "hub_bars_follow_ours",
    "human_bytes",
    "human_count",
    "human_rate",
    "lines_enabled",
]

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


def lines_enabled(quiet: bool = False) -> bool:
    """Whether progress lines are written now: stderr is no terminal (where bars cannot be drawn), neither ``-q``
    nor ``quiet``, and the package's log level lets warnings through (``--log-level error`` silences them)."""
    if quiet or _state["quiet"] or logging.getLogger(LOGGER).getEffectiveLevel() > logging.WARNING:
        return False
    return not sys.stderr.isatty()


LINE_AT_MOST_EVERY_S = 10.0
LINE_AT_LEAST_EVERY_S = 30.0


def _duration(seconds: float) -> str:
    """``45s``, ``2m05s``, ``1h02m``: short enough for a log line, exact to the second below an hour."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


class _Bar(tqdm):
    """tqdm without its monitor thread, which every bar (a disabled one too) would start: under ``ulimit -v`` a thread
    may not start, and tqdm then prints a warning of two lines; our bars are updated often enough not to need it."""

    monitor_interval = 0


class Progress:
    """One long job's progress, shown where it is read: a tqdm bar on a terminal, plain lines in a log.

    Every command with long work makes one (``with Progress("eval", unit="step") as progress:``) and reports
    to it: ``update(n)`` adds ``n`` done, ``show(done, total, stage, detail)`` says where the job is. A
    ``stage`` (``"layer 3 of 28"``) names a boundary worth a line of its own; ``detail`` (``"120/2000
    tensors"``) only rides along. The rate rules are in the module docstring. ``clock`` (seconds; default
    :func:`time.monotonic`) is read when the job starts and once per report while lines are on, so a test
    can drive it.
    """

    def __init__(
        self,
        desc: str,
        *,
        quiet: bool = False,
        bar: bool = True,
        total: int | None = None,
        unit: str = "B",
        clock: Callable[[], float] | None = None,
    ):
        self.desc, self.unit, self.total, self.done = desc, unit, total, 0
        self._bar = _Bar(
            total=total,
            desc=desc,
            unit=unit,
            unit_scale=unit == "B",  # KiB/MiB/GiB for bytes; steps as whole numbers ("3/12", not "3.00/12.0")
            unit_divisor=1024,
            disable=not (bar and bars_enabled(quiet)),
            file=sys.stderr,
            leave=False,
        )
        self._lines = lines_enabled(quiet)
        self._clock = clock or monotonic
        self._lock = threading.Lock()  # validate's scan reports from a thread pool
        self._start = self._last_line = self._clock() if self._lines else 0.0
        self._stage: str | None = None
        self._wrote = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None) -> None:
        self.close(completed=kind is None)

    def update(self, n: int) -> None:
        """``n`` more done (bytes written or scanned, steps run)."""
        with self._lock:
            self._show(self.done + n, self.total, None, None)

    def show(self, done: int, total: int | None = None, stage: str | None = None, detail: str | None = None) -> None:
        """Where the job is: ``done`` of ``total`` (``None``: not known), in ``stage``, with a ``detail``."""
        with self._lock:
            self._show(done, total, stage, detail)

    def _show(self, done: int, total: int | None, stage: str | None, detail: str | None) -> None:
        self._bar.total = total
        self._bar.update(done - self._bar.n)
        postfix = ", ".join(part for part in (stage, detail) if part)
        if postfix:
            self._bar.set_postfix_str(postfix, refresh=False)
        self.done, self.total = done, total
        if not self._lines:
            return
        now = self._clock()
        since_last = now - self._last_line
        new_stage = stage is not None and stage != self._stage
        self._stage = stage if stage is not None else self._stage
        if since_last >= LINE_AT_LEAST_EVERY_S or (new_stage and since_last >= LINE_AT_MOST_EVERY_S):
            self._write(self._where(stage, detail, now))
            self._last_line = now

    def close(self, completed: bool = True) -> None:
        """Close the bar; after a job that wrote lines, one more saying it is done (not when it failed)."""
        self._bar.close()
        if self._lines and self._wrote and completed:
            amount = human_bytes(self.done) if self.unit == "B" else f"{self.done:,} {self.unit}{'' if self.done == 1 else 's'}"
            self._write(f"done, {amount} in {_duration(self._clock() - self._start)}")
        self._lines = False

    def _where(self, stage: str | None, detail: str | None, now: float) -> str:
        elapsed = now - self._start
        bytes_ = self.unit == "B"
        share = human_bytes(self.done) if bytes_ else f"{self.unit} {self.done:,}"
        if self.total:
            share += f" of {human_bytes(self.total) if bytes_ else f'{self.total:,}'} ({100 * self.done / self.total:.0f}%)"
        parts = [part for part in (stage, share, detail) if part]
        parts.append(f"{_duration(elapsed)} elapsed")
        if self.total and 0 < self.done < self.total:
            parts.append(f"about {_duration(elapsed * (self.total - self.done) / self.done)} left")
        return ", ".join(parts)

    def _write(self, text: str) -> None:
        click.echo(f"hpu-fp8: progress: {self.desc}: {text}", err=True)
        self._wrote = True


_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")
_COUNT_UNITS = (" K", " M", " B", " T")  # thousand, million, billion (as in "a 21B model"), trillion


def _scaled(value: float, base: int, units: tuple[str, ...]) -> str:
    """``value`` divided by ``base`` until its three significant digits fall below 1000, then printed with the unit
    reached: 1.23, 12.3, 123 (never an exponent, never "1000 K" where "1.00 M" is meant)."""
    unit = 0
    value /= base
    while unit < len(units) - 1 and float(f"{value:.3g}") >= 1000:
        value /= base
        unit += 1
    value = float(f"{value:.3g}")
    digits = f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"
    return f"{digits}{units[unit]}"


def human_bytes(size: float) -> str:
    """A byte count for people, in binary units to three significant digits: ``512 B``, ``1.21 MiB``, ``43.3 GiB``.

    Every size the CLI prints goes through here, so a tiny model reads ``35.2 KiB``, never ``0.00 GiB``.

    Example:
        >>> human_bytes(512), human_bytes(1_270_000), human_bytes(43.3 * 2**30)
        ('512 B', '1.21 MiB', '43.3 GiB')
    """
    return f"{size:.0f} B" if size < 1024 else _scaled(size, 1024, tuple(f" {unit}" for unit in _BINARY_UNITS))


def human_rate(size: float, seconds: float) -> str:
    """Bytes per second for people (:func:`human_bytes` and ``/s``); a run too short to time says so."""
    return f"{human_bytes(size / seconds)}/s" if seconds > 0 else "too fast to time"


def human_count(count: float) -> str:
    """A count (parameters, tokens) for people, to three significant digits: ``812``, ``35.2 K``, ``21.8 B``.

    Example:
        >>> human_count(812), human_count(35_200), human_count(494_032_768), human_count(21_825_437_696)
        ('812', '35.2 K', '494 M', '21.8 B')
    """
    return f"{count:.0f}" if float(f"{count:.3g}") < 1000 else _scaled(count, 1000, _COUNT_UNITS)


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

"""Run FastDeploy's import and probes in a child process with a deadline, so that nothing FastDeploy does can end,
hang or garble the process that reports on it.

``hpu-fp8 doctor`` imports paddle and FastDeploy and has FastDeploy build a model: code that is not ours and may
call ``sys.exit`` on import, raise a ``BaseException`` of its own, print to stdout (which would break ``--json``),
kill its process or never return. Each of those becomes a step outcome here, one line saying what happened, and the
caller turns it into a failed check.

The child is the same interpreter with the caller's ``sys.path``. It runs the steps in order and appends one JSON
line per event to a result file the caller names (never stdout, which FastDeploy may write to): a step's start,
then its result or the error it raised. The first step that fails ends the run. The child's own stdout and stderr
are captured to files; the last line of its stderr is quoted when the child ends early.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpu_fp8_loader.errors import HpuFp8Error, one_line

__all__ = ["Step", "StepOutcome", "run_steps"]

_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from hpu_fp8_loader.fastdeploy.isolation import child_main; child_main(sys.argv[2], sys.argv[3])"
)
_QUOTED = 300  # characters of the child's last stderr line quoted in an outcome


@dataclass(frozen=True)
class Step:
    """One call the child makes: ``function`` is ``module:name`` inside this package, ``arguments`` JSON-able."""

    name: str
    function: str
    arguments: dict


@dataclass(frozen=True)
class StepOutcome:
    """What became of a step: its result, the error it raised, or how the child ended while it ran (one line each)."""

    step: str
    result: dict | None = None
    error: str | None = None
    ended: str | None = None

    @property
    def ok(self) -> bool:
        return self.result is not None


def _describe(exc: BaseException) -> str:
    """One line for what a step raised; ours (HpuFp8Error) says it all, anything else is named by its class."""
    if isinstance(exc, HpuFp8Error):
        return one_line(exc)
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})"
    text = one_line(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def child_main(steps_json: str, result_path: str) -> None:
    """The child: run each step, append its events to ``result_path``; stop at the first that fails."""
    descriptor = os.open(result_path, os.O_WRONLY | os.O_APPEND)

    def record(event: dict) -> None:
        os.write(descriptor, (json.dumps(event) + "\n").encode())

    for step in json.loads(steps_json):
        record({"step": step["name"], "started": True})
        try:
            module, _, name = step["function"].partition(":")
            result = getattr(importlib.import_module(module), name)(**step["arguments"])
        except BaseException as exc:  # FastDeploy's code may raise anything, SystemExit and its own classes included
            record({"step": step["name"], "error": _describe(exc)})
            break
        record({"step": step["name"], "result": result})
    os.close(descriptor)


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return one_line(lines[-1])[:_QUOTED] if lines else ""


def _how_it_ended(returncode: int | None, timeout: float, stderr: Path) -> str:
    if returncode is None:
        ended = f"did not finish within {timeout:g} s and was stopped"
    elif returncode < 0:
        ended = f"was killed by {signal.Signals(-returncode).name}" if -returncode in signal.valid_signals() else "was killed"
    else:
        ended = f"ended the process with exit status {returncode}"
    last = _last_line(stderr)
    return f"{ended} (its last line on stderr: {last})" if last else ended


def _read_events(path: Path) -> list[dict]:
    events = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut short by the child's end: its step counts as unfinished
        if isinstance(event, dict) and isinstance(event.get("step"), str):
            events.append(event)
    return events


def run_steps(steps: Sequence[Step], timeout: float) -> dict[str, StepOutcome]:
    """Run ``steps`` in one child process; the outcome of every step that started, by name.

    A step missing from the result never started (an earlier one failed or the child ended first). The child and
    anything it started are killed at the deadline, or if this process is interrupted while waiting.
    """
    with tempfile.TemporaryDirectory(prefix="hpu-fp8-doctor-") as work:
        results, stdout, stderr = Path(work, "events.jsonl"), Path(work, "stdout"), Path(work, "stderr")
        results.touch()
        payload = json.dumps([{"name": s.name, "function": s.function, "arguments": s.arguments} for s in steps])
        with stdout.open("wb") as out, stderr.open("wb") as err:
            child = subprocess.Popen(
                [sys.executable, "-c", _BOOT, json.dumps(sys.path), payload, str(results)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
            )  # fmt: skip
            try:
                returncode: int | None = child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:
                if child.poll() is None:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
        events = _read_events(results)
        outcomes: dict[str, StepOutcome] = {}
        for event in events:
            name = event["step"]
            if "result" in event:
                outcomes[name] = StepOutcome(name, result=event["result"] if isinstance(event["result"], dict) else {})
            elif "error" in event:
                outcomes[name] = StepOutcome(name, error=str(event["error"]))
            else:
                outcomes[name] = StepOutcome(name)
        unfinished = [name for name, outcome in outcomes.items() if outcome.result is None and outcome.error is None]
        for name in unfinished:
            outcomes[name] = StepOutcome(name, ended=_how_it_ended(returncode, timeout, stderr))
        if steps and not events:  # the child never reached its first step: our own start-up failed, not FastDeploy
            raise RuntimeError(f"internal error: doctor's child process {_how_it_ended(returncode, timeout, stderr)}")
        return outcomes

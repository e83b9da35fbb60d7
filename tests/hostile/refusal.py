"""What every hostile-input test asserts about the CLI's answer: refused, in one named line, nothing lost.

A refusal is a non-zero exit through the CLI's own error path (never an escaped exception, never a
traceback), one line on stderr that starts with ``hpu-fp8: error:`` and names the file, tensor or key at
fault. ``tree_digest`` before and after proves the input was not modified and nothing was left behind.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

from click.testing import CliRunner, Result

from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.io import writer


def run_cli(*args: object, env: dict | None = None, input: str | None = None) -> Result:
    """Run ``hpu-fp8 ARGS`` in-process; an exception that escapes the CLI stays on ``result.exception``."""
    return CliRunner().invoke(main, [str(a) for a in args], env=env, input=input, catch_exceptions=True)


def assert_refused(result: Result, *names: str, code: int | None = None) -> str:
    """The command failed cleanly with one line naming each of ``names``; returns that line."""
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        f"escaped exception {type(result.exception).__name__}: {result.exception}\n{result.stderr}"
    )
    assert result.exit_code != 0, f"accepted silently (exit 0):\n{result.stdout}\n{result.stderr}"
    if code is not None:
        assert result.exit_code == code, (result.exit_code, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("hpu-fp8: error:")]
    assert len(errors) == 1, f"expected one error line, got:\n{result.stderr}"
    assert not [line for line in lines if line.startswith(("Usage:", "Try ", "Error:"))], result.stderr  # click's block
    for name in names:
        assert name in errors[0], f"{name!r} not named in: {errors[0]}"
    for leak in _NOT_FOR_HUMANS.findall(errors[0]):
        raise AssertionError(f"the message shows Python internals ({leak!r}): {errors[0]}")
    REFUSED.append(errors[0])
    return errors[0]


# Every refusal asserted in this session, for the summary line tests/conftest.py prints.
REFUSED: list[str] = []


# What a message must never show a user: numpy reprs, pydantic's prefixes, a bare Python None or a class repr.
_NOT_FOR_HUMANS = re.compile(r"np\.(?:float|int|uint|bool)\w*\(|Value error, |Assertion failed, |\bNone\b|<class '")


def left_staging(out: Path) -> Path:
    """``OUT.partial`` as an interrupted run of this tool leaves it: made by ``prepare_output_dir`` (its marker inside),
    no longer locked. Only in such a directory can a planted file reach the tool: any other is refused untouched."""
    partial = writer.prepare_output_dir(out)
    writer._release_lock(partial)
    return partial


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file (and the target of every link) under ``root``: equal digests, nothing changed."""
    root = Path(root)
    if not root.exists():
        return {}
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    digest = {}
    for path in sorted(root.rglob("*")):
        key = path.relative_to(root).as_posix()
        if path.is_symlink():
            digest[key] = "-> " + str(path.readlink())
        elif path.is_file():
            digest[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            digest[key] = "dir"
    return digest


@contextlib.contextmanager
def deadline(seconds: int = 10) -> Iterator[None]:
    """Fail what blocks or loops for ``seconds`` (a TimeoutError), instead of hanging the test session."""

    def expire(_signum, _frame):
        raise TimeoutError(f"took over {seconds} s: a hang or a loop on hostile input")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def within_deadline(test: Callable) -> Callable:
    """Each example of a property (put it under ``@given``) runs within :func:`deadline`: no reader may hang."""

    @functools.wraps(test)
    def bounded(*args, **kwargs):
        with deadline():
            return test(*args, **kwargs)

    return bounded

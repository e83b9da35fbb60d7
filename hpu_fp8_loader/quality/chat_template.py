"""A model's chat template, rendered in a child process under a deadline, a memory limit and an output limit.

A chat template is code from the model's repository. jinja2's sandbox keeps it away from Python's internals,
but not from running for hours (two nested ``range(99999)`` loops), asking for gigabytes in one step
(``' ' * 10**10``, ``'%9999999999d' % 1``), recursing until Python gives up, or raising any Python error
(``{{ 1/0 }}``, ``{% include %}``, ``range(10**6)``). No in-process counter sees all of these: a plain loop
runs no hook, and a filter or a string method allocates before anything can look. So the template is compiled
and rendered in a child interpreter: its address space is capped (``RLIMIT_AS``), so an allocation past the
cap is a MemoryError there instead of the machine's memory; a record not rendered by the deadline is stopped by
killing the child; whatever the template raises comes back as one line naming the record, and the child's
stderr goes nowhere, so nothing it does prints on the caller's. The output is streamed (``Template.generate``)
and refused past a limit before a tokenizer sees it: the tokenizers library aborts the whole process when an
allocation fails.

The child is a fresh interpreter (not a fork: a fork of a threaded process may deadlock, and multiprocessing's
spawn would import the caller's main script again), started once per command in a few tenths of a second; each
record is a pipe round trip. It reads pickled ``messages`` (our own data) and answers JSON, never a pickle.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hpu_fp8_loader.errors import TokenizerError, one_line
from hpu_fp8_loader.io.jsonfile import JsonFormatError, parse_json

__all__ = ["RENDER_CHARACTERS", "RENDER_MEMORY_BYTES", "RENDER_SECONDS", "ChatRenderer"]

# Per record: far beyond any real chat template (they render in milliseconds, to a few kilobytes), far below
# what would stall a run or exhaust a machine.
RENDER_SECONDS = 10.0
RENDER_CHARACTERS = 2**23
# The child's address space beyond what it holds when it starts (an interpreter and jinja2).
RENDER_MEMORY_BYTES = 2**30
# Starting the child and compiling the template, on a loaded machine.
_START_SECONDS = 120.0
# The directory the package is imported from: the child imports this very copy, never one the working directory holds.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class ChatRenderer:
    """``render(messages, where)``: one record's ``messages`` through the chat template, as text.

    The template is compiled when the renderer is made, so a template that does not parse is refused before any
    dataset is read. Every failure on a record is :class:`TokenizerError` naming ``where`` (file and line or row)
    and the template's file: an error the template raises, a render past ``seconds``, more than ``characters`` of
    output, more than ``memory_bytes`` of memory, a child that died. After a failure that ended the child, the
    next record gets a fresh one. The child ends with :meth:`close` (or ``with``), when the renderer is
    garbage-collected, or when this process ends.

    Args:
        source: the template's text.
        origin: the file it came from, for messages.
        variables: what the template sees besides ``messages`` and ``add_generation_prompt`` (the special tokens).
        seconds: the deadline of one record.
        characters: the most text one record may render to.
        memory_bytes: the memory one rendering may take.

    Example:
        >>> with ChatRenderer("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", Path("t.jinja"), {}) as render:
        ...     render([{"role": "user", "content": "hi"}], "chats.jsonl:1")
        '<user>hi'
    """

    def __init__(
        self,
        source: str,
        origin: Path,
        variables: dict[str, str],
        *,
        seconds: float = RENDER_SECONDS,
        characters: int = RENDER_CHARACTERS,
        memory_bytes: int = RENDER_MEMORY_BYTES,
    ):
        self.origin, self.seconds, self.characters, self.memory_bytes = origin, seconds, characters, memory_bytes
        self._setup = {"source": source, "variables": variables, "characters": characters, "memory_bytes": memory_bytes}
        self._child: _Child | None = None
        self._start()

    def _start(self) -> None:
        """Start a child and wait for the template to compile there; refused naming the template when it does not."""
        self._child = _Child()
        self._child.send(self._setup)
        kind, text = self._receive(_START_SECONDS)
        if kind != "ready":
            self.close()
            problem = "does not parse" if kind == "refused" else "cannot be used"
            raise TokenizerError(f"{self.origin}: the chat template {problem} ({text})")

    def __call__(self, messages: list, where: str) -> str:
        if self._child is None:
            self._start()
        assert self._child is not None  # _start made it, or raised
        self._child.send(messages)
        kind, text = self._receive(self.seconds)
        if kind == "text":
            return text
        raise TokenizerError(f"{where}: the chat template of {self.origin} fails on this record ({text})")

    def _receive(self, seconds: float) -> tuple[str, str]:
        """The child's ``(kind, text)``; when none comes within ``seconds`` the child is killed, and when it died the
        text says how. Either way it is closed, and the next record gets a fresh one."""
        assert self._child is not None
        reply = self._child.receive(seconds, 4 * self.characters + 1024)
        if isinstance(reply, tuple):
            return reply
        self.close()
        return "gone", reply

    def close(self) -> None:
        """End the child (it is ended at exit anyway)."""
        if self._child is not None:
            self._child.stop()
        self._child = None

    def __enter__(self) -> ChatRenderer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Child:
    """The child interpreter and the two pipes to it."""

    def __init__(self):
        child_reads, parent_writes = os.pipe()
        parent_reads, child_writes = os.pipe()
        code = (
            f"import sys; sys.path[0] = {_PACKAGE_ROOT!r}; from {__name__} import _serve; _serve({child_reads}, {child_writes})"
        )
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,  # whatever happens there, never a traceback on the caller's stderr
                pass_fds=(child_reads, child_writes),
            )
        except OSError as exc:
            for fd in (parent_writes, parent_reads):
                os.close(fd)
            raise TokenizerError(f"cannot start a process to render the chat template ({exc.strerror or exc})") from None
        finally:
            os.close(child_reads)
            os.close(child_writes)
        self.writer, self.reader = Connection(parent_writes, readable=False), Connection(parent_reads, writable=False)
        self._finalizer = weakref.finalize(self, _stop, self.process, self.writer, self.reader)

    def send(self, value: object) -> None:
        with contextlib.suppress(OSError, ValueError):  # the child is gone: receive() says how
            self.writer.send(value)

    def receive(self, seconds: float, most_bytes: int) -> tuple[str, str] | str:
        """``(kind, text)`` as the child sent it, or why there is none: the deadline passed (the child is killed), or
        it died."""
        try:
            if self.reader.poll(seconds):
                reply = parse_json(self.reader.recv_bytes(most_bytes))
                if isinstance(reply, list) and len(reply) == 2 and all(isinstance(part, str) for part in reply):
                    return reply[0], reply[1]
                return "the process rendering it answered nonsense"
            self.stop()
            return f"not finished within {seconds:g} s; a template that loops without end?"
        except (EOFError, OSError, JsonFormatError):
            self.stop()
            code = self.process.returncode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
            return f"the process rendering it died ({how}; out of memory?)"

    def stop(self) -> None:
        self._finalizer()


def _stop(process: subprocess.Popen, *connections: Connection) -> None:
    for connection in connections:
        connection.close()
    if process.poll() is None:
        process.kill()
    process.wait()


# ----- the child -----


def _serve(reader_fd: int, writer_fd: int) -> None:
    """The child's life: cap its memory, compile the template, then render each ``messages`` it is sent until the
    parent closes the pipe (or dies)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent reports it once
    reader, writer = Connection(reader_fd, writable=False), Connection(writer_fd, readable=False)
    setup = reader.recv()
    memory_bytes, characters, variables = setup["memory_bytes"], setup["characters"], setup["variables"]
    try:
        _limit_memory(memory_bytes)
        template = _compile(setup["source"])
    except BaseException as exc:  # a template that does not parse, or no memory even for that
        _reply(writer, "refused", _reason(exc, memory_bytes))
        return
    _reply(writer, "ready", "")
    while True:
        try:
            messages = reader.recv()
        except EOFError:
            return
        try:
            kind, text = "text", _render(template, messages, variables, characters)
        except BaseException as exc:  # whatever the template does, one line back
            kind, text = "error", _reason(exc, memory_bytes)
        _reply(writer, kind, text)


def _reply(writer: Connection, kind: str, text: str) -> None:
    writer.send_bytes(json.dumps([kind, text]).encode())


def _limit_memory(memory_bytes: int) -> None:
    """``RLIMIT_AS`` at what the child holds now plus ``memory_bytes`` (no /proc, no limit: not Linux)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            now = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = now + memory_bytes if hard == resource.RLIM_INFINITY else min(now + memory_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _compile(source: str) -> Any:
    """The template in jinja2's immutable sandbox, as transformers renders chat templates (trim_blocks,
    lstrip_blocks, loop controls, ``tojson``, ``raise_exception``); ``{% include %}`` finds no template."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], loader=jinja2.DictLoader({})
    )
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(source)


class _OutputLimitError(Exception):
    """The output limit, reported as it is worded."""


def _render(template: Any, messages: list, variables: dict[str, str], characters: int) -> str:
    """The rendered text, streamed and refused past ``characters``."""
    parts: list[str] = []
    size = 0
    for part in template.generate(messages=messages, add_generation_prompt=False, **variables):
        size += len(part)
        if size > characters:
            raise _OutputLimitError(f"it renders more than {characters:,} characters for one record")
        parts.append(part)
    return "".join(parts)


def _reason(exc: BaseException, memory_bytes: int) -> str:
    """One line for what a template raised (while compiling or rendering), in a user's terms where Python's are unclear."""
    import jinja2

    if isinstance(exc, MemoryError):
        return f"it needs more than {memory_bytes / 2**20:,.0f} MiB of memory"
    if isinstance(exc, RecursionError):
        return "it nests or recurses too deeply (a macro that calls itself?)"
    if isinstance(exc, jinja2.TemplateNotFound):
        return f"it includes or imports the template {exc.name!r}; a chat template can use no other file"
    text = one_line(exc)
    if isinstance(exc, (jinja2.TemplateError, _OutputLimitError)):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

"""Read a shell block of our documents as bash would split it: what each command runs, with which environment.

Enough of bash for what the README and the model cards show: comments, backslash-continued lines, ``export``
lines, ``NAME=value`` prefixes of a command, and ``NAME=$(command)``. Words are split by ``shlex`` in POSIX mode,
so quoting is undone as bash undoes it; ``$NAME`` stays as written (the caller substitutes what it stands for).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_SUBSTITUTION = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=\$\((.*)\)(\s+#.*)?$")


@dataclass
class ShellCommand:
    comment: str  # the comment line last seen above it
    environment: dict[str, str]  # every export so far, then the command's own NAME=value prefixes
    words: list[str]
    assigns: str = ""  # NAME of ``NAME=$(command)`` or of a lone ``NAME=value``
    prefix: dict[str, str] = field(default_factory=dict)  # the command's own NAME=value prefixes


def logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined."""
    return text.replace("\\\n", " ").splitlines()


def read_block(text: str) -> list[ShellCommand]:
    """Every command of ``text`` in order; ``export`` lines feed the environment of those after them."""
    exported: dict[str, str] = {}
    commands: list[ShellCommand] = []
    comment = ""
    for line in logical_lines(text):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            comment = stripped.lstrip("#").strip()
            continue
        substitution = _SUBSTITUTION.match(stripped)
        if substitution:
            words = shlex.split(substitution.group(2))
            commands.append(ShellCommand(comment, dict(exported), words, assigns=substitution.group(1)))
            continue
        words = shlex.split(stripped, comments=True)
        if words[0] == "export":
            exported.update(word.split("=", 1) for word in words[1:])  # type: ignore[misc]
            continue
        prefix = {}
        while words and _ASSIGNMENT.match(words[0]):
            name, value = words.pop(0).split("=", 1)
            prefix[name] = value
        assigns = next(iter(prefix)) if not words and len(prefix) == 1 else ""  # NAME=value alone: a shell variable
        commands.append(ShellCommand(comment, {**exported, **prefix}, words, assigns=assigns, prefix=prefix))
    return commands


def fenced_blocks(markdown: str, language: str = "bash") -> list[str]:
    """The contents of every ```language fenced block of ``markdown``."""
    return re.findall(rf"^```{language}\n(.*?)^```", markdown, re.S | re.M)

"""Every command that stages a checkpoint directory in ``OUT.partial``, to run each against the same hostile output
path. Its inputs are the fixtures of tests/hostile/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import Result

from hostile.refusal import run_cli

# command -> (argv from (source, OUT, measurement file), the fixture that makes the source, or None)
STAGING_WRITERS = {
    "import": (lambda s, o, m: ("import", s, o, "--measurements", m, "-q"), "block"),
    "export-compressed-tensors": (lambda s, o, m: ("export-compressed-tensors", s, o, "-q"), "ckpt"),
    "convert": (lambda s, o, m: ("convert", s, o, "--measurements", m, "-q", "--workers", "1"), "src"),
    "synth": (lambda s, o, m: ("synth", o, "--preset", "qwen2-tiny", "-q"), None),
    "retarget": (lambda s, o, m: ("retarget", s, o, "--target", "gaudi3"), "ckpt"),
    "export-legacy": (lambda s, o, m: ("export-legacy", s, o), "ckpt"),
    "import-legacy": (lambda s, o, m: ("import-legacy", s, o, "--measurements", m), "legacy"),
    "map --all-ranks": (lambda s, o, m: ("map", s, "--all-ranks", "--tp", "1", "-o", o), "ckpt"),
}


def run_writer(request: pytest.FixtureRequest, command: str, out: Path, *extra: str) -> Result:
    """``command`` of :data:`STAGING_WRITERS` writing ``out`` (its source made by its fixture), plus ``extra``."""
    build, fixture = STAGING_WRITERS[command]
    source = request.getfixturevalue(fixture) if fixture else None
    return run_cli(*build(source, out, request.getfixturevalue("measurements")), *extra)

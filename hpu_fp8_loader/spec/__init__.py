"""The hpu-fp8 checkpoint format, version 1: names, config schema and measurement file format.

This package is the only place tensor names and the ``quantization_config`` schema are spelled;
docs/spec.md is its text.
"""

from typing import Final

FORMAT_VERSION: Final = 1  # spec/config.py spells it as Literal[1] too; mypy flags the two drifting apart

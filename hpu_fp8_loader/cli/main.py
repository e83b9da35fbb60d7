"""``hpu-fp8``: a thin shell over the Python API. No math and no I/O of its own.

The group and its error mapping live in :mod:`.group`; the commands, by pipeline stage, in the
``*_commands`` modules, which register themselves on the group when imported here.
"""

from __future__ import annotations

from hpu_fp8_loader.cli import (  # noqa: F401  (imported to register their commands)
    checks_commands,
    conversion_commands,
    export_commands,
    fastdeploy_commands,
    hub_commands,
    quality_commands,
    sources_commands,
)
from hpu_fp8_loader.cli.group import main

__all__ = ["main"]

if __name__ == "__main__":
    main()

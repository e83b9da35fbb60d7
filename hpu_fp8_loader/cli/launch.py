"""The ``hpu-fp8`` executable's first step: an address space too small to start in is refused in one line of ours.

Under a ``ulimit -v`` below about 200 MiB the imports themselves fail, each in its own way: numpy's OpenBLAS prints
"Memory allocation still failed after 10 retries, giving up" and exits as it loads, pydantic's extension fails to
map with a traceback. So the limit is read (``resource``, with nothing else imported) before any of them load.
"""

from __future__ import annotations

import resource
import sys

__all__ = ["MIN_ADDRESS_SPACE", "main"]

# The least ``ulimit -v`` a command starts under: the interpreter, numpy and its BLAS, pydantic and click take about
# 200 MiB (on the project's machine `validate` of a tiny checkpoint ran at 200 MiB; the imports failed at 150 MiB).
MIN_ADDRESS_SPACE = 256 << 20


def main() -> None:
    """Refuse a ``ulimit -v`` below :data:`MIN_ADDRESS_SPACE`, else run the command line."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY and soft < MIN_ADDRESS_SPACE:
        sys.stderr.write(
            f"hpu-fp8: error: ulimit -v (RLIMIT_AS) is {soft >> 20} MiB; hpu-fp8 needs at least "
            f"{MIN_ADDRESS_SPACE >> 20} MiB of address space to start (Python, numpy and its BLAS library): raise it "
            "with `ulimit -v`\n"
        )
        sys.exit(1)
    from hpu_fp8_loader.cli.main import main as command_line

    command_line()


if __name__ == "__main__":
    main()

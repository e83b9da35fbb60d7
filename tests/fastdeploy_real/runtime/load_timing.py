"""One FastDeploy load, timed, inside FastDeploy's environment: what a user restarting a server waits for.

    python load_timing.py CASE.json

CASE: ``checkpoint``, ``load_choices`` (``default``: FastDeploy's own v0 loader; ``hpu_fp8``: the hook), ``tp``,
``rank``. Builds FastDeploy's config as its worker does and runs ``HPUModelRunner.load_model`` once; reports the
seconds that took (imports and config excluded: the same for both loaders), the parameters loaded and their bytes.
The caller measures the process's peak memory (bench/hook_load.py). Prints one JSON report on the last line.
"""

from __future__ import annotations

import time

import fd_bootstrap  # noqa: F401  (before fastdeploy)
from fd_harness import fd_config, load, report_case


def run(case: dict) -> dict:
    config = fd_config(case["checkpoint"], case["tp"], case["rank"], case["load_choices"])
    started = time.perf_counter()
    model = load(config)
    seconds = time.perf_counter() - started
    parameters = list(model.parameters())
    return {
        "load_seconds": seconds,
        "parameters": len(parameters),
        "parameter_bytes": sum(int(p.numel()) * p.element_size() for p in parameters),
    }


if __name__ == "__main__":
    report_case(run)

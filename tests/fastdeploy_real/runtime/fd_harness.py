"""FastDeploy's own config building and loading, as its worker process does them, inside one process.

Runs in the suite's FastDeploy environment (``fd_environment.py``), after ``fd_bootstrap``. The config
comes from ``worker_process.parse_args`` and ``initialize_fd_config`` on the arguments FastDeploy's
engine passes its workers (``hpu_fp8_loader.fastdeploy.probe``, which ``hpu-fp8 doctor`` uses too);
loading is ``HPUModelRunner.load_model`` (``get_model_loader`` -> the loader -> ``convert_model``).
Tensor-parallel ranks are simulated in one process (see the probe).
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import fd_bootstrap  # noqa: F401  (before fastdeploy)
import numpy as np
import paddle

from hpu_fp8_loader.fastdeploy.probe import fastdeploy_config


def fd_config(
    model_dir: str, tp: int = 1, rank: int = 0, load_choices: str = "default", expert_parallel: bool = False, dp: int = 1
):
    """FastDeploy's FDConfig for one rank, built by its worker's own code (the package's probe, shared with doctor)."""
    return fastdeploy_config(model_dir, tp, rank, load_choices, expert_parallel, dp)


def loaded_runner(config):
    """FastDeploy's ``HPUModelRunner`` after its ``load_model``: chosen loader, then ``convert_model``."""
    from fastdeploy.worker.hpu_model_runner import HPUModelRunner

    rank = config.parallel_config.tensor_parallel_rank
    runner = HPUModelRunner(fd_config=config, device="cpu", device_id=0, rank=rank, local_rank=rank)
    runner.load_model()
    return runner


def load(config):
    """The model as ``HPUModelRunner.load_model`` leaves it."""
    return loaded_runner(config).model


def first_hpu_op(call: Callable[[], object]) -> tuple[str, tuple, dict] | None:
    """The first compiled HPU op ``call`` reaches (the stand-in ops stop there), with its arguments; None if none."""
    from paddle_custom_device import intel_hpu as hpu_ops

    before = len(hpu_ops.CALLS)
    try:
        call()
    except hpu_ops.ReachedHpuOpError:
        return hpu_ops.CALLS[before]
    return None


def bits(tensor) -> np.ndarray:
    """The exact bits of a paddle tensor as unsigned integers (fp8 and bf16 through integer views)."""
    if tensor.dtype == paddle.float8_e4m3fn:
        return tensor.view(paddle.uint8).numpy()
    if tensor.dtype == paddle.bfloat16:
        return tensor.view(paddle.uint16).numpy().astype(np.uint16)
    return np.ascontiguousarray(tensor.numpy()).view(f"u{tensor.element_size()}")


def state(model) -> dict[str, dict]:
    """Every parameter and buffer, plus ``down_proj_in_scale`` where FastDeploy holds it as a per-expert list (its
    develop layout). PR 5855's ``process_scales_alignment_after_loading`` replaces that parameter after loading by a
    padded tensor, which paddle then keeps as a buffer."""
    out = {}
    for name, parameter in model.named_parameters():
        out[name] = {"tensor": parameter}
    for name, buffer in model.named_buffers():
        out[name] = {"tensor": buffer}
    for name, layer in model.named_sublayers():
        scales = layer.__dict__.get("down_proj_in_scale")
        if isinstance(scales, list):
            out[f"{name}.down_proj_in_scale"] = {"list": scales}
    return out


def report_case(run: Callable[[dict], dict]) -> None:
    """Run the case named by argv[1] and print its JSON report as the last line of stdout; a failure becomes the
    report's ``error`` (the traceback goes to stderr, which the test prints)."""
    try:
        report = run(json.loads(Path(sys.argv[1]).read_text()))
    except Exception as exc:
        traceback.print_exc()
        report = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(report))

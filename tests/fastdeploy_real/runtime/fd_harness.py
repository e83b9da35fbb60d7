"""FastDeploy's own config building and loading, as its worker process does them, inside one process.

Runs in the suite's FastDeploy environment (``environment.py``), after ``fd_bootstrap``. The config
comes from ``worker_process.parse_args`` and ``initialize_fd_config`` on the arguments FastDeploy's
engine passes its workers; loading is ``HPUModelRunner.load_model`` (``get_model_loader`` -> the
loader -> ``convert_model``). Tensor-parallel ranks are simulated in one process: the communication
group FastDeploy creates is replaced by an object with the rank and size (loading reads nothing
else of it; a collective on it would fail).
"""

from __future__ import annotations

import json
import sys

import fd_bootstrap  # noqa: F401  (before fastdeploy)
import numpy as np
import paddle
import paddle.distributed as dist
from fastdeploy.worker import worker_process

_DISTRIBUTED = False


class SimulatedGroup:
    """The communication group of one simulated rank: its rank and size, nothing to communicate over."""

    def __init__(self, ranks, rank: int):
        self.ranks = list(ranks)
        self.nranks = len(self.ranks)
        self.world_size = self.nranks
        self.rank = rank
        self.id = 1000
        self.name = f"simulated_tp{self.nranks}_rank{rank}"
        self.process_group = None

    def is_member(self) -> bool:
        return True

    def get_group_rank(self, rank: int) -> int:
        return self.ranks.index(rank) if rank in self.ranks else -1


def _arguments(model_dir: str, tp: int, load_choices: str) -> list[str]:
    argv = [
        "worker_process", "--model", model_dir, "--tensor_parallel_size", str(tp), "--load_choices", load_choices,
        "--max_model_len", "256", "--max_num_seqs", "4", "--max_num_batched_tokens", "1024", "--block_size", "128",
        "--graph_optimization_config", json.dumps({"use_cudagraph": False}),
    ]  # fmt: skip
    for option in ("--speculative_config", "--plas_attention_config", "--early_stop_config", "--eplb_config",
                   "--routing_replay_config"):  # fmt: skip
        argv += [option, "{}"]  # the engine always passes these (fastdeploy/engine/engine.py)
    return argv


def fd_config(model_dir: str, tp: int = 1, rank: int = 0, load_choices: str = "default"):
    """FastDeploy's FDConfig for one rank, built by its worker's own argument parsing and config code."""
    global _DISTRIBUTED
    if not _DISTRIBUTED:
        worker_process.init_distributed_environment()  # FastDeploy's own; a world of one process here
        _DISTRIBUTED = True
    if tp > 1:
        from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

        tracker = get_rng_state_tracker()
        if "model_parallel_rng" not in tracker.states_:  # what fleet.init registers with mp_degree > 1
            tracker.add("model_parallel_rng", 20 + rank)
    saved_argv, saved_new_group = sys.argv, dist.new_group
    sys.argv = _arguments(model_dir, tp, load_choices)
    dist.new_group = lambda ranks=None, *args, **kwargs: SimulatedGroup(range(tp) if ranks is None else ranks, rank % tp)
    try:
        return worker_process.initialize_fd_config(worker_process.parse_args(), ranks=tp, local_rank=rank)
    finally:
        sys.argv, dist.new_group = saved_argv, saved_new_group


def load(config):
    """The model as ``HPUModelRunner.load_model`` leaves it: chosen loader, then ``convert_model``."""
    from fastdeploy.worker.hpu_model_runner import HPUModelRunner

    rank = config.parallel_config.tensor_parallel_rank
    runner = HPUModelRunner(fd_config=config, device="cpu", device_id=0, rank=rank, local_rank=rank)
    runner.load_model()
    return runner.model


def bits(tensor) -> np.ndarray:
    """The exact bits of a paddle tensor as unsigned integers (fp8 and bf16 through integer views)."""
    if tensor.dtype == paddle.float8_e4m3fn:
        return tensor.view(paddle.uint8).numpy()
    if tensor.dtype == paddle.bfloat16:
        return tensor.view(paddle.uint16).numpy().astype(np.uint16)
    return np.ascontiguousarray(tensor.numpy()).view(f"u{tensor.element_size()}")


def state(model) -> dict[str, dict]:
    """Every parameter, plus ``down_proj_in_scale`` where FastDeploy holds it as a per-expert list."""
    out = {}
    for name, parameter in model.named_parameters():
        out[name] = {"tensor": parameter}
    for name, layer in model.named_sublayers():
        scales = layer.__dict__.get("down_proj_in_scale")
        if isinstance(scales, list):
            out[f"{name}.down_proj_in_scale"] = {"list": scales}
    return out

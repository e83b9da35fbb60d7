"""What paddle and FastDeploy in this environment do, probed in the process that runs them: the steps
``hpu-fp8 doctor`` runs in its child process (:mod:`.isolation`), and FastDeploy's model for a checkpoint built at
meta shapes beside what the hook would fill.

Each step returns a JSON-able dict and raises whatever paddle or FastDeploy raise; the child reports it.

For ``hpu-fp8 doctor CKPT`` on the Gaudi box, the FastDeploy installed there builds the model
from the checkpoint's config.json with its own worker code (``worker_process.parse_args`` and
``initialize_fd_config`` on the arguments its engine passes a worker), under ``paddle.LazyGuard`` so
no weight memory is allocated whatever the model's size; every parameter's name, shape and dtype is
then compared with what the hook's mapping fills on that rank, and the MoE layout is read off the
model. The conformance suite builds its configs the same way.

One process plays one rank: the communication group FastDeploy creates is replaced, while the config
is built, by an object holding the rank and the size, which is all building the model reads of it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

__all__ = [
    "OneProcessGroup",
    "fastdeploy_config",
    "fastdeploy_step",
    "mismatches",
    "model_step",
    "paddle_step",
    "routing_step",
    "worker_config",
]


class OneProcessGroup:
    """The tensor-parallel group of one rank played in this process: its rank and size, nothing to communicate over."""

    def __init__(self, ranks, rank: int):
        self.ranks = list(ranks)
        self.nranks = len(self.ranks)
        self.world_size = self.nranks
        self.rank = rank
        self.id = 1000
        self.name = f"one_process_tp{self.nranks}_rank{rank}"
        self.process_group = None

    def is_member(self) -> bool:
        return True

    def get_group_rank(self, rank: int) -> int:
        return self.ranks.index(rank) if rank in self.ranks else -1


def _worker_arguments(model_dir: str, tp: int, load_choices: str, expert_parallel: bool, dp: int) -> list[str]:
    argv = [
        "--model", model_dir, "--tensor_parallel_size", str(tp), "--load_choices", load_choices,
        "--max_model_len", "256", "--max_num_seqs", "4", "--max_num_batched_tokens", "1024", "--block_size", "128",
        "--graph_optimization_config", json.dumps({"use_cudagraph": False}),
    ]  # fmt: skip
    for option in ("--speculative_config", "--plas_attention_config", "--early_stop_config", "--eplb_config",
                   "--routing_replay_config"):  # fmt: skip
        argv += [option, "{}"]  # FastDeploy's engine always passes these to its workers
    if dp > 1:  # with one engine-worker queue port a data-parallel group, as FastDeploy's engine passes them
        argv += ["--data_parallel_size", str(dp), "--engine_worker_queue_port", ",".join(str(9923 + g) for g in range(dp))]
    if expert_parallel:  # what the engine passes for --enable-expert-parallel --disable-sequence-parallel-moe
        argv += ["--enable_expert_parallel", "--disable_sequence_parallel_moe"]
    return argv


_FLEET_READY = False


def fastdeploy_config(
    model_dir: str | Path,
    tp: int = 1,
    rank: int = 0,
    load_choices: str = "hpu_fp8",
    expert_parallel: bool = False,
    dp: int = 1,
):
    """FastDeploy's FDConfig for worker ``rank`` of the ``dp x tp`` that serve ``model_dir``, built by its worker's own
    argument parsing and config code; ``expert_parallel``: the experts spread over all of them (FastDeploy's EP size
    is data x tensor parallel size, and a worker's EP rank its rank among them)."""
    return worker_config(_worker_arguments(str(model_dir), tp, load_choices, expert_parallel, dp), dp * tp, rank)


def worker_config(worker_argv: Sequence[str], world_size: int, rank: int):
    """FastDeploy's FDConfig for worker ``rank`` of the ``world_size`` processes ``paddle.distributed.launch`` starts,
    from the arguments its engine passes that worker (``worker_argv``, without the script), through
    ``worker_process.parse_args`` and ``initialize_fd_config`` as ``run_worker_proc`` calls them."""
    global _FLEET_READY
    import paddle.distributed as dist
    from fastdeploy.worker import worker_process

    if not _FLEET_READY:
        worker_process.init_distributed_environment()  # FastDeploy's own; a world of one process here
        _FLEET_READY = True
    if world_size > 1:
        from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

        tracker = get_rng_state_tracker()
        if "model_parallel_rng" not in tracker.states_:  # what fleet.init registers when mp_degree > 1
            tracker.add("model_parallel_rng", 20 + rank)

    def one_process_group(ranks: list[int] | None = None, *args: object, **kwargs: object) -> OneProcessGroup:
        members = list(range(world_size) if ranks is None else ranks)
        return OneProcessGroup(members, rank % len(members))

    saved_argv, saved_new_group = sys.argv, dist.new_group
    sys.argv = ["worker_process", *worker_argv]
    # paddle declares new_group to return its Group; ours returns a duck-typed stand-in (building the model reads only
    # the rank and the size, as the module docstring says), which its annotation cannot express
    dist.new_group = one_process_group  # type: ignore[assignment]
    try:
        return worker_process.initialize_fd_config(worker_process.parse_args(), ranks=world_size, local_rank=rank)
    finally:
        sys.argv, dist.new_group = saved_argv, saved_new_group


def mismatches(checkpoint: str | Path, tp: int = 1, rank: int = 0) -> tuple[list[str], str | None, int]:
    """(every parameter on which FastDeploy's model and the hook's mapping disagree, the MoE layout, parameters built)."""
    import paddle
    from fastdeploy.model_executor.models.model_base import ModelRegistry

    from hpu_fp8_loader.arch import describe
    from hpu_fp8_loader.fastdeploy.mapping import Parallelism, parameter_specs
    from hpu_fp8_loader.fastdeploy.plugin import (
        MOE_LIST_LAYOUT,
        fastdeploy_casts,
        model_parameter_names,
        moe_layout,
        router_parameters,
    )
    from hpu_fp8_loader.io.checkpoint import Checkpoint
    from hpu_fp8_loader.spec.config import parse_quantization_config

    config = fastdeploy_config(checkpoint, tp, rank)
    with paddle.LazyGuard():
        model = ModelRegistry.get_class(config.model_config.architectures[0])(config)
    built = {name: (tuple(p.shape), str(p.dtype).removeprefix("paddle.")) for name, p in model.named_parameters()}
    layout = moe_layout(model)
    opened = Checkpoint.open(checkpoint)
    qc = parse_quantization_config(opened.config)
    descriptor = describe(opened.config)
    specs = parameter_specs(descriptor, qc.kv_cache_scheme, Parallelism(tp, rank), qc.kept_bf16)
    routers = router_parameters(descriptor)
    dtypes = {"F8_E4M3": "float8_e4m3fn", "BF16": "bfloat16", "F32": "float32"}
    named = model_parameter_names(specs, built)
    expected = {
        named[name]: (spec.shape, dtypes[spec.dtype])
        for name, spec in specs.items()
        if not (layout == MOE_LIST_LAYOUT and name.endswith(".down_proj_in_scale"))
    }
    problems = [f"{name}: FastDeploy builds it, the hook does not fill it" for name in sorted(set(built) - set(expected))]
    problems += [f"{name}: the hook fills it, FastDeploy does not build it" for name in sorted(set(expected) - set(built))]
    for name in sorted(set(built) & set(expected)):
        (shape, dtype), (want_shape, want_dtype) = built[name], expected[name]
        if shape != want_shape or (dtype != want_dtype and not fastdeploy_casts(name, dtype, want_dtype, routers)):
            problems.append(f"{name}: FastDeploy builds {list(shape)} {dtype}, the hook fills {list(want_shape)} {want_dtype}")
    return problems, layout, len(built)


# ----------------------------------------------------------------------------- doctor's steps


def _has(module: object, dotted: str) -> bool:
    """Whether ``paddle.compat.enable_torch_proxy`` (say) exists under ``module``, the first part naming it."""
    node = module
    for part in dotted.split(".")[1:]:
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


def paddle_step(attributes: list[str]) -> dict:
    """paddle's version, its custom devices, and which of ``attributes`` (dotted from ``paddle``) it has."""
    if importlib.util.find_spec("paddle") is None:
        return {"installed": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paddle's "No ccache found" on import
        import paddle

    devices = [str(device) for device in paddle.device.get_all_custom_device_type() or []]
    present = {attribute: _has(paddle, attribute) for attribute in attributes}
    return {"installed": True, "version": str(paddle.__version__), "custom_devices": devices, "attributes": present}


def fastdeploy_step() -> dict:
    """``import fastdeploy``, as every FastDeploy process does first: its ``__init__`` imports paddle and calls it."""
    import fastdeploy

    return {"file": str(getattr(fastdeploy, "__file__", ""))}


def routing_step() -> dict:
    """Register the hook and ask FastDeploy's own ``get_model_loader`` for ``hpu_fp8``, as its worker does."""
    from hpu_fp8_loader.fastdeploy import plugin

    plugin.register()
    from fastdeploy.model_executor.model_loader import get_model_loader

    loader = get_model_loader(SimpleNamespace(load_choices=plugin.LOAD_CHOICE))
    if loader is None:
        return {"loader": None, "ours": False}
    return {"loader": type(loader).__name__, "ours": isinstance(loader, plugin.loader_class())}


def model_step(checkpoint: str, tp: int) -> dict:
    """FastDeploy builds ``checkpoint``'s model for TP rank 0 at meta shapes; what disagrees with the hook (:func:`mismatches`)."""
    problems, layout, built = mismatches(checkpoint, tp, 0)
    return {"problems": problems, "layout": layout, "built": built}

"""One recipe case, run inside FastDeploy's environment: a server command line as a user pastes it, through
FastDeploy's own code to the worker's loaded model.

    python recipe_case.py CASE.json

CASE: ``arguments`` (what follows ``python -m fastdeploy.entrypoints.openai.api_server``), ``rank`` (the worker
to load, or null to stop at the worker command), optionally ``moe_layout`` (``pr5855``: re-create PR 5855's loading, see pr5855_moe.py) and ``oracle``
(a checkpoint FastDeploy's own ``--load-choices default`` loads, to compare the hook's model with, parameter by
parameter, as conformance.py does). The process environment is the recipe's.

What runs is FastDeploy's: the api_server's parser (``make_arg_parser(FlexibleArgumentParser())``) and its model
resolution (``retrive_model_from_server``), as api_server.py does at import; ``EngineArgs.from_cli_args`` and
``create_engine_config``, as its ``load_engine`` does; the worker command ``LLMEngine._start_worker_service``
composes (its ``subprocess.Popen`` captured, its tokenizer-derived numbers from a stand-in: this checkpoint has
no tokenizer, and loading reads none of them); that command's environment prefix; and the worker's own
``parse_args``/``initialize_fd_config`` and ``HPUModelRunner.load_model`` for one of the processes
``paddle.distributed.launch --devices`` would start (``hpu_fp8_loader.fastdeploy.probe.worker_config``).
Prints one JSON report on the last line of stdout.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import subprocess
import traceback
import types

import fd_bootstrap  # noqa: F401  (before fastdeploy)
from fd_harness import fd_config, load, report_case, state

LAUNCHER = "paddle.distributed.launch"


def parse_server_arguments(arguments: list[str]):
    """The api_server's namespace, or the parser's own error text (argparse exits)."""
    from fastdeploy.entrypoints.openai.utils import make_arg_parser
    from fastdeploy.utils import FlexibleArgumentParser, retrive_model_from_server

    parser = make_arg_parser(FlexibleArgumentParser(prog="api_server"))
    unknown = [
        word.split("=", 1)[0]
        for word in arguments
        if word.startswith("--") and word.split("=", 1)[0] not in parser._option_string_actions
    ]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            args = parser.parse_args(arguments)
    except SystemExit:
        return None, printed.getvalue().strip().splitlines()[-1], unknown
    args.model = retrive_model_from_server(args.model, args.revision)  # a local directory comes back as it is
    return args, None, unknown


class _Tokenizer:
    """Stands in for the engine's tokenizer: the worker command carries a few of its numbers (from e53f5184 also the
    line break's id and the thinking-truncation prompt's ids, asked of its ``encode``/``tokenize``), loading reads
    none of them."""

    think_truncate_prompt = ""

    def __init__(self, size: int):
        self.vocab = {str(i): i for i in range(size)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return []

    def tokenize(self, text: str) -> list[str]:
        return []

    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int]:
        return []


def worker_command(config) -> str:
    """The shell command ``LLMEngine._start_worker_service`` runs for ``config`` (captured, not run)."""
    from fastdeploy.engine.engine import LLMEngine

    processor = types.SimpleNamespace(tokenizer=_Tokenizer(config.model_config.vocab_size), eos_token_id_len=1, pad_token_id=0)
    engine = LLMEngine.__new__(LLMEngine)  # its methods, without starting queues, schedulers or a tokenizer
    # release/2.5 also asks the inner engine for a multimodal model's per-item token budget: a text model has none
    inner = types.SimpleNamespace(data_processor=processor, mm_max_tokens_per_item=None)
    engine.cfg, engine.engine, engine.data_processor, engine.do_profile = config, inner, processor, 1
    captured: list[str] = []
    popen = subprocess.Popen
    subprocess.Popen = lambda command, **kwargs: captured.append(command)  # type: ignore[assignment,misc]
    try:
        engine._start_worker_service()
    finally:
        subprocess.Popen = popen  # type: ignore[misc]
    return captured[0]


def split_worker_command(command: str) -> tuple[dict[str, str], list[str], list[str]]:
    """(environment prefix, the launcher's devices, the worker's arguments) of the engine's worker command."""
    words = shlex.split(command)
    environment = {}
    while "=" in words[0] and not words[0].startswith("-"):
        name, value = words.pop(0).split("=", 1)
        environment[name] = value
    launcher = words.index(LAUNCHER)
    script = next(i for i, w in enumerate(words) if w.endswith("worker_process.py"))
    options = words[launcher + 1 : script]
    devices = options[options.index("--devices") + 1].split(",")
    worker = [w for w in words[script + 1 :] if not w.startswith("2>")]  # the shell's stderr redirection
    return environment, devices, worker


def run(case: dict) -> dict:
    if case.get("moe_layout") == "pr5855":
        import pr5855_moe

        pr5855_moe.apply()
    args, parse_error, unknown = parse_server_arguments(case["arguments"])
    if parse_error:
        return {"parse_error": parse_error, "unknown_options": unknown}
    from fastdeploy.engine.args_utils import EngineArgs

    config = EngineArgs.from_cli_args(args).create_engine_config()
    command = worker_command(config)
    prefix, devices, worker_arguments = split_worker_command(command)
    os.environ.update(prefix)  # the shell gives the launcher, and so every worker, the engine's prefix
    from hpu_fp8_loader.fastdeploy.probe import worker_config

    rank = case["rank"]
    report: dict = {
        "port": args.port,
        "unknown_options": unknown,
        "devices": devices,
        "worker_arguments": worker_arguments,
        "engine": {
            "load_choices": config.load_config.load_choices,
            "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
            "expert_parallel_size": config.parallel_config.expert_parallel_size,
            "use_cudagraph": config.graph_opt_config.use_cudagraph,
            "model": config.model_config.model,
        },
    }
    if rank is None:  # the command line and its launcher only
        return report
    oracle_model = None
    if case.get("oracle"):  # built first, as conformance.py does
        tp = config.parallel_config.tensor_parallel_size
        oracle_model = load(fd_config(case["oracle"], tp, rank, "default"))
    worker = worker_config(worker_arguments, len(devices), rank)
    parallel = worker.parallel_config
    report["worker"] = {
        "load_choices": worker.load_config.load_choices,
        "tensor_parallel": [parallel.tensor_parallel_rank, parallel.tensor_parallel_size],
        "expert_parallel": [parallel.expert_parallel_rank, parallel.expert_parallel_size],
        "use_sequence_parallel_moe": parallel.use_sequence_parallel_moe,
    }
    from fastdeploy.model_executor.model_loader import get_model_loader

    report["loader"] = type(get_model_loader(worker.load_config)).__name__
    try:
        model = load(worker)
    except Exception as exc:  # e.g. without FD_PLUGINS FastDeploy's own loader meets the hpu-fp8 checkpoint
        traceback.print_exc()
        report["load_error"] = f"{type(exc).__name__}: {exc}"
        return report
    hook = state(model)
    report["parameters"] = len(hook)
    report["router_dtypes"] = sorted({str(p.dtype) for n, p in model.named_parameters() if n.endswith(".mlp.gate.weight")})
    if oracle_model is not None:
        from conformance import DEVICE_ROUNDED, compare_states

        report["differences"] = compare_states(state(oracle_model), hook)
        report["device_rounded"] = DEVICE_ROUNDED
    return report


if __name__ == "__main__":
    report_case(run)

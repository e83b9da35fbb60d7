"""How to serve an hpu-fp8 checkpoint with FastDeploy on a Gaudi: one source for every copy of the recipe.

The README's serving block and every model card's are rendered from here, so that the environment variables
and the argument lines cannot drift apart. The FastDeploy conformance suite runs the rendered lines, as a user
pastes them, through FastDeploy's own api_server argument parser, its engine's config building, the worker
command line its engine composes, the worker's own parser and model load with the hook
(``tests/fastdeploy_real/test_recipe.py``); a misspelled flag or variable fails there.

Where each setting comes from (docs/fastdeploy.md section 1, "FD on Gaudi: the install guide"): the device
variables are FastDeploy's Gaudi guide's (``docs/get_started/installation/intel_gaudi.md``), the others are
read by FastDeploy's code at the supported commits. What each one does is its ``note``, the comment the
block shows beside it. The guide's warm-up-off line also passes ``--graph-optimization-config
'{"use_cudagraph":false}'``; FastDeploy turns CUDA graphs off itself on every platform but GPU and MACA
(``FDConfig.postprocess``), so the recipe leaves it out and the suite checks that they are off.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from hpu_fp8_loader.fastdeploy.plugin import ANNOUNCEMENT_PREFIX, LOAD_CHOICE

__all__ = [
    "CHECKPOINT_VARIABLE",
    "DEVICE_VARIABLES",
    "HOOK_VARIABLES",
    "LAYOUTS",
    "PORT",
    "PRIVACY_VARIABLES",
    "SERVER_MODULE",
    "ServingLayout",
    "Variable",
    "layouts_for",
    "log_check_command",
    "pulled",
    "request_body",
    "request_command",
    "server_arguments",
    "serving_block",
]

SERVER_MODULE = "fastdeploy.entrypoints.openai.api_server"
# FastDeploy's api_server listens on 8000 unless told (entrypoints/openai/utils.py, make_arg_parser); the Gaudi
# guide's request goes to 8188 without passing --port, so the recipe passes it.
PORT = 8188
CHECKPOINT_VARIABLE = "CKPT"  # the shell variable holding the local checkpoint directory
# FastDeploy resolves a --model that is not a local path with its own downloader (FD_MODEL_SOURCE, default
# AIStudio), which knows nothing of the Hub and checks no hashes: the recipe always passes a local directory.
MODEL_ARGUMENT = f"${CHECKPOINT_VARIABLE}"
# the Gaudi guide's sizes for ERNIE-4.5-21B-A3B; `hpu-fp8 plan` gives the memory they need per rank
SIZE_ARGUMENTS = ("--max-model-len", "32768", "--max-num-seqs", "128")
INSTALL_LINE = "pip install ./hpu-fp8-loader"
INSTALL_NOTE = "into FastDeploy's environment, from a clone (or its wheel)"
DOCTOR_LINE = f'hpu-fp8 doctor "${CHECKPOINT_VARIABLE}"'


@dataclass(frozen=True)
class Variable:
    """One environment variable of the recipe: its value, the comment shown beside it, and who reads it.

    ``read_by`` is ``fastdeploy`` (its ``envs.py`` or its code), ``paddle``, or ``gaudi`` (the Gaudi software
    and PaddleCustomDevice's ``intel_hpu`` backend, which the guide sets them for and which are not on a CPU), or
    ``fastdeploy-usage`` (FastDeploy's usage reporting, which only FastDeploy from ``93b7675a`` has: read there, and
    without effect on a FastDeploy without it).
    """

    name: str
    value: str
    note: str
    read_by: str


DEVICE_VARIABLES = (
    Variable(
        "GC_KERNEL_PATH",
        "/usr/local/lib/python3.10/dist-packages/paddle_custom_device/intel_hpu/libcustom_tpc_perf_lib.so"
        ":/usr/lib/habanalabs/libtpc_kernels.so",
        "PaddleCustomDevice's kernels, then Habana's (the guide's two lines in one)",
        "gaudi",
    ),
    Variable("INTEL_HPU_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7", "as FastDeploy's Gaudi guide sets them", "gaudi"),
    Variable("PADDLE_DISTRI_BACKEND", "xccl", "paddle's collectives over its custom device", "paddle"),
    Variable("PADDLE_XCCL_BACKEND", "intel_hpu", "... the Gaudi", "paddle"),
    Variable("HABANA_PROFILE", "0", "no profiler trace", "fastdeploy"),
)
HOOK_VARIABLES = (
    Variable("FD_PLUGINS", LOAD_CHOICE, "FastDeploy runs only the plugins named here", "fastdeploy"),
    Variable("FD_ATTENTION_BACKEND", "HPU_ATTN", "the default, APPEND_ATTN, is for GPUs", "fastdeploy"),
    Variable(
        "HPU_WARMUP_BUCKET",
        "1",
        "warm-up on: compile prefill shapes before serving (0, the default: off)",
        "fastdeploy",
    ),
    Variable("HPU_WARMUP_MODEL_LEN", "4096", "... up to this many tokens", "fastdeploy"),
)


# FastDeploy from 93b7675a (2026-01-14; in releases 2.5 and 2.6) reports usage from worker rank 0
# (fastdeploy/usage/usage_lib.py, report_usage_stats, called by hpu_worker.py): its whole config, the model path
# included, posted to FastDeploy's usage server (FD_USAGE_STATS_SERVER) as it starts and every 600 s, and
# usage_stats.json written under FD_CONFIG_ROOT, unless DO_NOT_TRACK is exactly "1" (envs.py). Read from the code
# at e53f5184, f3fb7e03 (release/2.5) and 7198b588 (release/2.6), not run; 8c3513a4 predates it.
PRIVACY_VARIABLES = (
    Variable(
        "DO_NOT_TRACK",
        "1",
        "else FastDeploy 2.5+ sends its config, model path included, out every 10 minutes",
        "fastdeploy-usage",
    ),
)


@dataclass(frozen=True)
class ServingLayout:
    """A way to spread the model over Gaudi cards: the cards FastDeploy uses and the flags that say how."""

    key: str
    title: str
    devices: str  # HPU_VISIBLE_DEVICES: FastDeploy's device ids on HPU (config.py), one worker each
    flags: tuple[str, ...]
    tp: int
    ep: int = 1
    requires: str = ""  # what FastDeploy must carry beyond the supported commits


LAYOUTS = (
    ServingLayout("tp1", "TP 1: one Gaudi", "0", ("--tensor-parallel-size", "1"), tp=1),
    ServingLayout("tp2", "TP 2: two Gaudis", "0,1", ("--tensor-parallel-size", "2"), tp=2),
    ServingLayout(
        "ep2",
        "EP 2: experts spread over two Gaudis (MoE)",
        "0,1",
        # with EP and TP > 1 FastDeploy turns on sequence-parallel MoE, whose o_proj the hook does not split
        ("--tensor-parallel-size", "2", "--enable-expert-parallel", "--disable-sequence-parallel-moe"),
        tp=2,
        ep=2,
        requires="FastDeploy with PR 5855",
    ),
)


def server_arguments(layout: ServingLayout, model: str = MODEL_ARGUMENT) -> list[str]:
    """The api_server's arguments for ``layout``, as the recipe writes them (``model`` as given)."""
    return ["--model", model, "--port", str(PORT), "--load-choices", LOAD_CHOICE, *layout.flags, *SIZE_ARGUMENTS]


def _command_lines(words: list[str], indent: str = "    ") -> str:
    """A long command as shell lines of at most ~110 characters, continued with backslashes."""
    lines, current = [], ""
    for word in words:
        if current and len(current) + 1 + len(word) > 110:
            lines.append(current + " \\")
            current = indent + word
        else:
            current = f"{current} {word}" if current else word
    return "\n".join([*lines, current])


def _quoted(word: str) -> str:
    return f'"{word}"' if word == MODEL_ARGUMENT else shlex.quote(word)


def _commented(line: str, note: str, column: int = 42) -> str:
    """``line`` with ``note`` as a comment: beside it, or above a line too long to share a column."""
    return f"{line:<{column}}# {note}" if len(line) < column else f"# {note}\n{line}"


def _exports(variables: tuple[Variable, ...]) -> list[str]:
    return [_commented(f"export {v.name}={shlex.quote(v.value)}", v.note) for v in variables]


def request_body() -> dict:
    """The test request: the Gaudi guide's question, a short answer."""
    return {"messages": [{"role": "user", "content": "What is AI?"}], "max_tokens": 24}


def request_command() -> str:
    """A ``curl`` request to FastDeploy's OpenAI chat endpoint on the recipe's port."""
    url = f"http://127.0.0.1:{PORT}/v1/chat/completions"
    body = json.dumps(request_body())
    return f'curl -s {url} -H "Content-Type: application/json" \\\n    -d {shlex.quote(body)}'


def log_check_command() -> str:
    """The command that shows the hook's line in each worker's log (paddle's launcher writes log/workerlog.N)."""
    return f'grep "{ANNOUNCEMENT_PREFIX}" log/workerlog.*'


def layouts_for(tp_sizes: tuple[int, ...], experts: bool) -> tuple[ServingLayout, ...]:
    """The recipe's layouts a model can use: those whose TP size it divides into (``tp_sizes``), EP only with experts."""
    return tuple(layout for layout in LAYOUTS if layout.tp in tp_sizes and (layout.ep == 1 or experts))


def pulled(repo_id: str) -> tuple[str, str]:
    """The line that sets ``$CKPT`` to a published checkpoint's local copy, and its comment."""
    return f"{CHECKPOINT_VARIABLE}=$(hpu-fp8 pull {repo_id})", "a local directory, every sha256 checked"


def serving_block(checkpoint: tuple[str, str], layouts: tuple[ServingLayout, ...] = LAYOUTS) -> str:
    """The shell block from install to the first answer: paste it down to ``hpu-fp8 doctor``, run one server
    command, then the checks. ``checkpoint`` is the line that sets ``$CKPT`` to a local hpu-fp8 directory, with
    its comment (:func:`pulled`, or a directory made on this machine)."""
    parts = [
        _commented(INSTALL_LINE, INSTALL_NOTE),
        _commented(*checkpoint),
        "# FastDeploy's Gaudi guide's device settings",
        *_exports(DEVICE_VARIABLES),
        "# the hook and FastDeploy's HPU path",
        *_exports(HOOK_VARIABLES),
        *_exports(PRIVACY_VARIABLES),
        _commented(DOCTOR_LINE, "FastDeploy, the hook, the checkpoint: each problem with its fix"),
    ]
    for i, layout in enumerate(layouts):
        needs = f"; needs {layout.requires}" if layout.requires else ""
        parts += ["", f"# {'' if i == 0 else 'or '}{layout.title}{needs}"]
        words = [f"HPU_VISIBLE_DEVICES={layout.devices}", "python", "-m", SERVER_MODULE]
        words += [_quoted(w) for w in server_arguments(layout)]
        parts.append(_command_lines(words))
    parts += [
        "",
        "# once it listens: the hook's line in each worker's log, then a request",
        log_check_command(),
        request_command(),
    ]
    return "\n".join(parts) + "\n"

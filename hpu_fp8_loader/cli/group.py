"""The ``hpu-fp8`` group: its options, the pipeline order of its commands, the error mapping and the shared options.

Every :class:`~hpu_fp8_loader.errors.HpuFp8Error` becomes one line on stderr and a non-zero exit; a usage
error one line naming the option; Ctrl-C one line and exit 130; a failed allocation one line naming the memory seen. Options several commands share are declared
here once.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from hpu_fp8_loader import __version__
from hpu_fp8_loader.console import LEVELS, LOGGER, configure
from hpu_fp8_loader.errors import HpuFp8Error, command_line
from hpu_fp8_loader.io.jsonfile import JsonFormatError, parse_json
from hpu_fp8_loader.memory import out_of_memory
from hpu_fp8_loader.quality.tokenizer import BYTE_VOCAB_LIMIT, TOKENIZER_CHOICES
from hpu_fp8_loader.spec.choices import Bf16Group, DeadExpertPolicy, KvCacheScheme, Rebalance, Target, unservable_bf16_choice

if TYPE_CHECKING:
    pass

log = logging.getLogger(LOGGER)
FC = TypeVar("FC", bound=Callable[..., Any])  # a command function, as click's decorators type it

EXIT_INVALID = 1
EXIT_UNREADABLE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
# What Ctrl-C leaves and what running the same command again does, per command (one line, exit 130). A command
# that writes a checkpoint publishes it by a rename only when complete; only convert's work (and import's, which
# converts) resumes, from the shards OUT.partial finished; every other command starts again from the beginning.
_NOTHING_WRITTEN = "nothing was written"
_RESUMES = (
    "nothing was published; run the same command again to resume: it keeps the shards OUT.partial finished from "
    "the same source, options and amax"
)
_STARTS_AFRESH = "nothing was published; the same command starts again from the beginning (it does not resume)"
INTERRUPTED = {
    "demo": "--out holds a partial run, which the next demo replaces",
    "synth": _STARTS_AFRESH,
    "stress": _STARTS_AFRESH,
    "calibrate": "no file was written; a calibration does not resume, so the same command starts from the beginning",
    "convert": _RESUMES,
    "import": _RESUMES,
    "import-legacy": _STARTS_AFRESH,
    "retarget": _STARTS_AFRESH,
    "validate": _NOTHING_WRITTEN,
    "inspect": _NOTHING_WRITTEN,
    "eval": "nothing was written; an evaluation does not resume, so the same command starts from the beginning",
    "plan": _NOTHING_WRITTEN,
    "map": _STARTS_AFRESH,
    "export-legacy": _STARTS_AFRESH,
    "export-compressed-tensors": _STARTS_AFRESH,
    "doctor": _NOTHING_WRITTEN,
    "push": "a push does not resume: the same command starts again from the beginning",
    "pull": "files downloaded whole stay in the Hugging Face cache; the same command fetches the rest",
    "schema": _NOTHING_WRITTEN,
}


def interrupted_line(command: str | None) -> str:
    """The one line Ctrl-C prints in ``command`` (None: before a command started)."""
    return f"interrupted; {INTERRUPTED[command]}" if command in INTERRUPTED else "interrupted"


THREAD_NOT_STARTED = "can't start new thread"  # CPython's RuntimeError when a thread's stack cannot be allocated
LIBRARY_NOT_MAPPED = "failed to map segment from shared object"  # glibc's loader, in an ImportError, when it has no room


def fail(message: str, code: int = EXIT_INVALID) -> NoReturn:
    click.echo(f"hpu-fp8: error: {message}", err=True)
    sys.exit(code)


@contextmanager
def user_errors(code: int = EXIT_INVALID):
    try:
        yield
    except HpuFp8Error as exc:
        fail(str(exc), code)
    except OSError as exc:  # permissions, a full disk: the file and the reason, not a traceback
        fail(f"{exc.filename}: {exc.strerror or exc}" if exc.filename else str(exc.strerror or exc), code)


def say(as_json: bool):
    """Where a long command's step lines go: stdout, or stderr when stdout holds the JSON result."""
    return (lambda line: click.echo(line, err=True)) if as_json else click.echo


def warn_each(warnings) -> None:
    for warning in warnings:
        log.warning(warning)


def parse_overrides(pairs: tuple[str, ...]) -> dict:
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--set")
        try:  # strictly, as every JSON we read: a 5,000-digit integer is refused there, not a ValueError here
            overrides[key] = parse_json(value)
        except JsonFormatError:
            overrides[key] = value
    return overrides


def parse_size(text: str) -> int:
    """``5GB``, ``500MiB``, ``64000``: a positive whole number of bytes, or a usage error naming the option."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    for suffix in sorted(units, key=len, reverse=True):
        if suffix and text.upper().endswith(suffix):
            number, factor = text[: -len(suffix)], units[suffix]
            break
    else:
        number, factor = text, 1
    try:
        size = float(number) * factor
    except ValueError:
        size = math.nan
    if not (1 <= size < 2**63):  # also refuses nan, inf and a fraction of a byte
        raise click.BadParameter(f"{text!r} is not a positive size like 5GB or 500MiB", param_hint="'--max-shard-size'")
    return int(size)


# Options several commands share, declared once: ``name_option()`` as declared, ``name_option(help=...)`` (or any
# other click.option keyword) where one command needs its own wording or default.
def _shared_option(*declarations: str, **defaults: Any) -> Callable[..., Callable[[FC], FC]]:
    def option(**overrides: Any) -> Callable[[FC], FC]:
        return click.option(*declarations, **{**defaults, **overrides})

    return option


class EnumChoice(click.Choice):
    """A choice among an enum's values (``--kv-cache fp8``) that hands the command the enum member, so that options
    reach the library typed as it declares them."""

    def __init__(self, enum: type[Enum]):
        self.enum = enum
        super().__init__([member.value for member in enum])

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> Enum:
        if isinstance(value, self.enum):
            return value
        return self.enum(super().convert(value, param, ctx))


# Counts are at least 1 and ranks at least 0: click refuses anything else as a usage error naming the option.
COUNT = click.IntRange(min=1)
# Worker processes of convert and import: two keep the disk busy while one computes; more rarely pay on two cores.
DEFAULT_WORKERS = min(2, os.cpu_count() or 1)
RANK = click.IntRange(min=0)
force_option = _shared_option("--force", is_flag=True, help="Replace OUT if it exists.")
quiet_option = _shared_option("-q", "--quiet", is_flag=True, help="No progress bar or progress lines.")
report_option = _shared_option(
    "--report",
    "report_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Also write a report here: report.json, index.html and PNGs of per-linear FP8 error, activation amax, weight "
    "spread and expert load (an existing non-empty directory needs --force).",
)
json_option = _shared_option(
    "--json", "as_json", is_flag=True, help="Print the result as one JSON document on stdout (messages stay on stderr)."
)
shard_size_option = _shared_option("--max-shard-size", default="5GB", show_default=True, help="Largest output shard file.")


def _enum_option(flag: str, enum: type[Enum], help: str) -> Callable[..., Callable[[FC], FC]]:
    """A shared option choosing one of an enum's values, the first member by default."""
    return _shared_option(flag, type=EnumChoice(enum), default=next(iter(enum)).value, show_default=True, help=help)


target_option = _enum_option("--target", Target, "gaudi2: FP8 range ±240 (what FastDeploy serves); gaudi3: ±448.")
kv_cache_option = _enum_option(
    "--kv-cache",
    KvCacheScheme,
    "fp8: FP8 KV cache and FP8 attention (FastDeploy's cache_fp8_sdpa_fp8); none: attention and KV cache in BF16, "
    "FP8 linears only (not yet seen working on a Gaudi; docs/spec.md section 5).",
)
measurements_option = _shared_option(
    "--measurements",
    "measurement_paths",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Activation statistics: an hpu-fp8 measurement file (JSON, whatever its name) or a directory of them (one set "
    "per file), or FastDeploy's measurement text files.",
)
tp_option = _shared_option("--tp", type=COUNT, default=1, show_default=True, help="Tensor-parallel size.")
ep_option = _shared_option("--ep", type=COUNT, default=1, show_default=True, help="Expert-parallel size (MoE).")
rebalance_option = _enum_option(
    "--rebalance",
    Rebalance,
    "With --calibrate: exact power-of-two channel folds before quantizing, where a point's amax / median |x| "
    "exceeds what E4M3 at ±240 holds (flagged) or everywhere (all); the model computes the same, FP8 sees smaller "
    "outliers (docs/guide.md, 'FP8 range').",
)
dead_experts_option = _enum_option(
    "--dead-experts",
    DeadExpertPolicy,
    "Experts without a positive amax: error stops and lists them; sibling-max gives each the max of its "
    "layer's other experts and records which in config.json.",
)

DATASET_FORMS = (
    "FILE.txt, FILE.jsonl (one record a line), FILE.json (an array of records, or JSON Lines), FILE.csv (a header "
    "row, then one record a row), FILE.parquet; other suffixes are refused. Or a DIR of such files (sorted, "
    "recursively; hidden and .md files passed over, any other file refused), or a Hub dataset ORG/NAME (through "
    "the Hugging Face cache; HF_HUB_OFFLINE=1 reads the cache only). A local path wins. Read only as far as the "
    "windows need."
)


def dataset_options(dataset_help: str) -> Callable[[FC], FC]:
    """``--dataset`` (with each command's own help) and how its records become tokens: ``--text-field``,
    ``--chat-template``, ``--dataset-revision`` and ``--tokenizer``, shared by calibrate and eval."""
    options = [
        click.option("--dataset", default="builtin", show_default=True, help=f"{dataset_help} {DATASET_FORMS}"),
        click.option(
            "--text-field",
            default="text",
            show_default=True,
            help="The JSON key (.jsonl, .json), CSV column or parquet column of each record's text.",
        ),
        click.option(
            "--chat-template",
            is_flag=True,
            help="Render each record's 'messages' (a list of {role, content}; .jsonl, .json or .parquet) through the "
            "model's chat template instead.",
        ),
        click.option(
            "--dataset-revision",
            help="Branch, tag or commit of a Hub dataset (calibrate records the commit it read in the measurements).",
        ),
        click.option(
            "--tokenizer",
            type=click.Choice(TOKENIZER_CHOICES),
            default="auto",
            show_default=True,
            help="auto: the model's tokenizer.json, else its sentencepiece tokenizer.model (BOS as tokenizer_config.json "
            f"says); byte tokens only for a model without either and a vocabulary of at most {BYTE_VOCAB_LIMIT}. "
            "bytes: one token per UTF-8 byte.",
        ),
    ]

    def decorate(command: FC) -> FC:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


threads_option = click.option(
    "--threads",
    type=COUNT,
    default=None,
    help="Batches of windows run at once, each on a thread of its own, BLAS using the cores left to each "
    "(default: every core this process may use; never more BLAS threads than OPENBLAS_NUM_THREADS allows). Each "
    "batch's arithmetic is its own, so N changes no result except through BLAS's own thread count, which may round "
    "a product's last bit differently: with OPENBLAS_NUM_THREADS=1 every N gives the same bits. Each thread holds a "
    "batch's activations: where one BLAS call already fills the cores (ERNIE-4.5-300B-A47B's width on 2 cores) "
    "--threads 1 is as fast and holds ~1 GiB less.",
)
BUILTIN_CALIBRATION_TEXT = "builtin: Python's own documentation, offline (its last 10% is held out for eval)."
# CalibrationOptions' fields, as the options of calibration_options() name them.
CALIBRATION_FIELDS = (
    "dataset", "text_field", "chat_template", "dataset_revision", "tokenizer", "samples", "seq_len", "batch_size",
    "all_experts", "threads",
)  # fmt: skip


def calibration_options(dataset_help: str) -> Callable[[FC], FC]:
    """How a calibration runs, declared once for calibrate, convert --calibrate and import --calibrate: the
    :func:`dataset_options`, ``--samples``, ``--seq-len``, ``--batch-size`` and ``--all-experts``. The command
    receives them as one dict ``calibration`` (CalibrationOptions' fields)."""
    options = [
        dataset_options(dataset_help),
        click.option("--samples", default=32, type=COUNT, show_default=True, help="Windows of --seq-len tokens to run."),
        click.option(
            "--seq-len", default=256, type=COUNT, show_default=True, help="Tokens per window (at most max_position_embeddings)."
        ),
        click.option("--batch-size", default=4, type=COUNT, show_default=True, help="Windows run through a layer at a time."),
        click.option(
            "--all-experts",
            is_flag=True,
            help="Also run every token through every expert, for the statistics only (never the forward): no expert "
            "stays uncalibrated, but expert ranges get wider and the expert work grows about E/k times.",
        ),
        threads_option,
    ]

    def decorate(command: FC) -> FC:
        @functools.wraps(command)
        def gathered(*args: Any, **kwargs: Any) -> Any:
            kwargs["calibration"] = {name: kwargs.pop(name) for name in CALIBRATION_FIELDS}
            return command(*args, **kwargs)

        wrapped: Any = gathered
        for option in reversed(options):
            wrapped = option(wrapped)
        return wrapped

    return decorate


def calibration_given_alone(ctx: click.Context, run_calibration: bool) -> None:
    """Refuse calibration options without ``--calibrate``: they would be silently ignored."""
    if run_calibration:
        return
    given = [name for name in CALIBRATION_FIELDS if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise click.UsageError(f"{flag} applies to the calibration: pass --calibrate too, or leave it out")


class Bf16GroupChoice(click.ParamType):
    """A :class:`Bf16Group` by value; anything else refused with why FastDeploy cannot serve it (not just the list)."""

    name = "group"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> Bf16Group:
        if isinstance(value, Bf16Group):
            return value
        try:
            return Bf16Group(value)
        except ValueError:
            self.fail(unservable_bf16_choice(str(value)), param, ctx)


keep_bf16_option = _shared_option(
    "--keep-bf16",
    "keep_bf16",
    multiple=True,
    type=Bf16GroupChoice(),
    metavar="GROUP",
    help="Keep a group of linears in BF16, as FastDeploy serves them: dense (attention, dense MLPs and shared experts) "
    "or experts (every routed expert). FastDeploy keeps whole groups only; anything else is refused, saying why. "
    "Repeatable.",
)


def revision_option(argument: str, flag: str = "--revision") -> Callable[[FC], FC]:
    """``--revision`` (or ``flag``) of the positional ``argument`` when that is a Hub repo id: every command that names
    a model or checkpoint declares it here, and hands both to ``sources.resolve.local_or_hub``."""
    return click.option(
        flag,
        flag.lstrip("-").replace("-", "_"),
        default=None,
        metavar="REV",
        help=f"Branch, tag or commit of {argument} when it is a Hub repo id ORG/NAME (default: main; a local path, then a "
        "shipped tiny model's name, wins).",
    )


PIPELINE_ORDER = [
    "demo", "synth", "stress", "calibrate", "convert", "import", "import-legacy", "retarget", "validate", "inspect", "eval",
    "plan", "map", "export-legacy", "export-compressed-tensors", "doctor", "push", "pull", "schema",
]  # fmt: skip


def _usage_failure(exc: click.UsageError, ctx: click.Context) -> NoReturn:
    """A usage error as one line: click's reason and the command whose --help explains it."""
    where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
    fail(f"{exc.format_message()} (see `{where} --help`)", exc.exit_code)


class _Commands(click.Group):
    """The command group: every failure of a command is one ``hpu-fp8: error:`` line. A usage error (a bad
    option value, a missing argument) names the option and where help is, exit 2, instead of click's
    four-line usage block; Ctrl-C is one line and exit 130, not click's "Aborted!" and exit 1."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Commands in the order of the pipeline, not the alphabet."""
        listed = super().list_commands(ctx)
        return sorted(listed, key=lambda name: PIPELINE_ORDER.index(name) if name in PIPELINE_ORDER else len(listed))

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """The group's own options (``--log-level``, ``-v``) fail in one line too."""
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            _usage_failure(exc, ctx)

    def invoke(self, ctx: click.Context):
        try:
            with command_line():  # messages name --force, not Python's force=True
                return super().invoke(ctx)
        except click.UsageError as exc:
            _usage_failure(exc, ctx)
        except KeyboardInterrupt:
            fail(interrupted_line(ctx.invoked_subcommand), EXIT_INTERRUPTED)
        except MemoryError as exc:  # one a step did not name (those are OutOfMemoryError, an HpuFp8Error)
            fail(str(out_of_memory(ctx.invoked_subcommand or ctx.command_path, exc)))
        except RuntimeError as exc:
            if str(exc) != THREAD_NOT_STARTED:  # our own bug: its traceback is what a report needs
                raise
            # a thread's stack is address space too: under ulimit -v, this is how the memory runs out
            fail(str(out_of_memory(f"{ctx.invoked_subcommand or ctx.command_path}: starting a thread", MemoryError())))
        except ImportError as exc:
            if LIBRARY_NOT_MAPPED not in str(exc):  # a broken installation: the traceback says which module
                raise
            # so is a library's code: under ulimit -v, a module imported late may find no room to be mapped
            fail(
                str(
                    out_of_memory(
                        f"{ctx.invoked_subcommand or ctx.command_path}: loading {exc.name or 'a library'}", MemoryError()
                    )
                )
            )


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="hpu-fp8")
@click.option("-v", "--verbose", count=True, help="More on stderr: -v the steps of long work, -vv debug detail.")
@click.option(
    "-q", "--quiet", is_flag=True, help="No progress bars or lines and no step messages; warnings and errors still show."
)
@click.option(
    "--log-level",
    type=click.Choice(list(LEVELS), case_sensitive=False),
    envvar="HPU_FP8_LOG_LEVEL",
    help="Set the level outright (error hides warnings too). [env: HPU_FP8_LOG_LEVEL]",
)
@click.pass_context
def main(ctx: click.Context, verbose: int, quiet: bool, log_level: str | None) -> None:
    """FP8 checkpoints for FastDeploy on Intel Gaudi, made and checked on a CPU.

    The hpu-fp8 format (docs/spec.md) stores FP8 weights, fp32 dequantization scales and raw
    activation amax, and records the FP8 range, target and calibration provenance.

    stdout holds each command's result (with --json, one JSON document); warnings, errors and progress
    go to stderr. Progress bars are drawn only on a terminal, and never with TQDM_DISABLE or
    HF_HUB_DISABLE_PROGRESS_BARS set. When stderr is not a terminal (a log file), long work writes
    "hpu-fp8: progress:" lines instead: as a layer begins, at most one per 10 s and at least one per 30 s,
    with the step, elapsed time and an estimate of the time left (-q or --log-level error: none).
    """
    for stream in (sys.stdout, sys.stderr):  # a path of bytes that are no UTF-8 prints as \x escapes, not a traceback
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    from_command_line = ctx.get_parameter_source("log_level") == click.core.ParameterSource.COMMANDLINE
    if log_level and (from_command_line or not (verbose or quiet)):
        level = LEVELS[log_level]
    else:
        level = logging.DEBUG if verbose >= 2 else logging.INFO if verbose == 1 else logging.WARNING
    configure(level, quiet)

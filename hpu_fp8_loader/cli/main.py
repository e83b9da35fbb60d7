"""``hpu-fp8``: a thin shell over the Python API. No math and no I/O of its own.

Every :class:`~hpu_fp8_loader.errors.HpuFp8Error` becomes one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import click

from hpu_fp8_loader import __version__
from hpu_fp8_loader.arch import Layout
from hpu_fp8_loader.console import LEVELS, LOGGER, configure, emit_json, progress_bar
from hpu_fp8_loader.errors import HpuFp8Error

log = logging.getLogger(LOGGER)

EXIT_INVALID = 1
EXIT_UNREADABLE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
INTERRUPTED = "interrupted; nothing was published (run the same command again: a conversion resumes)"


def _fail(message: str, code: int = EXIT_INVALID) -> None:
    click.echo(f"hpu-fp8: error: {message}", err=True)
    sys.exit(code)


@contextmanager
def _errors(code: int = EXIT_INVALID):
    try:
        yield
    except HpuFp8Error as exc:
        _fail(str(exc), code)
    except OSError as exc:  # permissions, a full disk: the file and the reason, not a traceback
        _fail(f"{exc.filename}: {exc.strerror or exc}" if exc.filename else str(exc.strerror or exc), code)


def _say(as_json: bool):
    """Where a long command's step lines go: stdout, or stderr when stdout holds the JSON result."""
    return (lambda line: click.echo(line, err=True)) if as_json else click.echo


def _warn_each(warnings) -> None:
    for warning in warnings:
        log.warning(warning)


def _parse_overrides(pairs: tuple[str, ...]) -> dict:
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--set")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def _parse_size(text: str) -> int:
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
def _shared_option(*declarations: str, **defaults: object):
    def option(**overrides: object):
        return click.option(*declarations, **{**defaults, **overrides})

    return option


# Counts are at least 1 and ranks at least 0: click refuses anything else as a usage error naming the option.
COUNT = click.IntRange(min=1)
RANK = click.IntRange(min=0)
force_option = _shared_option("--force", is_flag=True, help="Replace OUT if it exists.")
quiet_option = _shared_option("-q", "--quiet", is_flag=True, help="No progress bar.")
json_option = _shared_option(
    "--json", "as_json", is_flag=True, help="Print the result as one JSON document on stdout (messages stay on stderr)."
)
shard_size_option = _shared_option("--max-shard-size", default="5GB", show_default=True, help="Largest output shard file.")
target_option = _shared_option(
    "--target",
    type=click.Choice(["gaudi2", "gaudi3"]),
    default="gaudi2",
    show_default=True,
    help="gaudi2: FP8 range ±240 (what FastDeploy serves); gaudi3: ±448.",
)
kv_cache_option = _shared_option(
    "--kv-cache",
    type=click.Choice(["fp8", "none"]),
    default="fp8",
    show_default=True,
    help="fp8: fp8 KV cache and fp8 attention; none: attention stays BF16 (safer for Qwen2).",
)
measurements_option = _shared_option(
    "--measurements",
    "measurement_paths",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Activation statistics: hpu-fp8 measurement files (.json) or FastDeploy's measurement text files.",
)
tp_option = _shared_option("--tp", type=COUNT, default=1, show_default=True, help="Tensor-parallel size.")
ep_option = _shared_option("--ep", type=COUNT, default=1, show_default=True, help="Expert-parallel size (MoE).")
dead_experts_option = _shared_option(
    "--dead-experts",
    type=click.Choice(["error", "sibling-max"]),
    default="error",
    show_default=True,
    help="Experts without a positive amax: error stops and lists them; sibling-max gives each the max of its "
    "layer's other experts and records which in config.json.",
)


_PIPELINE_ORDER = [
    "demo", "synth", "calibrate", "convert", "import", "import-legacy", "retarget", "validate", "inspect", "eval",
    "plan", "map", "export-legacy", "doctor", "push", "pull", "schema",
]  # fmt: skip


def _usage_failure(exc: click.UsageError, ctx: click.Context) -> None:
    """A usage error as one line: click's reason and the command whose --help explains it."""
    where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
    _fail(f"{exc.format_message()} (see `{where} --help`)", exc.exit_code)


class _Commands(click.Group):
    """The command group: every failure of a command is one ``hpu-fp8: error:`` line. A usage error (a bad
    option value, a missing argument) names the option and where help is, exit 2, instead of click's
    four-line usage block; Ctrl-C is one line and exit 130, not click's "Aborted!" and exit 1."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Commands in the order of the pipeline, not the alphabet."""
        listed = super().list_commands(ctx)
        return sorted(listed, key=lambda name: _PIPELINE_ORDER.index(name) if name in _PIPELINE_ORDER else len(listed))

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """The group's own options (``--log-level``, ``-v``) fail in one line too."""
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            _usage_failure(exc, ctx)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            _usage_failure(exc, ctx)
        except KeyboardInterrupt:
            _fail(INTERRUPTED, EXIT_INTERRUPTED)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="hpu-fp8")
@click.option("-v", "--verbose", count=True, help="More on stderr: -v the steps of long work, -vv debug detail.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars and no step messages; warnings and errors still show.")
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
    HF_HUB_DISABLE_PROGRESS_BARS set.
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


@main.command(short_help="Check a checkpoint against every rule of the spec.")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--quick",
    is_flag=True,
    help="Check headers, scales, index and file sizes only (seconds on any size); skip the weight scan "
    "(with --hashes the values are checked anyway, on the same read as the sha256).",
)
@click.option("--hashes", is_flag=True, help="Also compare every file's sha256 with hpu_fp8_manifest.json (reads every byte).")
@json_option(help="Print the report as JSON.")
@quiet_option()
def validate(directory: Path, quick: bool, hashes: bool, as_json: bool, quiet: bool) -> None:
    """Check DIRECTORY against every rule of the hpu-fp8 v1 spec.

    Exit status: 0 valid, 1 invalid (every violation is listed), 2 unreadable (no directory,
    config.json missing or not JSON, not an hpu-fp8 checkpoint, unknown format_version, a file
    the system cannot read).
    """
    from hpu_fp8_loader.checks.validate import validate as run_validation

    try:
        with progress_bar("scanning weights", quiet or quick or as_json) as bar:
            report = run_validation(directory, full=not quick, hashes=hashes, progress=bar.update)
    except (HpuFp8Error, OSError) as exc:  # OSError: permissions, I/O errors; named like _errors() names them
        message = str(exc) if isinstance(exc, HpuFp8Error) else f"{exc.filename or directory}: {exc.strerror or exc}"
        if as_json:  # the report a script reads, and the one line a person reads
            emit_json({"root": directory, "valid": False, "unreadable": message})
        _fail(message, EXIT_UNREADABLE)
    if as_json:
        emit_json(report.to_dict())
    else:
        for warning in report.warnings:
            click.echo(f"warning: {warning}")
        for v in report.violations:
            click.echo(f"[{v.rule}] {v.where}: {v.message}")
        verdict = "valid" if report.valid else f"INVALID ({len(report.violations)} violation(s))"
        click.echo(f"{directory}: {verdict} hpu-fp8 v1 checkpoint; {report.tensors} tensors, {report.mode} check")
    sys.exit(0 if report.valid else EXIT_INVALID)


@main.command(short_help="Summarise a checkpoint: roles, dtypes, scales.")
@click.argument("directory", type=click.Path(path_type=Path))
@json_option(help="Print the summary as JSON.")
def inspect(directory: Path, as_json: bool) -> None:
    """Summarise DIRECTORY: layers, roles, dtypes, bytes, scale ranges, saturated share."""
    from hpu_fp8_loader.checks.inspection import inspect_checkpoint

    with _errors(EXIT_UNREADABLE):
        result = inspect_checkpoint(directory)
    if as_json:
        emit_json(result.to_dict())
        return
    _print_inspection(result)


def _print_inspection(result) -> None:
    click.echo(
        f"{result.root}: {result.model_type}, {result.layers} layers"
        + (f" ({len(result.moe_layers)} MoE, {result.experts} experts)" if result.experts else "")
        + f"; fp8_max {result.fp8_max:g} ({result.target}); KV cache {result.kv_cache_scheme}; {result.total_bytes / 2**20:.1f} MiB"
    )
    click.echo(
        f"{'role':<16}{'tensors':>8}{'MiB':>10}  {'dtypes':<14}{'weight scale min/med/max':<32}{'act scale min/med/max':<32}{'at ±max':>10}"
    )

    def fmt(stats: dict | None) -> str:
        return "-" if stats is None else f"{stats['min']:.3g}/{stats['median']:.3g}/{stats['max']:.3g}"

    for role, s in result.roles.items():
        sat = "-" if s.saturated_share is None else f"{100 * s.saturated_share:.4f}%"
        click.echo(
            f"{role:<16}{s.tensors:>8}{s.bytes / 2**20:>10.2f}  {','.join(s.dtypes):<14}{fmt(s.weight_scale):<32}{fmt(s.act_scale):<32}{sat:>10}"
        )


@main.command(short_help="Write a deterministic random BF16 source checkpoint.")
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--preset",
    default="ernie-moe-tiny",
    show_default=True,
    help="Model size preset: ernie-moe-tiny, ernie-dense-tiny, qwen2-tiny.",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config.json key (JSON value), e.g. --set hidden_size=256. Repeatable.",
)
@click.option(
    "--layout",
    type=click.Choice([layout.value for layout in Layout]),
    default="paddle",
    show_default=True,
    help="paddle: FastDeploy's fused [in, out] names; torch: Hugging Face [out, in], separate q/k/v and gate/up.",
)
@click.option("--seed", type=RANK, default=0, show_default=True, help="Values depend only on the seed and the tensor's name.")
@shard_size_option()
@force_option()
@quiet_option()
@json_option()
def synth(
    out: Path,
    preset: str,
    overrides: tuple[str, ...],
    layout: str,
    seed: int,
    max_shard_size: str,
    force: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Write a deterministic random-init BF16 source checkpoint to OUT."""
    from hpu_fp8_loader.arch import describe
    from hpu_fp8_loader.sources.synth import preset_config, synthesize

    with _errors():
        config = preset_config(preset, _parse_overrides(overrides))
        descriptor = describe(config, f"synth --preset {preset}")
        with progress_bar("synth", quiet or as_json, total=2 * descriptor.parameter_count()) as bar:
            synthesize(out, config, Layout(layout), seed, _parse_size(max_shard_size), force, progress=bar.update)
    if as_json:
        emit_json(
            {
                "out": out,
                "model_type": descriptor.model_type,
                "parameters": descriptor.parameter_count(),
                "layout": layout,
                "seed": seed,
            }
        )
        return
    click.echo(f"{out}: {descriptor.model_type} ({descriptor.parameter_count():,} parameters) in {layout} layout, seed {seed}")


@main.command(short_help="Convert a BF16 checkpoint to hpu-fp8 v1.")
@click.argument("src")
@click.argument("out", type=click.Path(path_type=Path))
@measurements_option(
    required=True,
    help="Activation amax: an hpu-fp8 measurement file (.json), or FastDeploy's model_measurement.txt, its "
    "per-rank model_measurement_{rank}.txt set, or a directory holding them. Repeat to combine sources (max per point).",
)
@target_option()
@kv_cache_option()
@click.option(
    "--scale-rounding",
    type=click.Choice(["none", "pow2"]),
    default="none",
    show_default=True,
    help="pow2 rounds every scale up to a power of two.",
)
@dead_experts_option()
@click.option("--workers", type=COUNT, default=min(2, os.cpu_count() or 1), show_default=True, help="Worker processes.")
@shard_size_option()
@click.option("--revision", default=None, help="Revision of SRC when it is a Hub repo id.")
@force_option()
@quiet_option()
@json_option()
def convert(
    src: str,
    out: Path,
    measurement_paths: tuple[Path, ...],
    target: str,
    kv_cache: str,
    scale_rounding: str,
    dead_experts: str,
    workers: int,
    max_shard_size: str,
    revision: str | None,
    force: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Convert the BF16 checkpoint SRC into an hpu-fp8 v1 checkpoint at OUT.

    SRC is a directory (Paddle or Hugging Face torch layout; BF16, FP16, FP32, or compressed-tensors FP8) or a Hub repo id
    (the local cache is used offline). Output is written into OUT.partial and renamed when complete;
    after an interruption the same command resumes, reusing finished shards whose sha256 still matches.
    """
    from hpu_fp8_loader.conversion.convert import convert as run_convert
    from hpu_fp8_loader.conversion.plan import ConvertOptions
    from hpu_fp8_loader.sources.measurements import load_measurements
    from hpu_fp8_loader.sources.resolve import resolve_checkpoint

    options = ConvertOptions(target, kv_cache, scale_rounding, _parse_size(max_shard_size), force, workers, dead_experts)
    with _errors():
        source = resolve_checkpoint(src, revision)
        loaded = [load_measurements(p) for p in measurement_paths]
        for item in loaded:
            _warn_each(item.warnings)
        with progress_bar("convert", quiet or as_json) as bar:

            def show(p) -> None:
                bar.total = p.bytes_total
                bar.update(p.bytes_done - bar.n)
                bar.set_postfix_str(f"{p.tensors_done}/{p.tensors_total} tensors", refresh=False)

            result = run_convert(source, out, [item.measurements for item in loaded], options, progress=show)
    if as_json:
        emit_json({**dataclasses.asdict(result), "ratio": result.ratio, "target": target, "kv_cache": kv_cache})
        return
    filled = f"; {len(result.filled_experts)} dead expert(s) given their siblings' max" if result.filled_experts else ""
    reused = f"; resumed, {result.reused_shards} shard(s) reused" if result.reused_shards else ""
    click.echo(
        f"{out}: hpu-fp8 v1 ({target}, KV cache {kv_cache}) from {result.layout.value} layout; "
        f"{result.tensors_quantized} tensors quantized, {result.tensors_kept} kept; "
        f"{result.bytes_in / 2**30:.2f} GiB -> {result.bytes_out / 2**30:.2f} GiB ({result.ratio:.3f}); "
        f"{result.seconds:.1f} s, {result.bytes_in / 2**20 / max(result.seconds, 1e-9):.0f} MiB/s{filled}{reused}"
    )


@main.command("import-legacy", short_help="Bring a legacy FastDeploy FP8 checkpoint to hpu-fp8.")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@measurements_option(
    help="Points the legacy checkpoint lacks (e.g. Qwen2's MLP, which FastDeploy never measures); JSON or FastDeploy files."
)
@dead_experts_option()
@shard_size_option()
@force_option()
@json_option()
def import_legacy(
    src: Path,
    out: Path,
    measurement_paths: tuple[Path, ...],
    dead_experts: str,
    max_shard_size: str,
    force: bool,
    as_json: bool,
) -> None:
    """Bring a checkpoint of FastDeploy's legacy converter (Model_convert.py) into hpu-fp8 v1.

    Resolves the legacy activation_scale's two meanings (raw amax for self_attn keys, amax/240
    elsewhere), widens the older converter's tensor-wise expert scales to exact channel-wise ones,
    and fuses Hugging Face-named Qwen2 tensors (requantizing once where their scales differ).
    """
    from hpu_fp8_loader.conversion.legacy_import import import_legacy as run_import
    from hpu_fp8_loader.sources.measurements import load_measurements

    with _errors():
        extra = [load_measurements(p).measurements for p in measurement_paths]
        report = run_import(src, out, extra, dead_experts, _parse_size(max_shard_size), force)
    _warn_each(report.warnings)
    if as_json:
        emit_json(report)
        return
    click.echo(
        f"{out}: hpu-fp8 v1 from a legacy {report.layout.value}-layout checkpoint; expert scales: {report.expert_scales}; "
        f"KV cache {report.kv_cache.value}"
    )
    if report.requantized:
        worst = sorted(report.requantized, key=lambda item: -item[1])[:10]
        click.echo(f"{len(report.requantized)} fused tensor(s) requantized to one scale; added relative RMSE, worst first:")
        for name, error in worst:
            click.echo(f"  {name}: {error:.2e}")


@main.command("import", short_help="Bring a compressed-tensors FP8 checkpoint to hpu-fp8.")
@click.argument("src")
@click.argument("out", type=click.Path(path_type=Path))
@target_option()
@kv_cache_option()
@measurements_option(
    help="Statistics for the points the source lacks (q and softmax for FP8 attention; everything for dynamic checkpoints)."
)
@click.option(
    "--calibrate",
    "run_calibration",
    is_flag=True,
    help="Calibrate the dequantized model with the reference engine for the missing points.",
)
@dead_experts_option()
@shard_size_option()
@force_option()
@json_option()
def import_command(
    src: str,
    out: Path,
    target: str,
    kv_cache: str,
    measurement_paths: tuple[Path, ...],
    run_calibration: bool,
    dead_experts: str,
    max_shard_size: str,
    force: bool,
    as_json: bool,
) -> None:
    """Bring a compressed-tensors FP8 checkpoint (llm-compressor's, vLLM's) to hpu-fp8 v1 for Gaudi.

    Fuses q|k|v and gate|up, transposes to [in, out], and requantizes each fused group exactly once
    from the source's FP8 values to one tensor-wise scale (channel-wise for experts) at ±240 for
    gaudi2; prints the error that adds, worst first. Static input scales become act_amax (x 448).
    """
    from hpu_fp8_loader.conversion.compressed_tensors import compressed_tensors_scheme, import_compressed_tensors
    from hpu_fp8_loader.conversion.plan import ConvertOptions
    from hpu_fp8_loader.quality.calibrate import calibrate
    from hpu_fp8_loader.sources.measurements import load_measurements
    from hpu_fp8_loader.sources.resolve import resolve_checkpoint

    if run_calibration and measurement_paths:
        raise click.UsageError("--measurements and --calibrate both given: pass one source of activation statistics")
    options = ConvertOptions(
        target=target,
        kv_cache=kv_cache,
        dead_experts=dead_experts,
        max_shard_bytes=_parse_size(max_shard_size),
        force=force,
        workers=min(2, os.cpu_count() or 1),
    )
    with _errors():
        source = resolve_checkpoint(src)
        compressed_tensors_scheme(source)  # refused before a calibration runs
        extra = [load_measurements(p).measurements for p in measurement_paths]
        if run_calibration:
            extra.append(calibrate(source).measurements)
        result = import_compressed_tensors(source, out, options, extra)
    _warn_each(result.warnings)
    if as_json:
        emit_json({**dataclasses.asdict(result), "target": target, "kv_cache": kv_cache})
        return
    click.echo(f"{out}: hpu-fp8 v1 ({target}, KV cache {kv_cache}) from compressed-tensors ({result.scheme})")
    click.echo("relative RMSE the import adds to the source's own quantization, worst ten:")
    for name, error in result.errors[:10]:
        click.echo(f"  {name}: {error:.2e}")


@main.command("export-legacy", short_help="Write the legacy layout stock FastDeploy reads.")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@tp_option(help="Tensor parallelism it will be served at; >1 is refused where FastDeploy's v0 loader splits wrongly.")
@shard_size_option()
@force_option()
@json_option()
def export_legacy(src: Path, out: Path, tp: int, max_shard_size: str, force: bool, as_json: bool) -> None:
    """Write hpu-fp8 checkpoint SRC in the legacy layout stock FastDeploy reads without the hook.

    Serve it with FastDeploy's v0 loader (--load-choices default), without expert parallelism.
    Qwen2 only at TP 1: the v0 loader does not split its FP8 tensors (docs/fastdeploy.md section 5).
    """
    from hpu_fp8_loader.fastdeploy.legacy import export_legacy as run_export

    with _errors():
        report = run_export(src, out, tp, _parse_size(max_shard_size), force)
    _warn_each(report.warnings)
    if as_json:
        emit_json(report)
        return
    click.echo(
        f"{out}: legacy FastDeploy FP8 layout, {report.tensors} tensors; activation amax stored in bf16 as the layout does"
    )


@main.command(short_help="Move a checkpoint between ±448 (Gaudi3) and ±240.")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@target_option(
    default=None,
    required=True,
    show_default=False,
    help="gaudi2: rescale a ±448 checkpoint to ±240 (values x 0.5, weight scales x 2); gaudi3: relabel a ±240 one.",
)
@shard_size_option()
@force_option()
@json_option()
def retarget(src: Path, out: Path, target: str, max_shard_size: str, force: bool, as_json: bool) -> None:
    """Move hpu-fp8 checkpoint SRC between the Gaudi3 (±448) and Gaudi2 (±240) FP8 ranges."""
    from hpu_fp8_loader.conversion.retarget import retarget as run_retarget

    with _errors():
        report = run_retarget(src, out, target, _parse_size(max_shard_size), force)
    if as_json:
        emit_json(report)
        return
    click.echo(report.message)


@main.command("map", short_help="Write the parameters the hook hands one rank.")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@tp_option()
@click.option("--rank", type=RANK, default=0, show_default=True, help="Tensor-parallel rank to map.")
@ep_option()
@click.option("--ep-rank", type=RANK, default=0, show_default=True, help="Expert-parallel rank.")
@click.option(
    "--all-ranks", is_flag=True, help="Write FastDeploy's pre-sharded layout: OUT/rank{r}/ for every TP rank (legacy keys)."
)
@click.option(
    "-o", "--out", type=click.Path(path_type=Path), required=True, help="FILE.safetensors, or a directory with --all-ranks."
)
@force_option()
@json_option()
def map_command(
    checkpoint: Path, tp: int, rank: int, ep: int, ep_rank: int, all_ranks: bool, out: Path, force: bool, as_json: bool
) -> None:
    """Write exactly the parameters the hook hands FastDeploy on one rank (names, dtypes, values).

    Names are FastDeploy's parameter paths (e.g. ernie.layers.0.self_attn.qkv_proj.act_scale,
    ernie.layers.1.mlp.experts.up_gate_proj_weight); see the README for every name. With
    --all-ranks, writes rank{r}/ folders FastDeploy's pre-sharded path loads without splitting.
    """
    from hpu_fp8_loader.fastdeploy.mapping import Parallelism
    from hpu_fp8_loader.fastdeploy.rankfiles import write_presharded, write_rank_file

    with _errors():
        if all_ranks:
            if rank or ep_rank:
                raise click.UsageError("--all-ranks writes every rank; --rank and --ep-rank select one, so give one or the other")
            if ep > 1:
                raise click.UsageError("--all-ranks writes tensor-parallel ranks; expert parallelism is not pre-sharded")
            folders = write_presharded(checkpoint, out, tp, force)
            if as_json:
                emit_json({"out": out, "tp": tp, "rank_folders": folders})
            else:
                click.echo(f"{out}: {len(folders)} pre-sharded rank folder(s) in the legacy layout")
            return
        result = write_rank_file(checkpoint, out, Parallelism(tp, rank, ep, ep_rank), force)
    if as_json:
        emit_json({**dataclasses.asdict(result), "tp": tp, "rank": rank, "ep": ep, "ep_rank": ep_rank})
        return
    click.echo(
        f"{result.path}: {result.parameters} FastDeploy parameters of TP rank {rank}/{tp}, EP rank {ep_rank}/{ep}; "
        f"{result.bytes / 2**20:.1f} MiB"
    )


@main.command(short_help="Check that --load-choices hpu_fp8 works here.")
@click.argument("checkpoint", required=False)
@tp_option()
@ep_option()
@click.option("--revision", default=None, help="Revision of CHECKPOINT when it is a Hub repo id.")
@click.option(
    "--no-build", is_flag=True, help="Skip having FastDeploy build CHECKPOINT's model (at meta shapes, no weight memory)."
)
@json_option(help="Print every check as JSON.")
def doctor(checkpoint: str | None, tp: int, ep: int, revision: str | None, no_build: bool, as_json: bool) -> None:
    """Check that `--load-choices hpu_fp8` will work here: run it in FastDeploy's environment on the Gaudi box.

    Reports FastDeploy's version and commit and which MoE layout it builds, whether the hpu_fp8 entry
    point is installed and FD_PLUGINS names it, FD_ATTENTION_BACKEND, whether paddle and its intel_hpu
    device import, and whether FastDeploy's own get_model_loader hands hpu_fp8 to the hook. Given
    CHECKPOINT (a directory or a Hub repo id), also its quick validation, whether TP x EP can serve
    it, and FastDeploy building its model at meta shapes (no weight memory) with every parameter
    compared with what the hook fills. Every problem comes with its fix; exit 1 if any check fails.

    \b
    Examples:
      FD_PLUGINS=hpu_fp8 hpu-fp8 doctor
      hpu-fp8 doctor ./ERNIE-4.5-21B-A3B-hpu-fp8 --tp 2 --json
    """
    from hpu_fp8_loader.fastdeploy.doctor import doctor as run_doctor

    report = run_doctor(checkpoint, tp, ep, revision, build=not no_build)
    if as_json:
        emit_json(report.to_dict())
    else:
        for check in report.checks:
            click.echo(f"[{check.status:>4}] {check.name}: {check.detail}")
            if check.fix:
                click.echo(f"       fix: {check.fix}")
        click.echo("ready for --load-choices hpu_fp8" if report.ok else "not ready: fix the failed checks above")
    sys.exit(0 if report.ok else EXIT_INVALID)


@main.command(short_help="Size a deployment: bytes per rank, KV per token.")
@click.argument("model", type=click.Path(path_type=Path))
@tp_option()
@ep_option()
@kv_cache_option(help="KV-cache scheme to size for.")
@json_option(help="Print the plan as JSON.")
def plan(model: Path, tp: int, ep: int, kv_cache: str, as_json: bool) -> None:
    """Size a deployment from MODEL's config.json (a directory or the file): bytes per rank, KV per token.

    When the directory also holds the weights, the config's layer and expert counts are checked against them.
    """
    from hpu_fp8_loader.fastdeploy.plan import describe_model, plan_deployment

    with _errors():
        result = plan_deployment(describe_model(model), tp, ep, kv_cache)
    if as_json:
        emit_json(result.to_dict())
        return
    click.echo(f"{result.model_type}: {result.parameters / 1e9:.2f} B parameters; TP {tp} x EP {ep}; per rank:")
    for group, size in result.bytes_per_rank.items():
        if size:
            click.echo(f"  {group:<15}{size / 2**30:>10.3f} GiB")
    click.echo(f"  {'total':<15}{result.total_bytes_per_rank / 2**30:>10.3f} GiB")
    click.echo(
        f"KV cache per token per rank: {result.kv_bytes_per_token_per_rank:,} bytes ({kv_cache}); "
        f"{result.kv_bytes_per_token_per_rank_bf16:,} bytes in bf16"
    )


@main.command(short_help="Download and check an hpu-fp8 checkpoint.")
@click.argument("repo_id")
@click.option("--revision", default=None, help="Branch, tag or commit.")
@json_option()
def pull(repo_id: str, revision: str | None, as_json: bool) -> None:
    """Download (or find in the local cache) the hpu-fp8 checkpoint REPO_ID and check it.

    Checks the format version, every file's size and sha256 against the manifest, and the quick
    validation; prints the local path. HF_HUB_OFFLINE=1 uses the cache only; the token comes from
    huggingface_hub's usual sources (HF_TOKEN, `hf auth login`).
    """
    from hpu_fp8_loader.checks.load import load

    with _errors():
        loaded = load(repo_id, revision)
    _warn_each(loaded.warnings)
    qc = loaded.quantization_config
    if as_json:
        emit_json(
            {"path": loaded.path, "repo_id": repo_id, "revision": revision, "quantization_config": qc.model_dump(mode="json")}
        )
        return
    click.echo(f"{loaded.path}")
    click.echo(
        f"hpu-fp8 v{qc.format_version}, {qc.target.value} (±{qc.fp8_max:g}), KV cache {qc.kv_cache_scheme.value}: checked",
        err=True,
    )


@main.command(short_help="Record activation amax with the reference engine.")
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True, help="Measurement file to write (JSON).")
@click.option(
    "--dataset",
    default="builtin",
    show_default=True,
    help="builtin (Python's own documentation, offline; its last 10% is held out for eval), FILE.txt, or FILE.jsonl with a 'text' field.",
)
@click.option("--samples", default=32, type=COUNT, show_default=True, help="Windows of --seq-len tokens to run.")
@click.option(
    "--seq-len",
    default=256,
    type=COUNT,
    show_default=True,
    help="Tokens per window (at most max_position_embeddings).",
)
@click.option("--batch-size", default=4, type=COUNT, show_default=True, help="Windows per forward.")
@click.option(
    "--all-experts",
    is_flag=True,
    help="Also run every token through every expert, for the statistics only (never the forward): no expert stays "
    "uncalibrated, but expert ranges get wider and the expert work grows about E/k times.",
)
@click.option(
    "--fastdeploy-format",
    "fastdeploy_file",
    type=click.Path(path_type=Path),
    help="Also write the amax in FastDeploy's measurement-mode text format to this file.",
)
@force_option(help="Replace the -o (and --fastdeploy-format) file if it exists.")
@quiet_option()
@json_option()
def calibrate(
    model: Path,
    out: Path,
    dataset: str,
    samples: int,
    seq_len: int,
    batch_size: int,
    all_experts: bool,
    fastdeploy_file: Path | None,
    force: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Record activation amax at FastDeploy's measurement points with the float32 reference engine.

    MODEL is a BF16 checkpoint (Paddle or torch layout) or an hpu-fp8 one. Tokens come from its
    tokenizer.json when present (and the tokenizers library), else one token per UTF-8 byte.
    The output files are checked before any work and written atomically; an existing one is
    replaced only with --force, and never one inside MODEL.
    """
    from hpu_fp8_loader.quality.calibrate import calibrate as run_calibration
    from hpu_fp8_loader.quality.calibrate import check_outputs, write_fastdeploy_file
    from hpu_fp8_loader.sources.measurements import write_measurements

    if fastdeploy_file and fastdeploy_file.resolve() == out.resolve():
        raise click.BadParameter(f"{fastdeploy_file} is also the -o file; name another", param_hint="--fastdeploy-format")
    with _errors():
        check_outputs(model, dataset, [out, *([fastdeploy_file] if fastdeploy_file else [])], force)
        with progress_bar("calibrate", quiet or as_json, unit="tok") as bar:
            result = run_calibration(model, dataset, samples, seq_len, batch_size, all_experts, progress=bar.update)
        write_measurements(out, result.measurements, replace=force)
        if fastdeploy_file:
            write_fastdeploy_file(fastdeploy_file, result.measurements, replace=force)
    if result.dead_experts:
        listing = ", ".join(f"layer {layer} expert {e}" for layer, e in result.dead_experts)
        log.warning(
            f"no calibration token was routed to {len(result.dead_experts)} expert(s): {listing}. "
            "Calibrate with more data or --all-experts, or convert with --dead-experts sibling-max."
        )
    if as_json:
        emit_json(
            {
                "out": out,
                "fastdeploy_file": fastdeploy_file,
                "points": len(result.measurements.amax),
                "tokens": result.tokens,
                "tokenizer": result.tokenizer,
                "seconds": result.seconds,
                "dead_experts": [{"layer": layer, "expert": e} for layer, e in result.dead_experts],
            }
        )
        return
    click.echo(
        f"{out}: {len(result.measurements.amax)} points from {result.tokens:,} tokens ({result.tokenizer} tokens), "
        f"{result.tokens / max(result.seconds, 1e-9):,.0f} tokens/s"
    )


@main.command("eval", short_help="Compare emulated Gaudi FP8 with the BF16 model.")
@click.argument("bf16_source", type=click.Path(path_type=Path))
@click.argument("fp8_checkpoint", type=click.Path(path_type=Path))
@click.option(
    "--dataset",
    default="builtin",
    show_default=True,
    help="builtin uses its held-out part (never the calibration text), or FILE.txt/.jsonl.",
)
@click.option("--samples", type=COUNT, default=8, show_default=True, help="Windows of --seq-len tokens.")
@click.option("--seq-len", type=click.IntRange(min=2), default=128, show_default=True)
@tp_option(help="Emulate this tensor parallelism (bf16 partial sums reduced as FastDeploy would).")
@click.option("--weights-only", "only_weights", is_flag=True, help="Ablation row: FP8 weights, float32 activations.")
@click.option("--no-kv-fp8", "only_no_kv", is_flag=True, help="Ablation row: FP8 linears, BF16 attention and KV cache.")
@click.option(
    "--decode-attention",
    is_flag=True,
    help="Quantize unnormalised exp scores as FastDeploy's decode path does (default: prefill form).",
)
@json_option(help="Print the report as JSON.")
def eval_command(
    bf16_source: Path,
    fp8_checkpoint: Path,
    dataset: str,
    samples: int,
    seq_len: int,
    tp: int,
    only_weights: bool,
    only_no_kv: bool,
    decode_attention: bool,
    as_json: bool,
) -> None:
    """Compare the emulated FP8 model (Gaudi arithmetic, FastDeploy's parameters) with the BF16 model.

    Prints top-1 agreement, mean KL(bf16 || fp8), relative logit RMSE and both perplexities. Without
    --weights-only / --no-kv-fp8 every row is shown; with them, the FP8 row and the rows asked for.
    """
    from hpu_fp8_loader.quality.evaluate import evaluate

    variants = ("fp8", *(["weights-only"] if only_weights else []), *(["no-kv-fp8"] if only_no_kv else []))
    if not (only_weights or only_no_kv):
        variants = ("fp8", "weights-only", "no-kv-fp8")
    with _errors():
        report = evaluate(bf16_source, fp8_checkpoint, dataset, samples, seq_len, tp, variants, decode_attention)
    if as_json:
        emit_json(report.to_dict())
    else:
        print_eval(report)
    _warn_each(report.warnings)


def print_eval(report) -> None:
    click.echo(f"{report.tokens:,} held-out tokens ({report.dataset}), TP {report.tp}")
    click.echo(f"{'variant':<14}{'top-1 agree':>12}{'mean KL':>10}{'logit RMSE':>12}{'ppl bf16':>10}{'ppl fp8':>10}{'ppl +%':>8}")
    for r in report.rows:
        click.echo(
            f"{r.variant:<14}{100 * r.top1_agreement:>11.2f}%{r.mean_kl:>10.4f}{r.relative_logit_rmse:>12.4f}"
            f"{r.perplexity_bf16:>10.3f}{r.perplexity_fp8:>10.3f}{100 * r.perplexity_increase:>7.2f}%"
        )


@main.command(short_help="Convert, validate, evaluate and publish to the Hub.")
@click.argument("src")
@click.option("--repo-id", required=True, help="Hub repository to publish to (ORG/NAME).")
@measurements_option()
@click.option(
    "--calibrate", "run_calibration", is_flag=True, help="Calibrate with the reference engine on the built-in text instead."
)
@click.option("--base-model", default=None, help="Hub id of the BF16 model (default: SRC when it is a Hub id).")
@click.option("--license", "license_", default=None, help="License for the card (default: the source card's).")
@target_option()
@kv_cache_option()
@dead_experts_option()
@click.option("--eval", "force_eval", is_flag=True, help="Evaluate even above 3 B parameters (slow on CPU).")
@click.option("--skip-eval", is_flag=True, help="Never evaluate; the card says no evaluation was run.")
@click.option("--private", is_flag=True, help="Create the repository private.")
@click.option("--revision", default=None, help="Branch to push to (created if missing).")
@click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing to the branch.")
@click.option("--commit-message", default=None)
@click.option(
    "--work-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Keep the staged checkpoint and card here (default: a temporary directory).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Do everything locally, print every file with size and sha256 and the planned commit; touch nothing remote.",
)
@json_option()
def push(
    src: str,
    repo_id: str,
    measurement_paths: tuple[Path, ...],
    run_calibration: bool,
    base_model: str | None,
    license_: str | None,
    target: str,
    kv_cache: str,
    dead_experts: str,
    force_eval: bool,
    skip_eval: bool,
    private: bool,
    revision: str | None,
    create_pr: bool,
    commit_message: str | None,
    work_dir: Path | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Convert SRC, validate, evaluate, write the model card and upload to the Hugging Face Hub, then verify.

    A checkpoint that fails validation is never uploaded. After the upload every remote file's size and
    identifier (LFS sha256, or git blob id) is compared with the local manifest; a mismatch exits 1.
    Re-running after an interrupted upload resumes it. The token comes from huggingface_hub's usual
    sources (HF_TOKEN, `hf auth login`) and is never printed.
    """
    from hpu_fp8_loader.conversion.plan import ConvertOptions
    from hpu_fp8_loader.hub.publish import PushOptions
    from hpu_fp8_loader.hub.publish import push as run_push

    options = PushOptions(
        repo_id=repo_id,
        measurements=measurement_paths,
        calibrate=run_calibration,
        license=license_,
        base_model=base_model,
        private=private,
        revision=revision,
        create_pr=create_pr,
        commit_message=commit_message,
        work_dir=work_dir,
        dry_run=dry_run,
        evaluation="skip" if skip_eval else ("always" if force_eval else "auto"),
        convert=ConvertOptions(target=target, kv_cache=kv_cache, dead_experts=dead_experts, workers=1),
    )
    with _errors():
        result = run_push(src, options, say=_say(as_json))
    if as_json:
        emit_json(
            {
                "repo_id": repo_id,
                "revision": revision,
                "dry_run": dry_run,
                "private": private,
                "checkpoint": result.checkpoint,
                "files": result.files,
                "evaluation": result.evaluation.to_dict() if result.evaluation else None,
                "commit_url": result.commit_url,
                "pull_request_url": result.pull_request_url,
            }
        )
        return
    if dry_run:
        click.echo(
            f"dry run: would commit {len(result.files)} file(s) to {repo_id}"
            f"{'@' + revision if revision else ''}{' as a pull request' if create_pr else ''}"
            f"{' (private)' if private else ''}: {commit_message or 'Upload hpu-fp8 checkpoint'}"
        )
        for f in result.files:
            click.echo(f"  {f.name:<42}{f.size:>14,}  {f.sha256}")
        return
    if result.pull_request_url:
        click.echo(f"{repo_id}: pull request opened and verified ({len(result.files)} files): {result.pull_request_url}")
    else:
        click.echo(f"{repo_id}: published and verified ({len(result.files)} files): {result.commit_url}")


@main.command(short_help="The main job on a shipped tiny model, end to end.")
@click.option(
    "--out",
    "work_dir",
    default="hpu-fp8-demo",
    show_default=True,
    type=click.Path(path_type=Path),
    help="Working directory (replaced on each run; a directory the demo did not make needs --force).",
)
@click.option(
    "--model",
    type=click.Choice(["ernie-moe-bytes", "qwen2-bytes"]),
    default="ernie-moe-bytes",
    show_default=True,
    help="Which shipped tiny trained model to use.",
)
@kv_cache_option()
@force_option(help="Replace --out even if the demo did not make it.")
@json_option()
def demo(work_dir: Path, model: str, kv_cache: str, force: bool, as_json: bool) -> None:
    """Run the main job on the embedded default: calibrate, convert, validate and evaluate a tiny trained model."""
    from hpu_fp8_loader.cli.demo import run_demo

    with _errors():
        result = run_demo(work_dir, model, kv_cache, say=_say(as_json), force=force)
    if as_json:
        emit_json(
            {
                "source": result.source,
                "measurements": result.measurements,
                "checkpoint": result.checkpoint,
                "validation": result.report.to_dict(),
                "evaluation": result.evaluation.to_dict(),
            }
        )
    else:
        print_eval(result.evaluation)
    _warn_each(result.evaluation.warnings)
    sys.exit(0 if result.report.valid else EXIT_INVALID)


@main.command(short_help="Print the JSON Schema of a format.")
@click.argument("what", type=click.Choice(["quantization-config", "measurements"]))
@json_option(help="Accepted for uniformity: the schema is JSON anyway.")
def schema(what: str, as_json: bool) -> None:
    """Print the JSON Schema of the quantization_config object or of the measurement file."""
    from hpu_fp8_loader.spec.config import QuantizationConfig
    from hpu_fp8_loader.spec.measurements import Measurements

    model = QuantizationConfig if what == "quantization-config" else Measurements
    emit_json(model.model_json_schema())

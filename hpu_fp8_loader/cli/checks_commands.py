"""Commands that check or describe a checkpoint: validate, inspect, pull, schema."""

from __future__ import annotations

import sys

import click

from hpu_fp8_loader.cli.group import (
    EXIT_INVALID,
    EXIT_UNREADABLE,
    fail,
    json_option,
    main,
    quiet_option,
    revision_option,
    user_errors,
    warn_each,
)
from hpu_fp8_loader.console import Progress, emit_json, human_bytes
from hpu_fp8_loader.errors import HpuFp8Error


@main.command(short_help="Check a checkpoint against every rule of the spec.")
@click.argument("checkpoint")
@revision_option("CHECKPOINT")
@click.option(
    "--quick",
    is_flag=True,
    help="Check headers, scales, index and file sizes only (seconds on any size); skip the weight scan "
    "(with --hashes the values are checked anyway, on the same read as the sha256).",
)
@click.option("--hashes", is_flag=True, help="Also compare every file's sha256 with hpu_fp8_manifest.json (reads every byte).")
@json_option(help="Print the report as JSON.")
@quiet_option()
def validate(checkpoint: str, revision: str | None, quick: bool, hashes: bool, as_json: bool, quiet: bool) -> None:
    """Check CHECKPOINT against every rule of the hpu-fp8 v1 spec.

    CHECKPOINT is a directory or a Hub repo id ORG/NAME (a local path wins). A repo id is downloaded whole,
    even for --quick (its scales live inside the shards), or found in the local cache offline.

    Exit status: 0 valid, 1 invalid (every violation is listed), 2 unreadable (no directory,
    config.json missing or not JSON, not an hpu-fp8 checkpoint, unknown format_version, a file
    the system cannot read, a repo id the Hub or the cache cannot provide).

    \b
    Examples:
      # Every rule, every weight scanned
      hpu-fp8 validate ernie-fp8

    \b
      # Headers, scales, index and file sizes only: seconds on any size
      hpu-fp8 validate ernie-fp8 --quick

    \b
      # Also every file's sha256 against the manifest, the report as JSON
      hpu-fp8 validate ernie-fp8 --hashes --json

    \b
      # A tagged release on the Hub (HF_HUB_OFFLINE=1: from the local cache only)
      hpu-fp8 validate you/ERNIE-4.5-21B-A3B-hpu-fp8 --revision v1.0
    """
    from hpu_fp8_loader.checks.validate import validate as run_validation

    try:
        with Progress("scanning weights", quiet=quiet or quick, bar=not as_json) as progress:
            report = run_validation(checkpoint, full=not quick, hashes=hashes, progress=progress.update, revision=revision)
    except (HpuFp8Error, OSError) as exc:  # OSError: permissions, I/O errors; named like user_errors() names them
        message = str(exc) if isinstance(exc, HpuFp8Error) else f"{exc.filename or checkpoint}: {exc.strerror or exc}"
        if as_json:  # the report a script reads, and the one line a person reads
            emit_json({"root": checkpoint, "valid": False, "unreadable": message})
        fail(message, EXIT_UNREADABLE)
    warn_each(report.warnings)  # stderr, as every command's warnings; the JSON report holds them too
    if as_json:
        emit_json(report.to_dict())
    else:
        for v in report.violations:
            click.echo(f"[{v.rule}] {v.where}: {v.message}")
        verdict = "valid" if report.valid else f"INVALID ({len(report.violations)} violation(s))"
        click.echo(f"{checkpoint}: {verdict} hpu-fp8 v1 checkpoint; {report.tensors} tensors, {report.mode} check")
    sys.exit(0 if report.valid else EXIT_INVALID)


@main.command(short_help="Summarise a checkpoint: roles, dtypes, scales.")
@click.argument("checkpoint")
@revision_option("CHECKPOINT")
@json_option(help="Print the summary as JSON.")
def inspect(checkpoint: str, revision: str | None, as_json: bool) -> None:
    """Summarise CHECKPOINT: layers, roles, dtypes, bytes, scale ranges, saturated share.

    CHECKPOINT is a directory or a Hub repo id ORG/NAME (a local path wins). A repo id is downloaded whole
    (every fp8 weight is read to count saturated values), or found in the local cache offline.

    \b
    Examples:
      # One table row per role: tensors, size, dtypes, weight and act scale ranges, share at ±max
      hpu-fp8 inspect ernie-fp8

    \b
      # The same summary as one JSON document
      hpu-fp8 inspect ernie-fp8 --json

    \b
      # A checkpoint on the Hub, at a given branch, tag or commit
      hpu-fp8 inspect you/ERNIE-4.5-21B-A3B-hpu-fp8 --revision v1.0
    """
    from hpu_fp8_loader.checks.inspection import inspect_checkpoint

    with user_errors(EXIT_UNREADABLE):
        result = inspect_checkpoint(checkpoint, revision)
    if as_json:
        emit_json(result.to_dict())
        return
    _print_inspection(result)


def _print_inspection(result) -> None:
    click.echo(
        f"{result.root}: {result.model_type}, {result.layers} layers"
        + (f" ({len(result.moe_layers)} MoE, {result.experts} experts)" if result.experts else "")
        + f"; fp8_max {result.fp8_max:g} ({result.target}); KV cache {result.kv_cache_scheme}; {human_bytes(result.total_bytes)}"
    )
    click.echo(
        f"{'role':<16}{'tensors':>8}{'size':>10}  {'dtypes':<14}{'weight scale min/med/max':<32}{'act scale min/med/max':<32}{'at ±max':>10}"
    )

    def fmt(stats: dict | None) -> str:
        return "-" if stats is None else f"{stats['min']:.3g}/{stats['median']:.3g}/{stats['max']:.3g}"

    for role, s in result.roles.items():
        sat = "-" if s.saturated_share is None else f"{100 * s.saturated_share:.4f}%"
        click.echo(
            f"{role:<16}{s.tensors:>8}{human_bytes(s.bytes):>10}  {','.join(s.dtypes):<14}{fmt(s.weight_scale):<32}{fmt(s.act_scale):<32}{sat:>10}"
        )


@main.command(short_help="Download and check an hpu-fp8 checkpoint.")
@click.argument("repo_id")
@revision_option("REPO_ID")
@json_option()
def pull(repo_id: str, revision: str | None, as_json: bool) -> None:
    """Download (or find in the local cache) the hpu-fp8 checkpoint REPO_ID and check it.

    Checks the format version, every file's size and sha256 against the manifest, and the quick
    validation; prints the local path. HF_HUB_OFFLINE=1 uses the cache only; the token comes from
    huggingface_hub's usual sources (HF_TOKEN, `hf auth login`).

    \b
    Examples:
      # Download and check every file; prints the local path
      hpu-fp8 pull you/ERNIE-4.5-21B-A3B-hpu-fp8

    \b
      # A tagged release, the path and quantization_config as JSON
      hpu-fp8 pull you/ERNIE-4.5-21B-A3B-hpu-fp8 --revision v1.0 --json
    """
    from hpu_fp8_loader.checks.load import load

    with user_errors():
        loaded = load(repo_id, revision)
    warn_each(loaded.warnings)
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


@main.command(short_help="Print the JSON Schema of a format.")
@click.argument("what", type=click.Choice(["quantization-config", "measurements"]))
@json_option(help="Accepted for uniformity: the schema is JSON anyway.")
def schema(what: str, as_json: bool) -> None:
    """Print the JSON Schema of the quantization_config object or of the measurement file.

    \b
    Examples:
      # The schema of config.json's quantization_config object
      hpu-fp8 schema quantization-config

    \b
      # The schema of a measurement file (what calibrate writes and convert --measurements reads)
      hpu-fp8 schema measurements
    """
    from hpu_fp8_loader.spec.config import QuantizationConfig, json_schema
    from hpu_fp8_loader.spec.measurements import Measurements

    model = QuantizationConfig if what == "quantization-config" else Measurements
    emit_json(json_schema(model))

"""Commands that write hpu-fp8 checkpoints: convert, import, import-legacy, retarget."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import click

from hpu_fp8_loader.cli.group import (
    BUILTIN_CALIBRATION_TEXT,
    COUNT,
    DEFAULT_WORKERS,
    EnumChoice,
    calibration_given_alone,
    calibration_options,
    dead_experts_option,
    force_option,
    json_option,
    keep_bf16_option,
    kv_cache_option,
    main,
    measurements_option,
    parse_size,
    quiet_option,
    rebalance_option,
    revision_option,
    shard_size_option,
    target_option,
    user_errors,
    warn_each,
)
from hpu_fp8_loader.console import Progress, emit_json, human_bytes, human_rate
from hpu_fp8_loader.spec.choices import Bf16Group, DeadExpertPolicy, KvCacheScheme, Rebalance, ScaleRounding, Target

if TYPE_CHECKING:
    from hpu_fp8_loader.spec.measurements import Measurements


@main.command(short_help="Convert a BF16 checkpoint to hpu-fp8 v1.")
@click.argument("src")
@click.argument("out", type=click.Path(path_type=Path))
@measurements_option(
    help="Activation amax: an hpu-fp8 measurement file (JSON, whatever its name) or a directory of them (each file one "
    "source, in name order), or FastDeploy's model_measurement.txt, its per-rank model_measurement_{rank}.txt set, or "
    "a directory holding them. Repeat to combine sources (max per point). Or --calibrate.",
)
@click.option(
    "--calibrate",
    "run_calibration",
    is_flag=True,
    help="Calibrate SRC with the reference engine first (the dataset options below), instead of --measurements. An "
    "interrupted run reuses the calibration it left in OUT.partial.",
)
@calibration_options(BUILTIN_CALIBRATION_TEXT)
@keep_bf16_option()
@target_option()
@kv_cache_option()
@click.option(
    "--scale-rounding",
    type=EnumChoice(ScaleRounding),
    default="none",
    show_default=True,
    help="pow2 rounds every scale up to a power of two.",
)
@dead_experts_option()
@rebalance_option()
@click.option("--workers", type=COUNT, default=DEFAULT_WORKERS, show_default=True, help="Worker processes.")
@shard_size_option()
@revision_option("SRC")
@force_option()
@quiet_option()
@json_option()
@click.pass_context
def convert(
    ctx: click.Context,
    src: str,
    out: Path,
    measurement_paths: tuple[Path, ...],
    run_calibration: bool,
    calibration: dict,
    keep_bf16: tuple[Bf16Group, ...],
    target: Target,
    kv_cache: KvCacheScheme,
    scale_rounding: ScaleRounding,
    dead_experts: DeadExpertPolicy,
    rebalance: Rebalance,
    workers: int,
    max_shard_size: str,
    revision: str | None,
    force: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Convert the BF16 checkpoint SRC into an hpu-fp8 v1 checkpoint at OUT.

    SRC is a directory (Paddle or Hugging Face torch layout; BF16, FP16, FP32, or compressed-tensors FP8), a tiny model
    shipped with hpu-fp8 (ernie-moe-bytes, qwen2-bytes, qwen3-bytes, qwen3-moe-bytes) or a Hub repo id (the local cache is used offline), tried in
    that order. Activation statistics come from --measurements files, or from a calibration of SRC with --calibrate
    (as `hpu-fp8 calibrate` runs it). OUT keeps them as hpu_fp8_measurements.json. Output is written into OUT.partial
    and renamed when complete; after an interruption the same command resumes, reusing the calibration and the
    finished shards whose sha256 still matches.

    \b
    Examples:
      # One step from the Hub: calibrate on 64 windows of the built-in text, then convert
      hpu-fp8 convert baidu/ERNIE-4.5-21B-A3B-Paddle ernie-fp8 --calibrate --samples 64

    \b
      # The amax `hpu-fp8 calibrate` wrote, the routed experts kept in BF16 (no moe_quant_type)
      hpu-fp8 convert ./ERNIE-4.5-21B-A3B-Paddle ernie-fp8 --measurements m.json --keep-bf16 experts

    \b
      # FastDeploy's per-rank measurement files in fd-amax/, plus our own for Qwen2's MLP
      hpu-fp8 convert ./Qwen2-7B-Instruct qwen2-fp8 --measurements fd-amax/ --measurements mlp.json

    \b
      # For Gaudi3: the FP8 range ±448 instead of the ±240 FastDeploy serves on Gaudi2
      hpu-fp8 convert ./ERNIE-4.5-21B-A3B-PT ernie-g3 --measurements amax.json --target gaudi3
    """
    from hpu_fp8_loader.conversion.convert import convert as run_convert
    from hpu_fp8_loader.conversion.convert import convert_steps
    from hpu_fp8_loader.conversion.plan import ConvertOptions
    from hpu_fp8_loader.engine.layer_major import layer_steps
    from hpu_fp8_loader.quality.calibrate import CalibrationOptions, one_source_of_statistics
    from hpu_fp8_loader.quality.quantize import quantize
    from hpu_fp8_loader.sources.resolve import resolve_checkpoint

    calibration_given_alone(ctx, run_calibration)
    with user_errors():
        one_source_of_statistics(bool(measurement_paths), run_calibration)
        options = ConvertOptions(
            target,
            kv_cache,
            scale_rounding,
            parse_size(max_shard_size),
            force,
            workers,
            dead_experts,
            keep_bf16=frozenset(keep_bf16),
            rebalance=rebalance,
        )
        source = resolve_checkpoint(src, revision)
        with (
            Progress("calibrate", quiet=quiet or not run_calibration, bar=not as_json, unit="step") as steps,
            Progress("convert", quiet=quiet, bar=not as_json) as progress,
        ):
            show = convert_steps(progress)
            if run_calibration:
                quantized = quantize(source, out, CalibrationOptions(**calibration), options, show, layer_steps(steps))
                result, calibrated = quantized.conversion, quantized.calibration
            else:
                result, calibrated = run_convert(source, out, _measurement_sets(measurement_paths), options, show), None
    if calibrated is not None:
        warn_each(calibrated.warnings)
    if as_json:
        emit_json(
            {
                **dataclasses.asdict(result),
                "ratio": result.ratio,
                "target": target,
                "kv_cache": kv_cache,
                "keep_bf16": sorted(options.keep_bf16),
                "calibration": None
                if calibrated is None
                else {"tokens": calibrated.tokens, "seconds": calibrated.seconds, "warnings": calibrated.warnings},
            }
        )
        return
    if calibrated is not None:
        calibration_note = f"; calibrated on {calibrated.tokens:,} tokens ({calibrated.tokenizer}) in {calibrated.seconds:.1f} s"
    else:
        calibration_note = "; reused the calibration an interrupted run left" if run_calibration else ""
    kept = f"; kept in BF16: {', '.join(sorted(options.keep_bf16))}" if options.keep_bf16 else ""
    filled = f"; {len(result.filled_experts)} dead expert(s) given their siblings' max" if result.filled_experts else ""
    reused = f"; resumed, {result.reused_shards} shard(s) reused" if result.reused_shards else ""
    click.echo(
        f"{out}: hpu-fp8 v1 ({target.value}, KV cache {kv_cache.value}) from {result.layout.value} layout; "
        f"{result.tensors_quantized} tensors quantized, {result.tensors_kept} kept; "
        f"{human_bytes(result.bytes_in)} -> {human_bytes(result.bytes_out)} ({result.ratio:.3f}); "
        f"{result.seconds:.1f} s, {human_rate(result.bytes_in, result.seconds)}{filled}{reused}{kept}{calibration_note}"
    )


@main.command("import", short_help="Bring a compressed-tensors or block FP8 checkpoint in.")
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
    help="Calibrate the dequantized model with the reference engine for the missing points (the dataset options below).",
)
@calibration_options(BUILTIN_CALIBRATION_TEXT)
@dead_experts_option()
@shard_size_option()
@revision_option("SRC")
@force_option()
@json_option()
@quiet_option()
@click.pass_context
def import_command(
    ctx: click.Context,
    src: str,
    out: Path,
    target: Target,
    kv_cache: KvCacheScheme,
    measurement_paths: tuple[Path, ...],
    run_calibration: bool,
    calibration: dict,
    dead_experts: DeadExpertPolicy,
    max_shard_size: str,
    revision: str | None,
    force: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Bring a compressed-tensors FP8 checkpoint (llm-compressor's, vLLM's) or a block-wise FP8 one (Qwen3-*-FP8,
    DeepSeek; FastDeploy's Paddle block_wise_fp8, ERNIE-4.5-300B-A47B-FP8-Paddle) to hpu-fp8 v1 for Gaudi.

    Fuses q|k|v and gate|up, transposes to [in, out], and requantizes each fused group exactly once
    from the source's FP8 values (block-wise ones dequantized block by block) to one tensor-wise scale
    (channel-wise for experts) at ±240 for gaudi2; prints the error that adds, worst first. Static
    input scales become act_amax (x 448); block-wise checkpoints have none (--measurements or --calibrate).

    \b
    Examples:
      # A dynamic-activation checkpoint: calibrate every point, attention and KV cache in BF16
      hpu-fp8 import ./Qwen2-7B-Instruct-FP8-dynamic qwen2-fp8 --calibrate --kv-cache none

    \b
      # Static input scales become act_amax; the measurement file adds q and the softmax
      hpu-fp8 import ./Qwen2-7B-Instruct-FP8 qwen2-fp8 --measurements amax.json

    \b
      # Keep the source's ±448 range for Gaudi3
      hpu-fp8 import ./Qwen2-7B-Instruct-FP8 qwen2-g3 --target gaudi3 --measurements amax.json

    \b
      # A block-wise FP8 release: calibrate the dequantized blocks, then requantize
      hpu-fp8 import ./ERNIE-4.5-300B-A47B-FP8-Paddle ernie-300b-fp8 --calibrate --samples 64
    """
    from hpu_fp8_loader.conversion.block_fp8 import import_block_fp8
    from hpu_fp8_loader.conversion.compressed_tensors import (
        CompressedTensorsImportResult,
        compressed_tensors_scheme,
        import_compressed_tensors,
    )
    from hpu_fp8_loader.conversion.convert import convert_steps
    from hpu_fp8_loader.conversion.plan import ConvertOptions
    from hpu_fp8_loader.engine.layer_major import layer_steps
    from hpu_fp8_loader.io.checkpoint import read_config
    from hpu_fp8_loader.quality.calibrate import CalibrationOptions, one_source_of_statistics
    from hpu_fp8_loader.sources.block_fp8 import block_fp8_scheme
    from hpu_fp8_loader.sources.resolve import resolve_checkpoint

    calibration_given_alone(ctx, run_calibration)
    options = ConvertOptions(
        target=target,
        kv_cache=kv_cache,
        dead_experts=dead_experts,
        max_shard_bytes=parse_size(max_shard_size),
        force=force,
        workers=DEFAULT_WORKERS,
    )
    with user_errors():
        one_source_of_statistics(bool(measurement_paths), run_calibration, required=False)
        source = resolve_checkpoint(src, revision)
        extra = _measurement_sets(measurement_paths)
        block = block_fp8_scheme(read_config(Path(source)), Path(source) / "config.json")
        if block is None:
            compressed_tensors_scheme(source)  # a scheme that does not import is refused before the calibration runs
        if run_calibration:
            with Progress("calibrate", quiet=quiet, bar=not as_json, unit="step") as progress:
                calibrated = CalibrationOptions(**calibration).run(source, progress=layer_steps(progress))
            warn_each(calibrated.warnings)
            extra.append(calibrated.measurements)
        run_import = import_compressed_tensors if block is None else import_block_fp8
        with Progress("import", quiet=quiet, bar=not as_json) as progress:
            result = run_import(source, out, options, extra, convert_steps(progress))
    if isinstance(result, CompressedTensorsImportResult):  # what a block import leaves out, the converter has logged
        warn_each(result.warnings)
    if as_json:
        emit_json({**dataclasses.asdict(result), "target": target, "kv_cache": kv_cache})
        return
    origin = "compressed-tensors" if block is None else "a block-wise FP8 checkpoint"
    click.echo(f"{out}: hpu-fp8 v1 ({target.value}, KV cache {kv_cache.value}) from {origin} ({result.scheme})")
    click.echo("relative RMSE the import adds to the source's own quantization, worst ten:")
    for name, error in result.errors[:10]:
        click.echo(f"  {name}: {error:.2e}")


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
@quiet_option()
def import_legacy(
    src: Path,
    out: Path,
    measurement_paths: tuple[Path, ...],
    dead_experts: DeadExpertPolicy,
    max_shard_size: str,
    force: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Bring a checkpoint of FastDeploy's legacy converter (Model_convert.py) into hpu-fp8 v1.

    Resolves the legacy activation_scale's two meanings (raw amax for self_attn keys, amax/240
    elsewhere), widens the older converter's tensor-wise expert scales to exact channel-wise ones,
    and fuses Hugging Face-named Qwen2 tensors (requantizing once where their scales differ).

    \b
    Examples:
      # An ERNIE MoE written by FastDeploy's Model_convert.py
      hpu-fp8 import-legacy ./ERNIE-4.5-21B-A3B-fp8-legacy ernie-fp8

    \b
      # A legacy Qwen2, with our measurements for the MLP points FastDeploy never measures
      hpu-fp8 import-legacy ./Qwen2-7B-fp8-legacy qwen2-fp8 --measurements qwen2-mlp.json

    \b
      # Experts without a positive amax get the max of their layer's other experts
      hpu-fp8 import-legacy ./ERNIE-4.5-21B-A3B-fp8-legacy ernie-fp8 --dead-experts sibling-max
    """
    from hpu_fp8_loader.conversion.legacy_import import import_legacy as run_import

    with user_errors(), Progress("import-legacy", quiet=quiet, bar=not as_json) as progress:
        extra = _measurement_sets(measurement_paths)
        report = run_import(src, out, extra, dead_experts, parse_size(max_shard_size), force, progress.show)
    warn_each(report.warnings)
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
@quiet_option()
def retarget(src: Path, out: Path, target: Target, max_shard_size: str, force: bool, as_json: bool, quiet: bool) -> None:
    """Move hpu-fp8 checkpoint SRC between the Gaudi3 (±448) and Gaudi2 (±240) FP8 ranges.

    \b
    Examples:
      # A ±448 checkpoint to the ±240 FastDeploy serves on Gaudi2
      hpu-fp8 retarget ernie-g3 ernie-fp8 --target gaudi2

    \b
      # Relabel a ±240 checkpoint for Gaudi3, replacing an earlier OUT
      hpu-fp8 retarget ernie-fp8 ernie-fp8-gaudi3 --target gaudi3 --force
    """
    from hpu_fp8_loader.conversion.retarget import retarget as run_retarget

    with user_errors(), Progress("retarget", quiet=quiet, bar=not as_json) as progress:
        report = run_retarget(src, out, target, parse_size(max_shard_size), force, progress.show)
    if as_json:
        emit_json(report)
        return
    click.echo(report.message)


def _measurement_sets(paths: tuple[Path, ...]) -> list[Measurements]:
    """Every measurement set the --measurements paths name (a directory of JSON files: one per file, in name
    order), each sign of a stale or dummy FastDeploy file shown as a warning."""
    from hpu_fp8_loader.sources.measurements import load_measurement_sets

    loaded = [item for path in paths for item in load_measurement_sets(path)]
    for item in loaded:
        warn_each(item.warnings)
    return [item.measurements for item in loaded]

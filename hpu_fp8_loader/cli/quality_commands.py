"""Commands of calibration and accuracy: the demo, calibrate, eval."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hpu_fp8_loader.cli.group import (
    COUNT,
    EXIT_INVALID,
    force_option,
    json_option,
    kv_cache_option,
    log,
    main,
    quiet_option,
    revision_option,
    say,
    tp_option,
    user_errors,
    warn_each,
)
from hpu_fp8_loader.console import emit_json, progress_bar
from hpu_fp8_loader.spec.choices import KvCacheScheme


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
def demo(work_dir: Path, model: str, kv_cache: KvCacheScheme, force: bool, as_json: bool) -> None:
    """Run the main job on the embedded default: calibrate, convert, validate and evaluate a tiny trained model.

    \b
    Examples:
      # The tiny trained ERNIE MoE end to end in ./hpu-fp8-demo, printing the accuracy table
      hpu-fp8 demo

    \b
      # The tiny Qwen2 with attention and KV cache left in BF16, in another directory
      hpu-fp8 demo --model qwen2-bytes --kv-cache none --out qwen2-demo

    \b
      # Replace a directory the demo did not make, and print everything as one JSON document
      hpu-fp8 demo --out /tmp/hpu-fp8-demo --force --json
    """
    from hpu_fp8_loader.cli.demo import run_demo

    with user_errors():
        result = run_demo(work_dir, model, kv_cache, say=say(as_json), force=force)
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
    warn_each(result.evaluation.warnings)
    sys.exit(0 if result.report.valid else EXIT_INVALID)


@main.command(short_help="Record activation amax with the reference engine.")
@click.argument("model")
@revision_option("MODEL")
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
    model: str,
    revision: str | None,
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

    MODEL is a BF16 checkpoint (Paddle or torch layout) or an hpu-fp8 one: a directory, or a Hub repo id
    ORG/NAME (its weights, configs and tokenizer files downloaded, or found in the local cache offline; a local
    path wins). Tokens come from its
    tokenizer.json when present (and the tokenizers library), else one token per UTF-8 byte.
    The output files are checked before any work and written atomically; an existing one is
    replaced only with --force, and never one inside MODEL.

    \b
    Examples:
      # ERNIE MoE on the built-in text: 64 windows of 512 tokens
      hpu-fp8 calibrate ./ERNIE-4.5-21B-A3B-PT -o measurements.json --samples 64 --seq-len 512

    \b
      # Your own text, with every expert calibrated (no dead experts left for convert)
      hpu-fp8 calibrate ./ERNIE-4.5-21B-A3B-PT -o ernie.json --dataset corpus.jsonl --all-experts

    \b
      # Qwen2, also in FastDeploy's measurement text format, replacing earlier files
      hpu-fp8 calibrate ./Qwen2-7B-Instruct -o qwen2.json --fastdeploy-format qwen2.txt --force

    \b
      # A Hub model at a pinned commit (convert reads qwen2.json with --measurements)
      hpu-fp8 calibrate Qwen/Qwen2-7B-Instruct --revision a1b2c3d -o qwen2.json
    """
    from hpu_fp8_loader.quality.calibrate import calibrate as run_calibration
    from hpu_fp8_loader.quality.calibrate import check_outputs, write_fastdeploy_file
    from hpu_fp8_loader.sources.measurements import write_measurements
    from hpu_fp8_loader.sources.resolve import SOURCE_PATTERNS, local_or_hub

    if fastdeploy_file and fastdeploy_file.resolve() == out.resolve():
        raise click.BadParameter(f"{fastdeploy_file} is also the -o file; name another", param_hint="--fastdeploy-format")
    with user_errors():
        source = local_or_hub(model, revision, SOURCE_PATTERNS)
        check_outputs(source, dataset, [out, *([fastdeploy_file] if fastdeploy_file else [])], force)
        with progress_bar("calibrate", quiet or as_json, unit="tok") as bar:
            result = run_calibration(source, dataset, samples, seq_len, batch_size, all_experts, progress=bar.update)
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
@click.argument("bf16_source")
@click.argument("fp8_checkpoint")
@revision_option("BF16_SOURCE", "--source-revision")
@revision_option("FP8_CHECKPOINT")
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
    bf16_source: str,
    fp8_checkpoint: str,
    source_revision: str | None,
    revision: str | None,
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

    BF16_SOURCE and FP8_CHECKPOINT are directories or Hub repo ids ORG/NAME (a local path wins; downloaded, or
    found in the local cache offline). Prints top-1 agreement, mean KL(bf16 || fp8), relative logit RMSE and both
    perplexities. Without
    --weights-only / --no-kv-fp8 every row is shown; with them, the FP8 row and the rows asked for.

    \b
    Examples:
      # Every row (fp8, weights-only, no-kv-fp8) on the held-out part of the built-in text
      hpu-fp8 eval ./ERNIE-4.5-21B-A3B-Paddle ./ernie-fp8

    \b
      # As served at TP 2, with the decode path's attention quantization
      hpu-fp8 eval ./ERNIE-4.5-21B-A3B-Paddle ./ernie-fp8 --tp 2 --decode-attention

    \b
      # Only the FP8 and weights-only rows, on 32 windows of your own text
      hpu-fp8 eval ./Qwen2-7B-Instruct ./qwen2-fp8 --weights-only --dataset eval.txt --samples 32

    \b
      # Both from the Hub: the source at a pinned commit, the checkpoint at a tag
      hpu-fp8 eval Qwen/Qwen2-7B-Instruct you/qwen2-fp8 --source-revision a1b2c3d --revision v1
    """
    from hpu_fp8_loader.quality.evaluate import chosen_variants, evaluate
    from hpu_fp8_loader.sources.resolve import SOURCE_PATTERNS, SPEC_PATTERNS, local_or_hub

    variants = chosen_variants(only_weights, only_no_kv)
    with user_errors():
        source = local_or_hub(bf16_source, source_revision, SOURCE_PATTERNS)
        checkpoint = local_or_hub(fp8_checkpoint, revision, SPEC_PATTERNS)
        report = evaluate(source, checkpoint, dataset, samples, seq_len, tp, variants, decode_attention)
    if as_json:
        emit_json(report.to_dict())
    else:
        print_eval(report)
    warn_each(report.warnings)


def print_eval(report) -> None:
    click.echo(f"{report.tokens:,} held-out tokens ({report.dataset}), TP {report.tp}")
    click.echo(f"{'variant':<14}{'top-1 agree':>12}{'mean KL':>10}{'logit RMSE':>12}{'ppl bf16':>10}{'ppl fp8':>10}{'ppl +%':>8}")
    for r in report.rows:
        click.echo(
            f"{r.variant:<14}{100 * r.top1_agreement:>11.2f}%{r.mean_kl:>10.4f}{r.relative_logit_rmse:>12.4f}"
            f"{r.perplexity_bf16:>10.3f}{r.perplexity_fp8:>10.3f}{100 * r.perplexity_increase:>7.2f}%"
        )

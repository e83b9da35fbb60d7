"""Commands of calibration and accuracy: the demo, calibrate, eval."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from hpu_fp8_loader.cli.group import (
    BUILTIN_CALIBRATION_TEXT,
    COUNT,
    EXIT_INVALID,
    calibration_options,
    dataset_options,
    force_option,
    json_option,
    kv_cache_option,
    log,
    main,
    quiet_option,
    report_option,
    revision_option,
    say,
    threads_option,
    tp_option,
    user_errors,
    warn_each,
)
from hpu_fp8_loader.console import Progress, emit_json
from hpu_fp8_loader.io.checkpoint import resolve_path
from hpu_fp8_loader.quality import DEFAULT_EVAL_SAMPLES, DEFAULT_EVAL_SEQ_LEN
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS
from hpu_fp8_loader.spec.choices import KvCacheScheme


@main.command(short_help="The main job on a shipped tiny model, end to end.")
@click.option(
    "--out",
    "work_dir",
    default="hpu-fp8-demo",
    show_default=True,
    type=click.Path(path_type=Path),
    help="Working directory (replaced on each run; a directory the demo did not make is refused, never deleted).",
)
@click.option(
    "--model",
    type=click.Choice(list(TINY_MODELS)),
    default="ernie-moe-bytes",
    show_default=True,
    help="Which shipped tiny trained model to use.",
)
@kv_cache_option()
@json_option()
def demo(work_dir: Path, model: str, kv_cache: KvCacheScheme, as_json: bool) -> None:
    """Run the main job on the embedded default: calibrate, convert, validate and evaluate a tiny trained model.

    \b
    Examples:
      # The tiny trained ERNIE MoE end to end in ./hpu-fp8-demo, printing the accuracy table
      hpu-fp8 demo

    \b
      # The tiny Qwen2 with attention and KV cache left in BF16, in another directory
      hpu-fp8 demo --model qwen2-bytes --kv-cache none --out qwen2-demo

    \b
      # In a directory of its own, printing everything as one JSON document
      hpu-fp8 demo --out /tmp/hpu-fp8-demo --json
    """
    from hpu_fp8_loader.cli.demo import run_demo

    with user_errors():
        result = run_demo(work_dir, model, kv_cache, say=say(as_json))
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
@calibration_options(BUILTIN_CALIBRATION_TEXT)
@click.option(
    "--fastdeploy-format",
    "fastdeploy_file",
    type=click.Path(path_type=Path),
    help="Also write the amax in FastDeploy's measurement-mode text format to this file.",
)
@report_option()
@force_option(help="Replace the -o (and --fastdeploy-format) file, and the --report directory, if they exist.")
@quiet_option()
@json_option()
def calibrate(
    model: str,
    revision: str | None,
    out: Path,
    calibration: dict,
    fastdeploy_file: Path | None,
    report_dir: Path | None,
    force: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Record activation amax at FastDeploy's measurement points with the float32 reference engine.

    MODEL is a BF16 checkpoint (Paddle or torch layout) or an hpu-fp8 one: a directory, a tiny model shipped with
    hpu-fp8 (ernie-moe-bytes, qwen2-bytes, qwen3-bytes, qwen3-moe-bytes) or a Hub repo id ORG/NAME (its weights, configs and tokenizer files
    downloaded, or found in the local cache offline), tried in that order. Tokens come from its own
    tokenizer (tokenizer.json, else the sentencepiece tokenizer.model), one document (file or record)
    at a time, BOS as tokenizer_config.json says; byte tokens only with --tokenizer bytes or for a
    byte-level model (no tokenizer file, a vocabulary of at most 512). A model without a tokenizer is refused.
    The output files are checked before any work and written atomically; an existing one is
    replaced only with --force, and never one inside MODEL.

    Layer-major: every window goes through layer L before layer L+1 is read, and a layer's weights
    are read in parts, each once for all windows: attention, then the dense MLP, or the router and
    each routed expert in turn (the next part read while this one runs). Memory: the largest part
    in float32 (a dense MLP or the attention; an MoE layer holds its router part and one expert,
    whatever the expert count: 0.35 GB at ERNIE-4.5-300B-A47B's width, where the whole layer is
    22.5 GB), two when they fit half the available memory, --batch-size windows' activations, and
    three stores of all windows' hidden states (3 x samples x seq-len x hidden x 4 bytes), kept in
    memory when they fit a quarter of the available memory, else in scratch files beside -o
    (deleted when done).

    \b
    Examples:
      # 64 windows of 512 tokens of the built-in text, with a report (rep/index.html)
      hpu-fp8 calibrate ./ERNIE-4.5-21B-A3B-PT -o m.json --samples 64 --seq-len 512 --report rep

    \b
      # Chat records ({"messages": [...]}) rendered by the model's own chat template
      hpu-fp8 calibrate ./ERNIE-4.5-21B-A3B-PT -o ernie.json --dataset chats.jsonl --chat-template

    \b
      # Qwen2, also in FastDeploy's measurement text format, replacing earlier files
      hpu-fp8 calibrate ./Qwen2-7B-Instruct -o qwen2.json --fastdeploy-format qwen2.txt --force

    \b
      # A Hub model at a pinned commit, on the x field of a Hub dataset
      hpu-fp8 calibrate Qwen/Qwen2-7B --revision a1b2c3d -o q.json --dataset ORG/DATA --text-field x
    """
    from hpu_fp8_loader.engine.layer_major import layer_steps
    from hpu_fp8_loader.quality.calibrate import CalibrationOptions, check_outputs, write_fastdeploy_file
    from hpu_fp8_loader.sources.measurements import write_measurements
    from hpu_fp8_loader.sources.resolve import SOURCE_PATTERNS, local_or_hub

    with user_errors():
        if fastdeploy_file and resolve_path(fastdeploy_file) == resolve_path(out):  # a link loop: one named line
            raise click.BadParameter(f"{fastdeploy_file} is also the -o file; name another", param_hint="--fastdeploy-format")
        source = local_or_hub(model, revision, SOURCE_PATTERNS)
        options = CalibrationOptions(**calibration)
        check_outputs(source, options.dataset, [out, *([fastdeploy_file] if fastdeploy_file else [])], force)
        report = start_report(report_dir, force, [source])
        with Progress("calibrate", quiet=quiet, bar=not as_json, unit="step") as progress:
            result = options.run(source, progress=layer_steps(progress), scratch_dir=out.parent, report=report)
        write_measurements(out, result.measurements, force)
        if fastdeploy_file:
            write_fastdeploy_file(fastdeploy_file, result.measurements, force)
        finish_report(report, report_dir, force, [source], as_json)
    if result.dead_experts:
        from hpu_fp8_loader.conversion.activations import dead_expert_summary

        experts = result.measurements.model.moe_num_experts if result.measurements.model else None
        log.warning(
            f"no calibration token was routed to {len(result.dead_experts)} expert(s): "
            f"{dead_expert_summary(result.dead_experts, experts)}. Calibrate with more data or --all-experts, or "
            "convert with --dead-experts sibling-max (--json or -v lists every one)."
        )
        log.info("experts no token was routed to: %s", dead_expert_summary(result.dead_experts, experts, whole=True))
    warn_each(result.warnings)
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
                "warnings": result.warnings,
                "report": report_dir,
            }
        )
        return
    click.echo(
        f"{out}: {len(result.measurements.amax)} points from {result.tokens:,} tokens of {result.measurements.provenance.dataset} "
        f"(tokenizer: {result.tokenizer}), "
        f"{result.tokens / max(result.seconds, 1e-9):,.0f} tokens/s"
    )


@main.command("eval", short_help="Compare emulated Gaudi FP8 with the BF16 model.")
@click.argument("bf16_source")
@click.argument("fp8_checkpoint")
@revision_option("BF16_SOURCE", "--source-revision")
@revision_option("FP8_CHECKPOINT")
@dataset_options("builtin: the held-out 10% of Python's own documentation (never the calibration text).")
@click.option(
    "--samples",
    type=COUNT,
    default=DEFAULT_EVAL_SAMPLES,
    show_default=True,
    help="Windows of --seq-len tokens: the units the intervals resample (with one, there are none).",
)
@click.option("--seq-len", type=click.IntRange(min=2), default=DEFAULT_EVAL_SEQ_LEN, show_default=True)
@tp_option(help="Emulate this tensor parallelism (bf16 partial sums reduced as FastDeploy would).")
@click.option("--weights-only", "only_weights", is_flag=True, help="Ablation row: FP8 weights, float32 activations.")
@click.option("--no-kv-fp8", "only_no_kv", is_flag=True, help="Ablation row: FP8 linears, BF16 attention and KV cache.")
@click.option(
    "--per-token",
    is_flag=True,
    help="Ceiling row: every FP8 linear's input cast with its own token's scale (attention as served), which "
    "FastDeploy's HPU format cannot serve: how much better any static scale could do.",
)
@click.option(
    "--decode-attention",
    is_flag=True,
    help="Quantize unnormalised exp scores as FastDeploy's decode path does (default: prefill form).",
)
@report_option()
@force_option(help="Replace the --report directory if it exists.")
@click.option(
    "--scratch-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Where the hidden states wait between layers when they do not fit in memory (a scratch file, deleted when "
    "done; default: the system temp dir).",
)
@threads_option
@json_option(help="Print the report as JSON.")
def eval_command(
    bf16_source: str,
    fp8_checkpoint: str,
    source_revision: str | None,
    revision: str | None,
    dataset: str,
    text_field: str,
    chat_template: bool,
    dataset_revision: str | None,
    tokenizer: str,
    samples: int,
    seq_len: int,
    tp: int,
    only_weights: bool,
    only_no_kv: bool,
    per_token: bool,
    decode_attention: bool,
    report_dir: Path | None,
    force: bool,
    scratch_dir: Path | None,
    threads: int | None,
    as_json: bool,
) -> None:
    """Compare the emulated FP8 model (Gaudi arithmetic, FastDeploy's parameters) with the BF16 model.

    BF16_SOURCE is a directory, a tiny model shipped with hpu-fp8 (ernie-moe-bytes, qwen2-bytes, qwen3-bytes, qwen3-moe-bytes) or a Hub repo id
    ORG/NAME, tried in that order; FP8_CHECKPOINT a directory or a Hub repo id (a local path wins). A repo id is
    downloaded, or found in the local cache offline. Prints top-1 agreement, mean KL(bf16 || fp8), relative logit RMSE
    and both perplexities; top-1 and KL with a 95% bootstrap interval [low, high] (windows resampled 1,000 times with a
    fixed seed: the tokens of one window are correlated, so windows, not tokens, are the units). Without
    --weights-only / --no-kv-fp8 every row is shown; with them, the FP8 row and the rows asked for; --per-token adds
    its ceiling row to either. A quantization point whose amax / median |x| on the held-out text exceeds what E4M3
    at ±240 holds is warned of, by name.
    Tokens come from BF16_SOURCE's own tokenizer, as for calibrate.

    Layer-major: every window goes through layer L of the BF16 model and of every row before layer
    L+1 is read; each layer is read (and mapped) once, a part at a time as for calibrate: the rows
    run in lockstep, so each part of the FP8 model is mapped once for all of them. Memory: the
    largest part of a layer in float32 of each model (one expert of an MoE layer; the BF16 model's
    next part read ahead when two fit half the available memory), the heads as stored (bf16;
    one over 1 GiB in float32 is multiplied a block of vocabulary at a time),
    4 windows' activations and logits, and the hidden states of all windows per model, in memory
    when they fit a quarter of the available memory, else in --scratch-dir (deleted when done).

    \b
    Examples:
      # Every row on the held-out built-in text, with a report of which linears lose most
      hpu-fp8 eval ./ERNIE-4.5-21B-A3B-Paddle ./ernie-fp8 --report eval-report

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
    from hpu_fp8_loader.engine.layer_major import layer_steps
    from hpu_fp8_loader.quality.evaluate import chosen_variants, evaluate
    from hpu_fp8_loader.sources.resolve import SOURCE_PATTERNS, SPEC_PATTERNS, local_or_hub

    variants = chosen_variants(only_weights, only_no_kv, per_token)
    with user_errors():
        source = local_or_hub(bf16_source, source_revision, SOURCE_PATTERNS)
        checkpoint = local_or_hub(fp8_checkpoint, revision, SPEC_PATTERNS)
        collector = start_report(report_dir, force, [source, checkpoint])
        with Progress("eval", bar=not as_json, unit="step") as progress:
            report = evaluate(
                source,
                checkpoint,
                dataset,
                samples,
                seq_len,
                tp,
                variants,
                decode_attention,
                scratch_dir=scratch_dir,
                progress=layer_steps(progress),
                threads=threads,
                tokenizer=tokenizer,
                text_field=text_field,
                chat_template=chat_template,
                dataset_revision=dataset_revision,
                report=collector,
            )
        finish_report(collector, report_dir, force, [source, checkpoint], as_json)
    if as_json:
        emit_json(report.to_dict())
    else:
        print_eval(report)
    warn_each(report.warnings)


def _fold_targets(ctx: click.Context, param: click.Parameter, pairs: tuple[str, ...]) -> dict:
    """``--at FOLD=RATIO`` pairs as {Fold: ratio}, each refused in one line naming what is wrong."""
    from hpu_fp8_loader.conversion.folds import Fold

    targets = {}
    for pair in pairs:
        fold, sep, ratio = pair.partition("=")
        if not sep or fold not in {f.value for f in Fold}:
            raise click.BadParameter(f"{pair!r} is not FOLD=RATIO with FOLD one of {', '.join(f.value for f in Fold)}")
        try:
            targets[Fold(fold)] = float(ratio)
        except ValueError:
            raise click.BadParameter(f"{pair!r}: {ratio!r} is not a number") from None
    return targets


@main.command(short_help="Make a stress model: outliers as wide as real LLMs', the function unchanged.")
@click.argument("src")
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--at",
    "targets",
    multiple=True,
    required=True,
    metavar="FOLD=RATIO",
    callback=_fold_targets,
    help="Grow one channel of every site of FOLD (qkv, mlp-input, down, o-proj) until its point's amax / median |x| "
    "is RATIO (to the nearest power of two). Repeatable.",
)
@calibration_options(BUILTIN_CALIBRATION_TEXT)
@force_option()
@json_option()
def stress(src: str, out: Path, targets: dict, calibration: dict, force: bool, as_json: bool) -> None:
    """Write a copy of the BF16 model SRC whose chosen quantization points hold outliers, computing exactly what SRC
    computes.

    One channel of each site's point (the one already largest on the calibration text) is multiplied by a power
    of two and the next linear's rows divided by it: exact channel folds (docs/guide.md, "FP8 range"), so the BF16
    model's logits do not change by a bit, and static FP8 meets the range RATIO asks for. The outliers are
    channel-wise by construction; sink-token outliers (a few tokens, every channel) cannot be made this way.
    OUT records each grown site in hpu_fp8_stress.json.

    \b
    Examples:
      # The tiny Qwen2 with its down_proj inputs at amax / median 1e6, where static FP8 fails
      hpu-fp8 stress qwen2-bytes qwen2-stress --at down=1e6

    \b
      # The tiny ERNIE MoE's qkv and o_proj inputs at 1e5, measured on 8 windows
      hpu-fp8 stress ernie-moe-bytes ernie-stress --at qkv=1e5 --at o-proj=1e5 --samples 8
    """
    from hpu_fp8_loader.quality.calibrate import CalibrationOptions
    from hpu_fp8_loader.quality.stress import stress_model
    from hpu_fp8_loader.sources.resolve import SOURCE_PATTERNS, local_or_hub

    with user_errors():
        source = local_or_hub(src, None, SOURCE_PATTERNS)
        result = stress_model(source, out, targets, CalibrationOptions(**calibration), force)
    if as_json:
        emit_json({"out": result.out, "sites": [dataclasses.asdict(site) for site in result.sites]})
        return
    click.echo(f"{out}: {len(result.sites)} site(s) grown, the function unchanged")
    for site in result.sites:
        click.echo(
            f"  {site.point}: channel {site.channel} x 2^{site.growth}, amax / median {site.ratio_before:.3g} -> {site.ratio_after:.3g}"
        )


def start_report(report_dir: Path | None, force: bool, sources: list[Path]):
    """A report collector when --report is given, its directory checked before any work; None otherwise."""
    if report_dir is None:
        return None
    from hpu_fp8_loader.quality.report import Report, check_report_dir

    check_report_dir(report_dir, force, sources)
    return Report()


def finish_report(report, report_dir: Path | None, force: bool, sources: list[Path], as_json: bool) -> None:
    """Write the collected report atomically and say where it is (on stderr with --json, which owns stdout)."""
    if report is None or report_dir is None:
        return
    report.write(report_dir, force, sources)
    say(as_json)(f"report: {report_dir / 'index.html'}")


def print_eval(report) -> None:
    """The accuracy table: top-1 agreement and mean KL each followed by its 95% bootstrap interval over windows."""
    click.echo(
        f"{report.tokens:,} held-out tokens in {report.windows} windows ({report.dataset}, tokenizer: {report.tokenizer}), "
        f"TP {report.tp}; [low, high]: 95% bootstrap interval, windows resampled"
    )
    click.echo(
        f"{'variant':<14}{'top-1 agree':>12}{'[low, high] %':>17}{'mean KL':>10}{'[low, high]':>18}"
        f"{'logit RMSE':>12}{'ppl bf16':>10}{'ppl fp8':>10}{'ppl +%':>8}"
    )

    def interval(bounds: tuple[float, float] | None, scale: float, digits: int) -> str:
        return "-" if bounds is None else f"[{scale * bounds[0]:.{digits}f}, {scale * bounds[1]:.{digits}f}]"

    for r in report.rows:
        click.echo(
            f"{r.variant:<14}{100 * r.top1_agreement:>11.2f}%{interval(r.top1_agreement_interval, 100, 2):>17}"
            f"{r.mean_kl:>10.4f}{interval(r.mean_kl_interval, 1, 4):>18}{r.relative_logit_rmse:>12.4f}"
            f"{r.perplexity_bf16:>10.3f}{r.perplexity_fp8:>10.3f}{100 * r.perplexity_increase:>7.2f}%"
        )

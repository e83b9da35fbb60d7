"""Commands that write an hpu-fp8 checkpoint in another engine's format: export-compressed-tensors."""

from __future__ import annotations

from pathlib import Path

import click

from hpu_fp8_loader.cli.group import (
    force_option,
    json_option,
    main,
    parse_size,
    quiet_option,
    shard_size_option,
    user_errors,
    warn_each,
)
from hpu_fp8_loader.console import Progress, emit_json


@main.command("export-compressed-tensors", short_help="Write the FP8 format vLLM reads.")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--fp8-max",
    type=click.Choice(["448", "240"]),
    default="448",
    show_default=True,
    help="FP8 range of OUT: 448 (OCP, what vLLM and transformers assume; weights requantized once) or 240 (the "
    "checkpoint's own codes and scales, bit for bit, for a consumer that rescales for Gaudi2 itself).",
)
@shard_size_option()
@force_option()
@quiet_option()
@json_option()
def export_compressed_tensors(
    src: Path, out: Path, fp8_max: str, max_shard_size: str, force: bool, quiet: bool, as_json: bool
) -> None:
    """Write hpu-fp8 checkpoint SRC as a compressed-tensors FP8 checkpoint: one calibration, FastDeploy and vLLM.

    OUT has the Hugging Face layout (q/k/v and gate/up split back out, [out, in], each part with its
    group's shared scale), static per-tensor weight scales (per output channel for routed experts,
    as in SRC) and static per-tensor input scales (act_amax / fp8_max); k_scale and v_scale with a
    kv_cache_scheme when SRC has an FP8 KV cache (the q and s attention scales have no place in the
    format). Linears SRC keeps in BF16 stay BF16 and are listed in `ignore`, with lm_head and the
    MoE router. Tokenizer and generation files are copied; OUT appears only when complete.
    `hpu-fp8 import OUT` brings it back (docs/spec.md section 8).

    \b
    Examples:
      # For vLLM (GPU, or vllm-gaudi, which rescales 448 -> 240 on Gaudi2 itself)
      hpu-fp8 export-compressed-tensors ernie-fp8 ernie-fp8-ct

    \b
      # Keep Gaudi2's ±240 codes bit for bit
      hpu-fp8 export-compressed-tensors qwen2-fp8 qwen2-fp8-ct240 --fp8-max 240
    """
    from hpu_fp8_loader.conversion.ct_export import ExportProgress
    from hpu_fp8_loader.conversion.ct_export import export_compressed_tensors as run_export

    with user_errors(), Progress("export", quiet=quiet, bar=not as_json) as progress:

        def show(p: ExportProgress) -> None:
            progress.show(p.bytes_done, p.bytes_total, detail=f"{p.weights_done}/{p.weights_total} weights")

        report = run_export(src, out, float(fp8_max), parse_size(max_shard_size), force, show)
    warn_each(report.warnings)
    if as_json:
        emit_json(report)
        return
    requantized = f"{report.requantized} FP8 weights requantized to ±448" if report.requantized else "FP8 codes kept as they were"
    click.echo(
        f"{out}: compressed-tensors FP8 (±{report.fp8_max:g}), {report.tensors} tensors; {requantized}; "
        f"kept unquantized: {', '.join(report.ignored)}"
    )

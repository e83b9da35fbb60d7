"""Commands that make sources: a synthetic BF16 checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from hpu_fp8_loader.arch import Layout
from hpu_fp8_loader.cli.group import (
    RANK,
    force_option,
    json_option,
    main,
    parse_overrides,
    parse_size,
    quiet_option,
    shard_size_option,
    user_errors,
)
from hpu_fp8_loader.console import Progress, emit_json


@main.command(short_help="Write a deterministic random BF16 source checkpoint.")
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--preset",
    default="ernie-moe-tiny",
    show_default=True,
    help="Model size preset: ernie-moe-tiny, ernie-dense-tiny, qwen2-tiny, qwen3-tiny, qwen3-moe-tiny.",
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
    """Write a deterministic random-init BF16 source checkpoint to OUT.

    \b
    Examples:
      # A tiny random ERNIE MoE in FastDeploy's Paddle layout
      hpu-fp8 synth ernie-moe-tiny

    \b
      # The same model in the Hugging Face torch layout (same values, other names and shapes)
      hpu-fp8 synth ernie-moe-tiny-torch --layout torch

    \b
      # A four-layer tiny Qwen2, with other values (they depend only on the seed and the name)
      hpu-fp8 synth qwen2-tiny --preset qwen2-tiny --set num_hidden_layers=4 --seed 7
    """
    from hpu_fp8_loader.arch import describe
    from hpu_fp8_loader.sources.synth import preset_config, synthesize

    with user_errors():
        config = preset_config(preset, parse_overrides(overrides))
        descriptor = describe(config, f"synth --preset {preset}")
        with Progress("synth", quiet=quiet, bar=not as_json, total=2 * descriptor.parameter_count()) as progress:
            synthesize(out, config, Layout(layout), seed, parse_size(max_shard_size), force, progress=progress.update)
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

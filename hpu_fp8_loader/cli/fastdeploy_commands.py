"""Commands of FastDeploy's side: plan, map, export-legacy, doctor."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from hpu_fp8_loader.cli.group import (
    EXIT_INVALID,
    RANK,
    EnumChoice,
    ep_option,
    fail,
    force_option,
    json_option,
    keep_bf16_option,
    kv_cache_option,
    main,
    parse_size,
    quiet_option,
    revision_option,
    shard_size_option,
    tp_option,
    user_errors,
    warn_each,
)
from hpu_fp8_loader.console import Progress, emit_json, human_bytes, human_count
from hpu_fp8_loader.fastdeploy.doctor import DEFAULT_TIMEOUT
from hpu_fp8_loader.spec.choices import Bf16Group, KvCacheScheme, Target


@main.command(short_help="Size a deployment: bytes per rank, KV cache on a Gaudi.")
@click.argument("model")
@revision_option("MODEL")
@tp_option()
@ep_option()
@kv_cache_option(help="KV-cache scheme to size for.")
@click.option(
    "--device",
    type=EnumChoice(Target),
    default=None,
    help="Also size the KV cache on this Gaudi as FastDeploy's HPU worker does, and suggest --max-model-len and "
    "--max-num-seqs that fit.",
)
@click.option(
    "--max-model-len",
    type=click.IntRange(min=1),
    default=None,
    help="With --device: the --max-model-len to serve (default: the model's max_position_embeddings, shortened to "
    "what one sequence's KV blocks fit); --max-num-seqs is suggested for it.",
)
@keep_bf16_option(help="Size this group of linears as BF16, as `convert --keep-bf16` keeps it: dense or experts.")
@json_option(help="Print the plan as JSON.")
def plan(
    model: str,
    revision: str | None,
    tp: int,
    ep: int,
    kv_cache: KvCacheScheme,
    device: Target | None,
    max_model_len: int | None,
    keep_bf16: tuple[Bf16Group, ...],
    as_json: bool,
) -> None:
    """Size a deployment from MODEL's config.json: bytes per rank, KV per token, and with --device the KV-cache tokens
    a rank gets on a Gaudi.

    MODEL is a directory, the config.json file, a tiny model shipped with hpu-fp8 (ernie-moe-bytes, qwen2-bytes, qwen3-bytes, qwen3-moe-bytes) or a
    Hub repo id ORG/NAME, tried in that order.

    When the directory also holds the weights, the config's layer and expert counts are checked against them. Of a
    Hub repo id only config.json is downloaded (the weights are checked only if the local cache already holds them).

    \b
    With --device, the KV cache is sized by FastDeploy's HPU worker's own rule (its code, docs/fastdeploy.md):
    it assumes 96 GiB on every device (a Gaudi3's other 32 GiB hold no KV cache), keeps 90% of it
    (--gpu-memory-utilization 0.9) less 768 MiB, and after the weights and its profile run's KV cache cuts the
    rest into blocks of 64 tokens (at most 40000). The profile run's activations are not counted: the tokens are
    an upper bound; the worker log's num_blocks_local line says the real one. Suggested: --max-model-len the
    model's max_position_embeddings (2048 without one), shortened to what one sequence's blocks fit; --max-num-seqs
    as many such sequences as fit at once (at most 256); --max-num-batched-tokens when it must be below 8192.
    Exit 1 when one sequence of --max-model-len tokens does not fit.

    \b
    Examples:
      # Bytes per rank and KV cache per token at TP 2 (a TP that does not fit lists the valid ones)
      hpu-fp8 plan ./ERNIE-4.5-21B-A3B-Paddle --tp 2

    \b
      # KV-cache tokens per rank on a Gaudi2, and --max-num-seqs for 32K-token sequences
      hpu-fp8 plan ernie-fp8 --device gaudi2 --max-model-len 32768

    \b
      # From config.json alone, sized for a BF16 KV cache, as JSON
      hpu-fp8 plan ./Qwen2-7B-Instruct/config.json --tp 4 --kv-cache none --json

    \b
      # A model on the Hub (only its config.json is downloaded), its routed experts kept in BF16
      hpu-fp8 plan baidu/ERNIE-4.5-21B-A3B-Paddle --tp 4 --keep-bf16 experts
    """
    from hpu_fp8_loader.fastdeploy.plan import describe_model_config, plan_deployment

    if max_model_len is not None and device is None:
        raise click.UsageError("--max-model-len sizes the KV cache of a --device: pass --device gaudi2 or gaudi3")
    with user_errors():
        descriptor, config = describe_model_config(model, revision)
        result = plan_deployment(
            descriptor, tp, ep, kv_cache, device, max_model_len, config.get("max_position_embeddings"), frozenset(keep_bf16)
        )
    capacity = result.capacity
    if as_json:
        emit_json(result.to_dict())
    else:
        kept = f"; {', '.join(result.keep_bf16)} in BF16" if result.keep_bf16 else ""
        click.echo(f"{result.model_type}: {human_count(result.parameters)} parameters; TP {tp} x EP {ep}{kept}; per rank:")
        for group, size in result.bytes_per_rank.items():
            if size:
                click.echo(f"  {group:<15}{human_bytes(size):>10}")
        click.echo(f"  {'total':<15}{human_bytes(result.total_bytes_per_rank):>10}")
        click.echo(
            f"KV cache per token per rank: {result.kv_bytes_per_token_per_rank:,} bytes ({kv_cache.value}); "
            f"{result.kv_bytes_per_token_per_rank_bf16:,} bytes in bf16"
        )
        if capacity is not None:
            _print_capacity(capacity)
    if capacity is not None and not capacity.fits:
        fail(f"{model} at TP {tp} x EP {ep} does not fit a {capacity.device} as FastDeploy sizes it: {capacity.problem}")


def _print_capacity(c) -> None:
    """The KV-cache budget of one rank, line by line as FastDeploy's HPU worker computes it, and the options."""
    gib = 2**30
    click.echo(
        f"KV cache on a {c.device} ({c.device_hbm_bytes / gib:.0f} GiB; FastDeploy's HPU worker sizes for "
        f"{c.assumed_hbm_bytes / gib:.0f} GiB on every device), per rank:"
    )
    click.echo(f"  {'budget':<26}{c.budget_bytes / gib:>10.3f} GiB  (x 0.9 gpu_memory_utilization, less 768 MiB)")
    click.echo(f"  {'weights':<26}{c.weight_bytes / gib:>10.3f} GiB")
    click.echo(f"  {'profile run KV cache':<26}{c.profile_kv_bytes / gib:>10.3f} GiB  (freed before serving)")
    if not c.fits:
        click.echo(f"  does not fit: {c.problem}")
        return
    click.echo(
        f"  {'KV cache':<26}{c.blocks * c.block_bytes / gib:>10.3f} GiB  = {c.blocks:,} blocks of {c.block_size} tokens: "
        f"at most {c.kv_tokens:,} tokens (the profile run's activations, not counted, come off this)"
    )
    batched = f" --max-num-batched-tokens {c.max_num_batched_tokens}" if c.max_num_batched_tokens < 8192 else ""
    click.echo(f"suggested: --max-model-len {c.max_model_len} --max-num-seqs {c.max_num_seqs}{batched}")


@main.command("map", short_help="Write the parameters the hook hands one rank.")
@click.argument("checkpoint")
@revision_option("CHECKPOINT")
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
    checkpoint: str,
    revision: str | None,
    tp: int,
    rank: int,
    ep: int,
    ep_rank: int,
    all_ranks: bool,
    out: Path,
    force: bool,
    as_json: bool,
) -> None:
    """Write exactly the parameters the hook hands FastDeploy on one rank (names, dtypes, values).

    CHECKPOINT is a directory or a Hub repo id ORG/NAME (a local path wins; a repo id is downloaded whole, or
    found in the local cache offline).

    Names are FastDeploy's parameter paths (e.g. ernie.layers.0.self_attn.qkv_proj.act_scale,
    ernie.layers.1.mlp.experts.up_gate_proj_weight); see docs/fastdeploy.md section 11 for every name. With
    --all-ranks, writes rank{r}/ folders FastDeploy's pre-sharded path loads without splitting.

    \b
    Examples:
      # What the hook hands TP rank 1 of 2
      hpu-fp8 map ernie-fp8 --tp 2 --rank 1 -o rank1.safetensors

    \b
      # Expert-parallel rank 3 of 4
      hpu-fp8 map ernie-fp8 --ep 4 --ep-rank 3 -o ep3.safetensors

    \b
      # FastDeploy's pre-sharded layout for TP 4: ernie-fp8-tp4/rank0/ ... rank3/
      hpu-fp8 map ernie-fp8 --all-ranks --tp 4 -o ernie-fp8-tp4

    \b
      # A checkpoint on the Hub, at a tagged release
      hpu-fp8 map you/ERNIE-4.5-21B-A3B-hpu-fp8 --revision v1.0 --tp 2 --rank 0 -o rank0.safetensors
    """
    from hpu_fp8_loader.fastdeploy.mapping import Parallelism
    from hpu_fp8_loader.fastdeploy.rankfiles import write_presharded, write_rank_file
    from hpu_fp8_loader.sources.resolve import SPEC_PATTERNS, local_or_hub

    if all_ranks and (rank or ep_rank):
        raise click.UsageError("--all-ranks writes every rank; --rank and --ep-rank select one, so give one or the other")
    if all_ranks and ep > 1:
        raise click.UsageError("--all-ranks writes tensor-parallel ranks; expert parallelism is not pre-sharded")
    with user_errors():
        source = local_or_hub(checkpoint, revision, SPEC_PATTERNS)  # after the usage checks: nothing downloaded in vain
        if all_ranks:
            folders = write_presharded(source, out, tp, force)
            if as_json:
                emit_json({"out": out, "tp": tp, "rank_folders": folders})
            else:
                click.echo(f"{out}: {len(folders)} pre-sharded rank folder(s) in the legacy layout")
            return
        result = write_rank_file(source, out, Parallelism(tp, rank, ep, ep_rank), force)
    if as_json:
        emit_json({**dataclasses.asdict(result), "tp": tp, "rank": rank, "ep": ep, "ep_rank": ep_rank})
        return
    click.echo(
        f"{result.path}: {result.parameters} FastDeploy parameters of TP rank {rank}/{tp}, EP rank {ep_rank}/{ep}; "
        f"{human_bytes(result.bytes)}"
    )


@main.command("export-legacy", short_help="Write the legacy layout stock FastDeploy reads.")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@tp_option(help="Tensor parallelism it will be served at; >1 is refused where FastDeploy's v0 loader splits wrongly.")
@shard_size_option()
@force_option()
@json_option()
@quiet_option()
def export_legacy(src: Path, out: Path, tp: int, max_shard_size: str, force: bool, as_json: bool, quiet: bool) -> None:
    """Write hpu-fp8 checkpoint SRC in the legacy layout stock FastDeploy reads without the hook.

    Serve it with FastDeploy's v0 loader (--load-choices default), without expert parallelism.
    Qwen2 only at TP 1: the v0 loader does not split its FP8 tensors (docs/fastdeploy.md section 5).

    \b
    Examples:
      # For FastDeploy's stock v0 loader, served at TP 1
      hpu-fp8 export-legacy ernie-fp8 ernie-fp8-legacy

    \b
      # Checked for serving at TP 2, in shards of at most 2GB
      hpu-fp8 export-legacy ernie-fp8 ernie-fp8-legacy --tp 2 --max-shard-size 2GB
    """
    from hpu_fp8_loader.fastdeploy.legacy import export_legacy as run_export

    with user_errors(), Progress("export-legacy", quiet=quiet, bar=not as_json) as progress:
        report = run_export(src, out, tp, parse_size(max_shard_size), force, progress=progress.show)
    warn_each(report.warnings)
    if as_json:
        emit_json(report)
        return
    click.echo(
        f"{out}: legacy FastDeploy FP8 layout, {report.tensors} tensors; activation amax stored in bf16 as the layout does"
    )


@main.command(short_help="Check that --load-choices hpu_fp8 works here.")
@click.argument("checkpoint", required=False)
@tp_option()
@ep_option()
@revision_option("CHECKPOINT")
@click.option(
    "--no-build", is_flag=True, help="Skip having FastDeploy build CHECKPOINT's model (at meta shapes, no weight memory)."
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    metavar="SECONDS",
    default=DEFAULT_TIMEOUT,
    show_default=True,
    help="Seconds paddle's and FastDeploy's import, the routing and the model build may take together.",
)
@json_option(help="Print every check as JSON.")
def doctor(checkpoint: str | None, tp: int, ep: int, revision: str | None, no_build: bool, timeout: float, as_json: bool) -> None:
    """Check that `--load-choices hpu_fp8` will work here: run it in FastDeploy's environment on the Gaudi box.

    Reports FastDeploy's version and commit and which MoE layout it builds, whether the hpu_fp8 entry
    point is installed and FD_PLUGINS names it, FD_ATTENTION_BACKEND, whether paddle and its intel_hpu
    device import, and whether FastDeploy's own get_model_loader hands hpu_fp8 to the hook. Given
    CHECKPOINT (a directory or a Hub repo id), also its quick validation, whether TP x EP can serve
    it, and FastDeploy building its model at meta shapes (no weight memory) with every parameter
    compared with what the hook fills. Every problem comes with its fix; exit 1 if any check fails.

    FastDeploy's commit (its version.txt) is compared with the supported range (docs/fastdeploy.md section 1),
    and paddle with what that FastDeploy calls of it. paddle, FastDeploy and the model build run in a child
    process: if FastDeploy exits, raises, prints or hangs there (past --timeout), that check fails, naming it.

    \b
    Examples:
      # FastDeploy's environment alone: commit, MoE layout, entry point, FD_PLUGINS, routing
      hpu-fp8 doctor

    \b
      # Also this checkpoint at TP 2: validation, TP x EP, FastDeploy building its model
      hpu-fp8 doctor ./ERNIE-4.5-21B-A3B-hpu-fp8 --tp 2

    \b
      # A Hub checkpoint without the model build, every check as JSON
      hpu-fp8 doctor you/ERNIE-4.5-21B-A3B-hpu-fp8 --no-build --json
    """
    from hpu_fp8_loader.fastdeploy.doctor import doctor as run_doctor

    report = run_doctor(checkpoint, tp, ep, revision, build=not no_build, timeout=timeout)
    if as_json:
        emit_json(report.to_dict())
    else:
        for check in report.checks:
            click.echo(f"[{check.status:>4}] {check.name}: {check.detail}")
            if check.fix:
                click.echo(f"       fix: {check.fix}")
        click.echo("ready for --load-choices hpu_fp8" if report.ok else "not ready: fix the failed checks above")
    sys.exit(0 if report.ok else EXIT_INVALID)

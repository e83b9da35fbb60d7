"""Publishing to the Hugging Face Hub: push."""

from __future__ import annotations

from pathlib import Path

import click

from hpu_fp8_loader.cli.group import (
    dead_experts_option,
    json_option,
    kv_cache_option,
    main,
    measurements_option,
    rebalance_option,
    say,
    target_option,
    user_errors,
)
from hpu_fp8_loader.console import emit_json
from hpu_fp8_loader.spec.choices import DeadExpertPolicy, KvCacheScheme, Rebalance, Target


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
@rebalance_option()
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
    help="Keep the staged checkpoint and card in DIR/checkpoint (default: a temporary directory, removed when done).",
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
    target: Target,
    kv_cache: KvCacheScheme,
    dead_experts: DeadExpertPolicy,
    rebalance: Rebalance,
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

    SRC is a directory, a tiny model shipped with hpu-fp8 (ernie-moe-bytes, qwen2-bytes, qwen3-bytes, qwen3-moe-bytes) or a Hub repo id ORG/NAME,
    tried in that order; for either of the first two, --base-model names the BF16 model on the Hub.

    A checkpoint that fails validation is never uploaded. After the upload every remote file's size and
    identifier (LFS sha256, or git blob id) is compared with the local manifest; a mismatch exits 1.
    Re-running after an interrupted upload resumes it. The token comes from huggingface_hub's usual
    sources (HF_TOKEN, `hf auth login`) and is never printed.

    \b
    Examples:
      # A Hub model, calibrated on the built-in text; license and base model come from its card
      hpu-fp8 push Qwen/Qwen2-0.5B --repo-id you/Qwen2-0.5B-hpu-fp8 --calibrate

    \b
      # All the local work, then print every file and the planned commit; touch nothing remote
      hpu-fp8 push Qwen/Qwen2-0.5B --repo-id you/Qwen2-0.5B-hpu-fp8 --calibrate --dry-run

    \b
      # A local model names its BF16 original on the Hub, for the card's base_model
      hpu-fp8 push ./my-qwen2 --repo-id you/my-qwen2-fp8 --calibrate --base-model Qwen/Qwen2-0.5B

    \b
      # A 7 B model with its measurement file, as a pull request (eval above 3 B needs --eval)
      hpu-fp8 push Qwen/Qwen2-7B --repo-id you/Qwen2-7B-hpu-fp8 --measurements amax.json --create-pr
    """
    from hpu_fp8_loader.conversion.plan import ConvertOptions
    from hpu_fp8_loader.hub.publish import PushOptions
    from hpu_fp8_loader.hub.publish import commit_message as planned_commit_message
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
        convert=ConvertOptions(target=target, kv_cache=kv_cache, dead_experts=dead_experts, workers=1, rebalance=rebalance),
        show_progress=True,  # -q and --log-level error silence it, as for every command
    )
    with user_errors():
        result = run_push(src, options, say=say(as_json))
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
            f"{' (private)' if private else ''}: {planned_commit_message(options, len(result.files))}"
        )
        for f in result.files:
            click.echo(f"  {f.name:<42}{f.size:>14,}  {f.sha256}")
        if result.checkpoint is None:
            click.echo("staged in a temporary directory, now removed; pass --work-dir DIR to keep the checkpoint and card")
        else:
            click.echo(f"staged in {result.checkpoint} (kept)")
        return
    if result.pull_request_url:
        click.echo(f"{repo_id}: pull request opened and verified ({len(result.files)} files): {result.pull_request_url}")
    else:
        click.echo(f"{repo_id}: published and verified ({len(result.files)} files): {result.commit_url}")

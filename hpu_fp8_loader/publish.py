"""Publish an hpu-fp8 checkpoint: convert, validate, evaluate, write the card, upload, verify.

A checkpoint that fails validation is never uploaded. After the upload the remote file list is
compared with the local manifest: every size, and the identifier the Hub gives each file (the LFS
sha256 of large files, the git blob id of small ones). The token comes from huggingface_hub's usual
sources (``HF_TOKEN``, ``hf auth login``) and is never printed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .calibrate import calibrate
from .cards import CardFile, render_card
from .convert import ConvertOptions, convert
from .errors import HpuFp8Error
from .evaluate import EvalReport, evaluate
from .hub import resolve_checkpoint
from .io.checkpoint import read_config
from .io.manifest import MANIFEST_FILE, write_manifest
from .measurements import load_measurements
from .validate import validate

__all__ = ["PushOptions", "PushResult", "git_blob_id", "push", "remote_problems"]

CARD = "README.md"
# Above this many parameters the CPU evaluation takes long enough to ask for it explicitly.
EVAL_PARAMETER_LIMIT = 3e9
# A rough CPU throughput of the float32 engine, for the time estimate printed instead.
_ENGINE_FLOPS = 5e10


class UploadError(HpuFp8Error):
    """The Hub refused or interrupted the upload, or the uploaded files differ from the local ones."""


@dataclass
class PushOptions:
    repo_id: str
    measurements: Sequence[Path] = ()
    calibrate: bool = False
    license: str | None = None
    base_model: str | None = None
    private: bool = False
    revision: str | None = None
    create_pr: bool = False
    commit_message: str | None = None
    work_dir: Path | None = None
    dry_run: bool = False
    evaluation: str = "auto"  # auto | always | skip
    convert: ConvertOptions = field(default_factory=ConvertOptions)
    command: str = ""


@dataclass
class PushResult:
    checkpoint: Path
    files: list[CardFile]
    evaluation: EvalReport | None
    commit_url: str | None = None
    pull_request_url: str | None = None


def git_blob_id(data: bytes) -> str:
    """The id git (and the Hub) gives a small file: sha1 of ``blob <size>\\0`` + content."""
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


def _license_of(source: Path) -> str | None:
    card = source / CARD
    if not card.is_file():
        return None
    from huggingface_hub import ModelCard

    return ModelCard.load(card).data.license


def _stage(src: Path, options: PushOptions, work: Path, say: Callable[[str], None]) -> tuple[Path, EvalReport | None, str | None]:
    if options.calibrate:
        say("calibrating with the reference engine on the built-in text ...")
        measurements = [calibrate(src).measurements]
    elif options.measurements:
        measurements = [load_measurements(p).measurements for p in options.measurements]
    else:
        raise HpuFp8Error("no activation statistics: pass --measurements FILE or --calibrate")
    checkpoint = work / "checkpoint"
    shutil.rmtree(checkpoint, ignore_errors=True)
    convert(src, checkpoint, measurements, options.convert)
    report = validate(checkpoint)
    if not report.valid:
        listing = "; ".join(f"[{v.rule}] {v.where}: {v.message}" for v in report.violations[:5])
        raise HpuFp8Error(f"the converted checkpoint is not valid, so nothing is uploaded: {listing}")
    say(f"converted and validated: {checkpoint}")
    from .arch import describe

    parameters = describe(read_config(src)).parameter_count()
    evaluation, note = None, None
    if options.evaluation == "skip":
        note = "skipped with --skip-eval"
    elif parameters > EVAL_PARAMETER_LIMIT and options.evaluation != "always":
        minutes = 2 * parameters * 8 * 128 * 2 / _ENGINE_FLOPS / 60
        note = f"{parameters / 1e9:.1f} B parameters: about {minutes:.0f} CPU minutes; pass --eval to run it"
        say(f"no evaluation: {note}")
    else:
        evaluation = evaluate(src, checkpoint, samples=8, seq_len=128)
        say(f"evaluated: FP8 top-1 agreement {100 * evaluation.rows[0].top1_agreement:.2f}%")
    return checkpoint, evaluation, note


def _write_card(
    checkpoint: Path, src: Path, base_model: str, options: PushOptions, evaluation: EvalReport | None, note: str | None
) -> list[CardFile]:
    """README.md from model_cards/, then the manifest again so that it lists the card too."""
    license_ = options.license or _license_of(src)
    card = render_card(checkpoint, options.repo_id, base_model, license_ or "", options.command, evaluation, note)
    (checkpoint / CARD).write_text(card, encoding="utf-8")
    known = {
        name: (entry["size"], entry["sha256"])
        for name, entry in json.loads((checkpoint / MANIFEST_FILE).read_text())["files"].items()
    }
    known.pop(CARD, None)
    manifest = write_manifest(checkpoint, known)
    return [CardFile(name, entry["size"], entry["sha256"]) for name, entry in sorted(manifest["files"].items())]


def remote_problems(api, repo_id: str, revision: str, checkpoint: Path) -> list[str]:
    """Every file whose remote size or identifier differs from the local manifest, and every one missing."""
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())["files"]
    remote = {f.path: f for f in api.list_repo_tree(repo_id, revision=revision, recursive=True) if hasattr(f, "size")}
    problems = []
    for name, entry in sorted({**manifest, MANIFEST_FILE: None}.items()):
        local = (checkpoint / name).read_bytes() if entry is None else None
        size = len(local) if entry is None else entry["size"]
        found = remote.get(name)
        if found is None:
            problems.append(f"{name}: missing on the Hub")
        elif found.size != size:
            problems.append(f"{name}: {found.size} bytes on the Hub, {size} here")
        elif found.lfs is not None:
            sha = hashlib.sha256(local).hexdigest() if entry is None else entry["sha256"]
            if found.lfs.sha256 != sha:
                problems.append(f"{name}: LFS sha256 on the Hub differs from the local file")
        elif found.blob_id != git_blob_id(local if local is not None else (checkpoint / name).read_bytes()):
            problems.append(f"{name}: git blob id on the Hub differs from the local file")
    return problems


def _upload(checkpoint: Path, options: PushOptions, say: Callable[[str], None]) -> tuple[str, str | None]:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        api.create_repo(options.repo_id, private=options.private, exist_ok=True)
        if options.revision:
            api.create_branch(options.repo_id, branch=options.revision, exist_ok=True)
        commit = api.upload_folder(
            repo_id=options.repo_id,
            folder_path=checkpoint,
            revision=options.revision,
            commit_message=options.commit_message or f"Upload hpu-fp8 checkpoint ({len(list(checkpoint.iterdir()))} files)",
            create_pr=options.create_pr,
        )
        say(f"uploaded: {commit.commit_url}")
        problems = remote_problems(api, options.repo_id, commit.oid, checkpoint)
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise UploadError(
                f"{options.repo_id}: the Hub refused the credentials (HTTP {status}); log in with `hf auth login` or set HF_TOKEN "
                "to a token with write access"
            ) from None
        raise UploadError(f"{options.repo_id}: upload failed (HTTP {status}); run the same command again to resume") from None
    except (OSError, RuntimeError) as exc:  # huggingface_hub wraps a failed LFS transfer in RuntimeError
        raise UploadError(f"{options.repo_id}: upload interrupted ({exc}); run the same command again to resume") from None
    if problems:
        raise UploadError(f"{options.repo_id}: the uploaded files differ from the local checkpoint: " + "; ".join(problems[:10]))
    return commit.commit_url, commit.pr_url


def push(src: str | Path, options: PushOptions, say: Callable[[str], None] = print) -> PushResult:
    """Convert ``src``, check it, describe it and (unless ``dry_run``) upload and verify it."""
    source_id = str(src)
    src = resolve_checkpoint(src)
    base_model = options.base_model or (source_id if not Path(source_id).exists() else None)  # a Hub id is the base
    if not base_model:
        raise HpuFp8Error("the base model's Hub id is unknown: pass --base-model ORG/NAME")
    if not (options.license or _license_of(src)):
        raise HpuFp8Error("no license known for the base model (no README.md front matter in the source): pass --license")
    temporary = None
    if options.work_dir is None:
        temporary = tempfile.TemporaryDirectory(prefix="hpu-fp8-push-")
        work = Path(temporary.name)
    else:
        work = Path(options.work_dir)
        work.mkdir(parents=True, exist_ok=True)
    try:
        checkpoint, evaluation, note = _stage(src, options, work, say)
        files = _write_card(checkpoint, src, base_model, options, evaluation, note)
        result = PushResult(checkpoint, files, evaluation)
        if options.dry_run:
            return result
        result.commit_url, result.pull_request_url = _upload(checkpoint, options, say)
        return result
    finally:
        if temporary is not None:
            temporary.cleanup()

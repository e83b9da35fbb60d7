"""Checkpoints on the Hugging Face Hub: resolving a repo id (or its local cache) to a directory.

Everything goes through huggingface_hub, so its offline mode (``HF_HUB_OFFLINE=1``), cache location
(``HF_HUB_CACHE``) and token sources apply unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .console import hub_bars_follow_ours
from .errors import CheckpointNotFoundError, HpuFp8Error

__all__ = ["SOURCE_PATTERNS", "SPEC_PATTERNS", "LoadedCheckpoint", "check_repo_id", "load", "resolve_checkpoint"]

# What a conversion needs from a source repository: weights, index, configs and tokenizer files.
SOURCE_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model", "*.tiktoken"]
# What an hpu-fp8 checkpoint is made of (docs/spec.md section 1): shards, index, config, manifest,
# tokenizer and generation files.
SPEC_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.md"]
_REPO_ID_RULE = "ORG/NAME of ASCII letters, digits, '-', '_' and '.', at most 96 characters each, without '--' or '..'"


def check_repo_id(text: str, what: str = "repo id", namespace: bool = True) -> str:
    """``text`` if it is a Hub repo id by huggingface_hub's own rules (and ``ORG/NAME`` when ``namespace``).

    Checked before anything is downloaded or converted, so ``org/..`` or ``a/b/c`` fails at once by
    name instead of deep inside the client, or after hours of work. Canonical ids without an
    organisation (``gpt2``) exist only as base models, hence ``namespace=False`` for those.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
        valid = text.isascii() and (text.count("/") == 1 or not namespace)
    except HFValidationError:
        valid = False
    if not valid:
        raise HpuFp8Error(f"{what} {text!r} is not a Hugging Face repo id: {_REPO_ID_RULE}")
    return text


def resolve_checkpoint(location: str | Path, revision: str | None = None, allow_patterns: list[str] | None = None) -> Path:
    """A local directory as it is, else a Hub repo id resolved (downloaded, or from the cache offline)."""
    path = Path(location)
    if path.is_dir():
        return path
    text = str(location)
    try:
        check_repo_id(text)
    except HpuFp8Error:
        raise CheckpointNotFoundError(f"{text!r}: no such directory, and not a Hugging Face repo id ({_REPO_ID_RULE})") from None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    hub_bars_follow_ours()
    try:
        return Path(snapshot_download(text, revision=revision, allow_patterns=allow_patterns or SOURCE_PATTERNS))
    except GatedRepoError:
        raise CheckpointNotFoundError(
            f"{text}: the repository is gated; accept its terms on the Hub and log in (hf auth login)"
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointNotFoundError(
            f"{text}: no such repository on the Hub, or it is private and you are not logged in"
        ) from None
    except RevisionNotFoundError:
        raise CheckpointNotFoundError(f"{text}: revision {revision!r} does not exist") from None
    except LocalEntryNotFoundError:
        raise CheckpointNotFoundError(
            f"{text}: not in the local Hugging Face cache and the Hub cannot be reached (offline?); "
            "download it once with network access, or pass a local directory"
        ) from None


@dataclass
class LoadedCheckpoint:
    path: Path
    quantization_config: object  # spec.config.QuantizationConfig
    warnings: list[str]


class ChecksumMismatchError(HpuFp8Error):
    """Files of a checkpoint disagree with its manifest (a corrupt or partial download)."""


def load(location: str | Path, revision: str | None = None, hashes: bool = True) -> LoadedCheckpoint:
    """An hpu-fp8 checkpoint from a directory or the Hub, checked before anyone uses it.

    Checks: it is an hpu-fp8 checkpoint (a legacy FastDeploy one gets the import-legacy command),
    its format_version, the manifest (sizes, and sha256 when ``hashes``), and the quick validation
    (headers, index, config, scales). The offline cache is used when ``HF_HUB_OFFLINE=1``.
    """
    from .validate import validate

    path = resolve_checkpoint(location, revision, SPEC_PATTERNS)
    report = validate(path, full=False, hashes=hashes)  # raises for "not hpu-fp8", format_version, unreadable
    manifest = [v for v in report.violations if v.rule == "container.manifest"]
    if manifest:
        raise ChecksumMismatchError(f"{location}: " + "; ".join(v.message for v in manifest[:5]))
    if not report.valid:
        listing = "; ".join(f"[{v.rule}] {v.where}: {v.message}" for v in report.violations[:5])
        raise HpuFp8Error(f"{location}: not a valid hpu-fp8 checkpoint: {listing}")
    from .io.checkpoint import read_config
    from .spec.config import parse_quantization_config

    return LoadedCheckpoint(path, parse_quantization_config(read_config(path)), report.warnings)

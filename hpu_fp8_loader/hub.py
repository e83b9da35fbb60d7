"""Checkpoints on the Hugging Face Hub: resolving a repo id (or its local cache) to a directory.

Everything goes through huggingface_hub, so its offline mode (``HF_HUB_OFFLINE=1``), cache location
(``HF_HUB_CACHE``) and token sources apply unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import CheckpointNotFoundError

__all__ = ["SOURCE_PATTERNS", "resolve_checkpoint"]

# What a conversion needs from a source repository: weights, index, configs and tokenizer files.
SOURCE_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model", "*.tiktoken"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_checkpoint(location: str | Path, revision: str | None = None, allow_patterns: list[str] | None = None) -> Path:
    """A local directory as it is, else a Hub repo id resolved (downloaded, or from the cache offline)."""
    path = Path(location)
    if path.is_dir():
        return path
    text = str(location)
    if not _REPO_ID.match(text):
        raise CheckpointNotFoundError(f"{text}: no such directory, and not a Hugging Face repo id like 'org/name'")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

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

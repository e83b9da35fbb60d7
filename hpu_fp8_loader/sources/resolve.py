"""Checkpoints on the Hugging Face Hub: resolving a repo id (or its local cache) to a directory.

Everything goes through huggingface_hub, so its offline mode (``HF_HUB_OFFLINE=1``), cache location
(``HF_HUB_CACHE``) and token sources apply unchanged. Every failure to reach the Hub, here or in
``publish``, becomes one line through :func:`hub_error`, naming the repo id, the endpoint and the reason.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from hpu_fp8_loader.console import hub_bars_follow_ours
from hpu_fp8_loader.errors import CheckpointNotFoundError, HpuFp8Error, HubError, one_line
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS

__all__ = [
    "CONFIG_PATTERNS",
    "SOURCE_PATTERNS",
    "SPEC_PATTERNS",
    "check_repo_id",
    "check_revision",
    "download_snapshot",
    "hub_error",
    "hub_failures",
    "is_repo_id",
    "local_or_hub",
    "resolve_checkpoint",
]

log = logging.getLogger(__name__)

# What a conversion needs from a source repository: weights, index, configs and tokenizer files.
SOURCE_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model", "*.tiktoken"]
# What an hpu-fp8 checkpoint is made of (docs/spec.md section 1): shards, index, config, manifest,
# tokenizer and generation files, and the report plots push uploads beside them (every file the manifest lists).
SPEC_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.md", "*.png"]
# What sizing a deployment needs from a repository: its config.json, not the weights.
CONFIG_PATTERNS = ["config.json"]
_REPO_ID_RULE = "ORG/NAME of ASCII letters, digits, '-', '_' and '.', at most 96 characters each, without '--' or '..'"
# git check-ref-format: characters no ref name holds (besides control characters), and sequences none contains.
_REF_CHARACTERS = " ~^:?*[\\"
_REF_SEQUENCES = ("..", "@{", "//")
# What to do after a dropped connection or an HTTP error: huggingface_hub resumes downloads and uploads.
_AGAIN = "run the same command again to resume"
# A reason quoted from the client is cut to this many characters: its messages can run to paragraphs.
_REASON_LIMIT = 200


# user:password@ in a URL: an HF_ENDPOINT may carry credentials, which no message repeats.
_URL_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+@")


def _without_credentials(text: str) -> str:
    return _URL_CREDENTIALS.sub("***@", text)


def _check_endpoint(repo_id: str) -> None:
    """Refuse an HF_ENDPOINT that is no http(s) URL with a host, naming the repo id that was to be reached.

    Checked before huggingface_hub is imported: its constants module fails to import on some such values
    (``http://[::1``), and with the others (``notaurl``, ``ftp://...``) every request fails.
    """
    endpoint = os.environ.get("HF_ENDPOINT")
    if endpoint is None:
        return
    try:
        parts = urlsplit(endpoint)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a malformed IPv6 address, or a port that is no number in 0..65535 (raised by .port)
        valid = False
    if not valid:
        raise HubError(
            f"{repo_id}: HF_ENDPOINT {_without_credentials(repr(endpoint))} is not a usable http:// or https:// URL, so the Hub cannot be reached; "
            "fix it, or unset it for https://huggingface.co"
        )


def is_repo_id(text: str, namespace: bool = True) -> bool:
    """Whether ``text`` is a Hub repo id by huggingface_hub's own rules (and ``ORG/NAME`` when ``namespace``).

    The spelling alone: no request is made and HF_ENDPOINT is not looked at, so a caller can tell a local
    path from a repo id before deciding whether the Hub is involved at all.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return text.isascii() and (text.count("/") == 1 or not namespace)


def check_repo_id(text: str, what: str = "repo id", namespace: bool = True) -> str:
    """``text`` if it is a Hub repo id (:func:`is_repo_id`), else refused naming ``what``.

    Checked before anything is downloaded or converted, so ``org/..`` or ``a/b/c`` fails at once by
    name instead of deep inside the client, or after hours of work. Canonical ids without an
    organisation (``gpt2``) exist only as base models, hence ``namespace=False`` for those. Every use
    of the Hub passes here first, so HF_ENDPOINT is checked here too.
    """
    _check_endpoint(text)
    if not is_repo_id(text, namespace):
        raise HpuFp8Error(f"{what} {text!r} is not a Hugging Face repo id: {_REPO_ID_RULE}")
    return text


def _ref_name_problem(text: str) -> str | None:
    """Why git would not take ``text`` as a branch or tag name (``git check-ref-format --branch``), or None."""
    if not text:
        return "it is empty"
    if text == "@":
        return "'@' alone is git's shorthand for HEAD"
    character = next((c for c in text if not c.isprintable() or c in _REF_CHARACTERS), None)
    sequence = next((s for s in _REF_SEQUENCES if s in text), None)
    if character is not None or sequence is not None:
        return f"it holds {character or sequence!r}"
    if text[0] in "/-" or text[-1] in "/.":
        return "it starts with '/' or '-', or ends with '/' or '.'"
    part = next((p for p in text.split("/") if p.startswith(".") or p.endswith(".lock")), None)
    if part is not None:
        return f"its part {part!r} starts with '.' or ends with '.lock'"
    return None


def check_revision(text: str, what: str = "--revision") -> str:
    """``text`` if git, and so the Hub, would take it as a branch, tag or commit name; else refused naming ``what``.

    Checked before any request or work: a revision becomes part of URLs and, offline, of a path in the
    Hugging Face cache (``refs/<revision>``), so ``../../etc`` must never reach the client.
    """
    problem = _ref_name_problem(text)
    if problem:
        raise HpuFp8Error(f"{what} {text!r} is not a git branch, tag or commit name: {problem}")
    return text


def hub_failures() -> tuple[type[Exception], ...]:
    """What the client raises when the Hub or the connection to it fails: HTTP and transport errors (httpx's,
    which its own subclass), OSError, a failed LFS transfer (RuntimeError), a request it refuses to send,
    such as a card the Hub's YAML check refuses (ValueError)."""
    from huggingface_hub.errors import HTTPError

    return (HTTPError, OSError, RuntimeError, ValueError)


def _reason(exc: BaseException) -> str:
    """``exc`` as a short phrase on one line: the client's messages span lines and can run to paragraphs."""
    text = _without_credentials(one_line(exc))
    cut = text[:_REASON_LIMIT] + ("..." if len(text) > _REASON_LIMIT else "")
    return f"{type(exc).__name__}: {cut}"


def hub_error(repo_id: str, exc: BaseException, doing: str, error: type[HpuFp8Error] = HubError) -> HpuFp8Error:
    """One line for a failure of the Hub, or of the connection to it, while ``doing``: the repository, the
    endpoint (HF_ENDPOINT), the reason and what to do; never the token (the client's messages do not hold it).

    Shared by every command that talks to the Hub. Refused credentials ask for a login; anything else (a
    dropped connection, an HTTP error) may pass when the same command runs again. An endpoint that is no
    URL never gets this far (:func:`check_repo_id` refuses it).
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError

    endpoint = _without_credentials(constants.ENDPOINT)
    status = exc.response.status_code if isinstance(exc, HfHubHTTPError) and exc.response is not None else None
    if status in (401, 403):
        return error(
            f"{repo_id}: the Hub at {endpoint} refused the credentials (HTTP {status}) while {doing}; log in with "
            "`hf auth login` or set HF_TOKEN to a token with access to it (write access to publish)"
        )
    if status is not None:
        return error(f"{repo_id}: the Hub at {endpoint} answered HTTP {status} while {doing}; {_AGAIN}")
    if isinstance(exc, ValueError):
        return error(f"{repo_id}: the Hub client refused {doing}: {_reason(exc)}")
    return error(f"{repo_id}: the connection to the Hub at {endpoint} failed while {doing} ({_reason(exc)}); {_AGAIN}")


def _shipped(location: str | Path, revision: str | None) -> Path | None:
    """The directory of a shipped tiny model named ``location`` (``qwen2-bytes``), or None for any other name."""
    path = TINY_MODELS.get(str(location))
    if path is not None and revision is not None:
        log.warning(f"{location}: a tiny model shipped with hpu-fp8, so revision {revision!r} (for Hub repo ids) is ignored")
    return path


def resolve_checkpoint(location: str | Path, revision: str | None = None, allow_patterns: list[str] | None = None) -> Path:
    """A local directory as it is, else a shipped tiny model's name (``TINY_MODELS``), else a Hub repo id resolved
    (downloaded, or from the cache offline).

    Every way the Hub or the cache can fail is one error naming the repo id: a gated, missing or private
    repository, a missing revision, an empty cache while offline, an unreachable endpoint.
    """
    path = Path(location)
    if path.is_dir():
        return path
    if not path.exists() and (shipped := _shipped(location, revision)) is not None:
        return shipped
    text = str(location)
    if path.exists():
        raise CheckpointNotFoundError(f"{text}: a file, not a checkpoint directory (name the directory that holds config.json)")
    try:
        check_repo_id(text)
    except HubError:  # HF_ENDPOINT, not the id
        raise
    except HpuFp8Error:
        raise CheckpointNotFoundError(
            f"{text!r}: no such directory, no shipped tiny model ({', '.join(TINY_MODELS)}), and not a Hugging Face "
            f"repo id ({_REPO_ID_RULE})"
        ) from None
    if revision is not None:
        check_revision(revision)
    return download_snapshot(text, revision, allow_patterns or SOURCE_PATTERNS)


def download_snapshot(
    repo_id: str,
    revision: str | None,
    allow_patterns: list[str],
    repo_type: str = "model",
    missing: type[HpuFp8Error] = CheckpointNotFoundError,
    local: str = "a local directory",
) -> Path:
    """The snapshot directory of a checked ``repo_id`` (a model or a dataset repository), downloaded or from the
    cache offline; each way the Hub or the cache fails is one ``missing`` error (or a :func:`hub_error`) naming the
    repo id. ``local`` is what the offline message offers instead."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = "repository" if repo_type == "model" else f"{repo_type} repository"
    hub_bars_follow_ours()
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns))
    except GatedRepoError:
        raise missing(f"{repo_id}: the {what} is gated; accept its terms on the Hub and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise missing(f"{repo_id}: no such {what} on the Hub, or it is private and you are not logged in") from None
    except RevisionNotFoundError:
        raise missing(f"{repo_id}: revision {revision or 'main'!r} does not exist") from None
    except LocalEntryNotFoundError as exc:  # the Hub was not asked (offline) or did not answer, and the cache lacks it
        if exc.__cause__ is not None and not isinstance(exc.__cause__, OfflineModeIsEnabled):
            doing = "looking it up, as the local Hugging Face cache lacks it"
            raise hub_error(repo_id, exc.__cause__, doing) from None
        raise missing(
            f"{repo_id}: not in the local Hugging Face cache and the Hub cannot be reached (offline?); "
            f"download it once with network access, or pass {local}"
        ) from None
    except hub_failures() as exc:
        raise hub_error(repo_id, exc, "downloading") from None


def local_or_hub(location: str | Path, revision: str | None = None, allow_patterns: list[str] | None = None) -> Path:
    """``location`` itself when it exists here or cannot be a Hub repo id, else the repository resolved by
    :func:`resolve_checkpoint` (downloading only ``allow_patterns``; offline, from the cache).

    What every command and library function naming a model or checkpoint calls first. A local path always wins
    over a repo id of the same spelling (``revision`` is then ignored, with a warning); next the name of a tiny
    model shipped with the package (``ernie-moe-bytes``, ``qwen2-bytes``: ``TINY_MODELS``), then a Hub repo id.
    A missing path that is neither (``./ckpt``, ``ckpt``) is handed back as it is, so that the caller's own error
    names it.
    """
    path = Path(location)
    if path.exists():
        if revision is not None:
            log.warning(f"{location}: a local path, so revision {revision!r} (for Hub repo ids) is ignored")
        return path
    if (shipped := _shipped(location, revision)) is not None:
        return shipped
    if not is_repo_id(str(location)):
        return path
    return resolve_checkpoint(str(location), revision, allow_patterns)

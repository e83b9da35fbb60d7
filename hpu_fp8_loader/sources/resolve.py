"""Checkpoints on the Hugging Face Hub: resolving a repo id (or its local cache) to a directory.

Everything goes through huggingface_hub, so its offline mode (``HF_HUB_OFFLINE=1``), cache location
(``HF_HUB_CACHE``) and token sources apply unchanged. Every failure to reach the Hub, here or in
``publish``, becomes one line through :func:`hub_error`, naming the repo id, the endpoint and the reason.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import re
import socket
import ssl
from pathlib import Path
from urllib.parse import urlsplit

from hpu_fp8_loader.console import hub_bars_follow_ours
from hpu_fp8_loader.errors import CheckpointNotFoundError, HpuFp8Error, HubError, MalformedReplyError, one_line
from hpu_fp8_loader.io.hub_cache import names_in, snapshot_problem
from hpu_fp8_loader.sources.hub_replies import guard_hub_client
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
# What to do after a server error or a dropped connection: huggingface_hub keeps a file it finished downloading
# and an LFS object the Hub stored, and skips it on the next run (a file cut off midway starts over).
_AGAIN = "run the same command again to resume (files already transferred are not transferred again)"
# A reason quoted from the client is cut to this many characters: its messages can run to paragraphs.
_REASON_LIMIT = 200


# user:password@ in a URL: an HF_ENDPOINT may carry credentials, which no message repeats.
_URL_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+@")


def _without_credentials(text: str) -> str:
    return _URL_CREDENTIALS.sub("***@", text)


def _check_endpoint(repo_id: str) -> None:
    """Refuse an HF_ENDPOINT that is no http(s) URL with a host, or is plain http to another machine, naming the
    repo id that was to be reached.

    Checked before huggingface_hub is imported: its constants module fails to import on some such values
    (``http://[::1``), and with the others (``notaurl``, ``ftp://...``) every request fails. Plain http would
    send the token in the clear, and let anyone on the way answer in the Hub's name (huggingface_hub names cache
    files after what the server says; sources/hub_replies.py checks that, but a forged file needs no such trick).
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
    if parts.scheme == "http" and not _is_loopback(parts.hostname or ""):
        raise HubError(
            f"{repo_id}: HF_ENDPOINT {_without_credentials(repr(endpoint))} is plain http:// to another machine: the token "
            "and every file would cross the network unencrypted and could be altered on the way; use https:// (plain "
            "http:// only to this machine: 127.0.0.1, ::1, localhost)"
        )


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (a URL's host name) is this machine: ``localhost`` or a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower().rstrip(".") == "localhost"


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
    such as a card the Hub's YAML check refuses (ValueError); a reply refused before the client read it
    (:class:`~hpu_fp8_loader.errors.MalformedReplyError`), and the errors a reply of another shape than
    the client expects makes it raise (TypeError, KeyError, AttributeError, IndexError, AssertionError)."""
    from huggingface_hub.errors import HTTPError

    return (HTTPError, OSError, RuntimeError, ValueError, MalformedReplyError, *_UNREADABLE_REPLY)


# What huggingface_hub raises on a reply of a shape it does not expect (a list where it reads an object's key).
_UNREADABLE_REPLY = (TypeError, KeyError, AttributeError, IndexError, AssertionError)


def _reason(exc: BaseException) -> str:
    """``exc`` as a short phrase on one line: the client's messages span lines and can run to paragraphs."""
    text = _without_credentials(one_line(exc))
    cut = text[:_REASON_LIMIT] + ("..." if len(text) > _REASON_LIMIT else "")
    return f"{type(exc).__name__}: {cut}"


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception it was raised from or during (httpx wraps the socket's error twice)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _connection_failure(exc: BaseException, endpoint: str) -> tuple[str, bool]:
    """What is known of a failed connection to the Hub at ``endpoint``, as a phrase, and whether running again can
    get further (a dropped connection or a timeout may pass; an unknown host or a refused connection will not by
    itself)."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    hub = f"the Hub at {endpoint}"
    chain = _causes(exc)
    if any(isinstance(c, OfflineModeIsEnabled) for c in chain):
        return f"HF_HUB_OFFLINE is set, so {hub} was not asked", False
    if any(isinstance(c, socket.gaierror) for c in chain):
        return f"the host name of {hub} could not be resolved (DNS: {_reason(exc)})", False
    if any(isinstance(c, ConnectionRefusedError) or getattr(c, "errno", None) == errno.ECONNREFUSED for c in chain):
        return f"{hub} refused the connection", False
    if any(isinstance(c, ssl.SSLError) for c in chain):
        return f"the TLS handshake with {hub} failed ({_reason(exc)})", False
    if any(isinstance(c, TimeoutError) or "Timeout" in type(c).__name__ for c in chain):
        return f"the connection to {hub} timed out", True
    return f"the connection to {hub} failed ({_reason(exc)})", True


def hub_error(repo_id: str, exc: BaseException, doing: str, error: type[HpuFp8Error] = HubError) -> HpuFp8Error:
    """One line for a failure of the Hub, or of the connection to it, while ``doing``: the repository, the
    endpoint (HF_ENDPOINT), what is known of the cause and what to do; never the token (the client's messages do
    not hold it).

    Shared by every command that talks to the Hub. Refused credentials ask for a login. Running the same command
    again is offered only where it can get further (a server error, a dropped connection, a timeout): huggingface_hub
    then skips what it already transferred (a downloaded file, an uploaded LFS object). An endpoint that is no URL
    never gets this far (:func:`check_repo_id` refuses it).
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError

    endpoint = _without_credentials(constants.ENDPOINT)
    where = f"{repo_id}: the Hub at {endpoint}"
    status = exc.response.status_code if isinstance(exc, HfHubHTTPError) and exc.response is not None else None
    if status in (401, 403):
        return error(
            f"{where} refused the credentials (HTTP {status}) while {doing}; log in with "
            "`hf auth login` or set HF_TOKEN to a token with access to it (write access to publish)"
        )
    if status is not None and (status >= 500 or status == 429):
        return error(f"{where} answered HTTP {status} (a server error, or too many requests) while {doing}; {_AGAIN}")
    if status is not None:
        return error(f"{where} answered HTTP {status} while {doing} ({_reason(exc)})")
    if isinstance(exc, MalformedReplyError):
        settings = " (HF_ENDPOINT names it: is it a Hugging Face Hub?)" if os.environ.get("HF_ENDPOINT") else ""
        return error(f"{where} sent {exc.what} while {doing}; the reply was not used{settings}")
    if isinstance(exc, _UNREADABLE_REPLY):
        return error(f"{where} sent a reply huggingface_hub could not read while {doing} ({_reason(exc)})")
    if isinstance(exc, ValueError):
        return error(f"{repo_id}: the Hub client refused {doing}: {_reason(exc)}")
    failure, again = _connection_failure(exc, endpoint)
    return error(f"{repo_id}: {failure} while {doing}" + (f"; {_AGAIN}" if again else ""))


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
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.file_download import repo_folder_name

    what = "repository" if repo_type == "model" else f"{repo_type} repository"
    hub_bars_follow_ours()
    guard_hub_client()  # replies that would make the client write outside its cache are refused before it reads them
    repo_folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    verified, snapshots = names_in(repo_folder / "blobs"), names_in(repo_folder / "snapshots")
    try:
        snapshot = Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns))
    except GatedRepoError:
        raise missing(f"{repo_id}: the {what} is gated; accept its terms on the Hub and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise missing(f"{repo_id}: no such {what} on the Hub, or it is private and you are not logged in") from None
    except RevisionNotFoundError:
        raise missing(f"{repo_id}: revision {revision or 'main'!r} does not exist") from None
    except LocalEntryNotFoundError as exc:  # the Hub was not asked (offline) or did not answer, and the cache lacks it
        cause = exc.__cause__
        if cause is not None and not isinstance(cause, OfflineModeIsEnabled):
            lacks = "lacks some of its files" if isinstance(exc, IncompleteSnapshotError) else "lacks it"
            raise hub_error(repo_id, cause, f"looking it up, as the local Hugging Face cache {lacks}") from None
        why = "HF_HUB_OFFLINE is set, so the Hub was not asked" if constants.is_offline_mode() else "the Hub was not asked"
        cached = "only partly in" if isinstance(exc, IncompleteSnapshotError) else "not in"
        raise missing(
            f"{repo_id}: {cached} the local Hugging Face cache at {constants.HF_HUB_CACHE} (revision "
            f"{revision or 'main'!r}), and {why}; download it once with network access, or pass {local}"
        ) from None
    except hub_failures() as exc:
        raise hub_error(repo_id, exc, "downloading") from None
    if not snapshot.is_dir():  # huggingface_hub returns the revision's snapshot path even when it wrote nothing there
        others = sorted(names_in(repo_folder / "snapshots") - snapshots - {snapshot.name})
        why = (
            f"the Hub's file answers named commit {others[0]}, not the revision's commit {snapshot.name}"
            if others
            else f"no file of revision {revision or 'main'!r} matches {', '.join(allow_patterns)}"
        )
        raise missing(f"{repo_id}: nothing was downloaded: {why}")
    problem = snapshot_problem(snapshot, verified)
    if problem is not None:
        raise HubError(
            f"{repo_id}: in the Hugging Face cache, {problem}; nothing of it is used: delete {repo_folder} and download it again"
        )
    return snapshot


def local_or_hub(location: str | Path, revision: str | None = None, allow_patterns: list[str] | None = None) -> Path:
    """``location`` itself when it exists here or cannot be a Hub repo id, else the repository resolved by
    :func:`resolve_checkpoint` (downloading only ``allow_patterns``; offline, from the cache).

    What every command and library function naming a model or checkpoint calls first. A local path always wins
    over a repo id of the same spelling (``revision`` is then ignored, with a warning); next the name of a tiny
    model shipped with the package (``ernie-moe-bytes``, ``qwen2-bytes``, ``qwen3-bytes``, ``qwen3-moe-bytes``: ``TINY_MODELS``), then a Hub repo id.
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

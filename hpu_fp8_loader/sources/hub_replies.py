"""What the Hub (whatever HF_ENDPOINT names) answers, checked before huggingface_hub acts on it.

huggingface_hub 2.4 builds cache paths from what the server says: a file's blob is ``blobs/<ETag>``, its lock
``.locks/<repo>/<ETag>.lock``, a missing file's marker ``.no_exist/<X-Repo-Commit>/<file>``, a revision's snapshot
``snapshots/<sha>`` and its tree listing ``trees/<sha>.json``. None of these values is checked, so a server answering
``ETag: "../../../x"`` makes the client write ``x`` outside the cache. A response hook on the client's shared
session (``huggingface_hub.get_session()``, the documented place to customise its HTTP client) refuses such a
reply before the client reads it: an ETag that is no sha256 or git blob id (on a file download), an
``X-Repo-Commit`` or revision ``sha`` that is no 40-digit commit id. The same hook refuses replies of a shape the
client cannot read (revision info that is no object, ``siblings`` no list, ``whoami`` no object, a commit answer
without ``commitOid``), which would otherwise escape from it as a TypeError, KeyError or AttributeError.

A refusal raises :class:`MalformedReplyError`, which huggingface_hub lets through untouched; the code that called
the client turns it into its own one-line error (``sources.resolve.hub_error``), naming the repo id.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from hpu_fp8_loader.errors import MalformedReplyError
from hpu_fp8_loader.io.hub_cache import BLOB_NAME

__all__ = ["guard_hub_client"]

_COMMIT = re.compile(r"[0-9a-f]{40}")
# The routes whose JSON replies the client reads, by what follows the endpoint (which may carry a path prefix).
_REVISION = re.compile(r"/api/(?:models|datasets|spaces)/[^/]+/[^/]+(?:/revision/.*)?$")
_COMMIT_ROUTE = re.compile(r"/api/(?:models|datasets|spaces)/[^/]+/[^/]+/commit/")
_WHOAMI = re.compile(r"/api/whoami-v2$")
_TREE = re.compile(r"/api/(?:models|datasets|spaces)/[^/]+/[^/]+/tree/")
_FILE = re.compile(r"/resolve/")
_SHOWN = 60  # characters of a bad value quoted back


def _shown(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _revision_problem(info: object) -> str | None:
    if not isinstance(info, dict):
        return f"revision info that is {_kind(info)}, not an object"
    sha = info.get("sha")
    if not isinstance(sha, str) or not _COMMIT.fullmatch(sha):
        return f"revision info whose 'sha' is {_shown(sha)}, not a 40-digit commit id"
    siblings = info.get("siblings")
    if siblings is not None and (
        not isinstance(siblings, list) or not all(isinstance(s, dict) and isinstance(s.get("rfilename"), str) for s in siblings)
    ):
        return f"revision info whose 'siblings' is {_shown(siblings)}, not a list of {{rfilename: string}}"
    return None


def _tree_problem(entries: object) -> str | None:
    if not isinstance(entries, list):
        return f"a file listing that is {_kind(entries)}, not a list"
    for entry in entries:
        if (
            not isinstance(entry, dict)
            or entry.get("type") not in ("file", "directory")
            or not isinstance(entry.get("path"), str)
        ):
            return f"a file listing entry {_shown(entry)}, not an object with a 'type' and a 'path'"
        if entry["type"] == "file":
            lfs = entry.get("lfs")
            if type(entry.get("size")) is not int or not isinstance(entry.get("oid"), str):
                return f"a file listing entry for {_shown(entry['path'])} without an integer 'size' and a string 'oid'"
            if lfs is not None and not (
                isinstance(lfs, dict) and isinstance(lfs.get("oid"), str) and type(lfs.get("size")) is int
            ):
                return f"a file listing entry for {_shown(entry['path'])} whose 'lfs' is {_shown(lfs)}"
    return None


def _whoami_problem(me: object) -> str | None:
    return None if isinstance(me, dict) else f"an account description (whoami) that is {_kind(me)}, not an object"


def _commit_problem(answer: object) -> str | None:
    if not isinstance(answer, dict):
        return f"a commit answer that is {_kind(answer)}, not an object"
    if not isinstance(answer.get("commitOid"), str) or not _COMMIT.fullmatch(answer["commitOid"]):
        return f"a commit answer whose 'commitOid' is {_shown(answer.get('commitOid'))}, not a 40-digit commit id"
    if not isinstance(answer.get("commitUrl"), str) or not isinstance(answer.get("pullRequestUrl"), str | None):
        return "a commit answer without a 'commitUrl' string (or a 'pullRequestUrl' that is no string)"
    return None


_JSON_ROUTES: tuple[tuple[re.Pattern[str], Callable[[object], str | None]], ...] = (
    (_REVISION, _revision_problem),
    (_TREE, _tree_problem),
    (_WHOAMI, _whoami_problem),
    (_COMMIT_ROUTE, _commit_problem),
)


def _header_problem(response) -> str | None:
    """A header the client would build a cache path from that is no hash or commit id."""
    commit = response.headers.get("X-Repo-Commit")
    if commit is not None and not _COMMIT.fullmatch(commit):
        return f"X-Repo-Commit {_shown(commit)}, not a 40-digit commit id"
    if response.status_code >= 400 or not _FILE.search(response.request.url.path):
        return None
    header = "X-Linked-Etag" if response.headers.get("X-Linked-Etag") else "ETag"  # the client's choice, and order
    etag = response.headers.get(header)
    if etag is not None and not BLOB_NAME.fullmatch(etag.lstrip("W/").strip('"')):
        # file_download._normalize_etag, exactly: what it leaves is the blob's file name
        return f"{header} {_shown(etag)} for a file, not its sha256 or git blob id (it would name a file in the cache)"
    return None


def _check_reply(response) -> None:
    """The response hook: raise :class:`MalformedReplyError` for a reply the client must not act on."""
    problem = _header_problem(response)
    if problem is None and response.status_code == 200:
        path = response.request.url.path
        check = next((check for pattern, check in _JSON_ROUTES if pattern.search(path)), None)
        if check is not None:
            response.read()
            try:
                problem = check(json.loads(response.content))
            except (ValueError, RecursionError):  # not JSON at all: the client's own error says so
                problem = None
    if problem is not None:
        raise MalformedReplyError(problem)


def guard_hub_client() -> None:
    """Add the reply check to huggingface_hub's shared HTTP client, once; call it before every use of the client
    (a client made anew, e.g. after ``set_client_factory``, gets it again)."""
    from huggingface_hub import get_session

    client = get_session()
    hooks = client.event_hooks
    if _check_reply not in hooks["response"]:
        client.event_hooks = {**hooks, "response": [*hooks["response"], _check_reply]}

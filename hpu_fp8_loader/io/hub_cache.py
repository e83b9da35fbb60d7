"""huggingface_hub's cache as its ``file_download.py`` lays it out, and which links in it are the cache's own.

A file of a downloaded repository is a link ``<cache>/<kind>s--ORG--NAME/snapshots/<commit>/<file>`` ->
``../../blobs/<etag>``, where ``<etag>`` is the Hub's ETag of the file: the sha256 of an LFS file, the git blob
id (sha1) of any other. Such a link is followed only when the snapshot really lies in huggingface_hub's cache
(its root from ``huggingface_hub.constants`` or the environment, read at each call) and the link lands, without
leaving that repository through another link, on a regular file directly in the repository's own ``blobs``
directory. A directory merely shaped like a snapshot elsewhere (``x/snapshots/model`` with ``x/blobs`` a link
to ``/proc/self``) gets nothing followed, so its ``vocab.txt -> ../../blobs/environ`` never reads a token.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path

__all__ = ["BLOB_NAME", "blob_digest", "cache_blob", "cache_roots", "names_in", "snapshot_problem", "snapshot_repo"]

# How huggingface_hub names a repository's folder in the cache: repo_folder_name() in file_download.py.
_REPO_FOLDER = re.compile(r"(models|datasets|spaces)--.+")
# The name of a blob as the Hub gives it: a git blob id (sha1, 40 hex digits) or an LFS sha256 (64).
BLOB_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_READ_BYTES = 8 << 20


def cache_roots() -> set[Path]:
    """The real paths of every directory that is huggingface_hub's cache for this process.

    ``huggingface_hub.constants.HF_HUB_CACHE`` as it stands now (it is fixed at import, a caller may reassign it),
    and the cache the environment names now (``HF_HUB_CACHE``, ``HUGGINGFACE_HUB_CACHE``, ``HF_HOME``/hub,
    ``XDG_CACHE_HOME``), spelled out as constants.py does. Both are the user's own settings.
    """
    from huggingface_hub import constants

    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    from_environment = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return {Path(os.path.realpath(os.path.expandvars(os.path.expanduser(p)))) for p in (constants.HF_HUB_CACHE, from_environment)}


def snapshot_repo(root: str | Path) -> Path | None:
    """The real repository folder (``<cache>/models--ORG--NAME``) when ``root`` is a snapshot directory in the
    cache (``.../snapshots/<commit>``), else None."""
    real = Path(os.path.realpath(root))
    repo = real.parent.parent
    if real.parent.name != "snapshots" or not _REPO_FOLDER.fullmatch(repo.name) or repo.parent not in cache_roots():
        return None
    return repo


def _lstat(path: str | Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def cache_blob(root: str | Path, member: str | Path) -> Path | None:
    """The blob ``member`` links to when it is the cache's own link, else None.

    ``root`` must be a snapshot in the cache (:func:`snapshot_repo`) and ``member`` a link in it (a file path
    inside ``root``, its directories real ones inside the snapshot) whose target, taken from the link's real
    directory, names a file directly in the repository's ``blobs``: a real directory (no link) of the
    repository itself, holding the blob as a regular file (no link) named like a Hub ETag. No link is followed
    to decide this, so nothing outside the cache can pass for a blob.
    """
    repo = snapshot_repo(root)
    member = Path(os.path.abspath(member))
    link = _lstat(member)
    if repo is None or link is None or not stat.S_ISLNK(link.st_mode):
        return None
    directory = Path(os.path.realpath(member.parent))
    if not directory.is_relative_to(os.path.realpath(root)):
        return None
    target = Path(os.path.normpath(directory / os.readlink(member)))
    blobs, found_dir, blob = _lstat(repo / "blobs"), _lstat(target.parent), _lstat(target)
    if blobs is None or found_dir is None or blob is None or not BLOB_NAME.fullmatch(target.name):
        return None
    own_blobs = stat.S_ISDIR(blobs.st_mode) and (found_dir.st_dev, found_dir.st_ino) == (blobs.st_dev, blobs.st_ino)
    return repo / "blobs" / target.name if own_blobs and stat.S_ISREG(blob.st_mode) else None


def blob_digest(path: Path) -> str:
    """What the Hub would name the blob at ``path``: its sha256 when its name has 64 digits, else its git blob id."""
    size = os.path.getsize(path)
    digest = hashlib.sha256() if len(path.name) == 64 else hashlib.sha1(b"blob %d\x00" % size)
    with open(path, "rb") as file:
        while block := file.read(_READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


def names_in(directory: Path) -> set[str]:
    """The names in a directory of the cache now (none when it does not exist yet): a repository's blobs or
    snapshots, before a download, to tell what the download added."""
    try:
        return set(os.listdir(directory))
    except OSError:
        return set()


def snapshot_problem(snapshot: str | Path, verified: set[str]) -> str | None:
    """Why the snapshot huggingface_hub returned is no sound part of its cache, or None.

    It must be ``<cache>/<kind>s--ORG--NAME/snapshots/<40-digit commit>`` in the real cache; every file in it a
    regular file or the cache's own link into the repository's blobs (:func:`cache_blob`), no directory a link;
    and every blob not in ``verified`` (those present before this download) must hash to its own name, as the
    Hub names it (the ETag): else the server named a blob after some other content.
    """
    snapshot = Path(snapshot)
    if snapshot_repo(snapshot) is None or not re.fullmatch(r"[0-9a-f]{40}", snapshot.name):
        return f"the snapshot {snapshot} is not a commit's directory inside the cache"
    for directory, subdirectories, files in os.walk(snapshot):  # links are listed, never followed
        for name in subdirectories + files:
            member = Path(directory) / name
            found = os.lstat(member)
            if stat.S_ISREG(found.st_mode) or (stat.S_ISDIR(found.st_mode) and name in subdirectories):
                continue  # a copy (the cache on a file system without links), or a subdirectory of the snapshot
            blob = cache_blob(snapshot, member)
            relative = member.relative_to(snapshot)
            if blob is None:
                return f"{relative} in the snapshot is no link into the repository's blobs (it leads to {os.readlink(member)!r})"
            if blob.name not in verified and blob_digest(blob) != blob.name:
                return f"the content of {relative} does not hash to its blob name {blob.name}"
    return None

"""What a hostile or broken Hub (whatever HF_ENDPOINT names) can answer, through the real huggingface_hub client
against the Hub double (issue 28, items 4 and 5; issue 23, item 10).

A blob named after the server's ETag (``"../../../x"``) or a commit id that is a path must never write outside the
Hugging Face cache; a reply of the wrong shape (revision info a list, ``siblings`` a string, ``sha`` a number,
``whoami`` a list, a commit answer without ``commitOid``) is one line naming the repo id and what was malformed;
a plain ``http://`` endpoint to another machine is refused before the token is sent.

The commands run in this process: huggingface_hub's endpoint and cache, fixed when it was imported, are pointed
at the double and a private cache for each test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from doubles.hub import HubTestDouble, Repo, StoredFile

from hostile.refusal import assert_refused, run_cli, tree_digest

COMMIT = "1" * 40


@pytest.fixture
def hub(tmp_path, monkeypatch, spec_factory):
    """The Hub double serving ``acme/fp8`` (an hpu-fp8 checkpoint), with huggingface_hub pointed at it."""
    from huggingface_hub import constants

    double = HubTestDouble().start()
    files = {p.name: StoredFile(p.read_bytes(), lfs=p.suffix == ".safetensors") for p in spec_factory("qwen2-tiny").iterdir()}
    double.repos["acme/fp8"] = Repo(private=False, branches={"main": COMMIT}, files={COMMIT: files})
    cache = tmp_path / "place" / "hf-cache"
    for name, value in {
        "HF_ENDPOINT": double.url,
        "HF_TOKEN": next(iter(double.valid_tokens)),
        "HF_HUB_CACHE": str(cache),
        "HF_HOME": str(tmp_path / "place" / "hf-home"),
        "HF_HUB_DISABLE_XET": "1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "ENDPOINT", double.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", double.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    yield double
    double.stop()


def outside_the_cache(tmp_path: Path) -> dict[str, str]:
    """Everything under tmp_path but the cache and HF_HOME (which huggingface_hub may write to): where an escaping
    write would land."""
    ours = ("place/hf-cache", "place/hf-home")
    return {name: digest for name, digest in tree_digest(tmp_path).items() if name != "place" and not name.startswith(ours)}


def test_the_double_serves_a_pull(hub, tmp_path):
    """The control: the same setup without hostility downloads and checks the checkpoint."""
    result = run_cli("pull", "acme/fp8")
    assert result.exit_code == 0, result.output
    assert Path(result.stdout.strip()).parents[2] == tmp_path / "place" / "hf-cache"


# Each lands inside tmp_path if followed (the cache is tmp_path/place/hf-cache; its blobs four levels below tmp_path).
ESCAPING_ETAGS = {
    "parent dirs": '"../../../escaped"',
    "more parent dirs": '"../../../../escaped"',
    "absolute": '"{tmp}/escaped"',
    "weak": 'W/"../../../escaped"',
    "a name, not a hash": '"not-a-hash"',
}


@pytest.mark.parametrize("etag", list(ESCAPING_ETAGS.values()), ids=list(ESCAPING_ETAGS))
@pytest.mark.parametrize("header", ["ETag", "X-Linked-Etag"])
def test_a_blob_name_from_the_server_that_is_no_hash_writes_nothing_outside_the_cache(hub, tmp_path, etag, header):
    before = outside_the_cache(tmp_path)
    hub.file_headers = {header: etag.format(tmp=tmp_path)}
    assert_refused(run_cli("pull", "acme/fp8"), "acme/fp8", header)
    assert outside_the_cache(tmp_path) == before


@pytest.mark.parametrize("commit", ["../../../escaped", "{tmp}/escaped", "main", "1" * 39])
def test_a_commit_id_from_the_server_that_is_no_commit_id_writes_nothing_outside_the_cache(hub, tmp_path, commit):
    before = outside_the_cache(tmp_path)
    hub.file_headers = {"X-Repo-Commit": commit.format(tmp=tmp_path)}
    assert_refused(run_cli("pull", "acme/fp8"), "acme/fp8", "X-Repo-Commit")
    assert outside_the_cache(tmp_path) == before


@pytest.mark.parametrize("sha", ["../../../escaped", "{tmp}/escaped", 5, None, ["a"]])
def test_a_revision_sha_that_is_no_commit_id_writes_nothing_outside_the_cache(hub, tmp_path, sha):
    before = outside_the_cache(tmp_path)
    hub.replies["revision_info"] = lambda body: {**body, "sha": sha.format(tmp=tmp_path) if isinstance(sha, str) else sha}
    assert_refused(run_cli("pull", "acme/fp8"), "acme/fp8", "'sha'")
    assert outside_the_cache(tmp_path) == before

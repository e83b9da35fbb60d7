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

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from doubles.hub import HubTestDouble, Repo, StoredFile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
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


@pytest.mark.parametrize(
    "name", ["../escaped.json", "../" + "2" * 40 + "/config.json", "{tmp}/escaped.json", "a/../../escaped.json"]
)
def test_a_file_name_in_the_listing_that_leaves_its_snapshot_writes_nothing_there(hub, tmp_path, name):
    """A listed file name is a path inside the commit's snapshot to huggingface_hub; one that climbs out of it (into
    another commit's snapshot, or anywhere) is refused in one line, and nothing lands outside the snapshot."""
    name = name.format(tmp=tmp_path)
    hub.repos["acme/fp8"].files[COMMIT][name] = StoredFile(b'{"planted": true}', lfs=False)
    before = outside_the_cache(tmp_path)
    snapshots = tmp_path / "place" / "hf-cache" / "models--acme--fp8" / "snapshots"
    assert_refused(run_cli("pull", "acme/fp8"), "acme/fp8")
    assert outside_the_cache(tmp_path) == before
    planted = [p for p in snapshots.rglob("*") if p.is_file() and b"planted" in p.read_bytes()] if snapshots.exists() else []
    assert planted == [], planted


def test_a_source_repo_with_a_hostile_etag_is_refused_by_convert_and_push(hub, tmp_path, source_factory):
    """convert ORG/NAME and push ORG/NAME download their source the same way as pull."""
    from hpu_fp8_loader.sources.measurements import write_measurements
    from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements

    source = source_factory("qwen2-tiny")
    files = {p.name: StoredFile(p.read_bytes(), lfs=p.suffix == ".safetensors") for p in source.iterdir()}
    hub.repos["acme/src"] = Repo(private=False, branches={"main": COMMIT}, files={COMMIT: files})
    write_measurements(tmp_path / "m.json", synthetic_measurements(preset_config("qwen2-tiny")))
    hub.file_headers = {"ETag": '"../../../escaped"'}
    before = outside_the_cache(tmp_path)
    assert_refused(run_cli("convert", "acme/src", tmp_path / "out", "--measurements", tmp_path / "m.json"), "acme/src", "ETag")
    push = ["push", "acme/src", "--repo-id", "acme/out", "--measurements", tmp_path / "m.json", "--license", "mit"]
    assert_refused(run_cli(*push, "--dry-run", "--work-dir", tmp_path / "work"), "acme/src", "ETag")
    assert outside_the_cache(tmp_path) == {**before, "m.json": before["m.json"]}


def test_a_blob_named_after_other_content_is_refused_after_the_download(hub, tmp_path):
    """A well-formed name that is not the content's hash passes the reply check; the snapshot check after the
    download finds it (the blob would otherwise serve every later download that names that hash)."""
    hub.file_headers = {"ETag": '"' + "ab" * 32 + '"', "X-Linked-Etag": '"' + "ab" * 32 + '"'}
    line = assert_refused(run_cli("pull", "acme/fp8"), "acme/fp8", "does not hash to its blob name", "delete")
    assert "models--acme--fp8" in line


# What a broken or hostile Hub may answer in place of each reply the client reads: (route, rewrite, command).
PULL, WHOAMI, COMMIT_ROUTE = "pull", "push (whoami)", "push (commit)"
MALFORMED = {
    "revision info a list": ("revision_info", lambda body: [body], PULL, "revision info that is a list"),
    "revision info {}": ("revision_info", lambda body: {}, PULL, "'sha' is null"),
    "revision info a string": ("revision_info", lambda body: "main", PULL, "revision info that is a string"),
    "siblings a string": ("revision_info", lambda body: {**body, "siblings": "x"}, PULL, "'siblings'"),
    "siblings of numbers": ("revision_info", lambda body: {**body, "siblings": [1, 2]}, PULL, "'siblings'"),
    "sha a number": ("revision_info", lambda body: {**body, "sha": 5}, PULL, "'sha' is 5"),
    "tree an object": ("tree", lambda body: {}, PULL, "file listing that is an object"),
    "tree entry without a path": ("tree", lambda body: [{"type": "file"}], PULL, "file listing entry"),
    "tree size a string": ("tree", lambda body: [{**e, "size": "1"} for e in body], PULL, "integer 'size'"),
    "tree lfs a string": ("tree", lambda body: [{**e, "lfs": "x"} for e in body], PULL, "'lfs'"),
    "whoami a list": ("whoami_v2", lambda body: [body], WHOAMI, "whoami) that is a list"),
    "whoami null": ("whoami_v2", lambda body: None, WHOAMI, "whoami) that is null"),
    "commit a list": ("commit", lambda body: [body], COMMIT_ROUTE, "commit answer that is a list"),
    "commit without commitOid": (
        "commit",
        lambda body: {k: v for k, v in body.items() if k != "commitOid"},
        COMMIT_ROUTE,
        "'commitOid' is null",
    ),
    "commitOid a number": ("commit", lambda body: {**body, "commitOid": 7}, COMMIT_ROUTE, "'commitOid' is 7"),
    "commit without commitUrl": (
        "commit",
        lambda body: {k: v for k, v in body.items() if k != "commitUrl"},
        COMMIT_ROUTE,
        "'commitUrl'",
    ),
}


@pytest.fixture
def push_source(tmp_path, source_factory):
    from hpu_fp8_loader.sources.measurements import write_measurements
    from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements

    write_measurements(tmp_path / "m.json", synthetic_measurements(preset_config("qwen2-tiny")))
    return source_factory("qwen2-tiny")


def push_argv(tmp_path, source, *extra):
    return ("push", source, "--repo-id", "acme/out", "--base-model", "acme/src", "--license", "mit", "--skip-eval",
            "--measurements", tmp_path / "m.json", "--work-dir", tmp_path / "work", *extra)  # fmt: skip


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_reply_of_the_wrong_shape_is_one_line_naming_the_repo_and_what_was_malformed(hub, tmp_path, push_source, case):
    route, rewrite, command, what = MALFORMED[case]
    hub.replies[route] = rewrite
    before = outside_the_cache(tmp_path)
    result = run_cli("pull", "acme/fp8") if command == PULL else run_cli(*push_argv(tmp_path, push_source))
    repo = "acme/fp8" if command == PULL else "acme/out"
    line = assert_refused(result, repo, what)
    assert "the reply was not used" in line
    after = outside_the_cache(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("work")} == before
    if command != COMMIT_ROUTE:
        assert not (tmp_path / "work").exists()  # refused before any work


# -------------------------------------------------------------------------- HF_ENDPOINT and what the messages claim


@pytest.mark.parametrize(
    "endpoint", ["http://hub.example.com", "http://10.0.0.1:8080", "http://[2001:db8::1]", "HTTP://Example.org/mirror"]
)
@pytest.mark.parametrize("command", ["pull", "convert", "push"])
def test_plain_http_to_another_machine_is_refused_before_the_token_is_sent(tmp_path, monkeypatch, endpoint, command):
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value")
    argv = {
        "pull": ("pull", "acme/fp8"),
        "convert": ("convert", "acme/src", tmp_path / "out", "--measurements", tmp_path / "m.json"),
        "push": ("push", "acme/src", "--repo-id", "acme/out", "--calibrate", "--license", "mit"),
    }[command]
    line = assert_refused(run_cli(*argv), "acme/", "HF_ENDPOINT", "plain http://", "https://")
    assert "hf_secret_token_value" not in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9", "http://localhost:9", "http://[::1]:9", "http://127.1.2.3:9"])
def test_plain_http_to_this_machine_is_allowed_and_a_refused_connection_says_so(monkeypatch, endpoint):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    line = assert_refused(run_cli("pull", "acme/fp8"), "acme/fp8", "refused the connection")
    assert "resume" not in line and "offline?" not in line  # nothing to resume; no guess at the cause


def test_a_host_that_does_not_resolve_is_named_as_a_dns_failure(monkeypatch):
    from huggingface_hub import constants

    endpoint = "https://no-such-host.invalid"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    line = assert_refused(run_cli("pull", "acme/fp8"), "acme/fp8", "no-such-host.invalid", "could not be resolved (DNS")
    assert "resume" not in line and "offline?" not in line


def test_offline_with_an_empty_cache_says_hf_hub_offline_is_set(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    line = assert_refused(
        run_cli("pull", "acme/fp8"), "acme/fp8", "HF_HUB_OFFLINE is set", f"cache at {tmp_path / 'empty-cache'}"
    )
    assert "resume" not in line and "offline?" not in line


def test_a_dropped_connection_offers_the_resume_huggingface_hub_really_does(hub, tmp_path, push_source):
    hub.drop_commit = True
    line = assert_refused(run_cli(*push_argv(tmp_path, push_source)), "acme/out", "while uploading")
    assert "run the same command again to resume" in line
    assert run_cli(*push_argv(tmp_path, push_source)).exit_code == 0  # and it does: the second run publishes


# ------------------------------------------------------------------------------------ property-based: any reply

# Each example runs a real pull (or upload) against the double: the whole suite's profile is capped for them.
PULL_EXAMPLES = min(settings().max_examples, 50)
UPLOAD_EXAMPLES = min(settings().max_examples, 10)

# Any JSON value, and values close to what the client expects (a commit id, a path, a list of file objects).
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
near_values = st.sampled_from(
    [COMMIT, "2" * 40, "../../../escaped", "/etc", "", [{"rfilename": "config.json"}], [{"rfilename": 5}], {"sha": COMMIT}]
)
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=70) | st.sampled_from(
    ['"' + "a" * 64 + '"', "a" * 40, COMMIT, '"../x"', "W/", '""']
)


@contextmanager
def fresh_cache(tmp_path: Path) -> Iterator[None]:
    """A new, empty Hugging Face cache for one example: with the last one's, the client would take the files, or
    the file listing, from the cache and never see the reply under test."""
    from huggingface_hub import constants

    (tmp_path / "place" / "hf-cache").mkdir(parents=True, exist_ok=True)
    cache = tempfile.mkdtemp(dir=tmp_path / "place" / "hf-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_CACHE", cache)
        patch.setenv("HF_HUB_CACHE", cache)
        yield


def pull_is_used_or_refused(hub: HubTestDouble, tmp_path: Path, replies: dict | None = None, headers: dict | None = None):
    """``pull`` against the double answering with ``replies`` and file ``headers``, from a fresh cache; its outcome one
    of those documented: the checkpoint, from the cache, or one line naming the repo. Never a traceback or another
    exception, never a write outside the cache."""
    before = outside_the_cache(tmp_path)
    hub.replies, hub.file_headers = replies or {}, headers or {}
    with fresh_cache(tmp_path):
        result = run_cli("pull", "acme/fp8")
    if result.exit_code == 0:
        assert Path(result.stdout.strip()).is_relative_to(tmp_path / "place" / "hf-cache")
    else:
        assert_refused(result, "acme/fp8")
    assert outside_the_cache(tmp_path) == before


def rewrite_field(field: str | None, value: object):
    """A rewrite of a JSON object reply: ``field`` set to ``value`` (None: the whole reply replaced by it)."""
    return lambda body: value if field is None else {**body, field: value}


def rewrite_entries(field: str | None, value: object):
    """A rewrite of the file listing: every entry's ``field`` set to ``value`` (None: the whole listing replaced)."""
    return lambda body: value if field is None else [{**entry, field: value} for entry in body]


@given(
    field=st.sampled_from([None, "sha", "siblings", "id", "private", "lastModified", "cardData", "gated"]),
    value=json_values | near_values,
)
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=PULL_EXAMPLES)
def test_any_revision_info_is_used_or_refused_in_one_line(hub, tmp_path, field, value):
    pull_is_used_or_refused(hub, tmp_path, replies={"revision_info": rewrite_field(field, value)})


@given(field=st.sampled_from([None, "type", "path", "size", "oid", "lfs", "xetHash"]), value=json_values | near_values)
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=PULL_EXAMPLES)
def test_any_file_listing_is_used_or_refused_in_one_line(hub, tmp_path, field, value):
    pull_is_used_or_refused(hub, tmp_path, replies={"tree": rewrite_entries(field, value)})


@given(header=st.sampled_from(["ETag", "X-Linked-Etag", "X-Repo-Commit", "X-Linked-Size"]), value=header_values)
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=PULL_EXAMPLES)
def test_any_download_header_is_used_or_refused_in_one_line(hub, tmp_path, header, value):
    pull_is_used_or_refused(hub, tmp_path, headers={header: value})


@given(field=st.sampled_from([None, "type", "name", "orgs", "auth"]), value=json_values | near_values)
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_whoami_is_accepted_or_refused_as_an_upload_error(hub, field, value):
    from huggingface_hub import HfApi

    from hpu_fp8_loader.errors import HubError
    from hpu_fp8_loader.hub.publish import check_write_access
    from hpu_fp8_loader.sources.hub_replies import guard_hub_client

    hub.replies = {"whoami_v2": rewrite_field(field, value)}
    guard_hub_client()
    try:
        check_write_access(HfApi(), "acme/out")
    except HubError as exc:  # UploadError is one: one line, naming the repository
        assert str(exc).startswith("acme/out: ") and "\n" not in str(exc)


@given(field=st.sampled_from([None, "commitOid", "commitUrl", "pullRequestUrl"]), value=json_values | near_values)
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=UPLOAD_EXAMPLES)
def test_any_commit_answer_is_verified_or_refused_as_an_upload_error(hub, spec_factory, field, value):
    """The upload of a real checkpoint, whatever the commit answer: a verified upload, or one line naming the repo."""
    from huggingface_hub import HfApi

    from hpu_fp8_loader.errors import HubError
    from hpu_fp8_loader.hub.publish import PushOptions, _upload
    from hpu_fp8_loader.sources.hub_replies import guard_hub_client

    hub.replies = {"commit": rewrite_field(field, value)}
    guard_hub_client()
    try:
        commit_url, _ = _upload(HfApi(), spec_factory("qwen2-tiny"), PushOptions("acme/out"), say=lambda line: None)
    except HubError as exc:
        assert str(exc).startswith("acme/out: ") and "\n" not in str(exc)
    else:
        assert isinstance(commit_url, str)

"""Publishing: model cards, and `hpu-fp8 push` through the real huggingface_hub client against a test
double of the Hub on 127.0.0.1 (tests/doubles/hub.py), LFS path included."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from doubles.hub import HubTestDouble
from huggingface_hub import ModelCard, ModelCardData

from hpu_fp8_loader.conversion.folds import Fold
from hpu_fp8_loader.hub.cards import render_card
from hpu_fp8_loader.hub.publish import git_blob_id
from hpu_fp8_loader.quality.calibrate import CalibrationOptions
from hpu_fp8_loader.quality.evaluate import evaluate
from hpu_fp8_loader.quality.stress import stress_model
from hpu_fp8_loader.sources.measurements import read_measurements, write_measurements
from hpu_fp8_loader.sources.synth import synthetic_measurements
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS

pytestmark = pytest.mark.slow  # subprocesses against the Hub double: the inner loop leaves them to CI

TOKEN = "hf_test_double_token"
QWEN = str(TINY_MODELS["qwen2-bytes"])


@pytest.fixture
def hub():
    double = HubTestDouble(valid_tokens=[TOKEN]).start()
    yield double
    double.stop()
    assert double.unknown_routes == []  # the client only used what the double speaks


def run(
    args: list[str], hub: HubTestDouble | None, tmp_path: Path, token: str = TOKEN, endpoint: str | None = None
) -> subprocess.CompletedProcess:
    """``hpu-fp8 ARGS`` against ``hub`` (or ``endpoint``; by default a closed port), with a private cache."""
    env = {
        **os.environ,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
        "HF_TOKEN": token,
        "HF_ENDPOINT": endpoint or (hub.url if hub else "http://127.0.0.1:9"),
    }
    return subprocess.run(
        [str(Path(sys.executable).with_name("hpu-fp8")), *args], capture_output=True, text=True, env=env, check=False
    )


def push_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "push",
        QWEN,
        "--repo-id",
        "acme/qwen2-bytes-hpu-fp8",
        "--calibrate",
        "--license",
        "apache-2.0",
        "--base-model",
        "acme/qwen2-bytes",
        "--kv-cache",
        "none",
        "--work-dir",
        str(tmp_path / "work"),
        *extra,
    ]


def test_push_then_load_gives_identical_bytes(tmp_path, hub):
    pushed = run(push_args(tmp_path), hub, tmp_path)
    assert pushed.returncode == 0, pushed.stderr
    assert "published and verified" in pushed.stdout
    pulled = run(["pull", "acme/qwen2-bytes-hpu-fp8"], hub, tmp_path)
    assert pulled.returncode == 0, pulled.stderr
    local, remote = tmp_path / "work" / "checkpoint", Path(pulled.stdout.strip())
    names = sorted(p.name for p in local.iterdir())
    assert names == sorted(p.name for p in remote.iterdir()) and {"README.md", "hpu_fp8_measurements.json"} <= set(names)
    assert filecmp.cmpfiles(local, remote, names, shallow=False)[1:] == ([], [])
    assert hub.lfs_uploads >= 2  # the weights took the LFS path
    card = (remote / "README.md").read_text()
    plots = sorted(name for name in names if name.startswith("report-") and name.endswith(".png"))
    assert {"report-calibrate-linear_error.png", "report-eval-linear_error.png"} <= set(plots)  # pulled and verified
    assert all(f"]({name})" in card for name in plots)  # the card shows every uploaded plot
    assert "`hpu_fp8_measurements.json`" in card and "hpu-fp8 push acme/qwen2-bytes --repo-id acme/qwen2-bytes-hpu-fp8" in card
    assert str(tmp_path) not in card and "tiny_models" not in card  # no local path in the public card


def assert_one_error_line(result: subprocess.CompletedProcess, *names: str) -> str:
    """Refused as tests/hostile/refusal.py asserts for in-process runs: a non-zero exit and one line on stderr,
    ``hpu-fp8: error: ...``, naming each of ``names``; no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and lines[0].startswith("hpu-fp8: error: "), result.stderr
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    return lines[0]


UNREACHABLE = {
    "not-a-url": "notaurl",
    "ftp": "ftp://127.0.0.1:9",
    "no-host": "http://",
    "bad-ipv6": "http://[::1",  # huggingface_hub's own constants module cannot even be imported
    "closed-port": "http://127.0.0.1:9",
}


@pytest.mark.parametrize("endpoint", list(UNREACHABLE.values()), ids=list(UNREACHABLE))
@pytest.mark.parametrize(
    "command",
    [
        ["pull", "me/none"],
        ["pull", "me/none", "--revision", "fp8"],
        ["convert", "me/none", "out", "--measurements", "m.json"],
        ["push", "me/none", "--repo-id", "me/x", "--calibrate", "--license", "mit", "--dry-run"],
    ],
    ids=["pull", "pull-revision", "convert", "push-dry-run"],
)
def test_a_hub_that_cannot_be_reached_is_one_line_naming_the_repo_and_the_endpoint(tmp_path, endpoint, command):
    result = run(command, None, tmp_path, endpoint=endpoint)
    line = assert_one_error_line(result, "me/", endpoint)  # push names the first repo id it checks, --repo-id
    if endpoint != UNREACHABLE["closed-port"]:
        assert "HF_ENDPOINT" in line  # a URL the client cannot use: say which setting to fix
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("endpoint", ["notaurl", "ftp://127.0.0.1:9", "http://[::1"])
def test_push_to_an_endpoint_that_is_no_url_is_one_line_naming_it(tmp_path, endpoint):
    result = run(push_args(tmp_path), None, tmp_path, endpoint=endpoint)
    assert_one_error_line(result, "acme/qwen2-bytes-hpu-fp8", endpoint, "HF_ENDPOINT")
    assert not (tmp_path / "work").exists()  # refused while checking the token, before any work


@pytest.mark.parametrize(
    ("args", "token", "names"),
    [
        (["pull", "acme/none"], TOKEN, ["acme/none", "no such repository"]),
        (["pull", "acme/empty", "--revision", "nope"], TOKEN, ["acme/empty", "'nope' does not exist"]),
        (["pull", "acme/empty"], "hf_not_a_token", ["acme/empty", "HTTP 401"]),
    ],
    ids=["no-repo", "no-revision", "bad-token"],
)
def test_pull_failures_on_the_hub_are_one_line(tmp_path, hub, args, token, names):
    from doubles.hub import Repo

    hub.repos["acme/empty"] = Repo(private=False)
    line = assert_one_error_line(run(args, hub, tmp_path, token=token), *names)
    assert token not in line


def test_a_hub_source_gives_the_license_of_its_card(tmp_path, hub):
    """SRC as a Hub id: its README.md is downloaded with the weights, so that its license needs no --license."""
    from doubles.hub import Repo, StoredFile

    files = {p.name: StoredFile(p.read_bytes(), lfs=p.suffix == ".safetensors") for p in Path(QWEN).iterdir()}
    files["README.md"] = StoredFile(b"---\nlicense: mit\n---\n# qwen2-bytes\n", lfs=False)
    hub.repos["acme/qwen2-bytes"] = Repo(private=False, branches={"main": "1" * 40}, files={"1" * 40: files})
    args = ["push", "acme/qwen2-bytes", "--repo-id", "acme/qwen2-bytes-hpu-fp8", "--calibrate", "--kv-cache", "none"]
    result = run([*args, "--skip-eval", "--dry-run", "--work-dir", str(tmp_path / "work")], hub, tmp_path)
    assert result.returncode == 0, result.stderr
    card = ModelCard((tmp_path / "work" / "checkpoint" / "README.md").read_text())
    assert card.data.license == "mit" and card.data.base_model == "acme/qwen2-bytes"


def files_at(hub: HubTestDouble, repo_id: str, revision: str) -> set[str]:
    repo = hub.repos[repo_id]
    return set(repo.files[repo.branches[revision]])


def test_push_to_a_revision_commits_there_and_leaves_main_alone(tmp_path, hub):
    result = run(push_args(tmp_path, "--revision", "fp8", "--skip-eval"), hub, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "published and verified" in result.stdout and "Traceback" not in result.stderr
    assert files_at(hub, "acme/qwen2-bytes-hpu-fp8", "main") == set()
    assert {"README.md", "hpu_fp8_manifest.json", "hpu_fp8_measurements.json"} <= files_at(hub, "acme/qwen2-bytes-hpu-fp8", "fp8")


def test_create_pr_opens_a_pull_request_and_verifies_its_revision(tmp_path, hub):
    assert run(push_args(tmp_path, "--skip-eval"), hub, tmp_path).returncode == 0
    main_before = files_at(hub, "acme/qwen2-bytes-hpu-fp8", "main")
    # Only the pull request's revision holds the altered file: a small one, stored as a git blob (not LFS).
    hub.corrupt_on_commit = "generation_config.json"
    corrupted = run(push_args(tmp_path, "--skip-eval", "--create-pr", "--commit-message", "again"), hub, tmp_path)
    assert corrupted.returncode == 1 and "generation_config.json: git blob id on the Hub differs" in corrupted.stderr
    result = run(push_args(tmp_path, "--skip-eval", "--create-pr", "--commit-message", "fp8 weights"), hub, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "pull request opened and verified" in result.stdout and "/acme/qwen2-bytes-hpu-fp8/discussions/2" in result.stdout
    assert files_at(hub, "acme/qwen2-bytes-hpu-fp8", "refs/pr/2") == main_before
    assert hub.repos["acme/qwen2-bytes-hpu-fp8"].branches["main"] != hub.repos["acme/qwen2-bytes-hpu-fp8"].branches["refs/pr/2"]


@pytest.mark.parametrize("failure", ["HTTP 507", "dropped connection"])
def test_a_failed_commit_never_reports_success(tmp_path, hub, failure):
    if failure == "HTTP 507":
        hub.fail_commit = 507
    else:
        hub.drop_commit = True
    result = run(push_args(tmp_path, "--skip-eval"), hub, tmp_path)
    assert result.returncode == 1 and "published" not in result.stdout and "Traceback" not in result.stderr
    assert "run the same command again to resume" in result.stderr and len(result.stderr.strip().splitlines()[-1]) < 400
    assert files_at(hub, "acme/qwen2-bytes-hpu-fp8", "main") == set()


def test_an_interrupted_upload_resumes(tmp_path, hub):
    hub.fail_lfs_after = 1
    first = run(push_args(tmp_path), hub, tmp_path)
    assert first.returncode == 1 and "run the same command again to resume" in first.stderr
    assert "Traceback" not in first.stderr
    stored_before = len(hub.lfs)
    hub.fail_lfs_after = None
    uploads_before = hub.lfs_uploads
    second = run(push_args(tmp_path), hub, tmp_path)
    assert second.returncode == 0, second.stderr
    assert stored_before >= 1 and hub.lfs_uploads - uploads_before == len(hub.lfs) - stored_before  # stored objects skipped


def test_a_bad_token_gets_a_clear_message_without_the_token(tmp_path, hub):
    secret = "hf_this_token_is_wrong_123"
    result = run(push_args(tmp_path), hub, tmp_path, token=secret)
    assert result.returncode == 1 and "refused the credentials (HTTP 401) while checking the token" in result.stderr
    assert secret not in result.stdout + result.stderr
    assert not (tmp_path / "work").exists() and "calibrating" not in result.stdout  # refused before any work


@pytest.mark.parametrize(
    ("token", "repo_id", "message"),
    [
        ("", "acme/x", "not logged in"),
        ("hf_read_only", "acme/x", "the token is read-only"),
        (TOKEN, "stranger/x", "stranger is neither the token's account (user) nor one of its organisations"),
        (TOKEN, "readers/x", "user may only read in the organisation readers"),
    ],
)
def test_no_write_access_is_refused_before_any_work(tmp_path, token, repo_id, message):
    double = HubTestDouble(valid_tokens=[TOKEN], read_tokens=["hf_read_only"], orgs={"acme": "admin", "readers": "read"}).start()
    try:
        args = push_args(tmp_path)
        args[args.index("--repo-id") + 1] = repo_id
        result = run(args, double, tmp_path, token=token)
    finally:
        double.stop()
    assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "work").exists() and double.repos == {} and double.unknown_routes == []


def test_an_existing_repository_is_pushed_to(tmp_path, hub):
    assert run(push_args(tmp_path), hub, tmp_path).returncode == 0
    again = run(push_args(tmp_path, "--commit-message", "second upload"), hub, tmp_path)
    assert again.returncode == 0 and hub.commits == 2


@pytest.mark.parametrize(("path", "identifier"), [("config.json", "LFS sha256"), ("generation_config.json", "git blob id")])
def test_a_remote_file_whose_hash_differs_fails_verification(tmp_path, hub, path, identifier):
    hub.corrupt_on_commit = path  # config.json (> 1 KB) takes the LFS path in the double, generation_config.json not
    result = run(push_args(tmp_path), hub, tmp_path)
    assert result.returncode == 1 and f"{path}: {identifier} on the Hub differs" in result.stderr


def test_dry_run_touches_nothing_remote(tmp_path):
    result = run(push_args(tmp_path, "--dry-run", "--private", "--revision", "fp8"), None, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "would commit" in result.stdout and "@fp8" in result.stdout and "(private)" in result.stdout
    assert "model-00001-of-00001.safetensors" in result.stdout and "README.md" in result.stdout
    staged = tmp_path / "work" / "checkpoint"
    assert (staged / "README.md").is_file()
    # every file the commit would hold is counted and listed, the manifest (which does not list itself) included
    count = len(list(staged.iterdir()))
    assert (
        f"would commit {count} file(s) to acme/qwen2-bytes-hpu-fp8@fp8 (private): Upload hpu-fp8 checkpoint ({count} files)"
        in result.stdout
    )
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert sorted(listed) == sorted(p.name for p in staged.iterdir()) and "hpu_fp8_manifest.json" in listed
    assert result.stdout.splitlines()[-1] == f"staged in {staged} (kept)"


def test_push_warns_of_a_range_e4m3_cannot_hold_before_anything_is_uploaded(tmp_path):
    stressed = stress_model(QWEN, tmp_path / "stressed", {Fold.DOWN: 1e6}, CalibrationOptions(samples=8, seq_len=128))
    args = push_args(tmp_path, "--dry-run")
    args[1] = str(tmp_path / "stressed")
    result = run(args, None, tmp_path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "span more than E4M3 at ±240" in line]
    assert len(warnings) == 2  # the calibration's, and the evaluation's on the held-out text
    assert all(line.startswith("hpu-fp8: warning: ") and stressed.sites[0].point in line for line in warnings)
    assert "held-out text, at the checkpoint's scales" in warnings[1]
    folded = run([*args, "--rebalance", "flagged"], None, tmp_path)  # the same push, its outliers folded away
    assert folded.returncode == 0, folded.stderr
    warned = [line for line in folded.stderr.splitlines() if "span more than E4M3 at ±240" in line]
    assert len(warned) == 1 and "the calibration text" in warned[0]  # held-out text at the folded scales: none
    config = json.loads((tmp_path / "work" / "checkpoint" / "config.json").read_text())
    assert config["quantization_config"]["rebalancing"]["sites"] == [site.point for site in stressed.sites]


def test_a_dry_run_without_a_work_dir_says_its_staging_is_gone_and_names_no_path(tmp_path):
    args = ["push", QWEN, "--repo-id", "a/b", "--base-model", "a/c", "--license", "mit", "--calibrate", "--skip-eval"]
    result = run([*args, "--dry-run"], None, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        "staged in a temporary directory, now removed; pass --work-dir DIR to keep the checkpoint and card"
    )
    assert "hpu-fp8-push-" not in result.stdout + result.stderr  # no path that is gone when the command returns
    as_json = json.loads(run([*args, "--dry-run", "--json"], None, tmp_path).stdout)
    assert as_json["checkpoint"] is None and "hpu_fp8_manifest.json" in [f["name"] for f in as_json["files"]]


def test_push_needs_statistics_and_a_license(tmp_path):
    no_stats = run(["push", QWEN, "--repo-id", "a/b", "--base-model", "a/c", "--license", "mit", "--dry-run"], None, tmp_path)
    assert no_stats.returncode == 1 and "--measurements FILE or --calibrate" in no_stats.stderr
    both = tmp_path / "m.json"
    both.write_text("{}")
    two = run(push_args(tmp_path, "--measurements", str(both), "--dry-run"), None, tmp_path)
    assert two.returncode == 1 and "--measurements and --calibrate both given" in two.stderr
    assert not (tmp_path / "work").exists()
    no_license = run(["push", QWEN, "--repo-id", "a/b", "--base-model", "a/c", "--calibrate", "--dry-run"], None, tmp_path)
    assert no_license.returncode == 1 and "--license" in no_license.stderr


def test_git_blob_id_is_gits():
    assert git_blob_id(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"  # `git hash-object` of "hello\n"


@pytest.mark.parametrize(("model", "kv_cache"), [("ernie-moe-bytes", "fp8"), ("qwen2-bytes", "none")])
def test_cards_parse_offline_and_their_metadata_round_trips(tmp_path, model, kv_cache):
    from hpu_fp8_loader.conversion.convert import convert
    from hpu_fp8_loader.conversion.plan import ConvertOptions
    from hpu_fp8_loader.quality.calibrate import calibrate

    source = TINY_MODELS[model]
    convert(
        source,
        tmp_path / "c",
        [calibrate(source, samples=4, seq_len=64).measurements],
        ConvertOptions(kv_cache=kv_cache, dead_experts="sibling-max"),
    )
    evaluation = evaluate(source, tmp_path / "c", samples=2, seq_len=64) if kv_cache == "fp8" else None
    text = render_card(
        tmp_path / "c",
        f"acme/{model}-fp8",
        f"acme/{model}",
        "apache-2.0",
        "hpu-fp8 push ...",
        evaluation,
        None if evaluation else "skipped with --skip-eval",
    )
    card = ModelCard(text)
    data = card.data.to_dict()
    assert data["base_model"] == f"acme/{model}" and data["base_model_relation"] == "quantized"
    assert data["license"] == "apache-2.0" and data["pipeline_tag"] == "text-generation" and data["library_name"] == "fastdeploy"
    assert {"fp8", "intel-gaudi", "hpu", "fastdeploy"} <= set(data["tags"])
    assert ModelCardData(**data).to_dict() == data
    if evaluation:
        assert "| fp8 |" in text and "recovery" in text and "FP8 KV cache and FP8 attention" in text
    else:
        assert "No evaluation was run for this upload (skipped with --skip-eval)" in text and "BF16 (FP8 attention off)" in text
    assert "--load-choices hpu_fp8" in text and "export-legacy" in text and "model.safetensors.index.json" in text
    assert "Where the error comes from" not in text  # no plots given, none shown


@pytest.mark.skipif(
    not (os.environ.get("HPU_FP8_LIVE_HUB") == "1" and os.environ.get("HF_TOKEN")),
    reason="opt-in: set HPU_FP8_LIVE_HUB=1 and HF_TOKEN (and HPU_FP8_LIVE_REPO) to push to the real Hub",
)
def test_live_push_to_the_real_hub(tmp_path):
    repo = os.environ.get("HPU_FP8_LIVE_REPO", "hpu-fp8-loader-test/qwen2-bytes-hpu-fp8")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "cache")}
    cli = str(Path(sys.executable).with_name("hpu-fp8"))
    args = [
        "push",
        QWEN,
        "--repo-id",
        repo,
        "--calibrate",
        "--license",
        "apache-2.0",
        "--base-model",
        "acme/qwen2-bytes",
        "--private",
    ]
    assert subprocess.run([cli, *args], env=env, check=False).returncode == 0


def test_the_readme_publish_demo_command_runs(tmp_path):
    double = Path(__file__).with_name("doubles") / "hub.py"
    command = [
        sys.executable,
        str(double),
        "--",
        "hpu-fp8",
        "push",
        QWEN,
        "--repo-id",
        "demo/qwen2-bytes-hpu-fp8",
        "--calibrate",
        "--license",
        "apache-2.0",
        "--base-model",
        "demo/qwen2-bytes",
    ]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr
    assert "Hub test double listening on http://127.0.0.1:" in result.stdout and "published and verified" in result.stdout


def test_a_dry_run_card_shows_the_report_plots_it_stages(tmp_path):
    """eval's plots (and calibrate's with --calibrate) are staged beside the checkpoint, listed in the manifest
    and referenced by the card; a skipped eval leaves only calibrate's."""
    result = run(push_args(tmp_path, "--dry-run"), None, tmp_path)
    assert result.returncode == 0, result.stderr
    checkpoint = tmp_path / "work" / "checkpoint"
    card = (checkpoint / "README.md").read_text()
    manifest = json.loads((checkpoint / "hpu_fp8_manifest.json").read_text())["files"]
    plots = sorted(p.name for p in checkpoint.glob("report-*.png"))
    assert "report-eval-linear_error.png" in plots and "report-calibrate-linear_error.png" in plots
    for name in plots:
        assert name in manifest and f"![{name}]({name})" in card
    assert "report-eval-expert_tokens.png" not in plots  # a dense model has no expert heatmap
    skipped = run(push_args(tmp_path, "--dry-run", "--skip-eval"), None, tmp_path)
    assert skipped.returncode == 0, skipped.stderr
    assert not list(checkpoint.glob("report-eval-*")) and list(checkpoint.glob("report-calibrate-*"))


@pytest.mark.slow  # a dry-run push: convert and validate in a subprocess
def test_push_takes_a_directory_of_measurement_files_as_convert_does(tmp_path):
    """--measurements DIR of calibrate -o outputs: each file is a set, added to the repository in name order."""
    config = json.loads((Path(QWEN) / "config.json").read_text())
    folder = tmp_path / "measurements"
    folder.mkdir()
    for name, seed in (("b.json", 1), ("a.json", 2)):
        write_measurements(folder / name, synthetic_measurements(config, seed=seed))
    args = ["push", QWEN, "--repo-id", "a/b", "--base-model", "a/c", "--license", "mit", "--measurements", str(folder)]
    result = run([*args, "--skip-eval", "--dry-run", "--work-dir", str(tmp_path / "work")], None, tmp_path)
    assert result.returncode == 0, result.stderr
    staged = tmp_path / "work" / "checkpoint"
    assert read_measurements(staged / "hpu_fp8_measurements-1.json").provenance.files == ["a.json"]
    assert read_measurements(staged / "hpu_fp8_measurements-2.json").provenance.files == ["b.json"]

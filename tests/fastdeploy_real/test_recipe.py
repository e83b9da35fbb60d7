"""The serving recipe as a user pastes it, through FastDeploy's own code to the worker's loaded model.

The README's serving block and a rendered model card's are read as bash splits them (tests/helpers/shell_block.py):
each server command's environment (the block's exports and the command's own prefix) becomes the environment of
runtime/recipe_case.py, and its words after ``python -m fastdeploy.entrypoints.openai.api_server`` go through
FastDeploy's api_server parser, engine config, the worker command its engine composes and the worker's own parser
and model load with the hook, on the CPU as the conformance suite runs FastDeploy (docs/fastdeploy.md section 13).
Each loaded rank is compared, parameter by parameter, with FastDeploy's own loading of the legacy export.
A misspelled flag, FD_PLUGINS unset, a variable no one reads and too few devices for the TP size are each caught.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from fd_environment import RUNTIME, FastDeployEnvironment
from helpers.shell_block import ShellCommand, fenced_blocks, read_block

from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.fastdeploy import recipe
from hpu_fp8_loader.fastdeploy.legacy import export_legacy
from hpu_fp8_loader.fastdeploy.plugin import ANNOUNCEMENT_PREFIX, SEQUENCE_PARALLEL_MOE_REFUSAL
from hpu_fp8_loader.hub.cards import render_card
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SERVER = ["python", "-m", recipe.SERVER_MODULE]
GUIDE = "docs/get_started/installation/intel_gaudi.md"


@pytest.fixture(scope="module")
def ernie(tmp_path_factory) -> tuple[Path, Path]:
    """(an ERNIE-4.5-MoE hpu-fp8 checkpoint, its legacy export): amax the legacy layout stores exactly, as in
    test_conformance.py, so that the hook's model and FastDeploy's own loading agree to the bit."""
    from test_conformance import legacy_exact

    root = tmp_path_factory.mktemp("recipe")
    config = preset_config("ernie-moe-tiny")
    synthesize(root / "bf16", config, seed=11)
    convert(root / "bf16", root / "spec", [legacy_exact(synthetic_measurements(config))])
    export_legacy(root / "spec", root / "legacy")
    return root / "spec", root / "legacy"


def readme_block() -> str:
    readme = (ROOT / "README.md").read_text()
    return next(b for b in fenced_blocks(readme) if SERVER[-1] in b)


def server_commands(block: str) -> dict[str, ShellCommand]:
    """The block's server commands by layout title (the comment above each, without "or ")."""
    found = {}
    for command in read_block(block):
        if command.words[:3] == SERVER:
            found[command.comment.removeprefix("or ").split(";")[0]] = command
    return found


def with_checkpoint(command: ShellCommand, checkpoint: Path) -> list[str]:
    model = f"${recipe.CHECKPOINT_VARIABLE}"
    return [str(checkpoint) if word == model else word for word in command.words[3:]]


@pytest.fixture
def run_recipe(fastdeploy_env, tmp_path):
    """Run runtime/recipe_case.py with ``environment`` only (what the shell gives the server); its JSON report."""
    environment: FastDeployEnvironment = fastdeploy_env["environment"]

    def run(case: dict, variables: dict[str, str]) -> dict:
        work = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
        (work / "prometheus").mkdir(parents=True)
        (work / "case.json").write_text(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in case.items()}))
        done = environment.run(
            [str(RUNTIME / "recipe_case.py"), "case.json"], cwd=work,
            PROMETHEUS_MULTIPROC_DIR=str(work / "prometheus"), **variables,
        )  # fmt: skip
        lines = done.stdout.strip().splitlines()
        assert done.returncode == 0 and lines, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        report = json.loads(lines[-1])
        assert "error" not in report, report["error"] + "\n" + done.stderr[-6000:]
        report["stderr"] = done.stderr
        return report

    return run


def assert_served(report: dict, layout: recipe.ServingLayout, rank: int) -> None:
    """The hook loaded rank ``rank`` of ``layout`` from the exact lines, as FastDeploy's own loading does."""
    assert report["unknown_options"] == [] and report["port"] == recipe.PORT
    assert len(report["devices"]) == layout.tp, report["devices"]  # one worker per device, one per rank
    assert report["engine"]["load_choices"] == "hpu_fp8" and report["engine"]["use_cudagraph"] is False
    assert report["worker"]["tensor_parallel"] == [rank, layout.tp]
    assert report["loader"] == "HpuFp8ModelLoader" and "load_error" not in report, report.get("load_error")
    announced = [line for line in report["stderr"].splitlines() if ANNOUNCEMENT_PREFIX in line]
    assert len(announced) == 1 and f"(tp rank {rank} of {layout.tp}," in announced[0], announced
    assert report["differences"] == [], "\n".join(report["differences"])
    assert report["parameters"] > 0


LAYOUTS = {layout.key: layout for layout in recipe.LAYOUTS}


@pytest.mark.parametrize(("key", "rank"), [("tp1", 0), ("tp2", 0), ("tp2", 1)])
def test_the_readme_recipe_serves_through_fastdeploys_own_code(run_recipe, ernie, key, rank):
    layout = LAYOUTS[key]
    command = server_commands(readme_block())[layout.title]
    spec, legacy = ernie
    report = run_recipe({"arguments": with_checkpoint(command, spec), "rank": rank, "oracle": legacy}, command.environment)
    assert_served(report, layout, rank)
    print(f"README {layout.title}, rank {rank}: {report['parameters']} parameters as FastDeploy's own loading has them")


def test_the_model_cards_recipe_serves_through_fastdeploys_own_code(run_recipe, ernie):
    spec, legacy = ernie
    card = render_card(spec, "acme/ernie-hpu-fp8", "acme/ernie", "apache-2.0", "hpu-fp8 push acme/ernie")
    block = next(b for b in fenced_blocks(card) if SERVER[-1] in b)
    pull = next(c for c in read_block(block) if c.assigns == recipe.CHECKPOINT_VARIABLE)
    assert pull.words == ["hpu-fp8", "pull", "acme/ernie-hpu-fp8"]  # the card's own repository, pulled to a directory
    layout = LAYOUTS["tp1"]
    command = server_commands(block)[layout.title]
    report = run_recipe({"arguments": with_checkpoint(command, spec), "rank": 0, "oracle": legacy}, command.environment)
    assert_served(report, layout, 0)


def test_the_expert_parallel_line_reaches_fastdeploys_worker_config(run_recipe, ernie):
    """EP needs FastDeploy's PR 5855 (from fbcccaa7; before it its loading is re-created, runtime/pr5855_moe.py), and
    the line's flags must give the workers EP 2 without sequence-parallel MoE (whose o_proj, and from 6d33d5e3 shared
    experts, FastDeploy builds unsplit). At 8c3513a4 FastDeploy's own MoE layer then builds GPU EP buffers (deep_ep)
    before anything is loaded: the model is loaded only on a FastDeploy that carries PR 5855."""
    layout = LAYOUTS["ep2"]
    command = server_commands(readme_block())[layout.title]
    spec, _ = ernie
    report = run_recipe({"arguments": with_checkpoint(command, spec), "rank": 1, "moe_layout": "pr5855"}, command.environment)
    assert report["unknown_options"] == [] and len(report["devices"]) == 2
    assert report["engine"]["expert_parallel_size"] == 2
    assert report["worker"]["expert_parallel"] == [1, 2] and report["worker"]["use_sequence_parallel_moe"] is False
    assert report["loader"] == "HpuFp8ModelLoader"
    if "load_error" in report:  # this FastDeploy predates PR 5855
        assert "deep_ep" in report["load_error"], report["load_error"]
    else:
        assert any(ANNOUNCEMENT_PREFIX in line and "ep rank 1 of 2" in line for line in report["stderr"].splitlines())
    print("EP 2 line:", report.get("load_error", "loaded"))


def test_the_expert_parallel_line_without_its_sequence_parallel_flag_is_refused_by_the_hook(run_recipe, ernie):
    """The EP line less ``--disable-sequence-parallel-moe``: FastDeploy's own parsing then turns sequence-parallel MoE
    on (EP 2 at TP 2), which builds o_proj and, from 6d33d5e3, the shared experts unsplit; the hook refuses it in its
    one line before filling anything, whatever the commit's MoE layer does after."""
    layout = LAYOUTS["ep2"]
    command = server_commands(readme_block())[layout.title]
    spec, _ = ernie
    arguments = [word for word in with_checkpoint(command, spec) if word != "--disable-sequence-parallel-moe"]
    assert len(arguments) == len(with_checkpoint(command, spec)) - 1  # the recipe's EP line carries the flag
    report = run_recipe({"arguments": arguments, "rank": 1, "moe_layout": "pr5855"}, command.environment)
    assert report["worker"]["use_sequence_parallel_moe"] is True, report["worker"]
    assert SEQUENCE_PARALLEL_MOE_REFUSAL in report.get("load_error", ""), report.get("load_error")
    print("EP 2 line with sequence-parallel MoE:", report["load_error"])


def test_qwen3_moe_gets_a_float32_gate_with_moe_gate_fp32_where_fastdeploy_has_the_flag(run_recipe, fastdeploy_env, tmp_path):
    """docs/fastdeploy.md section 14: from 53aaac69 (release/2.6) FastDeploy builds Qwen3-MoE's gate in bf16 unless
    --moe-gate-fp32, and the hook fills either; before it (release/2.5) the gate is float32 and the flag unknown."""
    config = preset_config("qwen3-moe-tiny")
    synthesize(tmp_path / "bf16", config, seed=5)
    convert(tmp_path / "bf16", tmp_path / "spec", [synthetic_measurements(config)])
    command = server_commands(readme_block())[LAYOUTS["tp1"].title]
    line = with_checkpoint(command, tmp_path / "spec")
    block = fastdeploy_env["environment"].source / "fastdeploy/model_executor/models/qwen3moe.py"
    plain = run_recipe({"arguments": line, "rank": 0}, command.environment)
    flagged = run_recipe({"arguments": [*line, "--moe-gate-fp32"], "rank": 0}, command.environment)
    if "moe_gate_fp32" in block.read_text():
        assert plain["router_dtypes"] == ["paddle.bfloat16"] and flagged["router_dtypes"] == ["paddle.float32"], (plain, flagged)
        assert "load_error" not in flagged, flagged.get("load_error")
    else:
        assert plain["router_dtypes"] == ["paddle.float32"], plain
        assert flagged["unknown_options"] == ["--moe-gate-fp32"], flagged
    print(
        "Qwen3-MoE gate:",
        plain["router_dtypes"],
        "; with --moe-gate-fp32:",
        flagged.get("router_dtypes") or flagged["unknown_options"],
    )


def test_a_misspelled_flag_is_refused_by_fastdeploys_parser(run_recipe, ernie):
    command = server_commands(readme_block())[LAYOUTS["tp1"].title]
    arguments = [("--load-choises" if w == "--load-choices" else w) for w in with_checkpoint(command, ernie[0])]
    report = run_recipe({"arguments": arguments, "rank": 0}, command.environment)
    assert "--load-choises" in report["parse_error"] and report["unknown_options"] == ["--load-choises"]


def test_without_fd_plugins_the_recipe_does_not_reach_the_hook(run_recipe, ernie):
    command = server_commands(readme_block())[LAYOUTS["tp1"].title]
    assert command.environment["FD_PLUGINS"] == "hpu_fp8"
    variables = {k: v for k, v in command.environment.items() if k != "FD_PLUGINS"}
    report = run_recipe({"arguments": with_checkpoint(command, ernie[0]), "rank": 0}, variables)
    assert report["loader"] == "DefaultModelLoader" and "quant_weight" in report["load_error"], report.get("load_error")
    assert ANNOUNCEMENT_PREFIX not in report["stderr"]


def test_too_few_devices_for_the_tp_size_is_caught(run_recipe, ernie):
    """paddle.distributed.launch starts one worker per device of ``--devices`` (HPU_VISIBLE_DEVICES on HPU): a TP 2
    line with one device would start one worker where two ranks are needed. FastDeploy builds its config all the
    same; assert_served's device count is what catches it."""
    command = server_commands(readme_block())[LAYOUTS["tp2"].title]
    variables = {**command.environment, "HPU_VISIBLE_DEVICES": "0"}
    report = run_recipe({"arguments": with_checkpoint(command, ernie[0]), "rank": None}, variables)
    assert report["devices"] == ["0"] and report["engine"]["tensor_parallel_size"] == 2
    with pytest.raises(AssertionError, match=r"\['0'\]"):
        assert_served(report, LAYOUTS["tp2"], 0)


def _guide_text() -> str:
    """FastDeploy's Gaudi guide at the suite's FastDeploy: a checkout's file, or the git directory's blob."""
    given = Path(os.environ["HPU_FP8_FASTDEPLOY_SRC"])
    if (given / GUIDE).is_file():
        return (given / GUIDE).read_text()
    git_dir = given / ".git" if (given / ".git").is_dir() else given
    ref = os.environ.get("HPU_FP8_FASTDEPLOY_REF", "develop")
    return subprocess.run(
        ["git", "--git-dir", str(git_dir), "show", f"{ref}:{GUIDE}"], capture_output=True, text=True, check=True
    ).stdout


def unread_variables(environment: FastDeployEnvironment, variables: tuple[recipe.Variable, ...], cwd: Path) -> list[str]:
    """Each variable that is not read where the recipe says: FastDeploy (its envs.py list, or a quoted name in its
    code), paddle (a quoted name in its Python package), the Gaudi software (named in FastDeploy's Gaudi guide,
    which sets them; the Gaudi software itself is not on a CPU), or FastDeploy's usage reporting (its envs.py list
    where FastDeploy has ``fastdeploy/usage``; a FastDeploy without it, such as 8c3513a4, sends nothing to stop)."""
    names = environment.run(
        ["-c", "import json, fastdeploy.envs as e; print(json.dumps(sorted(e.environment_variables)))"], cwd=cwd
    )
    assert names.returncode == 0, names.stderr[-3000:]
    fd_envs = set(json.loads(names.stdout.strip().splitlines()[-1]))
    fd_code = "\n".join(p.read_text(errors="replace") for p in (environment.source / "fastdeploy").rglob("*.py"))
    site = subprocess.run(
        [str(environment.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    paddle_code = "\n".join(p.read_text(errors="replace") for p in (Path(site) / "paddle" / "distributed").rglob("*.py"))
    guide = _guide_text()
    unread = []
    for v in variables:
        quoted = re.compile(rf"[\"']{re.escape(v.name)}[\"']")
        found = {
            "fastdeploy": v.name in fd_envs or bool(quoted.search(fd_code)),
            "paddle": bool(quoted.search(paddle_code)),
            "gaudi": bool(re.search(rf"^export {re.escape(v.name)}=", guide, re.M)),
            "fastdeploy-usage": v.name in fd_envs or not (environment.source / "fastdeploy" / "usage").is_dir(),
        }[v.read_by]
        if not found:
            unread.append(f"{v.name} ({v.read_by})")
    return unread


def test_every_variable_of_the_recipe_is_read_where_it_says(fastdeploy_env, tmp_path):
    environment = fastdeploy_env["environment"]
    block = read_block(readme_block())
    exported = {name for c in block for name in c.environment} - {recipe.CHECKPOINT_VARIABLE}
    declared = recipe.DEVICE_VARIABLES + recipe.HOOK_VARIABLES + recipe.PRIVACY_VARIABLES
    # the block's variables are exactly the recipe's, plus HPU_VISIBLE_DEVICES, FastDeploy's device ids on HPU
    assert exported == {v.name for v in declared} | {"HPU_VISIBLE_DEVICES"}
    devices = recipe.Variable("HPU_VISIBLE_DEVICES", "0", "", "fastdeploy")
    assert unread_variables(environment, (*declared, devices), tmp_path) == []
    misspelled = (
        recipe.Variable("FD_PLUGIN", "hpu_fp8", "", "fastdeploy"),
        recipe.Variable("PADDLE_XCCL_BACKENDS", "intel_hpu", "", "paddle"),
        recipe.Variable("GC_KERNELS_PATH", "x", "", "gaudi"),
    )
    assert unread_variables(environment, misspelled, tmp_path) == [f"{v.name} ({v.read_by})" for v in misspelled]


def test_the_request_is_one_fastdeploys_chat_endpoint_accepts(fastdeploy_env, tmp_path):
    environment = fastdeploy_env["environment"]
    request = next(c for c in read_block(readme_block()) if c.words[:1] == ["curl"])
    url = next(w for w in request.words if w.startswith("http"))
    body = request.words[request.words.index("-d") + 1]
    assert url == f"http://127.0.0.1:{recipe.PORT}/v1/chat/completions"
    api_server = (environment.source / "fastdeploy/entrypoints/openai/api_server.py").read_text()
    assert '@app.post("/v1/chat/completions")' in api_server
    check = ("import fd_bootstrap, sys; from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest; "
             "print(ChatCompletionRequest.model_validate_json(sys.argv[1]).max_tokens)")  # fmt: skip
    done = environment.run(["-c", check, body], cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "24", done.stderr[-3000:]
    grep = next(c for c in read_block(readme_block()) if c.words[:1] == ["grep"])
    assert grep.words[1] == ANNOUNCEMENT_PREFIX  # the line the hook logs on each worker's stderr (log/workerlog.N)

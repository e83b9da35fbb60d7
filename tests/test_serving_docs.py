"""What users read about serving says what the code holds: the README's generated regions, the model card's serving
section, the support matrix against the conformance suite's cases, and help texts that recommend nothing unverified.

The recipe's lines themselves go through FastDeploy's own parsing and loading in tests/fastdeploy_real/test_recipe.py.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.shell_block import fenced_blocks, read_block

from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.fastdeploy import recipe, status
from hpu_fp8_loader.hub.cards import render_card
from hpu_fp8_loader.hub.publish import PushOptions, reproduce_command
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _render_readme_script():
    spec = importlib.util.spec_from_file_location("render_readme", ROOT / "scripts" / "render_readme.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readmes_generated_regions_are_what_the_package_renders():
    text = README.read_text()
    script = _render_readme_script()
    assert set(script.regions()) == {"recipe", "matrix", "versions"}
    assert script.render(text) == text, "a generated region differs: run python scripts/render_readme.py"
    fastdeploy_doc = (ROOT / "docs" / "fastdeploy.md").read_text()
    assert script.render(fastdeploy_doc, script.fastdeploy_doc_regions()) == fastdeploy_doc


def test_ci_runs_the_conformance_suite_on_the_ci_build():
    from hpu_fp8_loader.fastdeploy import support

    assert f"ci_build={support.CI_BUILD.commit.commit}\n" in (ROOT / ".ci" / "run").read_text()
    assert support.CI_BUILD is support.RECOMMENDED_BUILD


def test_the_supported_versions_users_read_are_those_doctor_compares_with():
    from hpu_fp8_loader.fastdeploy import support

    versions = support.render_versions()
    assert f"git checkout {support.RECOMMENDED_BUILD.commit.commit}" in versions
    assert all(f"`{build.commit.short}`" in versions for build in support.BUILDS)
    assert f"`{support.FIRST_SUPPORTED_COMMIT.short}`" in versions
    assert f"paddlepaddle>={support.PADDLE_MINIMUM}" in versions
    assert all(call.attribute in versions for call in support.PADDLE_CALLS)
    for path in (README, ROOT / "docs" / "fastdeploy.md"):
        assert versions in path.read_text(), path
    builds = support.render_builds()
    assert all(build.commit.short in builds for build in support.BUILDS)
    assert all(change.commit.short in builds for change in support.CHANGES)
    assert builds in (ROOT / "docs" / "fastdeploy.md").read_text()


def test_the_readme_region_check_fails_on_an_edited_block(tmp_path, monkeypatch):
    script = _render_readme_script()
    edited = README.read_text().replace(
        "--load-choices hpu_fp8 --tensor-parallel-size 1", "--load-choices hpu-fp8 --tensor-parallel-size 1"
    )
    assert edited != README.read_text()
    monkeypatch.setattr(script, "README", tmp_path / "README.md")
    monkeypatch.setattr(script, "FASTDEPLOY_DOC", tmp_path / "fastdeploy.md")
    (tmp_path / "README.md").write_text(edited)
    (tmp_path / "fastdeploy.md").write_text((ROOT / "docs" / "fastdeploy.md").read_text())
    assert script.main(["--check"]) == 1
    assert script.main([]) == 0 and script.main(["--check"]) == 0  # rewritten from the package


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_is_a_user_path_with_contents_that_link_to_its_sections():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; design detail belongs in docs/"
    # the first two commands a fresh clone runs: the demo, then exactly what CI runs (.ci/run's last line)
    commands = [line.strip() for line in lines[:12] if line.startswith("    ")]
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert commands[0].endswith("hpu-fp8 demo") and commands[1] == ci_command
    headings = [m.group(1) for m in re.finditer(r"^## (.+)$", text, re.M)]
    contents = re.findall(r"^\d+\. \[(.+?)\]\(#(.+?)\)$", text, re.M)
    assert [title for title, _ in contents] == [h for h in headings if h != "Contents"]
    assert all(anchor == _slug(title) for title, anchor in contents)
    # the order a user follows
    for earlier, later in [("Install", "Make an FP8 checkpoint"), ("Make an FP8 checkpoint", "Serve it with FastDeploy"),
                           ("Serve it with FastDeploy", "Check its accuracy"), ("Check its accuracy", "Publish it"),
                           ("Publish it", "Command reference")]:  # fmt: skip
        assert headings.index(earlier) < headings.index(later)


def test_the_readme_serves_what_it_makes():
    """The serving block's $CKPT is the directory the "Make an FP8 checkpoint" step converts to."""
    text = README.read_text()
    converted = re.search(r"^\s+hpu-fp8 convert \S+ (\S+) --measurements", text, re.M)
    block = next(b for b in fenced_blocks(text) if recipe.SERVER_MODULE in b)
    assignment = next(c for c in read_block(block) if c.assigns == recipe.CHECKPOINT_VARIABLE)
    assert converted and assignment.prefix[recipe.CHECKPOINT_VARIABLE] == "$PWD/" + converted[1].removeprefix("./")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """preset -> an hpu-fp8 checkpoint of it, for cards."""
    made = {}
    root = tmp_path_factory.mktemp("cards")
    for preset, kv in (("ernie-moe-tiny", "fp8"), ("qwen2-tiny", "none")):
        config = preset_config(preset)
        synthesize(root / preset, config, seed=3)
        convert(root / preset, root / f"{preset}-fp8", [synthetic_measurements(config)], ConvertOptions(kv_cache=kv))
        made[preset] = root / f"{preset}-fp8"
    return made


def _card(checkpoint: Path, repo_id: str) -> str:
    return render_card(checkpoint, repo_id, "acme/base", "apache-2.0", "hpu-fp8 push acme/base", measurement_files=["m.json"])


def test_the_card_serves_with_the_readmes_variables_and_flags(checkpoints):
    card = _card(checkpoints["ernie-moe-tiny"], "acme/ernie-fp8")
    block = next(b for b in fenced_blocks(card) if recipe.SERVER_MODULE in b)
    assert block == recipe.serving_block(recipe.pulled("acme/ernie-fp8"), recipe.LAYOUTS)
    readme = next(b for b in fenced_blocks(README.read_text()) if recipe.SERVER_MODULE in b)
    servers = {tuple(c.words): c.environment for c in read_block(readme) if c.words[:1] == ["python"]}
    assert {tuple(c.words): c.environment for c in read_block(block) if c.words[:1] == ["python"]} == servers
    pull = next(c for c in read_block(block) if c.assigns == recipe.CHECKPOINT_VARIABLE)
    assert pull.words == ["hpu-fp8", "pull", "acme/ernie-fp8"]  # a local directory for --model, never the repo id
    assert "--model acme/ernie-fp8" not in card and "pip install hpu-fp8-loader" not in card


def test_the_card_offers_only_what_its_model_can_use_and_says_what_is_checked(checkpoints):
    ernie = _card(checkpoints["ernie-moe-tiny"], "acme/ernie-fp8")
    qwen2 = _card(checkpoints["qwen2-tiny"], "acme/qwen2-fp8")
    assert "EP 2" in ernie and "EP 2" not in qwen2  # expert parallelism only for a model with experts
    for card in (ernie, qwen2):
        assert "it has not yet been run on a Gaudi" in card
    assert "no FP8 Qwen2 has been seen served" in qwen2 and "no FP8 Qwen2" not in ernie
    assert status.KV_NONE_CAVEAT in qwen2 and status.KV_NONE_CAVEAT not in ernie  # the Qwen2 one is KV none
    # export-legacy: what _check_servable enforces (docs/fastdeploy.md section 9), not "TP 1 or EP only"
    assert "tensor parallelism 1 only" in qwen2 and "any tensor-parallel size" in ernie
    assert "no expert parallelism" in ernie and "or expert parallelism only" not in ernie


def test_the_cards_reproduce_line_uses_the_uploaded_measurements():
    """With --calibrate too: the calibration's measurements are uploaded, and calibrating again would not give
    the same checkpoint."""
    for calibrate in (True, False):
        line = reproduce_command(PushOptions("acme/x-fp8", calibrate=calibrate), "acme/x", ["hpu_fp8_measurements.json"])
        assert "--measurements hpu_fp8_measurements.json" in line and "--calibrate" not in line
    assert "--calibrate" in reproduce_command(PushOptions("acme/x-fp8", calibrate=True), "acme/x", [])


def _suite(file: str) -> ast.Module:
    return ast.parse((ROOT / "tests" / "fastdeploy_real" / file).read_text())


def _listed(tree: ast.Module, name: str) -> list[tuple]:
    """The tuples of the module-level list ``name`` of a conformance test file."""
    value = next(n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == name)
    return ast.literal_eval(value)


def _conformance_cases() -> tuple[set[tuple], dict[str, set[str]]]:
    """(the (preset, kv, tp, layout) of every CASES entry and every FILL_CASES entry, every test function by file)."""
    files = {"test_conformance.py", status.QWEN3_SUITE, status.PR5855_SUITE}
    trees = {file: _suite(file) for file in files}
    entries = {(p, kv, tp, layout) for p, _, kv, tp, layout in _listed(trees["test_conformance.py"], "CASES")}
    entries |= {tuple(case) for case in _listed(trees[status.QWEN3_SUITE], "FILL_CASES")}
    functions = {file: {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} for file, tree in trees.items()}
    return entries, functions


LAYOUT_KEYS = {"PR 5324": "develop", "PR 5855": "pr5855", "any": "develop"}
CASE_LISTS = {"test_the_hook_fills_what_fastdeploys_own_loading_fills", status.QWEN3_FILL}  # evidence run per list entry


def test_every_checked_cell_of_the_support_matrix_is_a_conformance_case_and_every_case_a_checked_cell():
    cases, functions = _conformance_cases()
    claimed = [cell for cell in status.CELLS if cell.status in (status.Status.CHECKED, status.Status.CONFORMS)]
    for cell in claimed:
        assert cell.evidence in functions[cell.suite], cell
        assert (cell.status is status.Status.CONFORMS) == (cell.evidence == status.QWEN3_FILL), cell
        if cell.evidence in CASE_LISTS:
            assert (cell.preset, cell.kv_cache, cell.tp, LAYOUT_KEYS[cell.layout]) in cases, cell
    covered = {(c.preset, c.kv_cache, c.tp, LAYOUT_KEYS[c.layout]) for c in claimed}
    # the fill cases of dense Qwen3 add to its oracle cases; they claim no cell of their own
    unclaimed = {case for case in cases - covered if case[0] != "qwen3-tiny"}
    assert unclaimed == set(), f"conformance cases the matrix does not claim: {sorted(unclaimed)}"


def test_a_qwen3_moe_card_claims_conformance_only_and_a_qwen3_card_fastdeploys_own_loading():
    """FastDeploy cannot load an FP8 Qwen3-MoE itself, so nothing was compared with its own loading: the card says so."""
    moe, dense = status.model_status("qwen3_moe", "fp8"), status.model_status("qwen3", "fp8")
    assert "for conformance only" in moe and "to the bit" not in moe and "TP 2 (PR 5855)" in moe
    assert "equals FastDeploy's own loading to the bit" in dense and "TP 1, TP 2" in dense


def test_the_matrix_has_every_combination_once():
    combinations = [(c.model, c.layout, c.parallel, c.kv_cache) for c in status.CELLS]
    assert len(combinations) == len(set(combinations))
    assert {c.kv_cache for c in status.CELLS} == {"fp8", "none"}
    assert all(cell.notes for cell in status.CELLS if cell.status is status.Status.UNSUPPORTED)


@pytest.mark.parametrize("command", sorted(main.commands))
def test_no_help_recommends_bf16_attention_as_safer(command):
    shown = re.sub(r"\s+", " ", CliRunner().invoke(main, [command, "--help"], terminal_width=200).output)
    assert "safer" not in shown
    if "none: attention and KV cache in BF16" in shown:  # the shared --kv-cache option of the commands that write one
        assert "not yet seen working on a Gaudi" in shown


@pytest.mark.parametrize("command", ["convert", "import", "push", "demo"])
def test_every_command_writing_a_checkpoint_states_the_bf16_attention_caveat(command):
    shown = re.sub(r"\s+", " ", CliRunner().invoke(main, [command, "--help"], terminal_width=200).output)
    assert "none: attention and KV cache in BF16, FP8 linears only (not yet seen working on a Gaudi" in shown


def test_every_layout_of_the_recipe_gives_fastdeploy_one_device_per_worker():
    """FastDeploy starts one worker per HPU_VISIBLE_DEVICES id, and needs TP x DP of them (DP is 1 here)."""
    for layout in recipe.LAYOUTS:
        assert len(layout.devices.split(",")) == layout.tp, layout
        flags = recipe.server_arguments(layout)
        assert flags[flags.index("--tensor-parallel-size") + 1] == str(layout.tp)
        assert ("--enable-expert-parallel" in flags) == (layout.ep > 1)


def test_qwen3_cards_say_what_export_legacy_offers(spec_factory):
    qwen3 = _card(spec_factory("qwen3-tiny"), "acme/qwen3-fp8")
    moe = _card(spec_factory("qwen3-moe-tiny"), "acme/qwen3-moe-fp8")
    assert "does not split Qwen3 FP8 tensors" in qwen3 and "tensor parallelism 1 only" in qwen3
    assert "refuses Qwen3-MoE" in moe and "tensor parallelism 1 only" not in moe
    assert "EP 2" in moe and "EP 2" not in qwen3  # expert parallelism only for a model with experts
    for card in (qwen3, moe):
        assert "it has not yet been run on a Gaudi" in card

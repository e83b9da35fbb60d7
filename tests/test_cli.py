"""The installed console script, run as a user runs it."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_runs_the_pipeline_end_to_end_through_the_console_script(tmp_path):
    result = subprocess.run(
        [str(Path(sys.executable).with_name("hpu-fp8")), "demo", "--out", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert ": valid (" in result.stdout and "weights-only" in result.stdout and "no-kv-fp8" in result.stdout
    assert (tmp_path / "demo" / "fp8" / "hpu_fp8_manifest.json").is_file()


@pytest.mark.slow
def test_synth_convert_validate_through_the_cli(tmp_path):
    runner = CliRunner()
    assert (
        runner.invoke(main, ["synth", str(tmp_path / "src"), "--preset", "qwen2-tiny", "--layout", "torch", "-q"]).exit_code == 0
    )
    write_measurements(tmp_path / "m.json", synthetic_measurements(preset_config("qwen2-tiny")))
    result = runner.invoke(
        main,
        [
            "convert",
            str(tmp_path / "src"),
            str(tmp_path / "out"),
            "--measurements",
            str(tmp_path / "m.json"),
            "--kv-cache",
            "none",
            "--max-shard-size",
            "50kB",
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1
    assert runner.invoke(main, ["validate", "-q", str(tmp_path / "out")]).exit_code == 0


def test_convert_errors_are_one_line_without_traceback(tmp_path, source_factory):
    (tmp_path / "m.json").write_text("not json")
    result = CliRunner().invoke(
        main, ["convert", str(source_factory()), str(tmp_path / "out"), "--measurements", str(tmp_path / "m.json")]
    )
    assert result.exit_code == 1
    assert result.output.startswith("hpu-fp8: error:") and "not valid JSON" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_schema_command_prints_json_schemas():
    for what in ("quantization-config", "measurements"):
        schema = json.loads(CliRunner().invoke(main, ["schema", what]).stdout)
        assert schema["type"] == "object" and schema["properties"]


@pytest.mark.slow
def test_the_quantize_benchmark_runs_and_reports_ratios():
    bench = Path(__file__).resolve().parents[1] / "bench" / "quantize.py"
    result = subprocess.run(
        [sys.executable, str(bench), "--elements", "400000", "--repeat", "1"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "x the baseline" in result.stdout and "machine ceiling" in result.stdout


def test_the_command_list_reads_as_the_pipeline_and_nothing_is_cut_short():
    from hpu_fp8_loader.cli.group import PIPELINE_ORDER

    result = CliRunner().invoke(main, ["--help"], terminal_width=80)
    lines = result.output.split("Commands:")[1].splitlines()
    listing = [line for line in lines if line.startswith("  ") and not line.startswith("   ")]  # not a wrapped help's rest
    assert [line.split()[0] for line in listing] == PIPELINE_ORDER
    assert sorted(PIPELINE_ORDER) == sorted(main.commands)  # a new command gets a place in the order
    assert not [line for line in listing if line.endswith("...")]


def test_every_help_ends_with_commented_examples_that_parse():
    """Each command's --help ends with 2-4 examples, each under a `# what it does` line, each a valid invocation:
    click parses it without running it (options exist as spelled, values convert, required arguments and options are
    there). No path parameter declares exists=True, so parsing never looks at the disk and an example may name files
    this machine lacks; the first assertion keeps it so (such a parameter would need its file made for its examples)."""
    for name, command in main.commands.items():
        assert not [p.name for p in command.params if isinstance(p.type, click.Path) and p.type.exists], name
        result = CliRunner().invoke(main, [name, "--help"])
        assert result.exit_code == 0, result.output
        assert "Examples:" in result.output, f"{name} --help has no Examples: section"
        section = result.output.split("Examples:", 1)[1].split("\nOptions:", 1)[0].splitlines()
        lines = [line.strip() for line in section if line.strip()]
        examples = [line for line in lines if line.startswith("hpu-fp8 ")]
        assert 2 <= len(examples) <= 4, (name, examples)
        assert lines[1::2] == examples and all(line.startswith("# ") for line in lines[::2]), (name, lines)
        assert max(len(line) for line in section) <= 98, name  # the group's max_content_width 100, less click's margin
        for line in examples:
            words = shlex.split(line)
            assert words[:2] == ["hpu-fp8", name], line
            try:
                with command.make_context(name, words[2:], resilient_parsing=False):
                    pass
            except click.UsageError as exc:  # BadParameter, MissingParameter and NoSuchOption among them
                pytest.fail(f"{line!r} does not parse: {exc.format_message()}")


def _ppl_cell(row: dict) -> str:
    change = 100 * row["perplexity_increase"]
    sign = "−" if change < 0 else "+"  # the docs write a minus sign, not a hyphen
    return f"{row['perplexity_bf16']:.3f} → {row['perplexity_fp8']:.3f} ({sign}{abs(change):.2f}%)"


@pytest.mark.parametrize("model", sorted(TINY_MODELS))
def test_the_accuracy_rows_in_the_readme_and_the_guide_are_what_demo_prints(tmp_path, model):
    """Every shipped tiny model's rows, as `hpu-fp8 demo --model NAME` computes them now (a retrained model or a
    changed emulation must update both documents)."""
    result = CliRunner().invoke(main, ["demo", "--model", model, "--out", str(tmp_path / "demo"), "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["variant"]: row for row in json.loads(result.stdout)["evaluation"]["rows"]}
    fp8 = rows["fp8"]
    low, high = (100 * v for v in fp8["top1_agreement_interval"])
    kl_low, kl_high = fp8["mean_kl_interval"]
    readme = (
        f"| {model} | fp8 (KV fp8) | {100 * fp8['top1_agreement']:.2f}% [{low:.2f}, {high:.2f}] | "
        f"{fp8['mean_kl']:.4f} [{kl_low:.4f}, {kl_high:.4f}] | {_ppl_cell(fp8)} |"
    )
    assert readme in (ROOT / "README.md").read_text().splitlines()
    guide = (ROOT / "docs" / "guide.md").read_text().splitlines()
    lines = [
        f"| {first} | {100 * row['top1_agreement']:.2f}% | {row['mean_kl']:.4f} | {row['relative_logit_rmse']:.4f} | {_ppl_cell(row)} |"
        for first, row in (
            (f"{model} | fp8 (KV fp8)", fp8),
            ("| weights-only", rows["weights-only"]),
            ("| no-kv-fp8", rows["no-kv-fp8"]),
        )
    ]
    assert lines[0] in guide
    start = guide.index(lines[0])
    assert guide[start : start + 3] == lines

"""The installed console script, run as a user runs it."""

from __future__ import annotations

import json
import re
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


# A figure in the documents may differ from what demo prints here by a unit in its last digit only where the value
# lies within this fraction of a rounding boundary: BLAS kernels differ by CPU and by thread count (measured: OpenBLAS
# 0.3.31 on an AMD EPYC rounds a 64x64x192 sgemm differently on 2 threads than on 1), and a bootstrap interval's end
# moved from 0.0070503 to 0.0070497 between two machines. A retrained model or a changed emulation moves far more.
DOC_FIGURE_LATITUDE = 1e-4


def _figures(row: dict, *, intervals: bool) -> list[tuple[float, int]]:
    """A row's figures as the documents print them, in their order: (value, decimals printed)."""
    percent = [(100 * row["top1_agreement"], 2)]
    percent += [(100 * v, 2) for v in row["top1_agreement_interval"]] if intervals else []
    kl = [(row["mean_kl"], 4)] + ([(v, 4) for v in row["mean_kl_interval"]] if intervals else [])
    rmse = [] if intervals else [(row["relative_logit_rmse"], 4)]
    ppl = [(row["perplexity_bf16"], 3), (row["perplexity_fp8"], 3), (100 * row["perplexity_increase"], 2)]
    return percent + kl + rmse + ppl


def _assert_row_prints(document: str, line: str, figures: list[tuple[float, int]]) -> None:
    """A table row of ``document`` (its first two cells: the model, or none, and the variant) holds ``figures``,
    each to its printed digits."""
    cells = "|".join(line.split("|")[3:])
    printed = [float(n.replace("−", "-")) for n in re.findall(r"[−+-]?\d+\.\d+", cells)]
    assert len(printed) == len(figures), (document, line)
    for shown, (value, decimals) in zip(printed, figures, strict=True):
        assert abs(shown - value) <= 0.5 * 10**-decimals + DOC_FIGURE_LATITUDE * abs(value), (document, line, value)


@pytest.mark.parametrize("model", sorted(TINY_MODELS))
def test_the_accuracy_rows_in_the_readme_and_the_guide_are_what_demo_prints(tmp_path, model):
    """Every shipped tiny model's rows, as `hpu-fp8 demo --model NAME` computes them now, to the digits the documents
    print (with :data:`DOC_FIGURE_LATITUDE`): a retrained model or a changed emulation must update both documents."""
    result = CliRunner().invoke(main, ["demo", "--model", model, "--out", str(tmp_path / "demo"), "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["variant"]: row for row in json.loads(result.stdout)["evaluation"]["rows"]}
    readme = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(f"| {model} | fp8 (KV fp8) |")]
    assert len(readme) == 1, readme
    _assert_row_prints("README.md", readme[0], _figures(rows["fp8"], intervals=True))
    guide = (ROOT / "docs" / "guide.md").read_text().splitlines()
    first = next(i for i, line in enumerate(guide) if line.startswith(f"| {model} | fp8 (KV fp8) |"))
    variants = ["fp8", "weights-only", "no-kv-fp8"]
    assert [line.split("|")[2].strip() for line in guide[first : first + 3]] == ["fp8 (KV fp8)", *variants[1:]]
    for line, variant in zip(guide[first : first + 3], variants, strict=True):
        _assert_row_prints("docs/guide.md", line, _figures(rows[variant], intervals=False))

"""The package's front door: the README's Python section runs as it stands, importing only from ``hpu_fp8_loader``.

It also checks that the front door is lazy (importing the package imports none of the pipeline) and
that every name it lends resolves, is documented, and is typed for checkers (the TYPE_CHECKING block).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hpu_fp8_loader
from hpu_fp8_loader.fastdeploy.mapping import ParameterSpec, parameter_specs
from hpu_fp8_loader.spec.config import KvCacheScheme

ROOT = Path(__file__).resolve().parents[1]


def _readme_python() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("From Python, everything comes from the package itself") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_section_imports_only_the_front_door():
    tree = ast.parse(_readme_python())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert imported == {"hpu_fp8_loader"}


@pytest.mark.slow
def test_readme_python_section_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_readme_python(), "README.md", "exec"), {})
    lines = printed.getvalue().splitlines()
    agreement = {m.group(1): float(m.group(2)) for m in (re.match(r"\s*(\S+): top-1 agreement ([0-9.]+)", x) for x in lines) if m}
    assert set(agreement) == {"fp8", "weights-only", "no-kv-fp8"} and all(0.5 < a <= 1 for a in agreement.values())
    assert (tmp_path / "measurements.json").is_file() and (tmp_path / "qwen2-fp8" / "config.json").is_file()
    # rank 0 of TP 2 gets exactly the parameters FastDeploy builds there, under FastDeploy's names, once each
    # (a stacked MoE parameter would come once per expert; the tiny Qwen2 has none)
    pieces = [line.split(" ", 2) for line in lines if re.match(r"\S+ (float8_e4m3fn|bfloat16|float32) \(", line)]
    descriptor = hpu_fp8_loader.describe_model("qwen2-fp8")
    specs = parameter_specs(descriptor, KvCacheScheme.FP8, hpu_fp8_loader.Parallelism(tp_size=2, tp_rank=0))
    assert sorted(name for name, _, _ in pieces) == sorted(specs)
    assert {name: shape for name, _, shape in pieces} == {name: str(spec.shape) for name, spec in specs.items()}


def test_importing_the_package_imports_nothing_else():
    code = "import sys, hpu_fp8_loader; print(sorted(m for m in sys.modules if m.startswith('hpu_fp8_loader')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['hpu_fp8_loader']"


@pytest.mark.parametrize("name", [n for n in hpu_fp8_loader.__all__ if n != "__version__"])
def test_every_front_door_name_resolves_and_is_documented(name: str):
    value = getattr(hpu_fp8_loader, name)
    if name == "TINY_MODELS":  # a dict: its module documents it
        value = sys.modules["hpu_fp8_loader.sources.tiny_models"]
    else:
        assert value.__module__.startswith("hpu_fp8_loader.")
    assert (value.__doc__ or "").strip(), f"{name} has no docstring"


DOCUMENTED = [n for n in hpu_fp8_loader.__all__ if n not in ("__version__", "TINY_MODELS")]  # TINY_MODELS: its module


@pytest.mark.parametrize("name", DOCUMENTED)
def test_every_front_door_name_has_an_example_and_functions_their_sections(name: str):
    value = getattr(hpu_fp8_loader, name)
    doc = inspect.getdoc(value) or ""
    assert "Example" in doc, f"{name}'s docstring has no Example section"
    if inspect.isfunction(value):
        result = "Yields:" if inspect.isgeneratorfunction(value) else "Returns:"
        missing = [section for section in ("Args:", result) if section not in doc]
        assert missing == [], f"{name}'s docstring lacks {', '.join(missing)}"


def test_the_type_checking_block_names_every_export():
    tree = ast.parse((ROOT / "hpu_fp8_loader" / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    typed = {a.asname for node in block.body for a in node.names}
    assert typed == set(hpu_fp8_loader.__all__) - {"__version__"}


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'map_everything'"):
        hpu_fp8_loader.map_everything  # noqa: B018
    assert ParameterSpec  # the mapping module stays importable directly, too


@pytest.mark.parametrize(
    ("name", "builtin"),
    [
        ("ConfigError", ValueError),
        ("UnknownArchitectureError", ValueError),
        ("MeasurementError", ValueError),
        ("NonFiniteError", ValueError),
        ("SafetensorsFormatError", ValueError),
        ("ChecksumMismatchError", ValueError),
        ("DatasetError", ValueError),
        ("TokenizerError", ValueError),
    ],
)
def test_errors_are_also_the_builtin_they_mean(name: str, builtin: type[Exception]):
    """Code that catches the builtin (``except ValueError``) catches ours too, with our one-line message."""
    error = getattr(hpu_fp8_loader, name)
    with pytest.raises(builtin, match="^x.json: named$"):
        raise error("x.json: named")
    assert issubclass(error, hpu_fp8_loader.HpuFp8Error)

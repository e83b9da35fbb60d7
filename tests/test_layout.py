"""The package layout reads as the pipeline: no module imports from a later stage.

Every import counts, including those inside functions (deferred for speed, they are still
dependencies). The stages are those of pyproject's package list and docs/architecture.md; a new
package or top-level module must be placed in one before this test passes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hpu_fp8_loader"

# Earlier first. errors, console and memory are the base every stage may use.
STAGES = [
    ("errors", "console", "memory"),
    ("spec",),
    ("numerics",),
    ("arch",),
    ("io",),
    ("sources",),
    ("checks",),
    ("fastdeploy",),
    ("conversion",),
    ("engine",),
    ("quality",),
    ("hub",),
    ("cli",),
]
RANK = {name: rank for rank, names in enumerate(STAGES) for name in names}


def _unit(dotted: str) -> str:
    """The stage unit of ``hpu_fp8_loader.X[.Y]``: X (a subpackage or a top-level module)."""
    return dotted.split(".")[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import of the package in ``path``, resolving ``from hpu_fp8_loader import X``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("hpu_fp8_loader.")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hpu_fp8_loader":
            assert node.level == 0, f"{path}:{node.lineno}: relative import; the package imports absolutely"
            if node.module == "hpu_fp8_loader":  # the front door: only the version is imported from it inside the package
                found += [(node.lineno, f"hpu_fp8_loader.{a.name}") for a in node.names if a.name != "__version__"]
            else:
                found.append((node.lineno, node.module))
    return sorted(found)


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


def test_every_module_has_a_stage():
    units = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in MODULES}
    assert units - set(RANK) == set(), "place each new package or top-level module in a stage of STAGES"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_from_a_later_stage(path: Path):
    own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    later = [
        f"line {line}: {module} (stage {RANK[_unit(module)]} > {RANK[own]})"
        for line, module in _imports(path)
        if RANK[_unit(module)] > RANK[own]
    ]
    assert later == [], f"{path.relative_to(PACKAGE.parent)} imports from a later stage"


def test_the_checker_sees_a_violation(tmp_path: Path):
    """The AST walk finds a deferred import inside a function, and a from-import of the package root."""
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from hpu_fp8_loader.cli.main import main\n\nfrom hpu_fp8_loader import __version__, errors\n"
    )
    assert _imports(module) == [(2, "hpu_fp8_loader.cli.main"), (4, "hpu_fp8_loader.errors")]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk, each as the modules on it (one per back edge)."""
    cycles, state = [], {}  # state: 1 on the walk's path, 2 finished

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                walk(target, [*path, target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            walk(node, [node])
    return cycles


def _package_imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, type-only and deferred imports included (an arrow is an arrow)."""
    modules = {_module_name(p) for p in MODULES}
    edges: dict[str, set[str]] = {}
    for path in MODULES:
        own = _module_name(path)
        for _, imported in _imports(path):
            while imported not in modules and "." in imported:  # `from pkg.mod import name` names a module's attribute
                imported = imported.rsplit(".", 1)[0]
            if imported in modules and imported != own:
                edges.setdefault(own, set()).add(imported)
    return edges


def test_no_two_modules_import_each_other_even_through_others():
    """Within a stage the arrows run one way too: quality's report once imported calibrate and evaluate, which
    imported it (the observers now have one home, quality/observers.py)."""
    assert _import_cycles(_package_imports()) == []


def test_the_cycle_finder_sees_a_cycle():
    assert _import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _import_cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []

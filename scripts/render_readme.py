"""Rewrite the generated regions of README.md and docs/fastdeploy.md from the package, so that they say what the
code holds.

    python scripts/render_readme.py           # rewrite both files in place
    python scripts/render_readme.py --check   # exit 1, naming the file, if one differs

Regions lie between ``<!-- BEGIN name: ... -->`` and ``<!-- END name -->``: ``recipe`` is the serving block
(hpu_fp8_loader/fastdeploy/recipe.py, which the model cards render too), ``matrix`` the support matrix
(hpu_fp8_loader/fastdeploy/status.py), ``versions`` the supported FastDeploy and paddle
(hpu_fp8_loader/fastdeploy/support.py, which `hpu-fp8 doctor` compares with), ``builds`` (docs/fastdeploy.md only) the
FastDeploy builds checked and the changes between them (the same module). tests/test_serving_docs.py checks
that they match.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from hpu_fp8_loader.fastdeploy import recipe, status, support

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FASTDEPLOY_DOC = ROOT / "docs" / "fastdeploy.md"
# the README's checkpoint is the one its "Make an FP8 checkpoint" step converts
CHECKPOINT = (f"{recipe.CHECKPOINT_VARIABLE}=$PWD/ernie-fp8", "made above; a published one: CKPT=$(hpu-fp8 pull ORG/NAME)")


def regions() -> dict[str, str]:
    """Each region's content, as the README must hold it."""
    return {
        "recipe": f"```bash\n{recipe.serving_block(CHECKPOINT)}```\n",
        "matrix": status.render_matrix(),
        "versions": support.render_versions(),
    }


def fastdeploy_doc_regions() -> dict[str, str]:
    """Each region's content, as docs/fastdeploy.md must hold it."""
    return {"versions": support.render_versions(), "builds": support.render_builds()}


def render(text: str, contents: dict[str, str] | None = None, file: str = "README.md") -> str:
    """``text`` with every region's content replaced by its rendering."""
    for name, content in (regions() if contents is None else contents).items():
        pattern = re.compile(rf"(<!-- BEGIN {name}: [^\n]*-->\n)(.*?)(<!-- END {name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{file}: no region {name!r} (<!-- BEGIN {name}: ... --> ... <!-- END {name} -->)")
        text = pattern.sub(lambda m, content=content: m.group(1) + content + m.group(3), text)
    return text


def main(argv: list[str]) -> int:
    status_code = 0
    for path, contents in ((README, regions()), (FASTDEPLOY_DOC, fastdeploy_doc_regions())):
        current = path.read_text()
        rendered = render(current, contents, path.name)
        if "--check" not in argv:
            path.write_text(rendered)
        elif rendered != current:
            print(f"{path.name}: a generated region differs; run python scripts/render_readme.py", file=sys.stderr)
            status_code = 1
    return status_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

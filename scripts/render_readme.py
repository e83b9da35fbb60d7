"""Rewrite the README's generated regions from the package, so that they say what the code holds.

    python scripts/render_readme.py           # rewrite README.md in place
    python scripts/render_readme.py --check   # exit 1, naming the region, if README.md differs

Regions lie between ``<!-- BEGIN name: ... -->`` and ``<!-- END name -->``: ``recipe`` is the serving block
(hpu_fp8_loader/fastdeploy/recipe.py, which the model cards render too), ``matrix`` the support matrix
(hpu_fp8_loader/fastdeploy/status.py). tests/test_serving_docs.py checks that they match.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from hpu_fp8_loader.fastdeploy import recipe, status

README = Path(__file__).resolve().parents[1] / "README.md"
# the README's checkpoint is the one its "Make an FP8 checkpoint" step converts
CHECKPOINT = (f"{recipe.CHECKPOINT_VARIABLE}=$PWD/ernie-fp8", "made above; a published one: CKPT=$(hpu-fp8 pull ORG/NAME)")


def regions() -> dict[str, str]:
    """Each region's content, as the README must hold it."""
    return {"recipe": f"```bash\n{recipe.serving_block(CHECKPOINT)}```\n", "matrix": status.render_matrix()}


def render(text: str) -> str:
    """``text`` with every region's content replaced by its rendering."""
    for name, content in regions().items():
        pattern = re.compile(rf"(<!-- BEGIN {name}: [^\n]*-->\n)(.*?)(<!-- END {name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"README.md: no region {name!r} (<!-- BEGIN {name}: ... --> ... <!-- END {name} -->)")
        text = pattern.sub(lambda m, content=content: m.group(1) + content + m.group(3), text)
    return text


def main(argv: list[str]) -> int:
    current = README.read_text()
    rendered = render(current)
    if "--check" in argv:
        if rendered != current:
            print("README.md: a generated region differs; run python scripts/render_readme.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

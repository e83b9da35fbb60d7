"""Model cards for published hpu-fp8 checkpoints, rendered from ``model_cards/`` (Jinja2).

The card's YAML front matter is built by huggingface_hub's own ``ModelCardData`` and the rendered
card must parse back with ``ModelCard``: the Hub's YAML validation endpoint is online only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .errors import HpuFp8Error
from .evaluate import EvalReport
from .io.checkpoint import read_config
from .io.manifest import MANIFEST_FILE
from .spec.config import parse_quantization_config

__all__ = ["CardFile", "render_card"]

TEMPLATE = "hpu_fp8.md.j2"
_TAGS = ["fp8", "intel-gaudi", "hpu", "fastdeploy", "hpu-fp8"]


@dataclass(frozen=True)
class CardFile:
    name: str
    size: int
    sha256: str


def _environment():
    import jinja2

    templates = resources.files("hpu_fp8_loader") / "model_cards"  # a wheel ships model_cards/ inside the package
    if not templates.is_dir():  # a source checkout or an editable install: the repository's model_cards/
        templates = Path(__file__).resolve().parents[1] / "model_cards"
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates)),
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=False,
    )


def render_card(
    checkpoint: str | Path,
    repo_id: str,
    base_model: str,
    license: str,
    command: str,
    evaluation: EvalReport | None = None,
    eval_note: str | None = None,
) -> str:
    """README.md of the checkpoint at ``checkpoint``, as the Hub will show it."""
    from huggingface_hub import ModelCardData

    root = Path(checkpoint)
    config = read_config(root)
    qc = parse_quantization_config(config, str(root / "config.json"))
    if not license:
        raise HpuFp8Error("no license known for the base model: pass --license (e.g. apache-2.0)")
    datasets = sorted({s.dataset for s in qc.calibration.sources if s.dataset and s.dataset != "builtin"})
    data = ModelCardData(
        base_model=base_model,
        base_model_relation="quantized",
        license=license,
        pipeline_tag="text-generation",
        library_name="fastdeploy",
        datasets=datasets or None,
        tags=[*_TAGS, config.get("model_type", "")],
    )
    manifest = json.loads((root / MANIFEST_FILE).read_text())["files"]
    files = [CardFile(name, entry["size"], entry["sha256"]) for name, entry in sorted(manifest.items())]
    return (
        _environment()
        .get_template(TEMPLATE)
        .render(
            front_matter=data.to_yaml(),
            title=f"{repo_id.split('/')[-1]}",
            base_model=base_model,
            repo_id=repo_id,
            qc=qc,
            model_type=config.get("model_type"),
            evaluation=evaluation,
            eval_note=eval_note,
            command=command,
            files=files,
        )
    )

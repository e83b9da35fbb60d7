"""Model cards for published hpu-fp8 checkpoints, rendered from ``model_cards/`` (Jinja2).

The card's YAML front matter is built by huggingface_hub's own ``ModelCardData`` and the rendered
card must parse back with ``ModelCard``: the Hub's YAML validation endpoint is online only.

Every string that is not ours (repo ids, measurement provenance, config values) is escaped: the
environment HTML-escapes every value, and the templates pass such strings through ``md`` (one line,
Markdown punctuation backslash-escaped) or, inside a code block, ``fenced`` (one line). A hostile
provenance string cannot add a heading, a link or a ``<script>`` to a published card.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.errors import HpuFp8Error, one_line
from hpu_fp8_loader.fastdeploy import recipe
from hpu_fp8_loader.fastdeploy.legacy import stock_fastdeploy_layouts
from hpu_fp8_loader.fastdeploy.mapping import valid_tp_sizes
from hpu_fp8_loader.fastdeploy.status import model_status
from hpu_fp8_loader.io.checkpoint import read_config
from hpu_fp8_loader.io.manifest import MANIFEST_FILE
from hpu_fp8_loader.quality.evaluate import EvaluationResult
from hpu_fp8_loader.sources.resolve import check_repo_id
from hpu_fp8_loader.spec.config import parse_quantization_config

__all__ = ["CardFile", "CardPlot", "check_license", "render_card"]

TEMPLATE = "hpu_fp8.md.j2"
_TAGS = ["fp8", "intel-gaudi", "hpu", "fastdeploy", "hpu-fp8"]
# Inline Markdown that a value could start mid-line: emphasis, code, links and images, tables, strikethrough, math.
_MARKDOWN_INLINE = re.compile(r"([\\`*_\[\]|~$])")
# A Hub identifier such as a license (apache-2.0, cc-by-nc-4.0, llama3.1, openrail++, other) or a tag.
_IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}")


@dataclass(frozen=True)
class CardFile:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class CardPlot:
    """A report plot uploaded beside the checkpoint: its file name, which run made it, what it shows."""

    name: str
    kind: str  # "calibrate" or "eval"
    caption: str


def check_license(license: str) -> str:
    """``license`` if it looks like one of the Hub's license identifiers; it goes into the card's metadata."""
    if not _IDENTIFIER.fullmatch(license):
        raise HpuFp8Error(f"license {license!r} is not a Hub license identifier like apache-2.0, mit or other")
    return license


def markdown_text(value: object):
    """A value that is not ours as plain text in Markdown: one line, inline Markdown and HTML escaped."""
    from markupsafe import escape

    return escape(_MARKDOWN_INLINE.sub(r"\\\1", one_line(value)))


def fenced_text(value: object):
    """A value inside a fenced code block, which shows HTML and Markdown literally: only kept to one line, so that
    it cannot end the block."""
    from markupsafe import Markup

    return Markup(one_line(value))


def _hub_dataset_ids(datasets: list[str]) -> list[str]:
    """Datasets that are Hub ids (ORG/NAME) for the metadata; others (builtin, a file) are only named in the text."""
    ids = []
    for dataset in datasets:
        try:
            ids.append(check_repo_id(dataset))
        except HpuFp8Error:
            continue
    return ids


def _environment():
    import jinja2

    templates = resources.files("hpu_fp8_loader") / "model_cards"  # a wheel ships model_cards/ inside the package
    if not templates.is_dir():  # a source checkout or an editable install: the repository's model_cards/
        templates = Path(__file__).resolve().parents[2] / "model_cards"
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates)),
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=False,
        autoescape=True,
    )
    environment.filters.update(md=markdown_text, fenced=fenced_text)
    return environment


def render_card(
    checkpoint: str | Path,
    repo_id: str,
    base_model: str,
    license: str,
    command: str,
    evaluation: EvaluationResult | None = None,
    eval_note: str | None = None,
    measurement_files: Sequence[str] = (),
    plots: Sequence[CardPlot] = (),
) -> str:
    """README.md of the checkpoint at ``checkpoint``, as the Hub will show it.

    ``command`` is the reproduce line (repo ids and file names only); ``measurement_files`` are the
    activation statistics uploaded beside the checkpoint, which the card cites; ``plots`` the report PNGs
    uploaded beside it, which the card shows.
    """
    root = Path(checkpoint)
    config = read_config(root)
    qc = parse_quantization_config(config, str(root / "config.json"))
    if not license:
        raise HpuFp8Error("no license known for the base model: pass --license (e.g. apache-2.0)")
    check_license(license)
    check_repo_id(repo_id, "repo id")  # before huggingface_hub is imported: it checks HF_ENDPOINT too
    check_repo_id(base_model, "base model", namespace=False)
    from huggingface_hub import ModelCardData

    datasets = _hub_dataset_ids(sorted({s.dataset for s in qc.calibration.sources if s.dataset}))
    model_type = config.get("model_type")
    data = ModelCardData(
        base_model=base_model,
        base_model_relation="quantized",
        license=license,
        pipeline_tag="text-generation",
        library_name="fastdeploy",
        datasets=datasets or None,
        tags=[*_TAGS, *([model_type] if isinstance(model_type, str) and _IDENTIFIER.fullmatch(model_type) else [])],
    )
    # the serving block holds only our text and the repo id, which check_repo_id has kept to [A-Za-z0-9._-/]
    descriptor = describe(config)
    layouts = recipe.layouts_for(tuple(valid_tp_sizes(descriptor)), experts=descriptor.moe is not None)
    serving = recipe.serving_block(recipe.pulled(repo_id), layouts)
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
            model_type=model_type,
            evaluation=evaluation,
            eval_note=eval_note,
            command=command,
            serving=serving,
            status=model_status(str(model_type), qc.kv_cache_scheme.value),
            legacy=stock_fastdeploy_layouts(str(model_type)),
            files=files,
            measurement_files=list(measurement_files),
            plots=list(plots),
        )
    )

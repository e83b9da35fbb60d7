"""What serving an hpu-fp8 checkpoint through the hook has been checked on: one table, rendered into the README.

Each cell is a model, a FastDeploy MoE layout, a parallel layout and a KV-cache scheme. Its status says what
was done, never more: ``checked`` cells are cases of the FastDeploy conformance suite (FastDeploy's own code on
a CPU, the hook's model equal to the bit to FastDeploy's own loading; docs/fastdeploy.md section 13);
``conforms`` cells are cases where FastDeploy has no loading of its own to compare with (Qwen3-MoE): every
parameter its code creates is filled with its shape and dtype, and its first kernel calls get what the emulation
computes with. ``tests/test_serving_docs.py`` fails when either has no case there. Nothing has been seen served
on a Gaudi.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["CELLS", "LEGEND", "Cell", "Status", "model_status", "render_matrix"]


class Status(Enum):
    CHECKED = "checked"
    CONFORMS = "conforms"
    UNCHECKED = "not checked"
    UNSUPPORTED = "not supported"


LEGEND = (
    "**checked**: a case of the conformance suite runs FastDeploy's own code on a CPU (CI: release/2.5; opt-in: "
    "develop 8c3513a4 and e53f5184, release/2.6), and the model the hook loads "
    "equals FastDeploy's own loading to the bit, but for a self-attention linear's `act_scale_inv`, which CPU "
    "paddle's bf16 kernel rounds twice and the hook once (one bf16 ulp, each named; hpu-fp8-loader's docs/fastdeploy.md "
    "section 12); **conforms**: FastDeploy has no loading of its own to compare with; "
    "a case runs its code on a CPU, every parameter it creates is filled with the shape and dtype it created, and "
    "every argument of each layer's first attention and MoE kernel call equals what the project's emulation "
    "computes with; **not checked** (or not listed): the hook maps it, no case runs it; "
    "**not supported**: the note says why. Seen served on a Gaudi: none of them, yet."
)


@dataclass(frozen=True)
class Cell:
    """One combination and what is known of it. ``preset`` is the conformance suite's tiny model of that kind."""

    model: str
    model_type: str  # config.json's
    preset: str
    layout: str  # FastDeploy's MoE layout: "PR 5324" (develop up to 8c3513a4) or "PR 5855"; "any" for dense models
    parallel: str  # "TP 1", "TP 2" or "EP 2"
    kv_cache: str  # "fp8" or "none"
    status: Status
    notes: tuple[str, ...] = ()
    # the conformance test that checks it, and its file under tests/fastdeploy_real/; the default runs test_conformance.py's
    # CASES, test_qwen3_conformance.py's fill test its FILL_CASES
    evidence: str = "test_the_hook_fills_what_fastdeploys_own_loading_fills"
    suite: str = "test_conformance.py"

    @property
    def tp(self) -> int:
        return int(self.parallel.split()[1]) if self.parallel.startswith("TP") else 1


_EP_BEFORE_5855 = "FastDeploy's HPU MoE raises on expert parallelism before PR 5855"
_PR5855_FILES = (
    "on PR 5855 as merged (fbcccaa7: release/2.5, CI's build, release/2.6 and develop e53f5184), and on its MoE backend "
    "and model runner laid over FastDeploy 8c3513a4 in an opt-in case (hpu-fp8-loader's docs/fastdeploy.md section 13)"
)
_EP_5855 = (
    "against FastDeploy's own EP loading, which from fbcccaa7 reads the shared MoE input scale its measurement writes "
    "(over 8c3513a4, only under each expert's key)"
)
PR5855_SUITE = "test_pr5855_conformance.py"
PR5855_FILES = "test_the_hook_on_pr5855s_own_files"
_QWEN2_TP2 = "against FastDeploy's pre-sharded loading: its v0 loader does not split FP8 Qwen2"
_QWEN2 = (
    "FastDeploy never measures Qwen2's MLP and no FP8 Qwen2 has been seen served; with FP8 attention Qwen2-7B lost "
    "most of its GSM8K accuracy on another Gaudi stack (hpu-fp8-loader's docs/spec.md section 5)"
)


_QWEN3_TP2 = "against FastDeploy's pre-sharded loading: its v0 loader gives each rank the whole FP8 Qwen3 weights"
_QWEN3_NORMS = (
    "from 2533836d (both releases) FastDeploy's own loading hands its HPU attention no q/k norm; the hook hands the "
    "norms, the very parameters FastDeploy's own loading fills (hpu-fp8-loader's docs/fastdeploy.md section 14)"
)
QWEN3_SUITE = "test_qwen3_conformance.py"
QWEN3_FILL = "test_every_parameter_fastdeploy_creates_is_filled_and_every_kernel_argument_is_the_emulations"


def _qwen3_cells(kv: str) -> list[Cell]:
    """Qwen3 dense against FastDeploy's own loading; Qwen3-MoE, which FastDeploy cannot load itself, by conformance."""
    qwen3, moe = ("Qwen3", "qwen3"), ("Qwen3-MoE", "qwen3_moe")
    own_loading = "test_qwen3_loads_as_fastdeploys_own_loading_of_the_legacy_export"
    presharded = "test_qwen3_at_tp2_against_fastdeploys_presharded_loading"
    fp8 = kv == "fp8"
    conforms = {  # (layout, parallel) -> whether a fill case runs it at this KV scheme; other combinations are not listed
        ("PR 5324", "TP 1"): fp8,
        ("PR 5324", "TP 2"): True,
        ("PR 5855", "TP 2"): fp8,
    }
    cells = [
        Cell(*qwen3, "qwen3-tiny", "any", "TP 1", kv, Status.CHECKED, (_QWEN3_NORMS,), own_loading, QWEN3_SUITE),
        Cell(*qwen3, "qwen3-tiny", "any", "TP 2", kv, Status.CHECKED if fp8 else Status.UNCHECKED,
             (_QWEN3_NORMS, _QWEN3_TP2), presharded, QWEN3_SUITE),
    ]  # fmt: skip
    for (layout, parallel), runs in conforms.items():
        status = Status.CONFORMS if runs else Status.UNCHECKED
        cells.append(Cell(*moe, "qwen3-moe-tiny", layout, parallel, kv, status, (), QWEN3_FILL, QWEN3_SUITE))
    return cells


def _cells() -> tuple[Cell, ...]:
    moe, dense, qwen2 = ("ERNIE-4.5 MoE", "ernie4_5_moe"), ("ERNIE-4.5 dense", "ernie4_5"), ("Qwen2", "qwen2")
    checked, unchecked, unsupported = Status.CHECKED, Status.UNCHECKED, Status.UNSUPPORTED
    presharded = "test_qwen2_at_tp2_against_fastdeploys_presharded_loading"
    cells = []
    # PR 5855 at TP with KV fp8: the re-created layout, in CI; everything else of PR 5855: its own files, opt-in
    on_5855_files = (checked, (_PR5855_FILES,), PR5855_FILES, PR5855_SUITE)
    for kv in ("fp8", "none"):
        tp_5855 = (checked,) if kv == "fp8" else on_5855_files
        cells += [
            Cell(*moe, "ernie-moe-tiny", "PR 5324", "TP 1", kv, checked),
            Cell(*moe, "ernie-moe-tiny", "PR 5324", "TP 2", kv, checked),
            Cell(*moe, "ernie-moe-tiny", "PR 5324", "EP 2", kv, unsupported, (_EP_BEFORE_5855,)),
            Cell(*moe, "ernie-moe-tiny", "PR 5855", "TP 1", kv, *tp_5855),
            Cell(*moe, "ernie-moe-tiny", "PR 5855", "TP 2", kv, *tp_5855),
            Cell(*moe, "ernie-moe-tiny", "PR 5855", "EP 2", kv, checked, (_PR5855_FILES, _EP_5855), PR5855_FILES, PR5855_SUITE),
            Cell(*dense, "ernie-dense-tiny", "any", "TP 1", kv, unchecked),
            Cell(*dense, "ernie-dense-tiny", "any", "TP 2", kv, checked if kv == "fp8" else unchecked),
            Cell(*qwen2, "qwen2-tiny", "any", "TP 1", kv, checked, (_QWEN2,)),
            Cell(
                *qwen2, "qwen2-tiny", "any", "TP 2", kv, checked if kv == "fp8" else unchecked, (_QWEN2, _QWEN2_TP2), presharded
            ),
            *_qwen3_cells(kv),
        ]
    return tuple(cells)


CELLS = _cells()


def render_matrix() -> str:
    """The README's support matrix: one row per model, layout and parallelism, one column per KV-cache scheme."""
    rows: dict[tuple[str, str, str], dict[str, Cell]] = {}
    for cell in CELLS:
        rows.setdefault((cell.model, cell.layout, cell.parallel), {})[cell.kv_cache] = cell
    notes: list[str] = []  # numbered in order of first use

    def shown(cell: Cell) -> str:
        notes.extend(note for note in cell.notes if note not in notes)
        marks = "".join(f" ({notes.index(note) + 1})" for note in cell.notes)
        return f"{cell.status.value}{marks}"

    lines = ["| model | FastDeploy MoE layout | parallel | KV cache fp8 | KV cache none |", "|---|---|---|---|---|"]
    for (model, layout, parallel), by_kv in rows.items():
        lines.append(f"| {model} | {layout} | {parallel} | {shown(by_kv['fp8'])} | {shown(by_kv['none'])} |")
    lines += ["", " ".join([LEGEND, *(f"({i}) {note}." for i, note in enumerate(notes, 1))])]
    return "\n".join(lines) + "\n"


# what a model card says beyond its checked cells (docs/spec.md section 5, docs/fastdeploy.md section 12)
KV_NONE_CAVEAT = "FP8 linears with BF16 attention and KV cache (kv_cache_scheme none) have not been seen working on a Gaudi"


def model_status(model_type: str, kv_cache: str) -> str:
    """One paragraph for a model card: where serving such a checkpoint through the hook was checked, and its caveats."""
    cells = [c for c in CELLS if c.model_type == model_type and c.kv_cache == kv_cache]

    def where(status: Status) -> str:
        return ", ".join(f"{c.parallel}{'' if c.layout == 'any' else f' ({c.layout})'}" for c in cells if c.status is status)

    checked, conforming = where(Status.CHECKED), where(Status.CONFORMS)
    if checked:
        done = (
            f"checked on FastDeploy's own code on a CPU at {checked}: the model the hook loads equals FastDeploy's own "
            "loading to the bit, but for one bf16 rounding CPU paddle does twice (hpu-fp8-loader's docs/fastdeploy.md "
            "section 12)"
        )
    elif conforming:
        done = (
            f"checked on FastDeploy's own code on a CPU at {conforming} for conformance only (FastDeploy has no loading "
            "of its own to compare with): every parameter it creates is filled with its shape and dtype, and its first "
            "kernel calls get what the project's emulation computes with"
        )
    else:
        done = "not checked on FastDeploy's code"
    caveats = ([_QWEN2] if model_type == "qwen2" else []) + ([KV_NONE_CAVEAT] if kv_cache == "none" else [])
    said = "".join(f" {caveat[0].upper()}{caveat[1:]}." for caveat in caveats)
    return f"Serving this checkpoint through the hook is {done}; it has not yet been run on a Gaudi.{said}"

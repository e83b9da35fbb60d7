"""Numbers a person can look at: which linears lose most under FP8, activation ranges, weight spread, expert load.

Eval gives one figure per model (KL, top-1); when it is bad, the next question is *where*. A :class:`Report`
collects, while calibrate or eval runs its float32 forward anyway (no second pass over the weights):

- per linear, ``||y_fp8 - y|| / ||y||`` with ``y = x @ W`` (float32) and ``y_fp8`` the same product with the
  activation cast to e4m3 at ±240 with its per-tensor scale and the FP8 weight with its scale (per tensor, or
  per output channel for routed experts, as the converter makes it), on up to :data:`~hpu_fp8_loader.quality.observers.ROWS_PER_CALL` evenly
  spaced rows of each input the forward hands over;
- each linear's weight spread: max / min of its per-output-channel amax (what a per-tensor scale wastes on
  the small channels);
- the activation amax of every point and the tokens routed to each expert.

Where the FP8 side comes from differs (``fp8_source`` in report.json says which): calibrate has no checkpoint
yet, so the weights are quantized as ``convert`` would (±240, no scale rounding) and each activation at the
amax measured *so far* (the final amax for the last batch; e4m3's relative rounding does not depend on the
scale outside the subnormal range, and no value is clipped); eval uses the FP8 checkpoint's own codes, weight
scales and ``act_scale`` tensors, during the reference forward on the BF16 source.

Routed experts' up_gate error is measured on the layer's shared input rows (every token, not only those routed
to the expert: the observer does not see the routing); their down_proj on the tokens routed to them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from hpu_fp8_loader import __version__
from hpu_fp8_loader.arch import ModelDescriptor, Role
from hpu_fp8_loader.arch.base import linear_group
from hpu_fp8_loader.arch.contents import check_keep_bf16
from hpu_fp8_loader.engine.model import Observer
from hpu_fp8_loader.errors import ConfigError, OutputExistsError, UnsafePathError, WriteFailedError, force_flag, require_optional
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.io.manifest import foreign_entry
from hpu_fp8_loader.io.writer import check_apart, publish_output_dir
from hpu_fp8_loader.quality.observers import (
    AmaxObserver,
    CheckpointFp8,
    ConverterFp8,
    Fp8Side,
    LinearErrorObserver,
    RangeObserver,
    TeeObserver,
)
from hpu_fp8_loader.quality.ranges import NORMAL_SPAN
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.choices import Bf16Group
from hpu_fp8_loader.spec.fp8 import GAUDI2_FP8_MAX

__all__ = [
    "REPORT_FILE",
    "STARVED_SHARE",
    "Report",
    "check_report_dir",
]

REPORT_FILE = "report.json"
REPORT_FORMAT = "hpu-fp8-report"
# An expert that got fewer than this share of its layer's mean routed tokens is marked starved (0 is dead).
STARVED_SHARE = 0.1


def _point_type(module: str) -> str:
    """A module name without its layer (``self_attn.cache_k``, ``mlp.experts.*.down_proj``): one line in a plot."""
    rest = module.split(".layers.", 1)[1].split(".", 1)[1]
    expert = names.expert_of(module)
    return rest.replace(f"experts.{expert[1]}.", "experts.*.") if expert else rest


def _layer(point: str) -> int:
    """The layer of an activation point (every point a range is read at is one of names.MODULE_PATTERN)."""
    match = names.MODULE_PATTERN.match(point)
    assert match is not None
    return int(match.group("layer"))


class Report:
    """Collects a report while :func:`~hpu_fp8_loader.calibrate` or :func:`~hpu_fp8_loader.evaluate` runs
    (pass it as ``report=``), then writes it: ``report.json``, ``index.html`` and PNG plots.

    Example:
        >>> from hpu_fp8_loader import TINY_MODELS, Report, calibrate
        >>> report = Report()
        >>> result = calibrate(TINY_MODELS["qwen2-bytes"], samples=4, seq_len=64, report=report)
        >>> report.worst(1)[0]["module"]
        'qwen2.layers.1.mlp.down_proj'
        >>> report.write("calibration-report")
    """

    def __init__(self) -> None:
        self.kind: str | None = None
        self.model = ""
        self.descriptor: ModelDescriptor | None = None
        self.errors: LinearErrorObserver | None = None
        self.amax: Mapping[str, float] = {}
        self.expert_tokens: Mapping[str, int] = {}
        self.checkpoint: str | None = None  # eval: the FP8 checkpoint compared with the model
        self.checkpoint_amax: dict[str, float] = {}
        self.evaluation: dict | None = None  # set by evaluate: its EvaluationResult.to_dict()
        self.ranges: list[dict] = []  # set by calibrate and evaluate: every point's PointRange.to_dict()

    def _start(
        self,
        kind: str,
        model: str | Path,
        descriptor: ModelDescriptor,
        fp8: Fp8Side,
        amax_observer: AmaxObserver,
        ranges: RangeObserver,
    ) -> Observer:
        if self.kind is not None:
            raise RuntimeError("a Report collects one calibration or one evaluation; make another for the next run")
        self.kind, self.model, self.descriptor = kind, str(model), descriptor
        self.errors = LinearErrorObserver(descriptor, fp8)
        self.amax, self.expert_tokens = amax_observer.amax, amax_observer.expert_tokens
        return TeeObserver(amax_observer, ranges, self.errors)

    def calibration_observer(
        self, model: str | Path, descriptor: ModelDescriptor, amax_observer: AmaxObserver, ranges: RangeObserver
    ) -> Observer:
        """What calibrate runs instead of its amax and range observers: those, then the error observer reading the
        amax."""
        return self._start("calibrate", model, descriptor, ConverterFp8(amax_observer.amax), amax_observer, ranges)

    def evaluation_observer(
        self, model: str | Path, descriptor: ModelDescriptor, checkpoint: Checkpoint, ranges: RangeObserver
    ) -> Observer:
        """What eval's reference forward runs instead of its range observer: held-out amax and expert load, the
        magnitudes, and each linear's error against the checkpoint's FP8 weights and scales."""
        self.checkpoint = str(checkpoint.root)
        self.checkpoint_amax = {
            name.removesuffix("." + names.ACT_AMAX): float(np.asarray(checkpoint.get(name), np.float32).reshape(-1)[0])
            for name in checkpoint.tensors
            if name.endswith("." + names.ACT_AMAX)
        }
        return self._start("eval", model, descriptor, CheckpointFp8(checkpoint), AmaxObserver(descriptor.prefix), ranges)

    # ------------------------------------------------------------------ the data

    def worst(self, count: int | None = None) -> list[dict]:
        """The linears measured, largest relative error first."""
        rows = [row for row in self._linear_rows() if row["relative_error"] is not None]
        return sorted(rows, key=lambda row: -row["relative_error"])[:count]

    def _linear_rows(self) -> list[dict]:
        if self.errors is None:
            return []
        return [
            {
                "module": s.module,
                "layer": s.layer,
                "role": s.role.value,
                "expert": s.expert,
                "relative_error": s.relative_error,
                "rows": s.rows,
                "channel_spread": s.channel_spread,
                "act_amax": self.checkpoint_amax.get(s.point, self.amax.get(s.point)),
            }
            for s in self.errors.linears.values()
        ]

    def _layers(self) -> list[dict]:
        d = self.descriptor
        assert d is not None
        shown = self.checkpoint_amax or self.amax  # eval: the amax the checkpoint is served with
        layers: list[dict] = [{"layer": i, "amax": {}, "observed_amax": {}} for i in range(d.num_layers)]
        for source, key in ((shown, "amax"), (self.amax if self.checkpoint_amax else {}, "observed_amax")):
            for module, value in source.items():
                match = names.MODULE_PATTERN.match(module)
                if match:
                    point = _point_type(module)
                    per_layer = layers[int(match.group("layer"))][key]
                    per_layer[point] = max(per_layer.get(point, 0.0), float(value))
        for row in self._linear_rows():
            if row["relative_error"] is not None:
                entry = layers[row["layer"]]
                entry["max_relative_error"] = max(entry.get("max_relative_error", 0.0), row["relative_error"])
        return layers

    def _amax_points(self) -> list[dict] | None:
        """eval: every point's held-out amax beside the amax the checkpoint's scale was made from (held-out 0: no
        held-out token reached it, such as an expert none was routed to); None for a calibration."""
        if self.checkpoint is None:
            return None
        return [
            {"module": module, "point": _point_type(module), "checkpoint": value, "held_out": float(self.amax.get(module, 0.0))}
            for module, value in sorted(self.checkpoint_amax.items())
        ]

    def _experts(self) -> dict | None:
        d = self.descriptor
        assert d is not None
        if d.moe is None:
            return None
        moe_layers = [i for i in range(d.num_layers) if d.is_moe_layer(i)]
        tokens = [
            [int(self.expert_tokens.get(names.expert_tokens_key(d.prefix, i, e), 0)) for e in range(d.moe.num_experts)]
            for i in moe_layers
        ]
        dead, starved = [], []
        for layer, counts in zip(moe_layers, tokens, strict=True):
            mean = sum(counts) / len(counts)
            for e, count in enumerate(counts):
                if count == 0:
                    dead.append([layer, e])
                elif count < STARVED_SHARE * mean:
                    starved.append([layer, e])
        return {"moe_layers": moe_layers, "tokens": tokens, "dead": dead, "starved": starved, "starved_below": STARVED_SHARE}

    def _keep_bf16(self) -> dict:
        """Per group FastDeploy can keep in BF16, its worst linear; and the ``--keep-bf16`` choice that would keep the
        worst linear of all in BF16, when this model can serve it (None when keeping its group leaves no FP8 linear)."""
        d = self.descriptor
        assert d is not None
        groups: dict[str, dict] = {}
        for row in self.worst():
            group = linear_group(Role(row["role"]))
            if group is not None and group.value not in groups:
                groups[group.value] = {"worst_module": row["module"], "relative_error": row["relative_error"]}
        suggestion = None
        if groups:
            worst = max(groups, key=lambda g: groups[g]["relative_error"])
            try:
                check_keep_bf16(d, frozenset({Bf16Group(worst)}))
                suggestion = f"--keep-bf16 {worst}"
            except ConfigError:
                pass  # its group is every linear this model has
        return {"groups": groups, "suggestion": suggestion}

    def _evaluation(self) -> dict | None:
        if self.evaluation is None:
            return None
        data = dict(self.evaluation)
        kl = {row["variant"]: row["mean_kl"] for row in data["rows"]}
        data["kv_kl_difference"] = kl["fp8"] - kl["no-kv-fp8"] if {"fp8", "no-kv-fp8"} <= set(kl) else None
        return data

    def to_dict(self) -> dict:
        """report.json's content (docs/guide.md, "Reports", lists every key)."""
        if self.kind is None or self.descriptor is None or self.errors is None:
            raise RuntimeError("nothing collected: pass the Report to calibrate or evaluate first")
        d = self.descriptor
        return {
            "format": REPORT_FORMAT,
            "version": 1,
            "kind": self.kind,
            "tool_version": __version__,
            "model": self.model,
            "checkpoint": self.checkpoint,
            "model_type": d.model_type,
            "num_layers": d.num_layers,
            "fp8_max": GAUDI2_FP8_MAX,
            "fp8_source": self.errors.fp8.description,
            "rows_per_call": self.errors.rows_per_call,
            "linears": self.worst() + [row for row in self._linear_rows() if row["relative_error"] is None],
            "layers": self._layers(),
            "amax_points": self._amax_points(),
            "experts": self._experts(),
            "keep_bf16": self._keep_bf16(),
            "evaluation": self._evaluation(),
            "ranges": [{**row, "point": _point_type(row["module"]), "layer": _layer(row["module"])} for row in self.ranges],
            "normal_span": NORMAL_SPAN,
        }

    def write(self, directory: str | Path, force: bool = False, sources: Iterable[str | Path] = ()) -> Path:
        """Write report.json, the PNGs and index.html into ``directory``, atomically (built beside it, then
        renamed); an existing non-empty ``directory`` is replaced only with ``force`` and only if it is a report."""
        from hpu_fp8_loader.quality.report_plots import render

        out = Path(directory)
        check_report_dir(out, force, sources)
        data = self.to_dict()
        staging = Path(tempfile.mkdtemp(dir=out.absolute().parent, prefix=f".{out.name}.", suffix=".partial"))
        try:
            data["plots"] = render(data, staging)
            (staging / REPORT_FILE).write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
            # what publishes a checkpoint: synced, then renamed over OUT, which is checked again as it is now
            # with a manifest, as a checkpoint: it is what lets --force replace this report later, and nothing else
            return publish_output_dir(
                staging, out, manifest=True, force=True, replaceable=lambda found: check_report_dir(found, force)
            )
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def check_report_dir(directory: str | Path, force: bool, sources: Iterable[str | Path] = ()) -> None:
    """Refuse, before any work, a report directory that must not be written: one of ``sources`` (or inside or
    around one), a link or a file, a non-empty directory without ``force``, or with it one that is not a report this
    tool wrote, whole (its manifest accounts for everything in it: ``io.manifest.foreign_entry``)."""
    out = Path(directory)
    require_optional("matplotlib", f"{out}: the report's plots")
    check_apart(out, sources)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UnsafePathError(f"{out}: a link or a file; --report names a directory to write")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise OutputExistsError(f"{out}: already exists and is not empty; pass {force_flag()} to replace it")
        if (reason := foreign_entry(out)) is not None:
            raise OutputExistsError(
                f"{out}: {reason}; {force_flag()} replaces only a report this tool wrote, as its manifest lists it: "
                "nothing was removed, remove it yourself if it should go"
            )
    parent = out.absolute().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise WriteFailedError(f"{out}: its directory {parent} is missing or not writable")

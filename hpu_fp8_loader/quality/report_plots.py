"""A report's PNGs (matplotlib, Agg: no display needed) and the index.html that shows them.

Kept apart from report.py because importing matplotlib takes a second: only writing a report pays it.
Every string that comes from the model (module names, paths) is HTML-escaped; a model or checkpoint is named by its
directory's base name (a Hub snapshot by its repo id and revision), never by a local path.
"""

from __future__ import annotations

import html
from pathlib import Path, PurePath

__all__ = ["CAPTIONS", "HTML_FILE", "PLOTS", "render", "shown_name"]

HTML_FILE = "index.html"
# Plot name -> file name: what report.json's "plots" lists and a model card references.
PLOTS = {
    "linear_error": "linear_error.png",
    "act_amax": "act_amax.png",
    "weight_spread": "weight_spread.png",
    "expert_tokens": "expert_tokens.png",
    "attention": "attention.png",
    "held_out_amax": "held_out_amax.png",
    "act_range": "act_range.png",
}
_WORST_SHOWN = 30  # bars in the linear-error chart and rows in the page's table
_WIDEST_SHOWN = 10  # rows in the page's table of ranges
_ATTENTION_POINTS = ("self_attn.q", "self_attn.cache_k", "self_attn.cache_v", "self_attn.s")
# One look per line of a plot: tab20's 20 colours, each with its own marker (a point-type plot has up to ~15 lines,
# more than the default cycle's ten colours), and a second linestyle past twenty.
_COLOURS = 20
_MARKERS = "osD^vP*Xph"
_LINESTYLES = ("-", "--")


def shown_name(path: str) -> str:
    """A model or checkpoint as a report names it: a Hub snapshot (``.../models--ORG--NAME/snapshots/REV``) as
    ``ORG/NAME@REV`` (8 characters), any other directory by its base name; never a whole local path."""
    parts = PurePath(path).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return f"{parts[-3].removeprefix('models--').replace('--', '/')}@{parts[-1][:8]}"
    return PurePath(path).name or path


def _subject(data: dict) -> str:
    """What a report is about, for titles: the model, and in eval the FP8 checkpoint compared with it."""
    model = shown_name(data["model"])
    return f"{shown_name(data['checkpoint'])} vs {model}" if data.get("checkpoint") else model


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _short(module: str) -> str:
    """``qwen2.layers.3.self_attn.qkv_proj`` -> ``L3 self_attn.qkv_proj``: a readable bar label."""
    _, _, rest = module.partition(".layers.")
    layer, _, inside = rest.partition(".")
    return f"L{layer} {inside}" if rest else module


def _linear_error(plt, data: dict, path: Path) -> None:
    worst = [row for row in data["linears"] if row["relative_error"] is not None][:_WORST_SHOWN]
    fig, ax = plt.subplots(figsize=(9, 0.28 * max(len(worst), 4) + 1.2))
    ax.barh([_short(r["module"]) for r in worst][::-1], [r["relative_error"] for r in worst][::-1], color="tab:red")
    ax.set_xlabel("relative output error ||y_fp8 - y|| / ||y||")
    ax.set_title(f"Linears that lose most under FP8 (worst {len(worst)})")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _look(plt, index: int) -> dict:
    """Line ``index``'s colour, marker and linestyle: no two lines of a plot look alike."""
    colour = plt.get_cmap("tab20").colors[index % _COLOURS]
    return {"color": colour, "marker": _MARKERS[index % len(_MARKERS)], "linestyle": _LINESTYLES[index // _COLOURS % 2]}


def _per_layer_lines(
    plt, lines: dict[str, dict[int, float]], title: str, ylabel: str, path: Path, limit: tuple[float, str] | None = None
) -> None:
    """One line per label over the layers (log y), the legend beside the axes, whole layer numbers on x; ``limit``: a
    dashed horizontal line at its value, labelled."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for index, (label, per_layer) in enumerate(lines.items()):
        layers = sorted(per_layer)
        ax.plot(layers, [per_layer[x] for x in layers], markersize=4, label=label, **_look(plt, index))
    if limit is not None:
        ax.axhline(limit[0], color="black", linestyle=":", linewidth=1, label=limit[1])
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if lines or limit:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")  # the legend outside the axes is kept in the file
    plt.close(fig)


def _lines_by_point(plt, layers: list[dict], key: str, points: list[str], title: str, path: Path) -> None:
    lines = {point: {e["layer"]: e[key][point] for e in layers if e[key].get(point, 0) > 0} for point in points}
    _per_layer_lines(plt, lines, title, "amax (log)", path)


def _act_amax(plt, data: dict, path: Path) -> None:
    points = sorted({p for e in data["layers"] for p in e["amax"]})
    served = f"{shown_name(data['checkpoint'])}'s act_amax" if data.get("checkpoint") else shown_name(data["model"])
    _lines_by_point(plt, data["layers"], "amax", points, f"Activation amax per layer and point: {served}", path)


def _weight_spread(plt, data: dict, path: Path) -> None:
    by_role: dict[str, dict[int, float]] = {}
    for row in data["linears"]:
        if row["channel_spread"] is not None:
            per_layer = by_role.setdefault(row["role"], {})
            per_layer[row["layer"]] = max(per_layer.get(row["layer"], 0.0), row["channel_spread"])
    lines = {role + (" (max over experts)" if "expert_" in role else ""): by_role[role] for role in sorted(by_role)}
    title = f"Weight spread: how much a per-tensor scale wastes on small channels\n{shown_name(data['model'])}"
    _per_layer_lines(plt, lines, title, "max / min per-channel weight amax (log)", path)


def _expert_tokens(plt, experts: dict, path: Path) -> None:
    import numpy as np

    tokens = np.asarray(experts["tokens"], np.float64)
    fig, ax = plt.subplots(figsize=(min(4 + 0.25 * tokens.shape[1], 16), 1.5 + 0.35 * tokens.shape[0]))
    image = ax.imshow(tokens, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="routed tokens")
    row_of = {layer: i for i, layer in enumerate(experts["moe_layers"])}
    starved = f"starved (< {experts['starved_below']:.0%} of the layer mean)"
    for marks, style in (
        (experts["dead"], {"marker": "x", "color": "red", "label": "dead (0 tokens)"}),
        (experts["starved"], {"marker": "o", "facecolors": "none", "edgecolors": "orange", "label": starved}),
    ):
        if marks:
            ax.scatter([e for _, e in marks], [row_of[layer] for layer, _ in marks], s=60, linewidths=2, **style)
    ax.set_yticks(range(len(experts["moe_layers"])), [str(layer) for layer in experts["moe_layers"]])
    if tokens.shape[1] <= 64:
        ax.set_xticks(range(tokens.shape[1]))
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(f"Tokens routed per expert ({len(experts['dead'])} dead, {len(experts['starved'])} starved)\n{experts['model']}")
    if experts["dead"] or experts["starved"]:
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _attention(plt, data: dict, path: Path) -> None:
    points = [p for p in _ATTENTION_POINTS if any(p in e["amax"] for e in data["layers"])]
    evaluation = data["evaluation"]
    note = ""
    if evaluation and evaluation["kv_kl_difference"] is not None:
        note = (
            f"\nKL(fp8) - KL(no-kv-fp8) = {evaluation['kv_kl_difference']:+.4g} nats/token: what FP8 attention and KV cache cost"
        )
    _lines_by_point(plt, data["layers"], "amax", points, f"Attention points: amax per layer: {_subject(data)}{note}", path)


def _held_out_amax(plt, data: dict, path: Path) -> None:
    """eval: each point's held-out amax against the amax its scale was made from, coloured by point type."""
    by_type: dict[str, list[tuple[float, float]]] = {}
    unreached = 0
    for row in data["amax_points"]:
        if row["held_out"] > 0:
            by_type.setdefault(row["point"], []).append((row["checkpoint"], row["held_out"]))
        else:
            unreached += 1
    pairs = [pair for values in by_type.values() for pair in values]
    above = sum(held_out > calibrated for calibrated, held_out in pairs)
    fig, ax = plt.subplots(figsize=(7.5, 6))
    for index, (point, values) in enumerate(sorted(by_type.items())):
        look = _look(plt, index)
        ax.scatter(*zip(*values, strict=True), s=22, label=point, color=look["color"], marker=look["marker"])
    if pairs:
        low, high = min(min(p) for p in pairs), max(max(p) for p in pairs)
        ax.plot([low, high], [low, high], color="black", linewidth=0.8, label="held-out = calibrated")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"amax {shown_name(data['checkpoint'])}'s scales were made from (act_amax)")
    ax.set_ylabel(f"held-out amax ({shown_name(data['model'])}, float32 reference)")
    reached = f"; {unreached} point(s) no held-out token reached" if unreached else ""
    ax.set_title(
        f"Held-out vs calibrated amax, per point: {above} of {len(pairs)} above the diagonal{reached}\n{_subject(data)}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def _act_range(plt, data: dict, path: Path) -> None:
    """Each point type's widest amax / median |x| per layer (routed experts: the widest expert), against the ratio
    at which the median leaves E4M3's normal range."""
    lines: dict[str, dict[int, float]] = {}
    for row in data["ranges"]:
        per_layer = lines.setdefault(row["point"], {})
        ratio = row["ratio"] if row["ratio"] is not None else float("inf")
        per_layer[row["layer"]] = max(per_layer.get(row["layer"], 0.0), ratio)
    text = "held-out text, the checkpoint's scales" if data.get("checkpoint") else "calibration text"
    limit = (data["normal_span"], f"{data['normal_span']:,.0f}: median below E4M3's smallest normal")
    title = f"Range per layer and point: amax / median |x| ({text})\n{_subject(data)}"
    _per_layer_lines(plt, dict(sorted(lines.items())), title, "amax / median |x| (log)", path, limit)


def render(data: dict, directory: Path) -> dict[str, str]:
    """Write the PNGs ``data`` has material for and index.html into ``directory``; returns plot name -> file."""
    plt = _pyplot()
    made: dict[str, str] = {}
    for name, draw in (
        ("linear_error", _linear_error),
        ("act_amax", _act_amax),
        ("weight_spread", _weight_spread),
        ("attention", _attention),
    ):
        draw(plt, data, directory / PLOTS[name])
        made[name] = PLOTS[name]
    if data["experts"] is not None:
        _expert_tokens(plt, {**data["experts"], "model": shown_name(data["model"])}, directory / PLOTS["expert_tokens"])
        made["expert_tokens"] = PLOTS["expert_tokens"]
    if data.get("amax_points"):
        _held_out_amax(plt, data, directory / PLOTS["held_out_amax"])
        made["held_out_amax"] = PLOTS["held_out_amax"]
    if data["ranges"]:
        _act_range(plt, data, directory / PLOTS["act_range"])
        made["act_range"] = PLOTS["act_range"]
    (directory / HTML_FILE).write_text(_page(data, made), encoding="utf-8")
    return made


CAPTIONS = {
    "linear_error": "Relative output error of each linear under FP8 (activation and weight), worst first.",
    "act_amax": "Activation amax per layer, one line per point type: a sudden jump marks an outlier layer whose scale is coarse.",
    "weight_spread": "Per linear, max / min of the per-output-channel weight amax: large values mean a per-tensor scale leaves small channels few FP8 codes.",
    "expert_tokens": "Tokens routed to each expert (layers x experts): x marks a dead expert, o a starved one.",
    "attention": "Query, K cache, V cache and probability amax per layer (the FP8 attention and KV cache scales).",
    "held_out_amax": "Each point's largest held-out activation against the amax its FP8 scale was made from (the "
    "checkpoint's act_amax): a point above the diagonal saw larger values on held-out text than in calibration.",
    "act_range": "Per layer and point type, the amax the scale is made from over the median |x|: above the dotted line "
    "the median value is no E4M3 normal at the per-tensor scale, and static FP8 loses the bulk of the tensor.",
}


def _number(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _page(data: dict, plots: dict[str, str]) -> str:
    e = html.escape
    measured = [r for r in data["linears"] if r["relative_error"] is not None][:_WORST_SHOWN]
    rows = "".join(
        f"<tr><td>{i}</td><td>{e(r['module'])}</td><td>{r['relative_error']:.4g}</td>"
        f"<td>{_number(r['channel_spread'], '.3g')}</td><td>{_number(r['act_amax'], '.4g')}</td></tr>"
        for i, r in enumerate(measured, 1)
    )
    ranges = "".join(
        f"<tr><td>{e(r['module'])}</td><td>{r['amax']:.4g}</td><td>{r['median']:.4g}</td>"
        f"<td>{'inf' if r['ratio'] is None else format(r['ratio'], '.4g')}</td><td>{'beyond' if r['beyond'] else ''}</td></tr>"
        for r in data["ranges"][:_WIDEST_SHOWN]
    )
    evaluation = ""
    if data["evaluation"]:
        evaluation = (
            "<h2>Evaluation</h2><table><tr><th>variant</th><th>top-1 agreement</th><th>mean KL</th></tr>"
            + "".join(
                f"<tr><td>{e(r['variant'])}</td><td>{100 * r['top1_agreement']:.2f}%</td><td>{r['mean_kl']:.4g}</td></tr>"
                for r in data["evaluation"]["rows"]
            )
            + "</table>"
        )
    figures = "".join(
        f'<figure><img src="{e(file)}" alt="{e(name)}"><figcaption>{e(CAPTIONS[name])}</figcaption></figure>'
        for name, file in plots.items()
    )
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>hpu-fp8 report</title>'
        "<style>body{font-family:sans-serif;max-width:1000px;margin:auto}td,th{padding:2px 8px;text-align:left}"
        "img{max-width:100%}</style></head><body>\n"
        f"<h1>hpu-fp8 {e(data['kind'])} report: {e(_subject(data))}</h1>\n"
        f"<p>{e(data['model_type'])}, {data['num_layers']} layers; FP8 ±{data['fp8_max']:g}; FP8 side: {e(data['fp8_source'])}; "
        f'up to {data["rows_per_call"]} rows per input measured. The numbers are in <a href="report.json">report.json</a>.</p>\n'
        f"{evaluation}<h2>Linears that lose most</h2><table><tr><th>#</th><th>linear</th><th>relative error</th>"
        f"<th>weight spread</th><th>act amax</th></tr>{rows}</table>\n"
        f"<h2>Widest ranges</h2><p>amax / median |x| above {data['normal_span']:,.0f} is beyond what E4M3 at ±240 holds."
        f"</p><table><tr><th>point</th><th>amax</th><th>median |x|</th><th>ratio</th><th></th></tr>{ranges}</table>\n"
        f"{figures}\n</body></html>\n"
    )

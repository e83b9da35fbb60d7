"""FP8 that survives outliers (issue 42): today's static route, the exact rebalancing, and the per-token ceiling.

Every number is the emulation's (Gaudi FP8 arithmetic on a CPU, docs/accuracy.md), on held-out text never calibrated
on, against the float32 BF16 reference: mean KL(bf16 || fp8) per token. Per model (the shipped tiny models, and
stress models made from them with `hpu-fp8 stress`, whose BF16 function is the shipped model's to the bit):

- floor: convert --calibrate as today (rebalance off), the checkpoint's fp8 row;
- flagged / all: convert --calibrate --rebalance flagged / all, their fp8 rows;
- tok (the issue's ceiling): the floor checkpoint's per-token row (every FP8 linear input cast with its own token's
  scale, attention and KV cache as served), which FastDeploy's HPU format cannot serve;
- same: for a stress model, the floor of the shipped model it was made from: the same BF16 function, so what static
  FP8 gets where no outlier was grown;
- recovered: (floor - method) / (floor - same), how much of the loss the outliers cost the method wins back, with
  a 95% paired bootstrap interval over the evaluation windows (numerics/bootstrap.py; both on the same windows);
- vs tok: (floor - method) / (floor - per-token), the issue's "fraction of the gap closed"; above 1 where the
  method beats the per-token row, which is no ceiling for an outlier channel every token carries;
  "no gap" where the floor-to-reference gap's own interval does not exclude zero;
- dKL: method - floor per token, with its paired 95% interval (the windows resampled jointly).

Each row is repeated for several calibration seeds: seed s calibrates on the built-in calibration text's paragraphs
shuffled by s (seed 0: in order), so the windows calibrated on differ while the evaluation text stays the same.

    python bench/outliers.py                       # the tables of docs/guide.md, "FP8 range" (about 10 min, 2 cores)
    python bench/outliers.py --seeds 1 --json      # one seed, one JSON document
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from hpu_fp8_loader.conversion.folds import Fold, fold_sites
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.engine.weights import open_weights
from hpu_fp8_loader.numerics.bootstrap import bootstrap_gap_closed, bootstrap_ratio_interval
from hpu_fp8_loader.quality.calibrate import CalibrationOptions, calibrate
from hpu_fp8_loader.quality.datasets import builtin_text
from hpu_fp8_loader.quality.evaluate import evaluate
from hpu_fp8_loader.quality.quantize import quantize
from hpu_fp8_loader.quality.stress import stress_model
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS

# (model, stress targets): the shipped models as they are, then stressed at one kind of fold site each
CASES: list[tuple[str, dict[Fold, float]]] = [
    *((model, {}) for model in TINY_MODELS),
    *((model, {Fold.DOWN: 1e6}) for model in TINY_MODELS),
    ("qwen2-bytes", {Fold.QKV: 1e6}),
    ("qwen2-bytes", {Fold.MLP_INPUT: 1e6}),
    ("qwen2-bytes", {Fold.O_PROJ: 1e6}),
]
SWEEP = [1e2, 1e3, 1e4, 1e5, 1e6, 1e7]  # qwen2-bytes' down_proj inputs, amax / median


def calibration_text(seed: int, work: Path) -> str:
    """The built-in calibration text, its paragraphs shuffled by ``seed`` (0: as it is), as a dataset path."""
    if seed == 0:
        return "builtin"
    paragraphs = builtin_text("calibration").split("\n\n")
    order = np.random.default_rng(seed).permutation(len(paragraphs))
    path = work / f"calibration-{seed}.txt"
    path.write_text("\n\n".join(paragraphs[i] for i in order), encoding="utf-8")
    return str(path)


def interval(bounds: tuple[float, float]) -> list[float]:
    return [round(bounds[0], 6), round(bounds[1], 6)]


def closed(floor: np.ndarray, method: np.ndarray, reference: np.ndarray, tokens: np.ndarray) -> list | None:
    """(floor - method) / (floor - reference) with its paired interval; None where the floor-to-reference gap's own
    interval does not exclude zero (no gap to close)."""
    if bootstrap_ratio_interval(floor - reference, tokens)[0] <= 0:
        return None
    fraction, bounds = bootstrap_gap_closed(floor, method, reference)
    return [round(fraction, 4), interval(bounds)]


def measure(source: Path, work: Path, seed: int, args: argparse.Namespace, same_function: np.ndarray | None) -> dict:
    """floor, flagged, all and per-token on one source and one calibration seed; ``same_function``: the per-window KL
    of the floor of the shipped model a stress model was made from (the same BF16 function)."""
    calibration = CalibrationOptions(dataset=calibration_text(seed, work), samples=args.samples, seq_len=args.seq_len)
    rows, sites = {}, {}
    for mode in ("off", "flagged", "all"):
        out = work / f"fp8-{mode}"
        result = quantize(source, out, calibration, ConvertOptions(rebalance=mode, force=True, dead_experts="sibling-max"))
        sites[mode] = len(result.folds.exponents)
        variants = ("fp8", "per-token") if mode == "off" else ("fp8",)
        for row in evaluate(source, out, samples=args.eval_samples, variants=variants).rows:
            rows["per-token" if row.variant == "per-token" else ("floor" if mode == "off" else mode)] = row
    kl = {name: np.array(row.window_kl) for name, row in rows.items()}
    tokens = np.full(len(kl["floor"]), args.seq_len - 1, np.float64)
    found: dict = {
        "seed": seed,
        "kl": {name: row.mean_kl for name, row in rows.items()},
        "top1": {name: row.top1_agreement for name, row in rows.items()},
        "sites": sites,
        "window_kl_floor": kl["floor"].tolist(),
    }
    for method in ("flagged", "all"):
        found[method] = {
            "dkl": interval(bootstrap_ratio_interval(kl[method] - kl["floor"], tokens)),
            "closed_vs_per_token": closed(kl["floor"], kl[method], kl["per-token"], tokens),
            "recovered": None if same_function is None else closed(kl["floor"], kl[method], same_function, tokens),
        }
    if same_function is not None:
        found["kl"]["same-function floor"] = float(same_function.sum() / tokens.sum())
    return found


def stress_source(model: str, targets: dict[Fold, float], work: Path) -> tuple[Path, float | None]:
    """The model itself, or its stress model; with the widest calibration ratio at the stressed points."""
    if not targets:
        return TINY_MODELS[model], None
    out = work / "stress"
    stress_model(TINY_MODELS[model], out, targets, force=True)
    points = {site.points[0] for site in fold_sites(open_weights(out).descriptor) if site.fold in targets}
    measured = calibrate(out, samples=32, seq_len=128).ranges
    return out, max(r.ratio for r in measured if r.module in points)


def label(model: str, targets: dict[Fold, float]) -> str:
    return model + "".join(f" {fold.value}={ratio:.0e}" for fold, ratio in targets.items())


def shown(value: list | None) -> str:
    return "no gap" if value is None else f"{value[0]:+.2f} [{value[1][0]:+.2f}, {value[1][1]:+.2f}]"


HEADER = (
    f"{'model':<30} {'amax/med':>9} {'seed':>4} {'floor':>7} {'flagged':>7} {'all':>7} {'tok':>7} {'same':>7} "
    f"{'flg':>3} {'recovered flagged':>21} {'recovered all':>21} {'flagged vs tok':>21} {'dKL(all-floor) [95%]':>21}"
)


def print_row(name: str, ratio: float | None, found: dict) -> None:
    kl = found["kl"]
    same = kl.get("same-function floor")
    dkl = found["all"]["dkl"]
    print(
        f"{name:<30} {'-' if ratio is None else f'{ratio:9.3g}':>9} {found['seed']:>4} {kl['floor']:7.4f} "
        f"{kl['flagged']:7.4f} {kl['all']:7.4f} {kl['per-token']:7.4f} {'-' if same is None else f'{same:7.4f}':>7} "
        f"{found['sites']['flagged']:>3} {shown(found['flagged']['recovered']) if same else '-':>21} "
        f"{shown(found['all']['recovered']) if same else '-':>21} {shown(found['flagged']['closed_vs_per_token']):>21} "
        f"{f'[{dkl[0]:+.4f}, {dkl[1]:+.4f}]':>21}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="calibration seeds per case")
    parser.add_argument("--samples", type=int, default=32, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--eval-samples", type=int, default=32, help="held-out windows (the bootstrap's units)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: dict = {"cases": [], "sweep": []}
    say = (lambda *a: None) if args.json else print
    say("mean KL(bf16 || fp8) per token on held-out text; tok: the floor checkpoint's per-token row; same: the floor")
    say("of the shipped model a stress model computes the same function as; flg: fold sites --rebalance flagged moved")
    say(HEADER)
    floors: dict[tuple[str, int], np.ndarray] = {}  # (shipped model, seed) -> its floor's per-window KL
    with tempfile.TemporaryDirectory(prefix="hpu-fp8-bench-outliers-") as tmp:
        work = Path(tmp)
        for model, targets in CASES:
            source, ratio = stress_source(model, targets, work)
            for seed in range(args.seeds):
                found = measure(source, work, seed, args, floors.get((model, seed)) if targets else None)
                if not targets:
                    floors[(model, seed)] = np.array(found["window_kl_floor"])
                results["cases"].append({"model": label(model, targets), "ratio": ratio, **found})
                if not args.json:
                    print_row(label(model, targets), ratio, found)
            shutil.rmtree(work / "stress", ignore_errors=True)
        say("\nsweep: qwen2-bytes, down_proj inputs stressed to each amax / median, calibration seed 0")
        say(HEADER)
        for target in SWEEP:
            source, ratio = stress_source("qwen2-bytes", {Fold.DOWN: target}, work)
            found = measure(source, work, 0, args, floors[("qwen2-bytes", 0)])
            results["sweep"].append({"target": target, "ratio": ratio, **found})
            if not args.json:
                print_row(label("qwen2-bytes", {Fold.DOWN: target}), ratio, found)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

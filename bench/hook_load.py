"""The hook's load time and memory beside FastDeploy's own loader, at ERNIE-4.5-21B-A3B's full width (issue 26 item 4,
issue 27 item 7), as ratios (never asserts).

What a user restarting a server waits for. Synthesizes ERNIE-4.5-21B-A3B at its real width (hidden 2560, 20 query and
4 KV heads, 64 experts of 1536, the published config.json values) with a few layers (default 3: one dense, two MoE),
converts it with synthetic calibrated amax and writes its legacy export, then, in the FastDeploy conformance
environment (FastDeploy's real code on a CPU paddle, the suite's stand-ins; tests/fastdeploy_real/fd_environment.py),
loads one rank through ``HPUModelRunner.load_model`` as its worker does, each load a process of its own:

- FastDeploy's own v0 loader (``--load-choices default``) on the legacy export: the baseline;
- the hook (``--load-choices hpu_fp8``) on the hpu-fp8 checkpoint.

Each is measured for the load's own seconds (``load_model`` alone; imports and config are the same for both) and the
process's peak memory (summed PSS), best of ``--repeats`` alternating runs, the page cache warm for both alike. Then
one conformance case (runtime/conformance.py) compares every parameter of the two loaded models and the first kernel
call of every MLP and MoE layer, with the legacy layout's own bf16 rounding of the amax allowed on derived scales.

Goals: hook load time <= 1.0x FastDeploy's, hook peak memory <= 1.1x FastDeploy's. Needs a FastDeploy source
(``HPU_FP8_FASTDEPLOY_SRC``), as the conformance suite does; nothing here is run by CI. Disk: ~9 GB at 3 layers.

    python bench/hook_load.py --work /path/with/10GB/free [--layers 3] [--tp 1] [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from full_size import config_for
from memory import Measured, run_measured

from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.fastdeploy.legacy import export_legacy
from hpu_fp8_loader.sources.synth import synthesize, synthetic_measurements

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fastdeploy_real"))
from fd_environment import RUNTIME, FastDeployEnvironment, prepare, write_case

# The legacy layout stores each activation amax in bf16 and FastDeploy rounds what it derives: 2^-7 bounds the two
# (tests/fastdeploy_real/test_conformance.py, LEGACY_ROUNDING).
LEGACY_ROUNDING = 2.0**-7
GOALS = {"time": 1.0, "memory": 1.1}


def make_checkpoints(work: Path, layers: int) -> tuple[Path, Path]:
    """The hpu-fp8 checkpoint and its legacy export of a full-width ERNIE-4.5-21B-A3B with ``layers`` layers."""
    spec, legacy = work / "spec", work / "legacy"
    if (legacy / "config.json").exists():
        print(f"-- reusing {spec} and {legacy}", flush=True)
        return spec, legacy
    config = config_for(layers)
    print(f"-- synthesizing {layers} layers at ERNIE-4.5-21B-A3B width", flush=True)
    synthesize(work / "bf16", config, seed=11)
    convert(work / "bf16", spec, [synthetic_measurements(config)], ConvertOptions(kv_cache="fp8"))
    shutil.rmtree(work / "bf16")
    export_legacy(spec, legacy)
    return spec, legacy


def _case_dir(work: Path, name: str, case: dict) -> tuple[Path, dict[str, str]]:
    """A fresh working directory for one run, and the variables it runs with (as the suite's run_case)."""
    run = work / f"run-{name}"
    shutil.rmtree(run, ignore_errors=True)
    return run, write_case(run, case)


def _report(output: Path, what: str) -> dict:
    lines = output.read_text().strip().splitlines()
    report = json.loads(lines[-1]) if lines else {"error": "no report"}
    if "error" in report:
        sys.exit(f"{what} failed: {report['error']} (stderr in {output.parent})")
    return report


def timed_load(environment: FastDeployEnvironment, work: Path, name: str, case: dict) -> tuple[Measured, dict]:
    run, variables = _case_dir(work, name, case)
    with (run / "stdout").open("w") as stdout, (run / "stderr").open("w") as stderr:
        measured = run_measured(
            [str(environment.python), str(RUNTIME / "load_timing.py"), "case.json"],
            interval=0.1, env=environment.env(**variables), cwd=run, stdout=stdout, stderr=stderr,
        )  # fmt: skip
    return measured, _report(run / "stdout", name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/hook-load"), help="scratch directory (~9 GB at 3 layers)")
    parser.add_argument("--layers", type=int, default=3, help="layers at full width: the first dense, the rest MoE")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size; rank 0 is loaded")
    parser.add_argument("--repeats", type=int, default=2, help="alternating loads of each; the best is reported")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object at the end")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    spec, legacy = make_checkpoints(args.work, args.layers)
    environment, _, _ = prepare()
    loads = {"fastdeploy": (legacy, "default"), "hook": (spec, "hpu_fp8")}
    runs: dict[str, list[dict]] = {name: [] for name in loads}
    for repeat in range(args.repeats):
        for name, (checkpoint, choice) in loads.items():
            case = {"checkpoint": checkpoint, "load_choices": choice, "tp": args.tp, "rank": 0}
            measured, report = timed_load(environment, args.work, name, case)
            print(f"-- {name} load {repeat + 1}: {report['load_seconds']:.1f} s load_model, process {measured.seconds:.1f} s, "
                  f"peak {measured.peak_pss / 2**30:.2f} GiB, {report['parameters']} parameters "
                  f"({report['parameter_bytes'] / 2**30:.2f} GiB)", flush=True)  # fmt: skip
            runs[name].append({**report, "peak_bytes": measured.peak_pss})
    best = {
        name: {**done[-1], "load_seconds": min(r["load_seconds"] for r in done), "peak_bytes": min(r["peak_bytes"] for r in done)}
        for name, done in runs.items()
    }
    conformance_case = {"oracle": legacy, "hook": spec, "tp": args.tp, "rank": 0, "tolerance": LEGACY_ROUNDING}
    run, variables = _case_dir(args.work, "conformance", conformance_case)
    done = environment.run([str(RUNTIME / "conformance.py"), "case.json"], cwd=run, timeout=3600, **variables)
    (run / "stdout").write_text(done.stdout)
    (run / "stderr").write_text(done.stderr)
    compared = _report(run / "stdout", "conformance")
    ratios = {
        "time": best["hook"]["load_seconds"] / best["fastdeploy"]["load_seconds"],
        "memory": best["hook"]["peak_bytes"] / best["fastdeploy"]["peak_bytes"],
    }
    print(f"\nERNIE-4.5-21B-A3B width, {args.layers} layers, TP {args.tp} rank 0, FastDeploy's code on a CPU paddle")
    print(f"{'loader':<28}{'load_model s':>14}{'peak GiB':>10}")
    for name, label in (("fastdeploy", "FastDeploy v0 (legacy)"), ("hook", "hook (hpu_fp8)")):
        print(f"{label:<28}{best[name]['load_seconds']:>14.1f}{best[name]['peak_bytes'] / 2**30:>10.2f}")
    for what, ratio in ratios.items():
        verdict = "met" if ratio <= GOALS[what] else "MISSED"
        print(f"goal {what}: hook / FastDeploy = {ratio:.2f}x (goal <= {GOALS[what]:.1f}x): {verdict}")
    print(f"conformance: {compared['parameters']} parameters and {compared['kernel_calls']} kernel calls compared; "
          f"{len(compared['differences'])} parameter and {len(compared['kernel_differences'])} kernel differences; "
          f"{compared['rounded_values']} derived scale values within the legacy rounding "
          f"(largest {compared['largest_relative_difference']:.2e}); {len(compared['device_rounded'])} device-rounded")  # fmt: skip
    for difference in compared["differences"] + compared["kernel_differences"]:
        print("  ", difference)
    if args.json:
        print(json.dumps({"layers": args.layers, "tp": args.tp, "loads": best, "ratios": ratios, "goals": GOALS,
                          "differences": compared["differences"], "kernel_differences": compared["kernel_differences"],
                          "parameters_compared": compared["parameters"]}))  # fmt: skip


if __name__ == "__main__":
    main()

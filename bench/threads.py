"""Calibration's throughput against the number of threads (issue 26 item 3), as ratios in one run (never asserts).

Synthesizes ERNIE-4.5-21B-A3B at its real width (hidden 2560, 64 experts of 1536, 2 shared) with ``--layers``
layers (default 3: one dense, two MoE; ~4.7 GB BF16), then runs ``hpu-fp8 calibrate`` on it three ways, each its own
process and each the best of ``--repeat``:

- one core: the process held to one core (its affinity, as ``taskset -c 0`` holds it: read-ahead's conversion then
  shares that core too) with BLAS on one thread (``OPENBLAS_NUM_THREADS=1`` and its kin): the baseline;
- ``--threads 1`` with BLAS on every core: how calibrate ran before chunks had threads of their own;
- ``--threads N`` (every core): N chunks at once, BLAS on the cores left to each.

Goals: N = 2 threads >= 1.7x the one-core throughput; and, with bench/full_size.py, >= 0.7x the FLOP bound at full
21B size. The amax of the three runs are compared too: where the N-thread run leaves BLAS one thread (its chunks of
4 windows number at least the cores), it and the one-core run must be the same to the bit; the run with BLAS on
every core may differ in a last bit (BLAS's own thread count changes its rounding): its largest relative
difference is printed.

    python bench/threads.py [--work DIR] [--layers 3] [--samples 16] [--seq-len 512] [--repeat 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from full_size import config_for, train_tokenizer
from memory import Measured, run_measured

from hpu_fp8_loader.engine.layer_major import usable_cores
from hpu_fp8_loader.quality.calibrate import CalibrationOptions

ONE_THREAD = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def calibrate(cli: str, src: Path, out: Path, args, threads: int, one_core: bool = False) -> Measured:
    command = [cli, "calibrate", str(src), "-o", str(out), "--samples", str(args.samples), "--seq-len", str(args.seq_len)]
    env = {**os.environ, **(ONE_THREAD if one_core else {})}
    first = min(os.sched_getaffinity(0))
    pin = (lambda: os.sched_setaffinity(0, {first})) if one_core else None
    runs = []
    for _ in range(args.repeat):
        measured = run_measured([*command, "--threads", str(threads), "--force", "-q"], env=env, preexec_fn=pin)
        if measured.returncode != 0:
            sys.exit(f"calibrate --threads {threads} failed (exit {measured.returncode})")
        runs.append(measured)
    return min(runs, key=lambda m: m.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/hpu-fp8-threads"))
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    src, cli = args.work / "src", str(Path(sys.executable).with_name("hpu-fp8"))
    config = config_for(args.layers)
    sets = [arg for key, value in config.items() for arg in ("--set", f"{key}={json.dumps(value)}")]
    run_measured([cli, "synth", str(src), *sets, "--max-shard-size", "2GB", "-q"])
    train_tokenizer(src)
    cores = usable_cores()
    print(f"ERNIE-4.5-21B-A3B width, {args.layers} layers; {args.samples} windows x {args.seq_len}; {cores} cores", flush=True)
    runs = {
        "one core": calibrate(cli, src, args.work / "one.json", args, 1, one_core=True),
        "1 thread, BLAS on every core": calibrate(cli, src, args.work / "blas.json", args, 1),
        f"{cores} threads": calibrate(cli, src, args.work / "all.json", args, cores),
    }
    tokens = args.samples * args.seq_len
    for name, m in runs.items():
        print(f"  {name:30s} {m.seconds:7.1f} s  {tokens / m.seconds:7.1f} tokens/s  peak {m.peak_pss / 2**30:.2f} GiB")
    base = runs["one core"].seconds
    ratios = {name: base / m.seconds for name, m in runs.items()}
    print(f"{cores} threads over one core: {ratios[f'{cores} threads']:.2f}x (goal >= 1.7 at 2 threads)")
    print(
        f"{cores} threads over 1 thread with BLAS on every core: {runs['1 thread, BLAS on every core'].seconds / runs[f'{cores} threads'].seconds:.2f}x"
    )
    one, blas, every = (json.loads((args.work / f).read_text())["amax"] for f in ("one.json", "blas.json", "all.json"))
    same = list(one.items()) == list(every.items())  # the same bits, the same order
    blas_on_one = (
        -(-args.samples // CalibrationOptions().batch_size) >= cores
    )  # every thread has a chunk: BLAS on one thread each
    blas_differs = max(abs(blas[key] - value) / abs(value) for key, value in one.items() if value)
    print(
        f"amax of one core and {cores} threads the same to the bit: {same}" + ("" if blas_on_one else " (BLAS had more threads)")
    )
    print(f"amax with BLAS on every core: largest relative difference {blas_differs:.2e} (BLAS's own rounding)")
    if args.json:
        summary = {"cores": cores, "runs": {n: vars(m) for n, m in runs.items()}, "ratios": ratios, "same": same}
        print(json.dumps({**summary, "blas_relative_difference": blas_differs}))
    if blas_on_one and not same:
        sys.exit("the one-core and all-threads amax differ: chunk threads changed a result")
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()

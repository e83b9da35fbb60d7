"""Block-FP8 import at ERNIE-4.5-300B-A47B width (issue 25, item 3c), measured in one run (figures, never asserts).

Synthesizes ERNIE-4.5-300B-A47B at its published width (hidden 8192, 64 experts of moe_intermediate 3584, dense
intermediate 28672, 64 heads / 8 KV heads, vocabulary 103424; tests/helpers/real_configs.py) with few layers (layer
0 dense, the rest MoE), as a BF16 Paddle checkpoint, then writes the same model as a block-FP8 Paddle checkpoint
(the ERNIE-4.5-300B-A47B-FP8-Paddle kind: ``mix_quant`` / ``block_wise_fp8``, every linear an e4m3 ``quant_weight``
``[in, out]`` with a float32 ``weight_scale`` per 128x128 block), tensor by tensor and 128 rows at a time, never the
whole model in memory. Then each as its own process, with the same (synthetic) measurements:

    (a) hpu-fp8 convert  BF16 source   (the baseline; 2 workers, the CLI default)
    (b) hpu-fp8 import   block-FP8 source (2 workers)

reporting wall time, peak memory (summed PSS of the process tree), bytes read (rchar: every byte a read call
returned) against the source's size, and import / convert ratios. Disk: the BF16 source, its block-FP8 copy
(~half), and one output at a time (~half); everything is deleted at the end unless ``--keep``. Nothing here is
run by CI. On a shared machine run it as ``nice -n 10 python bench/import_block_fp8.py`` (children inherit it).

    python bench/import_block_fp8.py [--work DIR] [--layers 2] [--runs 1] [--keep] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
from memory import Measured, run_measured
from timing import taking_turns

from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.io.writer import CheckpointWriter, PlannedTensor
from hpu_fp8_loader.sources.block_fp8 import PADDLE_BLOCK, open_source
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.source_tensors import source_rows
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import real_configs
from helpers.block_fp8 import block_quantize

SHARD = 2 * 10**9  # bytes per shard of both sources
PADDLE_BLOCK_FP8 = {  # FastDeploy's mix_quant config for the block-FP8 Paddle releases (docs/spec.md section 4.5)
    "quantization": "mix_quant",
    "dense_quant_type": "block_wise_fp8",
    "moe_quant_type": "block_wise_fp8",
    "is_quantized": True,
}


def config_for(layers: int, experts: int = 64) -> dict:
    """ERNIE-4.5-300B-A47B's published config.json at ``layers`` layers (layer 0 dense, layers 1.. MoE) and
    ``experts`` routed experts (64, the real count, unless a smaller model of the same width is wanted)."""
    return preset_config(
        "ernie-moe-tiny",
        {
            **real_configs.ERNIE_300B,
            "num_hidden_layers": layers,
            "moe_num_experts": experts,
            "moe_layer_start_index": 1,
            "moe_layer_end_index": layers - 1,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
        },
    )


def write_block_fp8(src: Path, out: Path) -> None:
    """The BF16 Paddle checkpoint ``src`` as a block-FP8 Paddle one at ``out``: each linear (stored as FastDeploy's
    loader holds it, ``[in, out]`` and fused) quantized 128 rows at a time by transformers' block rule
    (tests/helpers/block_fp8.py), every other tensor copied as stored; at most one row block in float32 at a time."""
    checkpoint = open_source(src)
    descriptor = describe(checkpoint.config, str(src / "config.json"), checkpoint.tensors)
    rows = PADDLE_BLOCK[0]
    planned = []
    for w in descriptor.weights():
        if w.is_linear:
            grid = tuple(math.ceil(n / b) for n, b in zip(w.shape, PADDLE_BLOCK, strict=True))
            planned += [
                PlannedTensor(f"{w.module}.quant_weight", "F8_E4M3", w.shape),
                PlannedTensor(f"{w.module}.weight_scale", "F32", grid),
            ]
        else:
            planned.append(PlannedTensor(w.name, w.source_dtype, w.shape))
    writer = CheckpointWriter(out, planned, SHARD, metadata={"format": "pd"})
    for w in descriptor.weights():
        if not w.is_linear:
            writer.write(w.name, checkpoint.get(w.name))
            continue
        for first in range(0, w.shape[0], rows):
            codes, grid = block_quantize(source_rows(checkpoint, w.name, first, first + rows).astype(np.float32))
            writer.write(f"{w.module}.quant_weight", codes, first)
            writer.write(f"{w.module}.weight_scale", grid, first // rows)
    writer.finish({**checkpoint.config, "quantization_config": PADDLE_BLOCK_FP8}, copy_from=src)


def source_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def after_sync(command: list[str]) -> Measured:
    """A whole-process measurement after a sync: the previous command's dirty pages are not this one's writeback."""
    os.sync()
    measured = run_measured(command, interval=0.2)
    if measured.returncode != 0:
        sys.exit(f"failed (exit {measured.returncode}): {' '.join(command)}")
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/hpu-fp8-bench-block-fp8"))
    parser.add_argument("--layers", type=int, default=2, help="layer 0 dense, the rest MoE (2: 15.0 GB BF16)")
    parser.add_argument(
        "--experts", type=int, default=64, help="routed experts (64, the real count; fewer: a smaller model, same tensors)"
    )
    parser.add_argument("--runs", type=int, default=1, help="runs of each command, taking turns (best time, worst peak)")
    parser.add_argument("--keep", action="store_true", help="keep the sources and the last outputs in --work")
    parser.add_argument("--json", action="store_true", help="also print every figure as one JSON document")
    args = parser.parse_args()
    if args.layers < 2:
        parser.error("--layers must be at least 2 (one dense layer, then MoE layers)")
    config = config_for(args.layers, args.experts)
    descriptor = describe(config)
    bf16_bytes = 2 * descriptor.parameter_count()
    needed = 2.1 * bf16_bytes  # the source, its block-FP8 copy and one output, each ~half the source
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    free = shutil.disk_usage(args.work).free
    if needed > free:
        sys.exit(f"{args.work}: {args.layers} layers need ~{needed / 1e9:.0f} GB free, there are {free / 1e9:.0f} GB")
    src, block, measurements = args.work / "bf16", args.work / "block-fp8", args.work / "m.json"
    print(
        f"ERNIE-4.5-300B-A47B width, {args.layers} of 54 layers (1 dense + {args.layers - 1} MoE), {args.experts} experts: {bf16_bytes / 1e9:.1f} GB BF16",
        flush=True,
    )
    synthesize(src, config, "paddle", seed=0, max_shard_bytes=SHARD)
    write_block_fp8(src, block)
    write_measurements(measurements, synthetic_measurements(config))
    sizes = {"convert": source_bytes(src), "import": source_bytes(block)}
    print(f"sources: BF16 {sizes['convert'] / 1e9:.2f} GB, block-FP8 Paddle {sizes['import'] / 1e9:.2f} GB", flush=True)

    cli = str(Path(sys.executable).with_name("hpu-fp8"))
    given = ["--measurements", str(measurements), "--force"]
    commands = {
        "convert": [cli, "convert", str(src), str(args.work / "out-convert"), *given, "-q"],
        "import": [cli, "import", str(block), str(args.work / "out-import"), *given],
    }

    def measure(name: str) -> Measured:
        shutil.rmtree(args.work / "out-convert", ignore_errors=True)  # one output on the disk at a time
        shutil.rmtree(args.work / "out-import", ignore_errors=True)
        print(f"-- {' '.join(commands[name][1:])}", flush=True)
        return after_sync(commands[name])

    turns = taking_turns([functools.partial(measure, name) for name in commands], args.runs)
    runs = dict(zip(commands, turns, strict=True))
    best = {name: min(r.seconds for r in measured) for name, measured in runs.items()}
    peak = {name: max(r.peak_pss for r in measured) for name, measured in runs.items()}
    read = {name: max(r.bytes_read for r in measured) for name, measured in runs.items()}
    largest = max(descriptor.weights(), key=lambda w: math.prod(w.shape))
    print()
    disk = {name: max(r.disk_bytes_read for r in measured) for name, measured in runs.items()}
    print("| command | source | time | peak PSS | read (rchar) | read / source | from disk |")
    print("|---|---|---|---|---|---|---|")
    for name in runs:
        print(
            f"| `hpu-fp8 {name}` | {sizes[name] / 1e9:.2f} GB | {best[name]:.0f} s | {peak[name] / 2**30:.2f} GiB | "
            f"{read[name] / 1e9:.1f} GB | {read[name] / sizes[name]:.2f}x | {disk[name] / 1e9:.1f} GB |"
        )
    print(
        f"import / convert: time {best['import'] / best['convert']:.2f}x, peak PSS {peak['import'] / peak['convert']:.2f}x, "
        f"bytes read {read['import'] / read['convert']:.2f}x"
    )
    print(
        f"largest tensor {largest.name} {list(largest.shape)}: {math.prod(largest.shape) * 2 / 2**30:.2f} GiB BF16, "
        f"{math.prod(largest.shape) * 4 / 2**30:.2f} GiB float32; the model {bf16_bytes / 2**30:.1f} GiB BF16"
    )
    if args.json:
        figures = {name: [vars(r) for r in measured] for name, measured in runs.items()}
        print(json.dumps({"layers": args.layers, "bf16_bytes": bf16_bytes, "source_bytes": sizes, "runs": figures}))
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()

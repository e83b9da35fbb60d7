"""Reference-engine goals of issue 6, measured in the same run (ratios, never asserts).

1. Engine tokens/s vs transformers (torch CPU, float32) on the same config and batch: goal >= 0.7x.
2. Calibration overhead (default routing) vs the plain forward: goal <= 10%; with the range report's magnitude
   histograms calibrate always collects (issue 42), the same goal.

    python bench/engine.py [--preset ernie-moe-tiny|qwen2-tiny] [--batch 4] [--seq 128]
"""

from __future__ import annotations

import argparse
import shutil
import warnings
from pathlib import Path

import numpy as np
from timing import best_of

from hpu_fp8_loader.engine.model import forward
from hpu_fp8_loader.engine.weights import open_weights
from hpu_fp8_loader.quality.observers import AmaxObserver, RangeObserver, TeeObserver
from hpu_fp8_loader.sources.synth import preset_config, synthesize

SIZES = {  # hidden 512, 4 layers, vocab 32000 (45M parameters): transformers' float32 forward, batch 4 x 128, ~1.3 s on 2 cores
    "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "vocab_size": 32000, "head_dim": 64,
}  # fmt: skip
MOE = {"moe_intermediate_size": 352, "moe_num_experts": 8, "moe_k": 2, "moe_layer_end_index": 3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="ernie-moe-tiny", choices=["ernie-moe-tiny", "ernie-dense-tiny", "qwen2-tiny"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/hpu-fp8-bench-engine"))
    args = parser.parse_args()
    import torch
    import transformers

    shutil.rmtree(args.work, ignore_errors=True)
    config = preset_config(args.preset, {**SIZES, **(MOE if args.preset == "ernie-moe-tiny" else {})})
    synthesize(args.work, config, "torch", seed=0)
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (args.batch, args.seq))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(args.work, dtype=torch.float32)
    tokens = torch.tensor(ids)

    def reference() -> None:
        with torch.no_grad():
            model(tokens)

    weights = open_weights(args.work)
    theirs = best_of(args.repeat, reference)
    ours = best_of(args.repeat, lambda: forward(weights, ids))
    prefix = weights.descriptor.prefix
    observed = best_of(args.repeat, lambda: forward(weights, ids, AmaxObserver(prefix)))
    ranged = best_of(args.repeat, lambda: forward(weights, ids, TeeObserver(AmaxObserver(prefix), RangeObserver(prefix))))
    n = ids.size
    print(
        f"{args.preset}, {weights.descriptor.parameter_count() / 1e6:.0f} M parameters, batch {args.batch} x {args.seq}, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"transformers (torch float32): {theirs:.3f} s, {n / theirs:,.0f} tokens/s")
    print(f"reference engine (numpy):     {ours:.3f} s, {n / ours:,.0f} tokens/s -> {theirs / ours:.2f}x (goal >= 0.7)")
    print(f"engine with calibration:      {observed:.3f} s -> overhead {100 * (observed / ours - 1):.1f}% (goal <= 10%)")
    print(
        f"... and the ranges (calibrate): {ranged:.3f} s -> overhead {100 * (ranged / ours - 1):.1f}% (goal <= 10%), "
        f"{100 * (ranged / observed - 1):.1f}% over the amax alone"
    )
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Import goal of issue 9, measured in the same run (ratios, never asserts).

``hpu-fp8 import`` of a >= 1 GB compressed-tensors FP8 checkpoint (made here by llm-compressor's
model_free_ptq, FP8_DYNAMIC, in its own environment: see bench/peer_llmcompressor.py --setup) vs
``hpu-fp8 convert`` of its BF16 source, whole processes, same measurements, best of ``--runs`` runs
taking turns: goal <= 1.2x.

    python bench/import_ct.py --peer-venv /tmp/llmc-venv
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
from pathlib import Path

from memory import Measured, run_measured
from peer_llmcompressor import PEER, QWEN2_1GB
from timing import taking_turns

from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-venv", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/hpu-fp8-bench-import"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layers", type=int, default=20, help="Qwen2 layers of hidden 2048: 20 give a 2.2 GB BF16 source")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    config = preset_config("qwen2-tiny", {**QWEN2_1GB, "num_hidden_layers": args.layers})
    synthesize(args.work / "src", config, "torch", seed=0, max_shard_bytes=2 * 10**9)
    write_measurements(args.work / "m.json", synthetic_measurements(config))
    made = run_measured([str(args.peer_venv / "bin" / "python"), "-c", PEER, str(args.work / "src"), str(args.work / "ct")])
    assert made.returncode == 0
    size = sum(p.stat().st_size for p in (args.work / "ct").glob("*.safetensors"))
    print(
        f"compressed-tensors FP8_DYNAMIC checkpoint: {size / 1e9:.2f} GB (BF16 source "
        f"{sum(p.stat().st_size for p in (args.work / 'src').glob('*.safetensors')) / 1e9:.2f} GB)"
    )
    cli = str(Path(sys.executable).with_name("hpu-fp8"))
    out = str(args.work / "out")
    measurements = ["--measurements", str(args.work / "m.json"), "--force"]
    commands = {
        "hpu-fp8 convert (BF16 source, --workers 2)": [cli, "convert", str(args.work / "src"), out, *measurements, "-q"],
        "hpu-fp8 import (compressed-tensors)": [cli, "import", str(args.work / "ct"), out, *measurements],
    }

    def after_sync(command: list[str]) -> Measured:
        """A whole-process measurement after a sync: the other command's dirty pages are not this one's writeback."""
        os.sync()
        measured = run_measured(command)
        assert measured.returncode == 0, command
        return measured

    turns = taking_turns([functools.partial(after_sync, command) for command in commands.values()], args.runs)
    runs = dict(zip(commands, turns, strict=True))
    for label, measured in runs.items():
        print(
            f"{label}: {min(r.seconds for r in measured):.1f} s (runs {', '.join(f'{r.seconds:.1f}' for r in measured)}), "
            f"peak PSS {max(r.peak_pss for r in measured) / 2**30:.2f} GiB"
        )
    convert_s, import_s = (min(r.seconds for r in measured) for measured in runs.values())
    print(f"  -> import / convert time = {import_s / convert_s:.2f} (goal <= 1.2)")
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()

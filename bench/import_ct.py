"""Import goal of issue 9, measured in the same run (ratios, never asserts).

``hpu-fp8 import`` of a >= 1 GB compressed-tensors FP8 checkpoint (made here by llm-compressor's
model_free_ptq, FP8_DYNAMIC, in its own environment: see bench/peer_llmcompressor.py --setup) vs
``hpu-fp8 convert`` of its BF16 source, whole processes, same measurements: goal <= 1.2x.

    python bench/import_ct.py --peer-venv /tmp/llmc-venv
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from memory import run_measured
from peer_llmcompressor import PEER, QWEN2_1GB

from hpu_fp8_loader.spec.measurements import write_measurements
from hpu_fp8_loader.synth import preset_config, synthesize, synthetic_measurements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-venv", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/hpu-fp8-bench-import"))
    parser.add_argument("--runs", type=int, default=2)
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
    measured = {}
    for label, command in {
        "hpu-fp8 convert (BF16 source, --workers 2)": [
            cli,
            "convert",
            str(args.work / "src"),
            str(args.work / "out"),
            "--measurements",
            str(args.work / "m.json"),
            "-q",
            "--force",
        ],
        "hpu-fp8 import (compressed-tensors)": [
            cli,
            "import",
            str(args.work / "ct"),
            str(args.work / "out"),
            "--measurements",
            str(args.work / "m.json"),
            "--force",
        ],
    }.items():
        runs = [run_measured(command) for _ in range(args.runs)]
        assert all(r.returncode == 0 for r in runs), label
        measured[label] = min(r.seconds for r in runs), max(r.peak_pss for r in runs)
        print(f"{label}: {measured[label][0]:.1f} s, peak PSS {measured[label][1] / 2**30:.2f} GiB")
    (convert_s, _), (import_s, _) = measured.values()
    print(f"  -> import / convert time = {import_s / convert_s:.2f} (goal <= 1.2)")
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()

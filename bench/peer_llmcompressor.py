"""hpu-fp8 convert vs llm-compressor's model-free PTQ on the same BF16 Qwen2 checkpoint, same run.

Goal (issue 3): hpu-fp8 >= 2x faster and <= half the peak memory (whole process tree, sum of PSS).
The peer runs in its own virtual environment: llm-compressor 0.14.0.1 pins transformers <= 5.17.
``--setup`` makes that environment (torch==2.13.0 CPU wheel,
llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers<=5.17).

Not the same job: the peer writes FP8_DYNAMIC (per-channel weight scales, no activation scales) in
the compressed-tensors layout; hpu-fp8 writes tensor-wise weights, static activation scales and the
fused FastDeploy layout. Both read every BF16 weight once, quantize it on the CPU and write FP8.

    python bench/peer_llmcompressor.py --peer-venv /tmp/llmc-venv --setup
    python bench/peer_llmcompressor.py --peer-venv /tmp/llmc-venv
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from memory import run_measured

from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements

QWEN2_1GB = {  # a 1.34 GB BF16 random Qwen2: model-free PTQ took 16-24 s per process on 2 cores
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
PEER_PACKAGES = ["torch==2.13.0", "llmcompressor==0.14.0.1", "compressed-tensors==0.19.0", "transformers<=5.17"]
PEER = """
import sys
from llmcompressor import model_free_ptq
model_free_ptq(sys.argv[1], sys.argv[2], scheme="FP8_DYNAMIC", ignore=["lm_head", "model.embed_tokens"],
               max_workers=2, device="cpu")
"""


def setup(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *PEER_PACKAGES], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-venv", type=Path, required=True)
    parser.add_argument("--setup", action="store_true", help="create the peer's virtual environment first")
    parser.add_argument("--work", type=Path, default=Path("/tmp/hpu-fp8-peer"))
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    if args.setup:
        setup(args.peer_venv)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    config = preset_config("qwen2-tiny", QWEN2_1GB)
    synthesize(args.work / "src", config, "torch", seed=0, max_shard_bytes=2 * 10**9)
    write_measurements(args.work / "m.json", synthetic_measurements(config))
    size = 2 * describe(config).parameter_count()
    print(f"source: {size / 1e9:.2f} GB BF16 Qwen2, torch layout")
    cli = str(Path(sys.executable).with_name("hpu-fp8"))
    commands = {
        "llm-compressor model_free_ptq FP8_DYNAMIC": [
            str(args.peer_venv / "bin" / "python"),
            "-c",
            PEER,
            str(args.work / "src"),
            str(args.work / "peer"),
        ],
        "hpu-fp8 convert --workers 2": [
            cli,
            "convert",
            str(args.work / "src"),
            str(args.work / "ours"),
            "--measurements",
            str(args.work / "m.json"),
            "--workers",
            "2",
            "-q",
        ],
    }
    best = {}
    for label, command in commands.items():
        runs = []
        for _ in range(args.runs):
            shutil.rmtree(args.work / "peer", ignore_errors=True)
            shutil.rmtree(args.work / "ours", ignore_errors=True)
            started = time.perf_counter()
            runs.append(run_measured(command))
            assert runs[-1].returncode == 0, f"{label} failed after {time.perf_counter() - started:.0f} s"
        best[label] = (min(r.seconds for r in runs), max(r.peak_pss for r in runs))
        print(f"{label}: {best[label][0]:.1f} s (whole process), peak PSS {best[label][1] / 2**30:.2f} GiB")
    (peer_s, peer_m), (ours_s, ours_m) = best.values()
    print(f"  -> speed: hpu-fp8 is {peer_s / ours_s:.2f}x the peer's (goal >= 2)")
    print(f"  -> memory: hpu-fp8 uses {ours_m / peer_m:.2f} of the peer's peak (goal <= 0.5)")


if __name__ == "__main__":
    main()

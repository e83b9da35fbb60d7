"""Converter goals of issue 3, measured against baselines in the same run (ratios, never asserts).

1. convert time (``--workers 2``) / time of a plain copy through safetensors' numpy API
   (``safe_open(framework="numpy").get_tensor`` of every tensor, ``save_file`` to a new file): goal <= 1.5.
2. peak memory of the converter's whole process tree (sum of PSS, bench/memory.py): goal <= 1.5 GB and
   flat from 2 GB to 4 GB of input.
3. ``validate`` (full scan) time / raw read time of the same files: goal <= 2.

    python bench/convert.py --work /path/with/20GB/free [--sizes 2 4]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from memory import run_measured

from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements

_BASE = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "moe_intermediate_size": 512,
    "moe_num_experts": 64,
    "moe_k": 6,
    "moe_num_shared_experts": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": 32000,
    "moe_layer_start_index": 1,
}


def model_of_size(gigabytes: float) -> dict:
    """An Ernie4.5-MoE config whose BF16 checkpoint is at least ``gigabytes`` GB."""
    layers = 2
    while True:
        config = preset_config("ernie-moe-tiny", {**_BASE, "num_hidden_layers": layers, "moe_layer_end_index": layers - 1})
        if 2 * describe(config).parameter_count() >= gigabytes * 1e9:
            return config
        layers += 1


COPY = """
import sys
from pathlib import Path
import ml_dtypes  # noqa: F401  registers 'bfloat16' with numpy, which safetensors' numpy API needs for BF16
from safetensors import safe_open
from safetensors.numpy import save_file
src, dst, keep = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:] != ["--drop-each"]
dst.mkdir(parents=True, exist_ok=True)
for shard in sorted(src.glob("*.safetensors")):
    with safe_open(shard, framework="numpy") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    save_file(tensors, dst / shard.name)
    del tensors
    if not keep:  # timed, not kept: the disk then needs room for one copied shard only
        (dst / shard.name).unlink()
"""

RAW_READ = """
import sys
from pathlib import Path
buffer = bytearray(64 << 20)
view = memoryview(buffer)
for path in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
"""


def best(runs: int, command: list[str], cleanup=None):
    results = []
    for _ in range(runs):
        if cleanup:
            cleanup()
        results.append(run_measured(command))
        assert results[-1].returncode == 0, command
    return min(results, key=lambda r: r.seconds), max(r.peak_pss for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/hpu-fp8-bench"))
    parser.add_argument("--sizes", type=float, nargs="+", default=[2.0, 4.0], help="source sizes in GB")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    cli = str(Path(sys.executable).with_name("hpu-fp8"))
    py = sys.executable
    peaks = {}
    for size in args.sizes:
        work = args.work / f"{size:g}GB"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        config = model_of_size(size)
        started = time.perf_counter()
        synthesize(work / "src", config, "paddle", seed=0, max_shard_bytes=2 * 10**9)
        write_measurements(work / "m.json", synthetic_measurements(config))
        source_bytes = sum(p.stat().st_size for p in (work / "src").glob("*.safetensors"))
        print(
            f"\n== {source_bytes / 1e9:.2f} GB BF16 Ernie4.5-MoE ({config['num_hidden_layers']} layers, "
            f"synthesized in {time.perf_counter() - started:.0f} s)"
        )
        run_measured([py, "-c", RAW_READ, str(work / "src")])  # warm the page cache for everyone alike

        copy, copy_peak = best(
            args.runs,
            [py, "-c", COPY, str(work / "src"), str(work / "copy")],
            cleanup=lambda w=work: shutil.rmtree(w / "copy", ignore_errors=True),
        )
        shutil.rmtree(work / "copy", ignore_errors=True)
        conv, conv_peak = best(
            args.runs,
            [
                cli,
                "convert",
                str(work / "src"),
                str(work / "out"),
                "--measurements",
                str(work / "m.json"),
                "--workers",
                "2",
                "-q",
            ],
            cleanup=lambda w=work: shutil.rmtree(w / "out", ignore_errors=True),
        )
        raw, _ = best(args.runs, [py, "-c", RAW_READ, str(work / "out")])
        check, check_peak = best(args.runs, [cli, "validate", "-q", str(work / "out")])
        hashed, _ = best(1, [cli, "validate", "-q", "--hashes", str(work / "out")])
        peaks[size] = conv_peak
        print(f"plain copy (safetensors numpy API): {copy.seconds:.1f} s, peak PSS {copy_peak / 2**30:.2f} GiB")
        print(f"hpu-fp8 convert --workers 2:        {conv.seconds:.1f} s, peak PSS {conv_peak / 2**30:.2f} GiB")
        print(f"  -> convert / copy time = {conv.seconds / copy.seconds:.2f} (goal <= 1.5)")
        print(f"  -> convert peak memory = {conv_peak / 1e9:.2f} GB (goal <= 1.5 GB)")
        print(
            f"raw read of the output: {raw.seconds:.2f} s; validate (full): {check.seconds:.2f} s, peak PSS {check_peak / 2**30:.2f} GiB"
        )
        print(f"  -> validate / raw read = {check.seconds / raw.seconds:.2f} (goal <= 2)")
        print(
            f"  (validate --hashes, which also sha256es every byte: {hashed.seconds:.2f} s, {hashed.seconds / raw.seconds:.2f}x raw read)"
        )
        shutil.rmtree(work, ignore_errors=True)
    if len(peaks) > 1:
        low, high = min(peaks), max(peaks)
        print(
            f"\npeak memory {low:g} GB -> {high:g} GB input: {peaks[low] / 2**30:.2f} -> {peaks[high] / 2**30:.2f} GiB "
            f"(x{peaks[high] / peaks[low]:.2f}; goal: flat)"
        )


if __name__ == "__main__":
    main()

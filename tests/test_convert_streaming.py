"""The converter's streaming, parallel and resumable machinery gives the same bytes as the simple path."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpu_fp8_loader.arch import SourcePart
from hpu_fp8_loader.checks.validate import validate
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.conversion.worker import reads_whole
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.sources.measurements import load_measurements, write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements

pytestmark = pytest.mark.slow  # worker pools, kill -9 and resume: the inner loop leaves them to CI

MEDIUM = {  # ~30 MB of BF16: big enough to interrupt, small enough for CI
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "moe_layer_end_index": 3,
    "moe_num_experts": 8,
    "vocab_size": 8000,
    "head_dim": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}


def same_files(a: Path, b: Path) -> None:
    names_a = sorted(p.name for p in a.iterdir())
    assert names_a == sorted(p.name for p in b.iterdir())
    _, mismatch, errors = filecmp.cmpfiles(a, b, names_a, shallow=False)
    assert not mismatch and not errors, mismatch


@pytest.fixture(scope="module")
def reference(tmp_path_factory, source_factory):
    """Default options, one worker: the output every other path must reproduce byte for byte."""
    made = {}

    def make(preset: str, layout: str) -> Path:
        if (preset, layout) not in made:
            out = tmp_path_factory.mktemp("ref") / f"{preset}-{layout}"
            convert(
                source_factory(preset, layout),
                out,
                [synthetic_measurements(preset_config(preset))],
                ConvertOptions(max_shard_bytes=64_000),
            )
            made[(preset, layout)] = out
        return made[(preset, layout)]

    return make


@pytest.mark.parametrize("kept", [None, 0], ids=["blocks-kept", "read-twice"])
@pytest.mark.parametrize("preset", ["ernie-moe-tiny", "qwen2-tiny"])
@pytest.mark.parametrize("layout", ["paddle", "torch"])
def test_streamed_blocks_give_the_same_bytes_as_whole_tensors(tmp_path, source_factory, reference, preset, layout, kept):
    """whole_tensor_bytes=0 streams every tensor; tiny blocks exercise column segments and fused biases. The row
    blocks are kept from the amax pass for the quantization (the default), or read again (kept_tensor_bytes=0)."""
    options = ConvertOptions(max_shard_bytes=64_000, whole_tensor_bytes=0, block_elements=1000, kept_tensor_bytes=kept)
    convert(source_factory(preset, layout), tmp_path / "o", [synthetic_measurements(preset_config(preset))], options)
    same_files(tmp_path / "o", reference(preset, layout))


@pytest.mark.parametrize(("kept", "reads"), [(None, 1), (0, 2)], ids=["blocks-kept", "read-twice"])
def test_a_streamed_tensors_source_is_read_once_when_its_blocks_are_kept(tmp_path, source_factory, monkeypatch, kept, reads):
    """Every source byte a conversion reads (every row read with pread, in this process: one worker), counted per
    tensor: once each when the blocks are kept, twice each (amax, then quantization) when they are not."""
    from hpu_fp8_loader.io.safetensors_file import SafetensorsFile

    counted: dict[str, int] = {}
    read_rows = SafetensorsFile.read_rows

    def counting(self, name, start, stop):
        rows = read_rows(self, name, start, stop)
        counted[name] = counted.get(name, 0) + rows.nbytes
        return rows

    monkeypatch.setattr(SafetensorsFile, "read_rows", counting)
    source = source_factory("ernie-moe-tiny", "torch")
    options = ConvertOptions(max_shard_bytes=64_000, whole_tensor_bytes=0, block_elements=1000, kept_tensor_bytes=kept)
    convert(source, tmp_path / "o", [synthetic_measurements(preset_config("ernie-moe-tiny"))], options)
    sizes = {name: info.nbytes for name, info in Checkpoint.open(source).tensors.items()}
    assert counted == {name: reads * size for name, size in sizes.items()}


def test_torch_and_paddle_layouts_give_the_same_checkpoint(reference):
    for preset in ("ernie-moe-tiny", "qwen2-tiny"):
        for name in ("hpu_fp8_manifest.json", "model.safetensors.index.json"):
            assert (reference(preset, "paddle") / name).read_bytes() == (reference(preset, "torch") / name).read_bytes()


def test_two_workers_give_the_same_bytes_as_one(tmp_path, source_factory, reference):
    options = ConvertOptions(max_shard_bytes=64_000, workers=2)
    result = convert(
        source_factory("ernie-moe-tiny", "torch"),
        tmp_path / "o",
        [synthetic_measurements(preset_config("ernie-moe-tiny"))],
        options,
    )
    same_files(tmp_path / "o", reference("ernie-moe-tiny", "torch"))
    assert result.reused_shards == 0 and result.tensors_quantized > 0


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    root = tmp_path_factory.mktemp("medium")
    config = preset_config("ernie-moe-tiny", MEDIUM)
    synthesize(root / "src", config, "torch", seed=5, max_shard_bytes=2_000_000)
    write_measurements(root / "m.json", synthetic_measurements(config))
    convert(root / "src", root / "reference", [_from_file(root)], ConvertOptions(max_shard_bytes=500_000))
    return root


def _from_file(medium: Path):
    """The measurements as `convert --measurements m.json` reads them (their provenance names the file), so a
    resume in Python is the same conversion as the command it resumes."""
    return load_measurements(medium / "m.json").measurements


def _start_conversion(medium: Path, out: Path) -> subprocess.Popen:
    cli = str(Path(sys.executable).with_name("hpu-fp8"))
    return subprocess.Popen(
        [
            cli,
            "convert",
            str(medium / "src"),
            str(out),
            "--measurements",
            str(medium / "m.json"),
            "--max-shard-size",
            "500kB",
            "--workers",
            "1",
            "-q",
        ]
    )


def _kill_after_first_shard(process: subprocess.Popen, partial: Path) -> int:
    journal = partial / ".hpu_fp8_progress.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            done = json.loads(journal.read_text())["shards"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            done = {}
        if done:
            process.send_signal(signal.SIGKILL)
            process.wait()
            return len(done)
        time.sleep(0.002)
    raise AssertionError("the conversion finished (or hung) before a shard was recorded; make MEDIUM larger")


def test_kill_9_then_resume_reuses_finished_shards_and_gives_the_same_bytes(tmp_path, medium):
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"
    killed_after = _kill_after_first_shard(_start_conversion(medium, out), partial)
    assert killed_after >= 1 and not out.exists() and partial.is_dir()
    assert not (partial / "hpu_fp8_manifest.json").exists()
    result = convert(
        medium / "src",
        out,
        [_from_file(medium)],
        ConvertOptions(max_shard_bytes=500_000),
    )
    assert result.reused_shards >= killed_after
    assert not partial.exists()
    same_files(out, medium / "reference")
    assert validate(out).valid


def test_a_damaged_finished_shard_is_converted_again(tmp_path, medium):
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    _kill_after_first_shard(_start_conversion(medium, out), partial)
    done = json.loads((partial / ".hpu_fp8_progress.json").read_text())["shards"]
    victim = partial / sorted(done)[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    result = convert(
        medium / "src",
        out,
        [_from_file(medium)],
        ConvertOptions(max_shard_bytes=500_000),
    )
    assert result.reused_shards == len(done) - 1
    same_files(out, medium / "reference")


def test_a_partial_of_another_conversion_is_not_reused(tmp_path, medium):
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    _kill_after_first_shard(_start_conversion(medium, out), partial)
    other = synthetic_measurements(preset_config("ernie-moe-tiny", MEDIUM), seed=9)
    result = convert(medium / "src", out, [other], ConvertOptions(max_shard_bytes=500_000))
    assert result.reused_shards == 0
    assert validate(out).valid and not filecmp.cmp(
        out / "hpu_fp8_manifest.json", medium / "reference" / "hpu_fp8_manifest.json", shallow=False
    )


def test_a_source_rewritten_in_place_with_the_same_size_and_mtime_is_not_reused(tmp_path, medium):
    """Resume trusts the content's fingerprint (io/fingerprint.py), not a file's size and mtime."""
    config = preset_config("ernie-moe-tiny", MEDIUM)
    source = tmp_path / "src"
    shutil.copytree(medium / "src", source)
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    process = subprocess.Popen(
        [str(Path(sys.executable).with_name("hpu-fp8")), "convert", str(source), str(out), "--measurements",
         str(medium / "m.json"), "--max-shard-size", "500kB", "--workers", "1", "-q"]
    )  # fmt: skip
    _kill_after_first_shard(process, partial)
    other = tmp_path / "other"
    synthesize(other, config, "torch", seed=6, max_shard_bytes=2_000_000)  # same shapes, other weights
    for shard in sorted(source.glob("*.safetensors")):
        stat = shard.stat()
        shard.write_bytes((other / shard.name).read_bytes())
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert shard.stat().st_size == stat.st_size
    result = convert(source, out, [synthetic_measurements(config)], ConvertOptions(max_shard_bytes=500_000))
    assert result.reused_shards == 0
    fresh = tmp_path / "fresh"
    convert(other, fresh, [synthetic_measurements(config)], ConvertOptions(max_shard_bytes=500_000))
    same_files(out, fresh)


def _limited_conversion(medium: Path, out: Path, limit: int) -> subprocess.CompletedProcess:
    import resource

    def apply_limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cli = str(Path(sys.executable).with_name("hpu-fp8"))
    return subprocess.run(
        [cli, "convert", str(medium / "src"), str(out), "--measurements", str(medium / "m.json"), "-q"],
        capture_output=True,
        text=True,
        preexec_fn=apply_limit,
        check=False,
    )


def test_a_file_size_limit_fails_cleanly_and_publishes_nothing(tmp_path, medium):
    result = _limited_conversion(medium, tmp_path / "out", 1_000_000)
    assert result.returncode == 1
    assert "file-size limit" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "out.partial" / "hpu_fp8_manifest.json").exists()


def test_a_full_disk_fails_cleanly_and_publishes_nothing(tmp_path, medium):
    # A 4 MB tmpfs in a private user+mount namespace: a real ENOSPC from the kernel, gone when the process exits.
    script = f"""
import json, sys
from pathlib import Path
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.conversion.worker import reads_whole
from hpu_fp8_loader.sources.measurements import read_measurements
out = Path(sys.argv[1]) / "out"
try:
    convert({str(medium / "src")!r}, out, [read_measurements({str(medium / "m.json")!r})], ConvertOptions())
    report = {{"error": None}}
except Exception as exc:
    report = {{"error": type(exc).__name__, "message": str(exc)}}
report["published"] = out.exists()
report["manifest_in_partial"] = (out.parent / "out.partial" / "hpu_fp8_manifest.json").exists()
print(json.dumps(report))
"""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    shell = f'mount -t tmpfs -o size=4m tmpfs "$1" && exec "{sys.executable}" -c "$2" "$1"'
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", shell, "sh", str(mount_point), script], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"could not make a small filesystem with unshare: {result.stderr}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["error"] == "WriteFailedError" and "no space left" in report["message"]
    assert report["published"] is False and report["manifest_in_partial"] is False


def test_an_fp8_source_is_read_whole_only_where_the_same_tensor_in_bf16_would_be():
    """A whole read becomes float32 whatever the source holds: an FP8 tensor is counted at BF16's 2 bytes an element,
    so a 300B-width expert (56 MiB of FP8) streams in row blocks as its 112 MiB BF16 twin does."""
    expert = (SourcePart("w", (8192, 7168)),)  # ERNIE-4.5-300B-A47B's expert up_gate_proj, [in, 2 x 3584]
    elements = 8192 * 7168
    threshold = 64 << 20
    assert not reads_whole(expert, elements, threshold)  # FP8: 56 MiB of bytes, 112 MiB counted
    assert not reads_whole(expert, 2 * elements, threshold)  # BF16
    assert reads_whole(expert, elements, 2 * elements)  # FP8 under a threshold its BF16 twin also meets
    assert not reads_whole(expert, 4 * elements, 2 * elements)  # FP32 counts its own 4 bytes

"""What the converter accepts as a source: layouts, dtypes, Hub repo ids from the local cache."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from helpers.hub_cache import add_to_cache
from safetensors.numpy import load_file, save_file

from hpu_fp8_loader.checks.validate import validate
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.errors import ConfigError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements


def _recast(src: Path, dst: Path, dtype) -> None:
    """The same checkpoint with every BF16 tensor stored in another float dtype, written by the library."""
    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(shard)
        save_file({k: (v.astype(dtype) if v.dtype == ml_dtypes.bfloat16 else v) for k, v in tensors.items()}, shard)


def test_an_fp32_source_converts_to_the_same_checkpoint_as_bf16(tmp_path, source_factory, spec_factory):
    _recast(source_factory(), tmp_path / "src", np.float32)
    out = convert(tmp_path / "src", tmp_path / "out", [synthetic_measurements(preset_config("ernie-moe-tiny"))]).out
    assert validate(out).valid
    ours, reference = Checkpoint.open(out), Checkpoint.open(spec_factory())
    for name in reference.tensors:  # bf16 values are exact in float32: every byte agrees
        np.testing.assert_array_equal(ours.get(name).view(np.uint8), reference.get(name).view(np.uint8), err_msg=name)


def test_an_fp16_source_converts_within_one_fp8_step(tmp_path, source_factory, spec_factory):
    _recast(source_factory(), tmp_path / "src", np.float16)
    out = convert(tmp_path / "src", tmp_path / "out", [synthetic_measurements(preset_config("ernie-moe-tiny"))]).out
    assert validate(out).valid
    ours, reference = Checkpoint.open(out), Checkpoint.open(spec_factory())
    for name, info in reference.tensors.items():
        if info.dtype == "F8_E4M3":  # float16 flushes the smallest bf16 values: an fp8 step at most, rarely
            a, b = ours.get(name).astype(np.float32), reference.get(name).astype(np.float32)
            assert np.all(np.abs(a - b) <= np.abs(b) / 8 + 2.0**-9), name
            assert np.mean(a != b) < 0.01, name


def test_unsupported_dtype_is_named(tmp_path, source_factory):
    src = tmp_path / "src"
    shutil.copytree(source_factory(), src)
    shard = next(p for p in sorted(src.glob("*.safetensors")) if b"mlp.gate.weight" in p.read_bytes()[:4096])
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k.endswith("mlp.gate.weight"))
    header[name]["dtype"] = "I32"  # same item size as F32, so the file stays well-formed
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    with pytest.raises(ConfigError, match=rf"'{name}' has dtype I32; supported: BF16, F16, F32"):
        convert(src, tmp_path / "out", [synthetic_measurements(preset_config("ernie-moe-tiny"))])


def test_the_source_is_never_modified(tmp_path, source_factory):
    src = source_factory("qwen2-tiny", "torch")
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in src.iterdir()}
    convert(src, tmp_path / "out", [synthetic_measurements(preset_config("qwen2-tiny"))])
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in src.iterdir()} == before


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).with_name("hpu-fp8")), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=False,
    )


@pytest.mark.slow
def test_a_hub_repo_id_converts_from_the_offline_cache(tmp_path, source_factory):
    cache = tmp_path / "hub"
    add_to_cache(cache, "acme/qwen2-tiny", source_factory("qwen2-tiny", "torch"))
    write_measurements(tmp_path / "m.json", synthetic_measurements(preset_config("qwen2-tiny")))
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    result = _cli(["convert", "acme/qwen2-tiny", str(tmp_path / "out"), "--measurements", str(tmp_path / "m.json"), "-q"], env)
    assert result.returncode == 0, result.stderr
    assert "from torch layout" in result.stdout
    assert validate(tmp_path / "out").valid
    missing = _cli(["convert", "acme/not-there", str(tmp_path / "out2"), "--measurements", str(tmp_path / "m.json")], env)
    assert missing.returncode == 1 and "not in the local Hugging Face cache" in missing.stderr


@pytest.mark.slow
def test_cli_convert_prints_a_summary_and_fastdeploy_warnings(tmp_path, source_factory):
    amax = synthetic_measurements(preset_config("ernie-moe-tiny")).amax
    from hpu_fp8_loader.spec import names

    (tmp_path / "model_measurement.txt").write_text(
        "".join(f"{names.fastdeploy_key_from_module(m)}\t{0.3 if m.endswith('.s') else v}\n" for m, v in amax.items())
    )
    result = CliRunner().invoke(
        main,
        [
            "convert",
            str(source_factory()),
            str(tmp_path / "out"),
            "--measurements",
            str(tmp_path / "model_measurement.txt"),
            "-q",
            "--workers",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "warning:" in result.stderr and "s_matmul" in result.stderr
    assert "tensors quantized" in result.stdout and "from paddle layout" in result.stdout
    assert re.search(r"\d [KMG]iB -> [\d.]+ [KMG]iB \(0\.\d+\); [\d.]+ s, ([\d.]+ [KMG]?i?B/s|too fast to time)", result.stdout)

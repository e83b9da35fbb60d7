"""A test double of PaddleCustomDevice's Model_convert.py, FastDeploy's legacy offline converter.

The real script needs an HPU (it pins ``intel_hpu:5`` at import) and cannot run here, so this
reimplements it, defects included, as docs/fastdeploy.md section 9 ("The legacy layout") records it
from PaddleCustomDevice's ``backends/intel_hpu/custom_ops/python/paddlenlp_ops/Model_convert.py`` at
``20c9eae8`` and ``1dd4eef8`` (moved to ``backends/intel_hpu/tools/`` by PaddleCustomDevice#2329, 2026-01-08), to make the legacy checkpoints that ``import-legacy`` must read:

* every BF16 key containing ``_proj.weight`` becomes ``quant_weight`` (int8 bytes of e4m3fn, no
  transpose, no split) plus ``weight_scale`` (bf16, rounded to nearest *after* quantizing with the
  fp32 scale); non-BF16 ``_proj.weight`` tensors are dropped;
* version ``20c9eae8`` quantizes routed experts (``.experts.`` keys) channel-wise over axis 0 and
  clips amax at 1e-8; version ``1dd4eef8`` is tensor-wise everywhere and clips at 1e-4;
* every measurement key is written as bf16 ``[1]`` into the last shard: raw amax for ``self_attn``
  keys, amax/240 otherwise; a zero amax is written as 0 (the guard compares a string with 0.0);
* shard names carry an estimated count: ``total_size * 0.506`` (20c9eae8) or ``total_size / 2``
  (1dd4eef8) divided by the shard limit, which can disagree with the real count.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from hpu_fp8_loader.io.checkpoint import Checkpoint

VERSIONS = ("20c9eae8", "1dd4eef8")
LEGACY_CONFIG = {
    "quantization": "mix_quant",
    "dense_quant_type": "tensor_wise_fp8",
    "moe_quant_type": "tensor_wise_fp8",
    "kv_cache_quant_type": "float8_e4m3",
    "is_quantized": True,
}


def _quantize(weight: np.ndarray, channel_wise: bool, floor: float) -> tuple[np.ndarray, np.ndarray]:
    w = weight.astype(np.float32)
    amax = np.maximum(np.abs(w).max(axis=0) if channel_wise else np.abs(w).max(keepdims=True), np.float32(floor))
    scale = (amax / np.float32(240.0)).astype(np.float32)
    q = (w / scale).astype(ml_dtypes.float8_e4m3fn)  # no clamp: |w / scale| <= 240 by construction
    return q.view(np.int8), scale.reshape(-1).astype(ml_dtypes.bfloat16)


def model_convert(
    src: Path, dst: Path, measurement: dict[str, float], version: str = "20c9eae8", shard_limit: int | None = None
) -> Path:
    """Write the legacy FP8 checkpoint of BF16 ``src``; ``measurement`` maps FastDeploy keys to raw amax."""
    assert version in VERSIONS
    source = Checkpoint.open(src)
    limit = shard_limit or (5 * 10**9 if version == "20c9eae8" else 5 * 2**30)
    tensors: dict[str, np.ndarray] = {}
    for name, info in source.tensors.items():
        array = np.asarray(source.get(name))
        if "_proj.weight" not in name:
            tensors[name] = array
        elif info.dtype == "BF16":
            channel_wise = version == "20c9eae8" and ".experts." in name
            q, scale = _quantize(array, channel_wise, 1e-8 if version == "20c9eae8" else 1e-4)
            tensors[name.replace(".weight", ".quant_weight")] = q
            tensors[name.replace(".weight", ".weight_scale")] = scale
        # other dtypes: "warning" and continue -- dropped from the output
    activations = {
        key: np.array([value if "self_attn" in key else value / 240.0], np.float32).astype(ml_dtypes.bfloat16)
        for key, value in measurement.items()
    }
    dst.mkdir(parents=True)
    total = sum(a.nbytes for a in tensors.values())
    estimated = max(1, math.ceil(total * (0.506 if version == "20c9eae8" else 0.5) / limit))
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(array)
        size += array.nbytes
    shards[-1].update(activations)  # only into the last shard
    weight_map = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{estimated:05d}.safetensors"
        save_file(shard, dst / file_name)
        weight_map.update(dict.fromkeys(shard, file_name))
    total_size = sum(a.nbytes for shard in shards for a in shard.values())
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map})
    )
    for extra in src.iterdir():
        if extra.suffix != ".safetensors" and extra.name not in ("model.safetensors.index.json", "hpu_fp8_manifest.json"):
            shutil.copy2(extra, dst / extra.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = dict(LEGACY_CONFIG)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst

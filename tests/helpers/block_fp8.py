"""Block-wise FP8 source checkpoints for the tests, made from the tiny BF16 models.

The block quantizer is the one transformers' fine-grained FP8 integration writes ``weight_scale_inv`` with
(``Fp8Quantize``: per-block amax / 448, codes = values / scale cast to e4m3): :func:`block_quantize` calls it
wherever a matrix divides into whole blocks, and for ragged shapes (which ``Fp8Quantize`` passes through
unquantized) applies the same rule to the zero-padded matrix, cropped, as FastDeploy's ``per_block_cast_to_fp8``
does (``fastdeploy/model_executor/layers/utils.py``@8c3513a4). The oracle for the values such a checkpoint stands
for is transformers' own ``_dequantize_fp8_weight`` (:func:`oracle_dequantize`).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Quantize, _dequantize_fp8_weight

from hpu_fp8_loader.arch import Layout, describe
from hpu_fp8_loader.engine.weights import open_weights

BLOCK = (128, 128)


class _Quantizer:  # what Fp8Quantize asks of its hf_quantizer
    def __init__(self, block: tuple[int, int]):
        self.quantization_config = FineGrainedFP8Config(weight_block_size=list(block))


def block_quantize(values: np.ndarray, block: tuple[int, int] = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``[rows, cols]`` -> (e4m3 codes, float32 ``weight_scale_inv`` grid), by transformers' rule."""
    tensor = torch.from_numpy(np.ascontiguousarray(values, np.float32))
    rows, cols = tensor.shape
    if rows % block[0] == 0 and cols % block[1] == 0:
        made = Fp8Quantize(_Quantizer(block)).convert({"w.weight": tensor})
        return made["w.weight"].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), made["w.weight_scale_inv"].numpy()
    padded = torch.zeros(math.ceil(rows / block[0]) * block[0], math.ceil(cols / block[1]) * block[1])
    padded[:rows, :cols] = tensor
    codes, grid = block_quantize(padded.numpy(), block)
    return np.ascontiguousarray(codes[:rows, :cols]), grid


def oracle_dequantize(codes: np.ndarray, grid: np.ndarray, block: tuple[int, int] = BLOCK) -> np.ndarray:
    """transformers' ``_dequantize_fp8_weight`` in float32: the values a block-FP8 weight stands for."""
    weight = torch.from_numpy(np.array(codes).view(np.uint8)).view(torch.float8_e4m3fn)  # a writable copy
    return _dequantize_fp8_weight(weight, torch.from_numpy(np.array(grid)), list(block), torch.float32).numpy()


def _write(out: Path, source: Path, tensors: dict[str, np.ndarray], quantization_config: dict) -> Path:
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(tensors, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def hf_block_checkpoint(source: Path, out: Path, block: tuple[int, int] = BLOCK) -> Path:
    """The Hugging Face layout (Qwen3-*-FP8): every linear an e4m3 ``weight`` [out, in] and ``weight_scale_inv``."""
    d = describe(json.loads((source / "config.json").read_text()))
    linears = {p.name for w in d.weights() if w.is_linear for p in w.source_parts(Layout.TORCH, d.prefix)}
    tensors = {}
    every = {name: value for shard in sorted(source.glob("*.safetensors")) for name, value in load_file(shard).items()}
    for name, value in every.items():
        if name in linears:
            codes, grid = block_quantize(value.astype(np.float32), block)
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = codes, grid
        else:
            tensors[name] = value
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return _write(out, source, tensors, qc)


def paddle_block_checkpoint(source: Path, out: Path) -> Path:
    """FastDeploy's Paddle layout (ERNIE-4.5-300B-A47B-FP8-Paddle): spec names, every linear an e4m3 ``quant_weight``
    [in, out] with a ``weight_scale`` [ceil(in/128), ceil(out/128)] that multiplies (models/ernie4_5_moe.py,
    utils.py rename_offline_ckpt_suffix_to_fd_suffix, block_wise_fp8.py@8c3513a4)."""
    weights = open_weights(source)
    tensors = {}
    for w in weights.descriptor.weights():
        value = weights.get(w)  # the spec (= Paddle) layout, fused, in float32
        if w.is_linear:
            codes, grid = block_quantize(value)
            tensors[w.module + ".quant_weight"], tensors[w.module + ".weight_scale"] = codes, grid
        else:
            tensors[w.name] = value.astype(np.float32 if w.source_dtype == "F32" else ml_dtypes.bfloat16)
    qc = {
        "quantization": "mix_quant",
        "dense_quant_type": "block_wise_fp8",
        "moe_quant_type": "block_wise_fp8",
        "is_quantized": True,
    }
    return _write(out, source, tensors, qc)

"""A minimal stand-in for FastDeploy's module surface, built from docs/fastdeploy.md.

FastDeploy cannot be installed here (PaddlePaddle FastDeploy is not on PyPI; the PyPI package named
``fastdeploy`` is an unrelated project). This writes, as real files on an import path, just the
pieces the hook touches, with FastDeploy's names:

* ``fastdeploy.model_executor.model_loader``: ``BaseModelLoader`` and a ``get_model_loader`` that, like
  FastDeploy's, is a hard-coded if/else (docs/fastdeploy.md section 2, "Load dispatch");
* ``fastdeploy.worker.hpu_model_runner``: imports ``get_model_loader`` *by name* at module top, and
  ``HPUModelRunner.load_model`` calls it, then ``convert_model`` (section 2, "Load dispatch"; section 10);
* ``fastdeploy.model_executor.models``: ``ModelRegistry.get_class(architecture)`` returning a model whose
  parameters are the HPU FP8 layers' (sections 5, 6 and 11), named and shaped here from
  docs/fastdeploy.md, independently of hpu_fp8_loader's mapping, for tensor-parallel rank ``r`` of ``tp``.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

BASE_LOADER = """
from abc import ABC, abstractmethod


class BaseModelLoader(ABC):
    def __init__(self, load_config):
        self.load_config = load_config

    @abstractmethod
    def download_model(self, model_config): ...

    @abstractmethod
    def load_model(self, fd_config): ...
"""

# FastDeploy's default_loader imports models.model_base, whose package runs the plugins: the plugin runs
# while model_loader is half-imported, before get_model_loader exists.
DEFAULT_LOADER = """
from fastdeploy.model_executor.model_loader.base_loader import BaseModelLoader
from fastdeploy.model_executor.models.model_base import ModelRegistry


class DefaultModelLoader(BaseModelLoader):
    def download_model(self, model_config):
        pass

    def load_model(self, fd_config):
        return "v0 loader"


class DefaultModelLoaderV1(DefaultModelLoader):
    pass
"""

MODEL_LOADER = """
from fastdeploy.model_executor.model_loader.base_loader import BaseModelLoader
from fastdeploy.model_executor.model_loader.default_loader import DefaultModelLoader, DefaultModelLoaderV1


def get_model_loader(load_config):
    if load_config.load_choices == "default_v1":
        return DefaultModelLoaderV1(load_config)
    return DefaultModelLoader(load_config)
"""

HPU_MODEL_RUNNER = """
from fastdeploy.model_executor.model_loader import get_model_loader


class HPUModelRunner:
    def __init__(self, fd_config):
        self.fd_config = fd_config
        self.converted = False

    def load_model(self):
        model = get_model_loader(load_config=self.fd_config.load_config).load_model(fd_config=self.fd_config)
        self.converted = True  # convert_model: installs the fused forwards (and, from PR 5855, pads down_proj_in_scale)
        return model
"""

# The plugins FastDeploy's models package runs on import: FD_PLUGINS names the entry points to load.
MODELS_PACKAGE = """
import os
from importlib.metadata import entry_points

for point in entry_points(group="fastdeploy.model_register_plugins"):
    if point.name in os.environ.get("FD_PLUGINS", "").split(","):
        point.load()()
"""

MODELS = '''
import paddle


def _add(root, dotted, shape, dtype):
    *path, leaf = dotted.split(".")
    node = root
    for part in path:
        child = node._sub_layers.get(part)
        if child is None:
            child = paddle.nn.Layer()
            node.add_sublayer(part, child)
        node = child
    node.add_parameter(leaf, node.create_parameter(shape, dtype=dtype, default_initializer=paddle.nn.initializer.Constant(0)))


def contract_parameters(c, tp, rank, moe_list_layout=False, lm_head_fp32=False):
    """name -> (shape, dtype) of an HPU FP8 model's parameters on one TP rank, from docs/fastdeploy.md section 11."""
    prefix = {"ernie4_5_moe": "ernie", "ernie4_5": "ernie", "qwen2": "qwen2"}[c["model_type"]]
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // heads
    kv_rank = kv // tp
    params = {f"{prefix}.embed_tokens.embeddings.weight": ([c["vocab_size"] // tp, h], "bfloat16"),
              f"{prefix}.norm.weight": ([h], "bfloat16")}
    # FastDeploy builds it tied or not; float32 with --lm_head-fp32
    params["lm_head.linear.weight"] = ([h, c["vocab_size"] // tp], "float32" if lm_head_fp32 else "bfloat16")

    def linear(name, shape):  # docs/fastdeploy.md section 5, "Linear layers"
        params[f"{name}.weight"] = (shape, "float8_e4m3fn")
        for scale in ("weight_scale", "act_scale", "act_scale_inv"):
            params[f"{name}.{scale}"] = ([1], "bfloat16")

    for i in range(c["num_hidden_layers"]):
        p = f"{prefix}.layers.{i}"
        params[f"{p}.input_layernorm.weight"] = ([h], "bfloat16")
        params[f"{p}.post_attention_layernorm.weight"] = ([h], "bfloat16")
        qkv = (heads // tp + 2 * kv_rank) * hd
        linear(f"{p}.self_attn.qkv_proj", [h, qkv])
        if c["model_type"] == "qwen2":
            params[f"{p}.self_attn.qkv_proj.bias"] = ([qkv], "bfloat16")
        linear(f"{p}.self_attn.o_proj", [heads * hd // tp, h])
        if c["quantization_config"].get("kv_cache_quant_type") == "float8_e4m3":  # docs/fastdeploy.md sections 3 and 6
            for s in ("cache_k", "cache_v", "q", "q_scaling", "s"):  # section 6, "Attention scales": float32 [1]
                params[f"{p}.self_attn.attn.{s}_scale"] = ([1], "float32")
                params[f"{p}.self_attn.attn.{s}_out_scale"] = ([1], "float32")
        moe = c.get("moe_num_experts") and c["moe_layer_start_index"] <= i <= c["moe_layer_end_index"]
        if not moe:
            inter = c["intermediate_size"] // tp
            linear(f"{p}.mlp.up_gate_proj", [h, 2 * inter])
            linear(f"{p}.mlp.down_proj", [inter, h])
            continue
        e, inter = c["moe_num_experts"], c["moe_intermediate_size"] // tp
        params[f"{p}.mlp.gate.weight"] = ([h, e], "float32")
        params[f"{p}.mlp.experts.gate_correction_bias"] = ([1, e], "float32")
        params[f"{p}.mlp.experts.up_gate_proj_weight"] = ([e, h, 2 * inter], "float8_e4m3fn")  # section 5, "MoE"
        params[f"{p}.mlp.experts.down_proj_weight"] = ([e, inter, h], "float8_e4m3fn")
        params[f"{p}.mlp.experts.up_gate_proj_weight_scale"] = ([e, 2 * inter], "bfloat16")
        params[f"{p}.mlp.experts.down_proj_weight_scale"] = ([e, h], "bfloat16")
        params[f"{p}.mlp.experts.up_gate_proj_in_scale"] = ([1], "bfloat16")
        if not moe_list_layout:  # PR 5855; before it, FastDeploy sets a per-expert list instead
            params[f"{p}.mlp.experts.down_proj_in_scale"] = ([e, 1], "bfloat16")
        if c.get("moe_num_shared_experts"):
            width = c["moe_num_shared_experts"] * c["moe_intermediate_size"] // tp
            linear(f"{p}.mlp.shared_experts.up_gate_proj", [h, 2 * width])
            linear(f"{p}.mlp.shared_experts.down_proj", [width, h])
    return params


class StandInModel(paddle.nn.Layer):
    def __init__(self, fd_config):
        super().__init__()
        parallel = fd_config.parallel_config
        for name, (shape, dtype) in contract_parameters(fd_config.model_config.config, parallel.tensor_parallel_size,
                                                       parallel.tensor_parallel_rank,
                                                       getattr(fd_config, "moe_list_layout", False),
                                                       fd_config.model_config.lm_head_fp32).items():
            _add(self, name, shape, dtype)


class ModelRegistry:
    @staticmethod
    def get_class(architecture):
        assert architecture in ("Ernie4_5_MoeForCausalLM", "Ernie4_5ForCausalLM", "Qwen2ForCausalLM"), architecture
        return StandInModel
'''


def write_standin(root: Path) -> Path:
    """Write the stand-in package under ``root`` (put ``root`` on sys.path to import it)."""
    files = {
        "fastdeploy/__init__.py": "",
        "fastdeploy/model_executor/__init__.py": "",
        "fastdeploy/model_executor/model_loader/__init__.py": MODEL_LOADER,
        "fastdeploy/model_executor/model_loader/base_loader.py": BASE_LOADER,
        "fastdeploy/model_executor/model_loader/default_loader.py": DEFAULT_LOADER,
        "fastdeploy/model_executor/models/__init__.py": MODELS_PACKAGE,
        "fastdeploy/model_executor/models/model_base.py": MODELS,
        "fastdeploy/worker/__init__.py": "",
        "fastdeploy/worker/hpu_model_runner.py": HPU_MODEL_RUNNER,
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def forget_standin() -> None:
    for name in [n for n in sys.modules if n == "fastdeploy" or n.startswith("fastdeploy.")]:
        del sys.modules[name]

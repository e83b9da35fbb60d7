"""A stand-in for FastDeploy's module chain, for the plugin's mechanics where FastDeploy's source is absent.

What FastDeploy itself builds and fills is checked against its real source by the conformance suite
(tests/fastdeploy_real); this stand-in covers only what that suite cannot where it is skipped: that
the plugin routes ``hpu_fp8`` through FastDeploy's module chain (``base_loader``, ``default_loader``
importing the models package, which runs the plugins named by ``FD_PLUGINS``, ``get_model_loader``,
``HPUModelRunner.load_model`` importing it by name), stacks experts, sets the per-expert list of the
PR 5324 MoE layout, casts a float32 lm_head, calls ``model.eval()``, and names what is missing or extra.
Its model holds exactly the parameters the hook's own mapping expects, so it says nothing about
FastDeploy's shapes or values.

``write_broken_fastdeploy`` and ``write_paddle_standin`` give ``hpu-fp8 doctor`` a FastDeploy with one fault of the
kinds a real one may have (exit, print, hang or die on import, a loader that is None or raises a BaseException, a
half-imported base_loader) and a paddle of the version FastDeploy's Gaudi guide installs, which cannot be installed
beside the tests' own.
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


DTYPES = {"F8_E4M3": "float8_e4m3fn", "BF16": "bfloat16", "F32": "float32"}


class StandInModel(paddle.nn.Layer):
    """The parameters the hook's own mapping expects (parameter_specs), not a reading of FastDeploy:
    whether FastDeploy builds the same is the conformance suite's question (tests/fastdeploy_real)."""

    def __init__(self, fd_config):
        super().__init__()
        from hpu_fp8_loader.arch import describe
        from hpu_fp8_loader.fastdeploy.mapping import LM_HEAD_PARAMETER, Parallelism, parameter_specs
        from hpu_fp8_loader.spec.config import parse_quantization_config

        config, parallel = fd_config.model_config.config, fd_config.parallel_config
        qc = parse_quantization_config(config)
        specs = parameter_specs(describe(config), qc.kv_cache_scheme,
                                Parallelism(parallel.tensor_parallel_size, parallel.tensor_parallel_rank), qc.kept_bf16)
        for name, spec in specs.items():
            if getattr(fd_config, "moe_list_layout", False) and name.endswith(".down_proj_in_scale"):
                continue  # FastDeploy before PR 5855 sets a per-expert list instead
            lm_head_fp32 = name == LM_HEAD_PARAMETER and fd_config.model_config.lm_head_fp32
            _add(self, name, list(spec.shape), "float32" if lm_head_fp32 else DTYPES[spec.dtype])


class ModelRegistry:
    @staticmethod
    def get_class(architecture):
        assert architecture in ("Ernie4_5_MoeForCausalLM", "Ernie4_5ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                "Qwen3MoeForCausalLM"), architecture
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


# ----------------------------------------------------------------------------- a broken FastDeploy, for doctor

# The thinnest FastDeploy `hpu-fp8 doctor` can examine, with one fault of the kind a real one may have. Its models
# package runs the plugins as FastDeploy's does; nothing imports paddle unless the fault says so, so these doubles
# run with the paddle stand-in below. What a real FastDeploy does under doctor is the conformance suite's question.
BROKEN_FASTDEPLOY_FAULTS = {
    "none": ("", MODEL_LOADER),
    "exit-on-import": ("import sys\nsys.exit(0)\n", MODEL_LOADER),
    "print-on-import": ("import sys\nprint('FastDeploy banner on stdout')\nprint('a warning', file=sys.stderr)\n", MODEL_LOADER),
    "hang-on-import": ("import time\ntime.sleep(3600)\n", MODEL_LOADER),
    "killed-on-import": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", MODEL_LOADER),
    "torch-proxy": ("import paddle\npaddle.compat.enable_torch_proxy(scope={'triton'})\n", MODEL_LOADER),
    # from 8b6bbb35 (release/2.5: d12aa284) FastDeploy's __init__ asks importlib.metadata for torch first
    "enable-compat": (
        "from importlib.metadata import PackageNotFoundError, distribution\nimport paddle\ntry:\n"
        "    distribution('torch')\nexcept PackageNotFoundError:\n    paddle.enable_compat(scope={'triton'})\n",
        MODEL_LOADER,
    ),
    "loader-none": ("", "def get_model_loader(load_config):\n    return None\n"),
    "base-exception": (
        "",
        "class FastDeployStop(BaseException):\n    pass\n\n\n"
        "def get_model_loader(load_config):\n    raise FastDeployStop('the worker was told to stop')\n",
    ),
    # base_loader imports the models package (which runs the plugins) before it defines BaseModelLoader
    "half-imported-base-loader": ("", MODEL_LOADER),
}

HALF_IMPORTED_BASE_LOADER = "import fastdeploy.model_executor.models.model_base\n" + BASE_LOADER

PLAIN_MODELS = """
class ModelRegistry:
    @staticmethod
    def get_class(architecture):
        raise KeyError(architecture)
"""


def write_broken_fastdeploy(root: Path, fault: str = "none", version_txt: str | None = None) -> Path:
    """A FastDeploy package under ``root`` with ``fault`` (a key of BROKEN_FASTDEPLOY_FAULTS) and, if given, a
    version.txt as FastDeploy's build.sh writes it; put ``root`` on sys.path to import it."""
    init, model_loader = BROKEN_FASTDEPLOY_FAULTS[fault]
    base_loader = HALF_IMPORTED_BASE_LOADER if fault == "half-imported-base-loader" else BASE_LOADER
    files = {
        "fastdeploy/__init__.py": init,
        "fastdeploy/model_executor/__init__.py": "",
        "fastdeploy/model_executor/model_loader/__init__.py": model_loader,
        "fastdeploy/model_executor/model_loader/base_loader.py": base_loader,
        "fastdeploy/model_executor/model_loader/default_loader.py": DEFAULT_LOADER,
        "fastdeploy/model_executor/models/__init__.py": MODELS_PACKAGE,
        "fastdeploy/model_executor/models/model_base.py": PLAIN_MODELS,
        # what doctor reads of the sources: the HPU FP8 MoE method of PR 5324
        "fastdeploy/model_executor/layers/backends/intel_hpu/moe/fused_moe_hpu_backend.py": "class HpuTensorWiseFP8MoEMethod: ...\n",
    }
    if version_txt is not None:
        files["fastdeploy/version.txt"] = version_txt
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def write_paddle_standin(root: Path, version: str = "3.3.0", compat: bool = True) -> Path:
    """The paddle doctor asks for: a version, custom devices (none), and ``paddle.compat.enable_torch_proxy`` (with its
    alias ``paddle.enable_compat``) when ``compat`` (paddle 3.3.0 on); without it, the paddle of FastDeploy's Gaudi guide (3.1.1 has no paddle.compat).
    No paddle 3.1.1 installs beside the tests' own 3.3, so this stands in for it; put ``root`` first on sys.path."""
    package = root / "paddle"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(
        f"__version__ = {version!r}\nfrom paddle import device\n"
        + ("from paddle import compat\nfrom paddle.compat import enable_torch_proxy as enable_compat\n" if compat else "")
    )
    (package / "device.py").write_text("def get_all_custom_device_type():\n    return []\n")
    if compat:
        (package / "compat.py").write_text("def enable_torch_proxy(scope=None):\n    return None\n")
    return root

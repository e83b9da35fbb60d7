"""``--load-choices hpu_fp8``: the only module that touches FastDeploy.

FastDeploy has no loader registry and no quantization-method plugin group (contract section 13), so
the hook rides on the ``fastdeploy.model_register_plugins`` entry-point group, which FastDeploy runs
once per process when its models package is imported. ``register`` wraps ``get_model_loader`` in
both places FastDeploy looks it up -- ``fastdeploy.model_executor.model_loader`` and
``fastdeploy.worker.hpu_model_runner``, which imports it by name -- so that ``load_choices ==
"hpu_fp8"`` gets :class:`HpuFp8ModelLoader`; every other choice goes to FastDeploy's own loaders.
It patches lazily: a module not imported yet is patched right after its import, because the plugin
runs in the middle of FastDeploy importing its model packages (an import here could be circular).

The loader builds the model as FastDeploy's v0 loader does, then fills every parameter exactly once
from :mod:`hpu_fp8_loader.fastdeploy.mapping` and fails naming every parameter left unfilled and
every mapped tensor the model lacks. ``HPUModelRunner.load_model`` still calls ``convert_model``
afterwards, which re-packs ``down_proj_in_scale`` and installs the fused HPU forwards.

[inferred] from the contract, not run against FastDeploy here: the FDConfig attribute names read in
:func:`_parallelism` and ``fd_config.model_config.model`` / ``architectures``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

import numpy as np

from ..errors import HpuFp8Error

__all__ = ["LOAD_CHOICE", "fill_model", "register"]

LOAD_CHOICE = "hpu_fp8"
PATCHED_MODULES = ("fastdeploy.model_executor.model_loader", "fastdeploy.worker.hpu_model_runner")
_MARK = "_hpu_fp8_wrapped"


def _wrap(get_model_loader):
    if getattr(get_model_loader, _MARK, False):
        return get_model_loader

    def get_model_loader_with_hpu_fp8(load_config, *args, **kwargs):
        if getattr(load_config, "load_choices", None) == LOAD_CHOICE:
            return loader_class()(load_config)
        return get_model_loader(load_config, *args, **kwargs)

    setattr(get_model_loader_with_hpu_fp8, _MARK, True)
    get_model_loader_with_hpu_fp8.__wrapped__ = get_model_loader
    return get_model_loader_with_hpu_fp8


def _patch(module) -> None:
    if hasattr(module, "get_model_loader"):
        module.get_model_loader = _wrap(module.get_model_loader)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of the patched modules so they are patched once imported."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHED_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                original = spec.loader.exec_module

                def exec_module(module, _original=original):
                    _original(module)
                    _patch(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


def register() -> None:
    """Entry point (``fastdeploy.model_register_plugins``): route ``--load-choices hpu_fp8`` to our loader."""
    for name in PATCHED_MODULES:
        if name in sys.modules:
            _patch(sys.modules[name])
    if not any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())


# ----------------------------------------------------------------------------- the loader


def _to_paddle(array: np.ndarray):
    """A paddle tensor of the array's exact bits: fp8 and bf16 go through integer views (paddle.to_tensor refuses ml_dtypes)."""
    import paddle

    if array.dtype.name == "float8_e4m3fn":
        return paddle.to_tensor(np.ascontiguousarray(array).view(np.uint8)).view(paddle.float8_e4m3fn)
    if array.dtype.name == "bfloat16":
        return paddle.to_tensor(np.ascontiguousarray(array).view(np.uint16)).view(paddle.bfloat16)
    return paddle.to_tensor(np.ascontiguousarray(array))


def _parallelism(fd_config):
    from .mapping import Parallelism

    parallel = fd_config.parallel_config
    return Parallelism(
        tp_size=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
        tp_rank=int(getattr(parallel, "tensor_parallel_rank", 0) or 0),
        ep_size=int(getattr(parallel, "expert_parallel_size", 1) or 1),
        ep_rank=int(getattr(parallel, "expert_parallel_rank", 0) or 0),
    )


def fill_model(model, root: str | Path, par) -> int:
    """Set every parameter of ``model`` from the hpu-fp8 checkpoint at ``root``; returns how many were set.

    Raises :class:`HpuFp8Error` naming every parameter left unfilled and every mapped tensor the model
    does not have, and any shape that disagrees.
    """
    from ..arch import describe
    from ..io.checkpoint import Checkpoint
    from ..spec.config import parse_quantization_config
    from .mapping import map_rank, parameter_specs

    checkpoint = Checkpoint.open(root)
    qc = parse_quantization_config(checkpoint.config, f"{root}/config.json")
    descriptor = describe(checkpoint.config)
    specs = parameter_specs(descriptor, qc.kv_cache_scheme, par)
    parameters = dict(model.named_parameters())
    unused = sorted(set(specs) - set(parameters))
    if unused:
        raise HpuFp8Error(f"the checkpoint maps {len(unused)} tensor(s) the model does not have: {', '.join(unused[:10])}")
    stacked: dict[str, np.ndarray] = {}
    filled = set()
    for piece in map_rank(checkpoint, qc, descriptor, par):
        if piece.expert is None:
            value = piece.array
        else:
            value = stacked.setdefault(piece.name, np.empty(specs[piece.name].shape, piece.array.dtype))
            value[piece.expert] = piece.array
            if piece.expert != specs[piece.name].shape[0] - 1:
                continue  # set once the last local expert has arrived
        parameter = parameters[piece.name]
        if list(parameter.shape) != list(value.shape):
            raise HpuFp8Error(
                f"parameter {piece.name} has shape {list(parameter.shape)}, the checkpoint gives {list(value.shape)}"
            )
        parameter.set_value(_to_paddle(value))
        stacked.pop(piece.name, None)
        filled.add(piece.name)
    unfilled = sorted(set(parameters) - filled)
    if unfilled:
        raise HpuFp8Error(f"{len(unfilled)} model parameter(s) left unfilled by the checkpoint: {', '.join(unfilled[:10])}")
    return len(filled)


_LOADER = None


def loader_class():
    """The loader class, made on first use so that importing this module never imports FastDeploy."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    from fastdeploy.model_executor.model_loader import BaseModelLoader
    from fastdeploy.model_executor.models import ModelRegistry

    from ..hub import load

    class HpuFp8ModelLoader(BaseModelLoader):
        """Loads an hpu-fp8 checkpoint (local directory or Hub repo id) into FastDeploy's HPU FP8 model."""

        def download_model(self, model_config) -> None:
            model_config.model = str(load(model_config.model, hashes=False).path)

        def load_model(self, fd_config):
            # format_version, manifest sizes, headers, index, scales: validate --quick, not a weight scan
            checkpoint = load(fd_config.model_config.model, hashes=False)
            architecture = fd_config.model_config.architectures[0]
            model = ModelRegistry.get_class(architecture)(fd_config)
            fill_model(model, checkpoint.path, _parallelism(fd_config))
            return model

    _LOADER = HpuFp8ModelLoader
    return _LOADER

"""``--load-choices hpu_fp8``: the only module that touches FastDeploy.

FastDeploy has no loader registry: ``get_model_loader`` returns ``DefaultModelLoaderV1`` for
``default_v1`` and ``DefaultModelLoader`` for anything else, so an unknown choice silently becomes
the v0 loader (docs/fastdeploy.md, "Load dispatch"). The hook rides on the
``fastdeploy.model_register_plugins`` entry-point group, which FastDeploy runs, when ``FD_PLUGINS``
names it, the first time its models package is imported.

``register`` does not wrap ``get_model_loader``: the HPU runner imports that function by name, and
the plugin may run while ``fastdeploy.model_executor.model_loader`` is still half-imported (its
``default_loader`` imports the models package), so a wrapper can miss either copy. It gives
``BaseModelLoader``, the class every FastDeploy loader derives from, a ``__new__`` that returns
:class:`HpuFp8ModelLoader` whenever ``load_choices == "hpu_fp8"``. Whichever loader FastDeploy picks
and however it was imported, ``hpu_fp8`` gets ours. ``base_loader`` has no FastDeploy model
imports, so it is either absent (patched right after its import) or complete when the plugin runs;
anything else is a loud error, never a silent fallback.

The loader builds the model as FastDeploy's v0 loader does (``ModelRegistry.get_class``, then
``model.eval()``), fills every parameter exactly once from :mod:`hpu_fp8_loader.fastdeploy.mapping`,
and fails naming every parameter left unfilled and every mapped tensor the model lacks.
``HPUModelRunner.load_model`` then runs ``convert_model`` as after its own loader.

From 2533836d (releases 2.5 and 2.6) FastDeploy holds Qwen3's q/k norms under ``self_attn.qk_norm`` and its HPU
runner no longer hands them to the fused attention; :func:`attach_qk_norms` gives them back (docs/fastdeploy.md
section 14, "q/k norms from 2533836d").

FastDeploy's MoE layer holds ``down_proj_in_scale`` in one of two ways, told apart on the model
FastDeploy built (docs/fastdeploy.md, "Two MoE layouts"): a Python list of per-expert bf16 ``[1]``
tensors set as an attribute (PR 5324 up to PR 5855), or an ``[E, 1]`` bf16 parameter that
``convert_model`` pads afterwards (from PR 5855). Each is filled as FastDeploy's own v0 loading fills it.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from collections.abc import Collection, Iterable
from pathlib import Path

import numpy as np

from hpu_fp8_loader.errors import HpuFp8Error

__all__ = [
    "ANNOUNCEMENT_PREFIX",
    "LOAD_CHOICE",
    "MOE_LIST_LAYOUT",
    "MOE_PARAMETER_LAYOUT",
    "SEQUENCE_PARALLEL_MOE_REFUSAL",
    "attach_qk_norms",
    "check_parallel_config",
    "fastdeploy_casts",
    "fill_model",
    "is_registered",
    "model_parameter_names",
    "moe_layout",
    "register",
    "router_parameters",
]

LOAD_CHOICE = "hpu_fp8"
BASE_LOADER_MODULE = "fastdeploy.model_executor.model_loader.base_loader"
# the INFO line each worker logs once the hook has filled the model: the recipe tells users to look for it
ANNOUNCEMENT_PREFIX = "hpu_fp8: filled"
MOE_LIST_LAYOUT = "down_proj_in_scale as a per-expert list (FastDeploy PR 5324 layout)"
MOE_PARAMETER_LAYOUT = "down_proj_in_scale as an [E, 1] parameter (FastDeploy PR 5855 layout)"
_DOWN_IN_SCALE = "down_proj_in_scale"
_ROUTED = "_hpu_fp8_routed"

log = logging.getLogger("hpu_fp8_loader.fastdeploy")


def _route(base_loader) -> None:
    """Give FastDeploy's ``BaseModelLoader`` a ``__new__`` that hands ``hpu_fp8`` to our loader."""
    if base_loader.__dict__.get(_ROUTED):
        return
    inherited_new = base_loader.__new__

    def new_routing_hpu_fp8(cls, load_config=None, *args, **kwargs):
        if getattr(load_config, "load_choices", None) == LOAD_CHOICE:
            ours = loader_class()
            if not issubclass(cls, ours):
                return ours(load_config)  # not an instance of cls: Python skips cls.__init__
        if inherited_new is object.__new__:
            return object.__new__(cls)
        return inherited_new(cls, load_config, *args, **kwargs)

    base_loader.__new__ = staticmethod(new_routing_hpu_fp8)
    setattr(base_loader, _ROUTED, True)


def _route_module(module) -> None:
    base_loader = getattr(module, "BaseModelLoader", None)
    if base_loader is None:
        raise HpuFp8Error(
            f"hpu_fp8: {BASE_LOADER_MODULE} is only half-imported while FastDeploy runs its plugins; "
            "--load-choices hpu_fp8 cannot be routed to the hpu_fp8 loader (run `hpu-fp8 doctor`)"
        )
    _route(base_loader)


class _RouteAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; makes the real loader of ``base_loader`` route it once executed."""

    def find_spec(self, name, path, target=None):
        if name != BASE_LOADER_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                original = spec.loader.exec_module

                def exec_module(module, _original=original):
                    _original(module)
                    _route_module(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


def register() -> None:
    """Entry point (``fastdeploy.model_register_plugins``): route ``--load-choices hpu_fp8`` to our loader."""
    module = sys.modules.get(BASE_LOADER_MODULE)
    if module is not None:
        _route_module(module)
    elif not any(isinstance(finder, _RouteAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RouteAfterImport())


def is_registered() -> bool:
    """Whether ``hpu_fp8`` reaches our loader in this process (now, or once ``base_loader`` is imported)."""
    module = sys.modules.get(BASE_LOADER_MODULE)
    if module is not None:
        return bool(getattr(getattr(module, "BaseModelLoader", None), _ROUTED, False))
    return any(isinstance(finder, _RouteAfterImport) for finder in sys.meta_path)


# ----------------------------------------------------------------------------- filling


def _paddle_dtype(array: np.ndarray):
    import paddle

    return {"float8_e4m3fn": paddle.float8_e4m3fn, "bfloat16": paddle.bfloat16, "float32": paddle.float32}[array.dtype.name]


def _to_paddle(array: np.ndarray):
    """A paddle tensor of the array's exact bits: fp8 and bf16 go through integer views (paddle.to_tensor refuses ml_dtypes)."""
    import paddle

    if array.dtype.name == "float8_e4m3fn":
        return paddle.to_tensor(np.ascontiguousarray(array).view(np.uint8)).view(paddle.float8_e4m3fn)
    if array.dtype.name == "bfloat16":
        return paddle.to_tensor(np.ascontiguousarray(array).view(np.uint16)).view(paddle.bfloat16)
    return paddle.to_tensor(np.ascontiguousarray(array))


def fastdeploy_casts(name: str, built: str, mapped: str, routers: Collection[str]) -> bool:
    """Whether FastDeploy's own loading casts a tensor mapped as ``mapped`` into the ``built`` dtype of its parameter
    (dtypes as paddle names them): a bf16 lm_head into the float32 one of ``--lm_head-fp32`` (exact), and a float32
    router into the bf16 gate FastDeploy builds for Qwen3-MoE by default from 53aaac69 (PR 6457, in release 2.6;
    float32 with ``--moe-gate-fp32``): ``UnquantizedLinearMethod.process_loaded_weights`` casts what it loads to the
    parameter's dtype."""
    from hpu_fp8_loader.fastdeploy.mapping import LM_HEAD_PARAMETER

    return (name == LM_HEAD_PARAMETER and (built, mapped) == ("float32", "bfloat16")) or (
        name in routers and (built, mapped) == ("bfloat16", "float32")
    )


def _for_parameter(name: str, parameter, value: np.ndarray, routers: Collection[str]):
    """The value as a paddle tensor of the parameter's dtype, cast only where FastDeploy's own loading casts it
    (:func:`fastdeploy_casts`) and as it does, by paddle's ``cast``."""
    tensor = _to_paddle(value)
    if parameter.dtype == tensor.dtype:
        return tensor
    built, mapped = (str(dtype).removeprefix("paddle.") for dtype in (parameter.dtype, tensor.dtype))
    if fastdeploy_casts(name, built, mapped, routers):
        return tensor.cast(parameter.dtype)
    raise HpuFp8Error(f"parameter {name} is {parameter.dtype}, the checkpoint gives {value.dtype.name}")


def _paddle_operand(value: np.float32):
    import paddle

    return paddle.to_tensor(np.array([value], np.float32))


def _paddle_result(value, dtype: str) -> np.ndarray:
    """A float32 paddle result cast as FastDeploy casts it, back as the exact numpy bits."""
    import paddle

    from hpu_fp8_loader.numerics import e4m3

    if dtype == "BF16":
        return value.astype(paddle.bfloat16).view(paddle.uint16).numpy().astype(np.uint16).view(e4m3.BF16_DTYPE)
    return value.astype(paddle.float32).numpy().astype(np.float32)


def paddle_arithmetic():
    """FastDeploy's scale formulas evaluated by this process's paddle, as FastDeploy's own loading evaluates them."""
    from hpu_fp8_loader.fastdeploy.mapping import Arithmetic

    return Arithmetic(_paddle_operand, _paddle_result)


def moe_layout(model) -> str | None:
    """Which way this FastDeploy model holds ``down_proj_in_scale``; None without FP8 MoE layers (none at all, or
    experts kept in BF16: FastDeploy's unquantized MoE method has no scales)."""
    parameters = dict(model.named_parameters())
    layers = [name for name in parameters if name.endswith(".mlp.experts.up_gate_proj_weight_scale")]
    if not layers:
        return None
    has_parameter = [name.replace("up_gate_proj_weight_scale", _DOWN_IN_SCALE) in parameters for name in layers]
    if all(has_parameter):
        return MOE_PARAMETER_LAYOUT
    if not any(has_parameter):
        return MOE_LIST_LAYOUT
    raise HpuFp8Error(f"the model holds {_DOWN_IN_SCALE} as a parameter in some MoE layers and not in others")


def model_parameter_names(mapped: Iterable[str], built: Collection[str]) -> dict[str, str]:
    """Each name the mapping fills -> the parameter of it in the model FastDeploy ``built``: the same name, but for
    Qwen3's q/k norms where this FastDeploy holds them in ``qk_norm`` (from 2533836d), told from the model itself as
    the MoE layout is."""
    from hpu_fp8_loader.fastdeploy.mapping import QK_NORM_HOLDER, held_qk_norm_parameter

    held = any(f".self_attn.{QK_NORM_HOLDER}." in name for name in built)
    return {name: (held_qk_norm_parameter(name) if held else None) or name for name in mapped}


def router_parameters(descriptor) -> frozenset[str]:
    """The MoE routers' parameter names (a float32 tensor in the spec)."""
    from hpu_fp8_loader.arch import Role
    from hpu_fp8_loader.fastdeploy.mapping import fastdeploy_name

    return frozenset(fastdeploy_name(descriptor, w) for w in descriptor.weights() if w.role is Role.ROUTER)


def attach_qk_norms(model) -> int:
    """Give each attention layer that holds its q/k norms in ``qk_norm`` its ``q_norm`` and ``k_norm`` back, as plain
    attributes; how many layers.

    Why: from 2533836d FastDeploy's HPU runner still hands its fused attention ``self.q_norm if hasattr(self,
    "q_norm") else None`` (``fused_self_atten_forward``, ``worker/hpu_model_runner.py``), which the rename makes
    always None, so Qwen3 on a Gaudi would run without its q/k norm, BF16 and FP8 alike. The HPU attention backend
    reads nothing of a norm but its ``weight`` (``fused_qkv_rope``'s arguments in ``hpu_attn_backend.py``), so the
    norm layers themselves restore what it handed the kernel before the rename. Set past paddle's ``__setattr__``,
    they are no sublayers: no parameter, name or child of the model changes, and ``convert_model`` walks the same
    tree. The conformance suite drives the attention on those commits and compares every argument with the
    emulation (docs/fastdeploy.md section 14)."""
    from hpu_fp8_loader.fastdeploy.mapping import QK_NORM_HOLDER, QK_NORMS

    attached = 0
    for _, layer in model.named_sublayers():
        holder = getattr(layer, QK_NORM_HOLDER, None)
        if holder is None or not all(hasattr(holder, norm) for norm in QK_NORMS):
            continue
        if any(hasattr(layer, norm) for norm in QK_NORMS):
            continue  # a FastDeploy whose attention has its own: nothing to restore
        for norm in QK_NORMS:
            object.__setattr__(layer, norm, getattr(holder, norm))
        attached += 1
    return attached


def fill_model(model, root: str | Path, par) -> int:
    """Set every parameter of ``model`` from the hpu-fp8 checkpoint at ``root``; returns how many were set.

    Raises :class:`HpuFp8Error` naming every parameter left unfilled and every mapped tensor the model
    does not have, and any shape or dtype that disagrees.
    """
    from hpu_fp8_loader.arch import describe
    from hpu_fp8_loader.fastdeploy.mapping import map_rank, parameter_specs
    from hpu_fp8_loader.io.checkpoint import Checkpoint
    from hpu_fp8_loader.spec.config import parse_quantization_config

    checkpoint = Checkpoint.open(root)
    qc = parse_quantization_config(checkpoint.config, f"{root}/config.json")
    descriptor = describe(checkpoint.config)
    specs = parameter_specs(descriptor, qc.kv_cache_scheme, par, qc.kept_bf16)
    parameters = dict(model.named_parameters())
    named = model_parameter_names(specs, parameters)
    routers = router_parameters(descriptor)
    as_lists = moe_layout(model) == MOE_LIST_LAYOUT
    sublayers = dict(model.named_sublayers()) if as_lists else {}
    expected = {named[name] for name in specs if not (as_lists and name.endswith(_DOWN_IN_SCALE))}
    unused = sorted(expected - set(parameters))
    if unused:
        raise HpuFp8Error(f"the checkpoint maps {len(unused)} tensor(s) the model does not have: {', '.join(unused[:10])}")
    stacked: dict[str, np.ndarray] = {}
    filled = set()
    for piece in map_rank(checkpoint, qc, descriptor, par, paddle_arithmetic()):
        if piece.expert is None:
            value = piece.array
        else:
            value = stacked.setdefault(piece.name, np.empty(specs[piece.name].shape, piece.array.dtype))
            value[piece.expert] = piece.array
            if piece.expert != specs[piece.name].shape[0] - 1:
                continue  # set once the last local expert has arrived
        if as_lists and piece.name.endswith(_DOWN_IN_SCALE):
            # FastDeploy's PR 5324 MoE method sets a list of the local experts' bf16 [1] scales on the layer
            setattr(sublayers[piece.name.removesuffix("." + _DOWN_IN_SCALE)], _DOWN_IN_SCALE, [_to_paddle(v) for v in value])
            continue
        name = named[piece.name]
        parameter = parameters[name]
        if list(parameter.shape) != list(value.shape):
            raise HpuFp8Error(f"parameter {name} has shape {list(parameter.shape)}, the checkpoint gives {list(value.shape)}")
        parameter.set_value(_for_parameter(name, parameter, value, routers))
        stacked.pop(piece.name, None)
        filled.add(name)
    unfilled = sorted(set(parameters) - filled)
    if unfilled:
        raise HpuFp8Error(f"{len(unfilled)} model parameter(s) left unfilled by the checkpoint: {', '.join(unfilled[:10])}")
    return len(filled)


SEQUENCE_PARALLEL_MOE_REFUSAL = (
    "hpu_fp8: sequence-parallel MoE is on (FastDeploy turns it on with expert parallelism at tensor-parallel size > 1): "
    "it builds each MoE layer's o_proj and, from FastDeploy 6d33d5e3 (in releases 2.5 and 2.6), its shared experts "
    "unsplit, which the hook does not map; serve with --disable-sequence-parallel-moe, as the recipe's EP line does"
)


def check_parallel_config(fd_config) -> None:
    """Refuse, in one line saying why, a parallel setting whose parameters the hook does not map (before any is built)."""
    if getattr(fd_config.parallel_config, "use_sequence_parallel_moe", False):
        raise HpuFp8Error(SEQUENCE_PARALLEL_MOE_REFUSAL)


def _parallelism(fd_config):
    from hpu_fp8_loader.fastdeploy.mapping import Parallelism

    parallel = fd_config.parallel_config
    return Parallelism(
        tp_size=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
        tp_rank=int(getattr(parallel, "tensor_parallel_rank", 0) or 0),
        ep_size=int(getattr(parallel, "expert_parallel_size", 1) or 1),
        ep_rank=int(getattr(parallel, "expert_parallel_rank", 0) or 0),
    )


_LOADER = None


def _announce(message: str, *args) -> None:
    """One INFO line on the worker's stderr (FastDeploy keeps it in log/workerlog.N): proof the hook ran."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    log.info(message, *args)


def loader_class():
    """The loader class, made on first use so that importing this module never imports FastDeploy."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    from fastdeploy.model_executor.model_loader.base_loader import BaseModelLoader
    from fastdeploy.model_executor.models.model_base import ModelRegistry

    from hpu_fp8_loader.checks.load import load

    class HpuFp8ModelLoader(BaseModelLoader):
        """Loads an hpu-fp8 checkpoint (local directory or Hub repo id) into FastDeploy's HPU FP8 model."""

        def download_model(self, model_config) -> None:
            model_config.model = str(load(model_config.model, hashes=False).path)

        def load_model(self, fd_config):
            if getattr(fd_config.load_config, "dynamic_load_weight", False):
                raise HpuFp8Error("hpu_fp8: dynamic weight loading (RL) is not supported; serve without --dynamic_load_weight")
            # format_version, manifest sizes, headers, index, scales: validate --quick, not a weight scan
            checkpoint = load(fd_config.model_config.model, hashes=False)
            check_parallel_config(fd_config)
            architecture = fd_config.model_config.architectures[0]
            model = ModelRegistry.get_class(architecture)(fd_config)
            model.eval()
            par = _parallelism(fd_config)
            count = fill_model(model, checkpoint.path, par)
            attached = attach_qk_norms(model)
            layout = moe_layout(model)
            _announce(
                ANNOUNCEMENT_PREFIX + " %d parameters of %s from %s (tp rank %d of %d, ep rank %d of %d%s)",
                count, architecture, checkpoint.path, par.tp_rank, par.tp_size, par.ep_rank, par.ep_size,
                (f"; MoE {layout}" if layout else "") + (f"; q/k norms handed to the HPU attention of {attached} layers"
                                                       if attached else ""),
            )  # fmt: skip
            return model

    _LOADER = HpuFp8ModelLoader
    return _LOADER

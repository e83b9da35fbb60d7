"""One conformance case, run inside FastDeploy's environment: FastDeploy's own loading is the oracle.

    python conformance.py CASE.json

CASE: ``oracle`` (a checkpoint FastDeploy's own ``--load-choices default`` loader reads: our
``export-legacy`` copy), ``hook`` (the hpu-fp8 checkpoint), ``tp``, ``rank``, ``moe_layout``
(``develop`` as the source has it, or ``pr5855``) and ``inject`` (a fault put into the hook's
output, for the negative control). Both models are built and loaded by ``HPUModelRunner.load_model``
with the same FastDeploy config but for the checkpoint and ``load_choices``; every parameter (and
every per-expert ``down_proj_in_scale`` list) is compared by name, shape, dtype and bits, then every
MLP and MoE layer is driven to its first HPU op, and every attention layer to its first op in prefill and in
decode with FastDeploy's own forward metadata and the KV cache its runner allocates (forward_inputs.py), and the
arguments each model hands each op are compared. From 2533836d FastDeploy's own loading hands Qwen3's attention no q/k
norm, which the hook restores: those arguments are reported apart (``restored_qk_norms``). Prints one JSON report on
the last line of stdout.
"""

from __future__ import annotations

import importlib

import fd_bootstrap  # noqa: F401  (before fastdeploy)
import numpy as np
import paddle
from faults import inject
from fd_harness import bits, fd_config, first_hpu_op, loaded_runner, report_case, state
from forward_inputs import BLOCKS, kv_cache, one_sequence


def _describe(value) -> dict:
    if isinstance(value, paddle.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("paddle.")}
    return {"type": type(value).__name__}


DERIVED_FROM_AMAX = (".act_scale", ".act_scale_inv", "_in_scale", "_scale")  # attention scalars end in _scale too
TOLERANCE: dict = {"relative": 0.0, "largest": 0.0, "values": 0}  # set per case: the legacy layout's bf16 rounding


def _within_tolerance(name: str, x, y, scale: bool) -> bool:
    """Ordinary amax: FastDeploy's value comes from the bf16-rounded legacy amax, ours from the exact one."""
    if not TOLERANCE["relative"] or x.dtype not in (paddle.bfloat16, paddle.float32):
        return False
    if not (scale or name.endswith(DERIVED_FROM_AMAX)):
        return False
    a, b = x.astype(paddle.float32).numpy(), y.astype(paddle.float32).numpy()
    relative = float(np.max(np.abs(a - b) / np.maximum(np.abs(a), np.finfo(np.float32).tiny)))
    TOLERANCE["largest"] = max(TOLERANCE["largest"], relative)
    TOLERANCE["values"] += int((a != b).sum())
    return relative <= TOLERANCE["relative"]


# Parameters FastDeploy computes as a bf16 tensor divided by a Python number (``act_scale / 240.0`` in
# HpuTensorWiseFP8LinearMethod.process_prequanted_weights, self_attn keys only). CPU paddle's kernel for it multiplies
# by bf16(1 / 240) and rounds again, one bf16 ulp from the correctly rounded value at times; the hook evaluates the
# formula in float32 and rounds once. What the HPU's kernel gives is not known here, so these values may differ by
# exactly one bf16 ulp, and each such value is reported by name as device-rounded, never counted as agreement.
DEVICE_ROUNDED_SUFFIXES = (".self_attn.qkv_proj.act_scale_inv", ".self_attn.o_proj.act_scale_inv")
DEVICE_ROUNDED: list[dict] = []  # {"name", "fastdeploy", "hook"}: each value one bf16 ulp apart


def _one_bf16_ulp_apart(x: np.ndarray, y: np.ndarray) -> bool:
    """Same sign, finite, and at most one step apart in bf16 (the bits of a positive bf16 value order as integers)."""
    a, b = x.astype(np.int32), y.astype(np.int32)
    same_sign = ((a ^ b) & 0x8000) == 0
    finite = ((a & 0x7F80) != 0x7F80) & ((b & 0x7F80) != 0x7F80)
    return bool(np.all(same_sign & finite & (np.abs(a - b) <= 1)))


def _device_rounded(name: str, a, b, x: np.ndarray, y: np.ndarray) -> bool:
    if a.dtype != paddle.bfloat16 or not name.endswith(DEVICE_ROUNDED_SUFFIXES) or not _one_bf16_ulp_apart(x, y):
        return False
    values = [
        float(v) for v in (a.astype(paddle.float32).numpy().reshape(-1)[0], b.astype(paddle.float32).numpy().reshape(-1)[0])
    ]
    DEVICE_ROUNDED.append({"name": name, "fastdeploy": values[0], "hook": values[1]})
    return True


def _difference(name: str, a, b, scale: bool = False) -> str | None:
    """None when ``a`` (FastDeploy's) and ``b`` (the hook's) are the same to the bit (or, for scales
    derived from an amax the legacy layout rounds, within TOLERANCE), else what differs."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if not isinstance(a, (list, tuple)) or not isinstance(b, (list, tuple)):
            return f"{name}: FastDeploy {type(a).__name__}, hook {type(b).__name__}"
        if len(a) != len(b):
            return f"{name}: FastDeploy {len(a)} items, hook {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _difference(f"{name}[{i}]", x, y, scale)
            if found:
                return found
        return None
    if isinstance(a, paddle.Tensor) or isinstance(b, paddle.Tensor):
        if not isinstance(a, paddle.Tensor) or not isinstance(b, paddle.Tensor):
            return f"{name}: FastDeploy {_describe(a)}, hook {_describe(b)}"
        if a.dtype != b.dtype or list(a.shape) != list(b.shape):
            return f"{name}: FastDeploy {_describe(a)}, hook {_describe(b)}"
        x, y = bits(a), bits(b)
        if not np.array_equal(x, y) and not _device_rounded(name, a, b, x, y) and not _within_tolerance(name, a, b, scale):
            where = np.argwhere(x != y)
            first = tuple(where[0])
            values = [float(t.astype(paddle.float32).numpy()[first]) for t in (a, b)] if a.dtype != paddle.float8_e4m3fn else []
            said = f": FastDeploy {values[0]!r}, hook {values[1]!r}" if values else ""
            return f"{name}: {len(where)} of {x.size} values differ, first at {where[0].tolist()}{said}"
        return None
    if hasattr(a, "named_parameters") or hasattr(b, "named_parameters"):  # a layer handed over: same kind
        return None if type(a).__name__ == type(b).__name__ else f"{name}: {type(a).__name__} vs {type(b).__name__}"
    return None if a == b else f"{name}: FastDeploy {a!r}, hook {b!r}"


def compare_states(oracle: dict, hook: dict) -> list[str]:
    problems = [f"{name}: only FastDeploy's loading fills it" for name in sorted(set(oracle) - set(hook))]
    problems += [f"{name}: only the hook fills it" for name in sorted(set(hook) - set(oracle))]
    for name in sorted(set(oracle) & set(hook)):
        a, b = oracle[name], hook[name]
        found = _difference(name, a.get("tensor", a.get("list")), b.get("tensor", b.get("list")))
        if found:
            problems.append(found)
    return problems


TOKENS = 3  # the prefill sequence's length; decode is the token after it


def kernel_arguments(runner) -> dict[str, tuple]:
    """The first HPU op each MLP and MoE layer reaches on the same bf16 input, and each attention layer's in prefill
    (``fused_qkv_rope``) and in decode (``fused_block_attention``, handed the KV cache FastDeploy allocated) with
    FastDeploy's own forward metadata for one sequence (forward_inputs.py), each with its arguments."""
    from fastdeploy.model_executor.layers.moe.moe import FusedMoE
    from fastdeploy.model_executor.models.ernie4_5_moe import Ernie4_5_MLP
    from fastdeploy.model_executor.models.qwen2 import Qwen2MLP

    model, hidden = runner.model, runner.model_config.hidden_size

    def activation(tokens: int):
        values = np.random.default_rng(tokens).standard_normal((tokens, hidden)).astype(np.float32)
        return paddle.to_tensor(values).astype(paddle.bfloat16)

    x = activation(TOKENS)
    reached = {}
    layers = dict(model.named_sublayers())
    attention = {name: layer for name, layer in layers.items() if name.endswith(".self_attn") and hasattr(layer, "qkv_proj")}
    for name, layer in layers.items():
        if isinstance(layer, (Ernie4_5_MLP, Qwen2MLP)):  # the MLPs convert_model binds to fused_mlp (Qwen3MLP is a Qwen2MLP)
            reached[name] = first_hpu_op(lambda layer=layer: layer.forward(x))
        elif isinstance(layer, FusedMoE):  # FastDeploy's own dispatch: forward_normal -> quant_method.apply
            gate = layers[name.rsplit(".", 1)[0]].gate
            reached[name] = first_hpu_op(lambda layer=layer, gate=gate: layer.forward(x, gate))
    for mode, decode, src in (("prefill", False, x), ("decode", True, activation(1))):
        meta = one_sequence(runner, TOKENS, decode)
        for name, layer in attention.items():
            reached[f"{name} ({mode})"] = first_hpu_op(lambda layer=layer, src=src, meta=meta: layer.forward(meta, src))
    return reached


def observe_layout() -> dict:
    """The MoE layout of the model as the hook filled it (``plugin.moe_layout`` right after ``fill_model``, observed,
    not changed): from PR 5855 on, ``convert_model`` then replaces the ``[E, 1]`` parameter by a padded tensor."""
    from hpu_fp8_loader.fastdeploy import plugin

    seen: dict = {}
    fill = plugin.fill_model

    def observed(model, root, par):
        count = fill(model, root, par)
        seen["layout"] = plugin.moe_layout(model)
        return count

    plugin.fill_model = observed
    return seen


def parameter_names(model) -> dict[int, str]:
    """The model's parameters, buffers (the MoE input scale FastDeploy's runner pads after loading, from PR 5855) and
    per-expert lists by ``id``: what names a kernel argument that is one of them."""
    names = {id(value): name for name, value in model.named_parameters()}
    names.update({id(value): name for name, value in model.named_buffers()})
    names.update({id(entry["list"]): name for name, entry in state(model).items() if "list" in entry})
    return names


def parameters_handed(model, calls: dict[str, tuple]) -> dict[str, list[str]]:
    """Per attention call, the model parameters among its arguments (by identity), as names below the layer."""
    known = parameter_names(model)
    out = {}
    for call, reached in calls.items():
        if call.endswith(")") and reached is not None:
            layer = call.rsplit(" (", 1)[0] + "."
            values = [*reached[1], *reached[2].values()]
            out[call] = sorted(known[id(v)].removeprefix(layer) for v in values if id(v) in known)
    return out


def moe_calls(calls: dict[str, tuple]) -> dict[str, dict]:
    """Per MoE layer, the op FastDeploy's forward reached, the expert range it passes and what each argument is."""
    out = {}
    for name, call in calls.items():
        if call is not None and call[0].startswith("fused_gate_moe"):
            op, args, kwargs = call
            described = [{"list": len(a)} if isinstance(a, list) else _describe(a) for a in args]
            out[name] = {"op": op, "experts": [kwargs.get("experts_min"), kwargs.get("experts_max")], "arguments": described}
    return out


def kv_cache_report(runner) -> dict:
    """The KV cache FastDeploy's runner allocated: how many tensors, their dtypes and shapes."""
    caches = kv_cache(runner)
    return {
        "blocks_asked": BLOCKS,
        "tensors": len(caches),
        "dtypes": sorted({str(c.dtype).removeprefix("paddle.") for c in caches}),
        "shapes": sorted({tuple(c.shape) for c in caches}),
    }


HELD_QK_NORMS = (".qk_norm.q_norm.weight", ".qk_norm.k_norm.weight")
RESTORED: list[str] = []  # "<call> -> <op> <slot> (<parameter>)": q/k norms FastDeploy's own loading hands no kernel


def _restored_norm(label: str, name: str, x, y, oracle_parameters: dict) -> bool:
    """FastDeploy from 2533836d hands its fused attention no q/k norm (``hasattr(self, "q_norm")`` fails once the norms
    live in ``qk_norm``); the hook's model hands the norm it loaded (plugin.attach_qk_norms). Such a slot is not a
    difference when the hook hands exactly the parameter FastDeploy's own loading filled under the same name; each
    one is reported by name, never counted as agreement."""
    if x is not None or not name.endswith(HELD_QK_NORMS) or name not in oracle_parameters:
        return False
    if _difference(label, oracle_parameters[name], y) is not None:
        return False
    RESTORED.append(label)
    return True


def compare_kernel_arguments(oracle: dict, hook: dict, names: dict[int, str], oracle_parameters: dict) -> list[str]:
    """What differs between the arguments each model hands each op; an argument that is one of the hook's model
    parameters (``names``, by identity) is named, and a q/k norm only the hook hands is checked against
    ``oracle_parameters`` (FastDeploy's own loading's, by name) and reported apart (:func:`_restored_norm`)."""
    problems = []
    for name in sorted(oracle):
        a, b = oracle[name], hook.get(name)
        if a is None or b is None:
            problems.append(f"{name}: reached no HPU op (FastDeploy: {a and a[0]}, hook: {b and b[0]})")
            continue
        if a[0] != b[0]:
            problems.append(f"{name}: FastDeploy calls {a[0]}, the hook's model {b[0]}")
            continue
        if len(a[1]) != len(b[1]):
            problems.append(f"{name} -> {a[0]}: FastDeploy passes {len(a[1])} arguments, the hook's model {len(b[1])}")
            continue
        slots = [(f"argument {i}", x, y) for i, (x, y) in enumerate(zip(a[1], b[1], strict=True))]
        slots += [(f"{key}=", a[2].get(key), b[2].get(key)) for key in sorted(set(a[2]) | set(b[2]))]
        for slot, x, y in slots:
            label = f" ({names[id(y)]})" if id(y) in names else ""
            where = f"{name} -> {a[0]} {slot}{label}"
            if _restored_norm(where, names.get(id(y), ""), x, y, oracle_parameters):
                continue
            found = _difference(where, x, y, scale=True)
            if found:
                problems.append(found)
    return problems


def _all_zero(entries: dict) -> list[str]:
    """Parameters FastDeploy's own loading left at their zero initialisation: the oracle must fill everything."""
    out = []
    for name, entry in entries.items():
        values = entry.get("list", [entry.get("tensor")])
        if all(not bits(v).any() for v in values):
            out.append(name)
    return out


def bf16_linear_weights(model) -> dict[str, int]:
    """Linear weights FastDeploy built unquantized (BF16), routed experts apart: which groups are kept in BF16."""
    counts = {"experts": 0, "dense": 0}
    for name, parameter in model.named_parameters():
        if name.endswith(("_proj.weight", "_proj_weight")) and parameter.dtype == paddle.bfloat16:
            counts["experts" if name.endswith("_proj_weight") else "dense"] += 1
    return counts


def run(case: dict) -> dict:
    if case.get("import_first"):  # e.g. FastDeploy's loader package before its models package ran the plugins
        importlib.import_module(case["import_first"])
    if case.get("moe_layout") == "pr5855":
        import pr5855_moe

        pr5855_moe.apply()
    tp, rank = case["tp"], case["rank"]
    TOLERANCE["relative"] = case.get("tolerance", 0.0)
    ep, dp = case.get("expert_parallel", False), case.get("dp", 1)
    oracle_runner = loaded_runner(fd_config(case["oracle"], tp, rank, case.get("oracle_loader", "default"), ep, dp))
    if case.get("inject"):
        inject(case["inject"])
    hook_config = fd_config(case["hook"], tp, rank, "hpu_fp8", ep, dp)
    from fastdeploy.model_executor.model_loader import get_model_loader

    loader = type(get_model_loader(hook_config.load_config)).__name__
    filled = observe_layout()
    try:
        hook_runner = loaded_runner(hook_config)
    except Exception as exc:  # without the plugin FastDeploy's own loader meets the hpu-fp8 checkpoint
        return {"loader": loader, "hook_error": f"{type(exc).__name__}: {exc}"}
    oracle_model, hook_model = oracle_runner.model, hook_runner.model
    oracle, hook = state(oracle_model), state(hook_model)
    oracle_calls, hook_calls = kernel_arguments(oracle_runner), kernel_arguments(hook_runner)
    oracle_cache, hook_cache = kv_cache_report(oracle_runner), kv_cache_report(hook_runner)
    from hpu_fp8_loader.fastdeploy.plugin import MOE_LIST_LAYOUT, MOE_PARAMETER_LAYOUT

    return {
        "parameters": len(oracle),
        "oracle_zero": _all_zero(oracle),
        "loader": loader,
        "moe_layout": {MOE_LIST_LAYOUT: "list", MOE_PARAMETER_LAYOUT: "parameter", None: None}[filled.get("layout")],
        "differences": compare_states(oracle, hook),
        "kernel_calls": len(oracle_calls),
        "kernel_differences": compare_kernel_arguments(
            oracle_calls, hook_calls, parameter_names(hook_model), dict(oracle_model.named_parameters())
        ),
        "restored_qk_norms": RESTORED,
        "attention_calls": {name: call[0] for name, call in hook_calls.items() if name.endswith(")") and call},
        "attention_parameters": parameters_handed(hook_model, hook_calls),
        "moe_calls": moe_calls(hook_calls),
        "kv_cache": hook_cache,
        "kv_cache_differs": oracle_cache != hook_cache,
        "bf16_weights": bf16_linear_weights(hook_model),
        "device_rounded": DEVICE_ROUNDED,
        "rounded_values": TOLERANCE["values"],
        "largest_relative_difference": TOLERANCE["largest"],
    }


if __name__ == "__main__":
    report_case(run)

"""What an hpu-fp8 v1 checkpoint of a described model holds: the one list the converter plans and the validator checks.

Kept beside the descriptors because it is a function of the descriptor and the quantization config
alone (docs/spec.md section 3, "Tensors").
"""

from __future__ import annotations

from collections.abc import Collection

from hpu_fp8_loader.arch.base import ModelDescriptor
from hpu_fp8_loader.errors import ConfigError
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.choices import Bf16Group
from hpu_fp8_loader.spec.config import KvCacheScheme, QuantizationConfig

__all__ = ["bf16_modules", "bf16_problems", "check_keep_bf16", "expected_tensors"]


def bf16_modules(descriptor: ModelDescriptor, groups: Collection[Bf16Group]) -> list[str]:
    """The linear modules of ``groups``, in model order: what ``quantization_config.ignore`` lists for them."""
    return [w.module for w in descriptor.weights() if w.is_linear and w.group in groups]


def check_keep_bf16(descriptor: ModelDescriptor, kept: frozenset[Bf16Group]) -> None:
    """Refuse groups this model cannot keep in BF16: experts it does not have, or every linear it has. The one rule
    of convert, quantize and plan alike, so that plan never sizes a checkpoint convert would not write.

    Raises:
        ConfigError: naming the groups and why.
    """
    if Bf16Group.EXPERTS in kept and descriptor.moe is None:
        raise ConfigError(f"keep_bf16 'experts': this {descriptor.model_type} model has no routed experts")
    if kept and not any(w.quantized(kept) for w in descriptor.weights()):
        raise ConfigError(
            f"keep_bf16 {', '.join(sorted(g.value for g in kept))}: no linear is left in FP8; serve the BF16 model itself"
        )


def bf16_problems(descriptor: ModelDescriptor, qc: QuantizationConfig) -> list[str]:
    """Why FastDeploy could not serve this config's BF16 linears as ``ignore`` declares them (empty: it can).

    FastDeploy keeps linears in BF16 by group only: ``dense_quant_type`` absent builds every linear outside the
    routed experts in BF16, ``moe_quant_type`` absent every routed expert (docs/fastdeploy.md section 3, "Keeping
    linears in BF16"). So ``ignore`` must list exactly the linears of the groups whose type is absent, and at
    least one linear must stay in FP8.
    """
    kept = qc.kept_bf16
    if descriptor.moe is None:
        kept = kept - {Bf16Group.EXPERTS}  # FastDeploy builds no MoE layer, so it never reads moe_quant_type
    problems = []
    ignored = set(qc.ignore)
    partial = [m for m in bf16_modules(descriptor, set(Bf16Group) - kept) if m in ignored]
    if partial:
        group = next(w.group for w in descriptor.weights() if w.module == partial[0]) or Bf16Group.DENSE
        key = "moe_quant_type" if group is Bf16Group.EXPERTS else "dense_quant_type"
        problems.append(
            f"ignore lists {len(partial)} linear(s) of the {group.value!r} group, e.g. {partial[0]}, but {key} is set: "
            f"FastDeploy builds every linear of that group in FP8 or every one in BF16 (leave {key} out and list "
            "them all, or none)"
        )
    missing = [m for m in bf16_modules(descriptor, kept) if m not in ignored]
    if missing:
        keys = " and ".join(
            k for g, k in ((Bf16Group.DENSE, "dense_quant_type"), (Bf16Group.EXPERTS, "moe_quant_type")) if g in kept
        )
        problems.append(
            f"{keys} absent, so FastDeploy builds those linears in BF16, but ignore misses {len(missing)} of them, "
            f"e.g. {missing[0]}"
        )
    if not any(w.quantized(kept) for w in descriptor.weights()):
        problems.append("no linear is left in FP8: serve the BF16 model itself")
    return problems


def expected_tensors(descriptor: ModelDescriptor, qc: QuantizationConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every tensor the checkpoint must hold, in the order shards are filled.

    A quantized linear is ``F8_E4M3`` with an F32 ``weight_scale`` (``[out]`` channel-wise for routed
    experts, ``[1]`` otherwise); an ignored linear and every other weight keep the source dtype; each
    measured point adds F32 ``[1]`` ``act_scale`` and ``act_amax``.

    Example:
        >>> contents = expected_tensors(describe(config), qc)
        >>> contents["model.layers.0.mlp.down_proj.weight_scale"]
        ('F32', (1,))
    """
    ignore = frozenset(qc.ignore)
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}
    for w in descriptor.weights():
        if w.is_linear and w.module not in ignore:
            expected[w.name] = ("F8_E4M3", w.shape)
            expected[names.tensor(w.module, names.WEIGHT_SCALE)] = ("F32", (w.shape[-1],) if w.channel_wise else (1,))
        else:
            expected[w.name] = (w.source_dtype, w.shape)
    for module in descriptor.act_modules(qc.kv_cache_scheme is KvCacheScheme.FP8, ignore):
        expected[names.tensor(module, names.ACT_SCALE)] = ("F32", (1,))
        expected[names.tensor(module, names.ACT_AMAX)] = ("F32", (1,))
    return expected

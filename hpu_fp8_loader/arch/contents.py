"""What an hpu-fp8 v1 checkpoint of a described model holds: the one list the converter plans and the validator checks.

Kept beside the descriptors because it is a function of the descriptor and the quantization config
alone (docs/spec.md section 3, "Tensors").
"""

from __future__ import annotations

from hpu_fp8_loader.arch.base import ModelDescriptor
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import KvCacheScheme, QuantizationConfig

__all__ = ["expected_tensors"]


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

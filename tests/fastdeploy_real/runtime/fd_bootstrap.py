"""Import before ``fastdeploy``: the thinnest stand-ins that let FastDeploy's own Intel HPU code run on a CPU paddle.

1. The platform check. FastDeploy picks its HPU classes when
   ``paddle.is_compiled_with_custom_device("intel_hpu")`` is true (``fastdeploy/platforms``,
   ``layers/backends/__init__.py`` at import time); it answers true here for ``intel_hpu`` only.
2. The compiled HPU ops: ``stubs/`` provides ``paddle_custom_device.intel_hpu`` (see its docstring).
3. Three CPU kernel gaps of paddle's CPU wheel, filled only where that wheel raises: ``paddle.stack`` of
   float8_e4m3fn tensors (FastDeploy's HPU MoE loading stacks its experts) goes through a uint8 view,
   bit for bit; ``paddle.min`` of a bfloat16 tensor (PR 5855's MoE backend takes the smallest of the
   experts' input multipliers) goes through float32, exact since the minimum is one of its inputs; a
   division whose divisor is a bfloat16 tensor (``240.0 / act_scale``, ``1.0 / act_scale`` in its linear
   loading) computes in float32 and rounds once to bf16, as a correctly rounded bf16 division would
   [assumed of the HPU kernel]. A bf16 tensor divided by a Python number
   (``act_scale / 240.0``) has a CPU kernel and keeps it: its last bit is then CPU paddle's, which
   the hook's float32 arithmetic need not share (conformance.py reports such values as device-rounded).

Everything else is FastDeploy's code, read from where it lies.
"""

from __future__ import annotations

import os
import sys

STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs")
if STUBS not in sys.path:
    sys.path.insert(0, STUBS)

import paddle  # noqa: E402

_compiled_with = paddle.is_compiled_with_custom_device


def _is_compiled_with_custom_device(device_type: str) -> bool:
    return device_type == "intel_hpu" or _compiled_with(device_type)


paddle.is_compiled_with_custom_device = _is_compiled_with_custom_device
paddle.device.is_compiled_with_custom_device = _is_compiled_with_custom_device

_stack = paddle.stack


def _stack_fp8_through_uint8(x, axis=0, name=None):
    tensors = list(x)
    if tensors and all(t.dtype == paddle.float8_e4m3fn for t in tensors):
        return _stack([t.view(paddle.uint8) for t in tensors], axis=axis).view(paddle.float8_e4m3fn)
    return _stack(tensors, axis=axis, name=name)


paddle.stack = _stack_fp8_through_uint8

_min = paddle.min


def _min_bf16_through_float32(x, axis=None, keepdim=False, name=None):
    if x.dtype == paddle.bfloat16:
        return _min(x.astype(paddle.float32), axis=axis, keepdim=keepdim).astype(paddle.bfloat16)
    return _min(x, axis=axis, keepdim=keepdim, name=name)


paddle.min = _min_bf16_through_float32

_divide = paddle.Tensor.__truediv__
_rdivide = paddle.Tensor.__rtruediv__


def _is_bf16(value) -> bool:
    return isinstance(value, paddle.Tensor) and value.dtype == paddle.bfloat16


def _bf16_tensor_by_bf16_tensor(a, b):
    """``a / b`` of two bf16 tensors, which CPU paddle has no kernel for: in float32, rounded once to bf16."""
    if _is_bf16(a) and _is_bf16(b):
        return _divide(a.astype(paddle.float32), b.astype(paddle.float32)).astype(paddle.bfloat16)
    return _divide(a, b)  # a bf16 tensor by a Python number, or mixed dtypes: CPU paddle's own kernel


def _number_by_bf16_tensor(a, b):
    """``b / a`` of a Python number by a bf16 tensor ``a`` (CPU paddle has no kernel): in float32, rounded once."""
    if _is_bf16(a) and not isinstance(b, paddle.Tensor):
        return _rdivide(a.astype(paddle.float32), b).astype(paddle.bfloat16)
    return _rdivide(a, b)


paddle.Tensor.__truediv__ = _bf16_tensor_by_bf16_tensor
paddle.Tensor.__rtruediv__ = _number_by_bf16_tensor

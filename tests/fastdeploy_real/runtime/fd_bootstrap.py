"""Import before ``fastdeploy``: the thinnest stand-ins that let FastDeploy's own Intel HPU code run on a CPU paddle.

1. The platform check. FastDeploy picks its HPU classes when
   ``paddle.is_compiled_with_custom_device("intel_hpu")`` is true (``fastdeploy/platforms``,
   ``layers/backends/__init__.py`` at import time); it answers true here for ``intel_hpu`` only.
2. The compiled HPU ops: ``stubs/`` provides ``paddle_custom_device.intel_hpu`` (see its docstring).
3. Two CPU kernel gaps of paddle's CPU wheel, filled with exact equivalents: ``paddle.stack`` of
   float8_e4m3fn tensors (FastDeploy's HPU MoE loading stacks its experts) goes through a uint8 view,
   bit for bit; ``paddle.divide`` of bfloat16 tensors (its linear loading divides bf16 activation
   scales) computes in float32 and rounds once to bf16, as a correctly rounded bf16 division would
   [assumed of the HPU kernel].

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

_divide = paddle.Tensor.__truediv__
_rdivide = paddle.Tensor.__rtruediv__


def _bf16_in_float32(operation):
    def divide(a, b):
        if getattr(a, "dtype", None) == paddle.bfloat16 or getattr(b, "dtype", None) == paddle.bfloat16:
            wide = [v.astype(paddle.float32) if isinstance(v, paddle.Tensor) else v for v in (a, b)]
            return operation(*wide).astype(paddle.bfloat16)
        return operation(a, b)

    return divide


paddle.Tensor.__truediv__ = _bf16_in_float32(_divide)
paddle.Tensor.__rtruediv__ = _bf16_in_float32(_rdivide)

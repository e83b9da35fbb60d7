"""PaddleCustomDevice's own ``Model_convert.py``, run unchanged on a CPU paddle, in FastDeploy's environment.

    python pcd_model_convert.py MODEL_CONVERT.py BF16_DIR FP8_DIR MEASUREMENT_FILE

The script is PaddleCustomDevice's (``backends/intel_hpu/custom_ops/python/paddlenlp_ops/Model_convert.py``; from
PaddleCustomDevice#2329, 2026-01-08, ``backends/intel_hpu/tools/Model_convert.py``), read
from where the caller put it, never copied here. Two patches, each where only an HPU would do:

1. its import-time ``paddle.device.set_device("intel_hpu:5")`` selects the CPU instead (the device it asked for is
   printed on the last line);
2. ``paddle.abs`` of a bfloat16 tensor, which paddle's CPU wheel has no kernel for, is computed through float32 and
   back: exact, since ``|x|`` of a bf16 value is a bf16 value (every other dtype keeps paddle's kernel).

Its quantization (paddle's float32 division and float8_e4m3fn cast), its bf16 storage of the scales and
of the measurement keys (raw amax for ``self_attn`` keys, amax / 240 otherwise), its shard and index writing and its
config rewrite all run as written. Prints ``{"requested_device": ...}`` as JSON on the last line of stdout.
"""

from __future__ import annotations

import json
import runpy
import sys

import paddle

requested: list[str] = []
_set_device = paddle.device.set_device


def _cpu_instead_of_an_hpu(device: str):
    """The one patch: an ``intel_hpu:N`` request is recorded and served by the CPU (no HPU here)."""
    requested.append(device)
    return _set_device("cpu" if device.startswith("intel_hpu") else device)


_abs = paddle.abs


def _abs_of_bf16_through_float32(x, name=None):
    """The other patch: CPU paddle has no bf16 ``abs``; through float32 it is exact."""
    if x.dtype == paddle.bfloat16:
        return _abs(x.astype(paddle.float32)).astype(paddle.bfloat16)
    return _abs(x, name=name)


paddle.device.set_device = _cpu_instead_of_an_hpu
paddle.abs = _abs_of_bf16_through_float32

if __name__ == "__main__":
    script, *arguments = sys.argv[1:]
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")
    print(json.dumps({"requested_device": requested}))

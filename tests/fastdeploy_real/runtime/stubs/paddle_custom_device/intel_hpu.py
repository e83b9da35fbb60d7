"""Stand-in for ``paddle_custom_device.intel_hpu``, the compiled Gaudi kernels FastDeploy imports.

They cannot exist without an HPU. Every op FastDeploy imports is defined so that its modules import;
an op that is called records its name and arguments in ``CALLS`` and raises :class:`ReachedHpuOpError`,
so the suite can drive a converted layer to its first HPU op and compare what FastDeploy would hand
the kernel. No op computes anything.
"""

from __future__ import annotations

CALLS: list[tuple[str, tuple, dict]] = []

OPS = (
    # imported at module import by fastdeploy/worker/hpu_model_runner.py and the HPU quantization methods
    "recover_block", "save_output", "step_paddle", "update_inputs_v3", "fused_mlp", "fused_mlp_ref", "fused_quant",
    # imported inside functions on the forward and measurement paths
    "init_measure_dict", "save_measure_dict", "prepare_block_metadata", "fused_index_select", "fused_gate_moe",
    "fused_gate_moe_ref", "fused_gate_moe_fp8", "fused_sampler", "get_output", "fused_qkv_rope", "fused_sdpa_proj",
    "fused_sdpa_proj_t", "fused_block_attention", "fused_rms_qkv_rope_t", "fused_rms_mlp", "fused_fp8_sdpa",
    "index_copy_", "fused_mlp_bf16",
    # imported beside the FP8 attention ops by the HPU attention backend's forward_extend and forward_decode
    "fused_qkv_rope_ref", "fused_sdpa_proj_ref", "fused_block_attention_ref",
)  # fmt: skip


class ReachedHpuOpError(Exception):
    """Raised by every stand-in op: the forward reached a compiled HPU kernel."""


def _op(name: str):
    def op(*args, **kwargs):
        CALLS.append((name, args, kwargs))
        raise ReachedHpuOpError(name)

    op.__name__ = name
    return op


for _name in OPS:
    globals()[_name] = _op(_name)


def __getattr__(name: str):
    """Any other op FastDeploy asks for exists too, and records its call like the rest."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _op(name)

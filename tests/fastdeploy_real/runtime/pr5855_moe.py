"""FastDeploy's PR 5855 MoE layout, re-created on top of an older FastDeploy source for the suite.

PR 5855 ("[Intel HPU] enable MoE EP for hpu", merged after 2026-01-12) is in no git history the suite
can read; its ``fused_moe_hpu_backend.py`` was read in PaddlePaddle/FastDeploy's published file
(docs/fastdeploy.md section 5, "Two MoE layouts"). For loading it changes exactly one thing, which
``apply`` reproduces here in our own code: ``HpuTensorWiseFP8MoEMethod.create_weights`` also creates
``down_proj_in_scale`` as an ``[num_local_experts, 1]`` parameter of the default dtype, and
``process_prequanted_weights`` sets it to the per-expert ``down_proj.activation_scale`` tensors
stacked, where the source this runs on keeps them as a Python list. The values stay FastDeploy's: the
list is built by the source's own code. ``convert_model``'s later padding of that parameter to the
kernel's alignment (``[E, 1, 64]``) is not re-created: it acts on the parameter after loading,
identically for every loader, and the suite compares parameters as loaded.
"""

from __future__ import annotations

import paddle

NAME = "down_proj_in_scale"


def native() -> bool:
    """Whether the source under test has PR 5855 itself (from fbcccaa7): its runner pads the parameter after loading."""
    from fastdeploy.worker import hpu_model_runner

    return hasattr(hpu_model_runner, "process_scales_alignment_after_loading")


def apply() -> None:
    """Re-create the layout, on a source without it; a source with PR 5855 itself (from fbcccaa7) is left as it is."""
    from fastdeploy.model_executor.layers.backends.intel_hpu.moe import fused_moe_hpu_backend as backend

    if native():
        return
    method = backend.HpuTensorWiseFP8MoEMethod
    if getattr(method, "_pr5855_layout", False):
        return
    create_weights, process_prequanted_weights = method.create_weights, method.process_prequanted_weights

    def create_weights_with_parameter(self, layer, **extra_weight_attrs):
        create_weights(self, layer, **extra_weight_attrs)
        parameter = layer.create_parameter(
            shape=[layer.num_local_experts, 1],
            dtype=layer._helper.get_default_dtype(),
            default_initializer=paddle.nn.initializer.Constant(0),
        )
        setattr(layer, NAME, parameter)

    def process_into_parameter(self, layer, state_dict, is_rearrange=False):
        parameter = layer._parameters.pop(NAME)  # the source's code sets a plain list under this name
        process_prequanted_weights(self, layer, state_dict, is_rearrange)
        scales = layer.__dict__.pop(NAME)
        layer._parameters[NAME] = parameter
        parameter.set_value(paddle.stack(scales, axis=0))

    method.create_weights = create_weights_with_parameter
    method.process_prequanted_weights = process_into_parameter
    method._pr5855_layout = True

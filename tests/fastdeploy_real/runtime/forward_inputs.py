"""FastDeploy's own forward metadata for one sequence, prefill or decode, and the KV cache its runner allocates.

In serving, ``HPUModelRunner._prepare_inputs`` hands the batch to the compiled ``prepare_block_metadata`` and
then builds the metadata with ``initialize_forward_meta`` (``HPUForwardMeta.init_forward_meta`` on
``share_inputs``). Here everything is the runner's own code but that one op, whose twenty outputs are stood in for
by ``one_sequence``: one sequence of ``tokens`` prompt tokens (prefill) or one decode token after them, in block 0,
the other half of the batch empty. The values are the case's input, the same for every model a case compares; their
exact form on a Gaudi (dtypes, the mask's layout) is our reading of the call sites, not checked, and no kernel
consumes them here (the stand-in ops stop at the first). The KV cache is the runner's own:
``update_share_input_block_num``, which the worker calls with the block count its profile run found, allocates it
through ``initialize_kv_cache`` (dtype from the quantization config, shape from the attention backend).
"""

from __future__ import annotations

import paddle

BLOCKS = 4  # KV-cache blocks to allocate: the worker's profile run decides this in serving


def kv_cache(runner) -> list:
    """The KV cache FastDeploy's runner allocates (two tensors a layer), allocating it once."""
    if "caches" not in runner.share_inputs:
        runner.update_share_input_block_num(BLOCKS)
    return runner.share_inputs["caches"]


def _block_metadata(runner, tokens: int, decode: bool) -> dict:
    """What ``prepare_block_metadata`` returns for one sequence, under the ``share_inputs`` names the runner uses."""
    rope, size = runner.share_inputs["rope_emb"], runner.cache_config.block_size

    def ints(*values, dtype="int32"):
        return paddle.to_tensor(list(values), dtype=dtype)

    active = {
        "ids_remove_padding": paddle.zeros([1 if decode else tokens], dtype="int64"),
        "rotary_embs": rope,
        "block_groups": ints(0),
        "block_list": ints(0),
        "block_indices": ints(0),
        "block_offsets": ints(tokens if decode else 0),
        "block_mapping": paddle.ones([1, 1], dtype=paddle.bfloat16),
        "block_bias": paddle.zeros([1, size], dtype=paddle.bfloat16),
        "batch_ids": ints(0),
        "total_batch": 1,
    }
    empty = {name: 0 if name == "total_batch" else None for name in active}
    now, other = ("decoder", "encoder") if decode else ("encoder", "decoder")
    out = {f"{name}_{now}": value for name, value in active.items()}
    out.update({f"{name}_{other}": value for name, value in empty.items()})
    out["ids_remove_padding"] = out[f"ids_remove_padding_{now}"]
    out["block_size"] = size
    return out


def one_sequence(runner, tokens: int, decode: bool):
    """The runner's ``forward_meta`` for one sequence: ``tokens`` prompt tokens, or (``decode``) the token after them."""
    kv_cache(runner)
    inputs = runner.share_inputs
    inputs["seq_lens_encoder"][:] = 0
    inputs["seq_lens_decoder"][:] = 0
    inputs["seq_lens_this_time"][:] = 0
    inputs["seq_lens_decoder" if decode else "seq_lens_encoder"][0:1] = tokens
    inputs["seq_lens_this_time"][0:1] = 1 if decode else tokens
    inputs.update(_block_metadata(runner, tokens, decode))
    runner.initialize_forward_meta()
    return runner.forward_meta

"""One case where FastDeploy has no FP8 loading of its own to compare with (Qwen3-MoE), run in its environment.

    python fill_case.py CASE.json

CASE: ``hook`` (the hpu-fp8 checkpoint), ``tp``, ``rank``, ``moe_layout`` (``develop`` as the source has it, or
``pr5855``, see pr5855_moe.py) and ``inject`` (a fault put into the hook's output, for the negative control).
Two oracles replace FastDeploy's own loading:

1. **FastDeploy's model, as it creates it.** ``HPUModelRunner.load_model`` builds the model through FastDeploy's
   own worker code with ``--load-choices hpu_fp8``; the hook's ``fill_model`` is observed (not changed) to record
   every parameter FastDeploy's ``create_weights`` made, with its shape, dtype and initial bits, before the hook
   writes anything. After loading every parameter must still have that name, shape and dtype and differ from its
   initial bits.
2. **The project's emulation** (``hpu_fp8_loader/engine/fp8.py``). Every layer's attention and MoE block is driven
   to its first compiled HPU op (``fused_qkv_rope``, ``fused_gate_moe_fp8``) through FastDeploy's own forward
   (``convert_model``'s attention binding, its HPU attention backend, ``FusedMoE``); every argument is then
   accounted for: a model parameter (found by identity) must equal, in shape and float32 value, the array the
   emulation reads under the same name when it runs that layer on the same rank; a number or flag must equal the
   emulation's (head_dim, heads per rank, top_k, ...); the rotary table is FastDeploy's own (``get_rope``, as its
   runner builds it) and must agree with the emulation's rotation angles to float32 rounding. Conversely every
   array the emulation reads for the module must reach that kernel or, for attention, the one FastDeploy calls
   next (``fused_sdpa_proj``, listed here from FastDeploy's source: the stand-in stops at the first op). Where
   FastDeploy builds Qwen3-MoE's router gate in bf16 (from 53aaac69), the gate must equal the emulation's float32
   router rounded to bf16, and how many values that rounding changed is reported (``routers_rounded_to_bf16``).

Prints one JSON report on the last line of stdout.
"""

from __future__ import annotations

import fd_bootstrap  # noqa: F401  (before fastdeploy)
import ml_dtypes
import numpy as np
import paddle
from faults import inject
from fd_harness import bits, fd_config, first_hpu_op, loaded_runner, report_case
from forward_inputs import one_sequence

# What FastDeploy's HPU attention backend hands the op after fused_qkv_rope (fused_sdpa_proj, forward_extend in
# layers/backends/intel_hpu/attention/hpu_attn_backend.py): parameters the emulation reads for attention too.
LATER_ATTENTION_OP = (
    "o_proj.weight", "o_proj.weight_scale", "o_proj.act_scale", "o_proj.act_scale_inv", "attn.q_out_scale",
    "attn.cache_k_out_scale", "attn.cache_v_out_scale", "attn.s_scale", "attn.s_out_scale",
)  # fmt: skip
# Positional arguments that are numbers, by op and position (the call sites in hpu_attn_backend.py and
# fused_moe_hpu_backend.py); keyword arguments are named by FastDeploy itself.
POSITIONAL_NUMBERS = {
    "fused_qkv_rope": {11: "head_dim", 12: "num_heads", 13: "total_batch_encoder"},
    "fused_gate_moe_fp8": {9: "top_k"},
}
# Arguments with no counterpart in the arithmetic: how a kernel splits its work, not what it computes.
NOT_ARITHMETIC = {"chunk_size"}
TOKENS = 3


class ReadsRecorded(dict):
    """A rank's mapped parameters that remember which names the emulation reads (``in`` tests are not reads)."""

    def __init__(self, parameters: dict) -> None:
        super().__init__(parameters)
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)

    def get(self, name, default=None):
        if name in self:
            self.read.add(name)
        return super().get(name, default)


def emulation_feeds(checkpoint: str, tp: int, rank: int, hidden: int) -> tuple[object, dict[int, dict[str, np.ndarray]]]:
    """(the emulator, per layer: every array its arithmetic reads for ``rank``, by FastDeploy name).

    The emulator runs a batch of ``TOKENS`` random tokens as eval runs it, one part of a layer at a time, on
    recording dicts. The emulation reads a replicated parameter (norms, router) from the first rank's copy for every
    rank, so a name the rank itself does not read is taken from rank 0's reads. It maps a routed expert alone
    (stacked ``[1, ...]``): the experts' reads are stacked again in expert order, as FastDeploy holds them, but for
    the one shared input scale every expert reads."""
    from hpu_fp8_loader.engine.fp8 import Fp8Emulator
    from hpu_fp8_loader.fastdeploy.mapping import EXPERT_PARAMETERS

    emulator = Fp8Emulator(checkpoint, tp)
    recorded: list[tuple[object, list[ReadsRecorded]]] = []
    mapped = emulator.parameters.part

    def recording(layer, part):
        ranks = [ReadsRecorded(p) for p in mapped(layer, part)]
        recorded.append(((layer, part), ranks))
        return ranks

    emulator.parameters.part = recording
    ids = np.random.default_rng(1).integers(0, emulator.d.vocab_size, (1, TOKENS))
    emulator.forward(ids)
    shared_input = EXPERT_PARAMETERS[4]
    feeds: dict[int, dict[str, np.ndarray]] = {}
    stacks: dict[int, dict[str, list[np.ndarray]]] = {}
    for (layer, part), ranks in recorded:
        if layer is None:
            continue
        reads = {name: dict.__getitem__(ranks[0], name) for name in ranks[0].read}
        reads.update({name: dict.__getitem__(ranks[rank], name) for name in ranks[rank].read})
        if not isinstance(part, int):
            feeds.setdefault(layer, {}).update(reads)
            continue
        for name, array in reads.items():
            if name.endswith(shared_input):
                feeds.setdefault(layer, {})[name] = array
            else:
                stacks.setdefault(layer, {}).setdefault(name, []).append(array)
    for layer, stacked in stacks.items():
        feeds[layer].update((name, np.concatenate(arrays)) for name, arrays in stacked.items())
    return emulator, feeds


def model_named(feeds: dict[int, dict[str, np.ndarray]], model) -> dict[int, dict[str, np.ndarray]]:
    """The emulation's reads under the names of the parameters FastDeploy built for them, by FastDeploy's own account:
    every ``RMSNorm`` keeps the checkpoint key it loads (``weight_key``), so a norm held elsewhere (Qwen3's q/k norms
    under ``qk_norm`` from 2533836d) is found by the key its loader reads, not by the hook's rule."""
    from fastdeploy.model_executor.layers.normalization import RMSNorm

    built = {
        layer.weight_key: f"{name}.weight"
        for name, layer in model.named_sublayers()
        if isinstance(layer, RMSNorm) and layer.weight_key and layer.weight_key != f"{name}.weight"
    }
    return {layer: {built.get(name, name): array for name, array in reads.items()} for layer, reads in feeds.items()}


def emulation_numbers(emulator, tp: int) -> dict[str, object]:
    """The numbers and flags the emulation's arithmetic uses where FastDeploy passes them to a kernel."""
    from hpu_fp8_loader.engine.fp8 import QK_NORM_EPS

    d, cfg = emulator.d, emulator.cfg
    numbers: dict[str, object] = {
        "head_dim": d.head_dim,
        "num_heads": d.num_heads // tp,
        "total_batch_encoder": 1,  # the case's own input: one sequence
        "transpose": False,  # weights stored [in, out] and multiplied as they are
        "use_neox_style": not cfg.interleaved_rotary,
        "epsilon": QK_NORM_EPS,
        "permuted_weights": False,
    }
    if d.moe is not None:
        numbers.update(
            top_k=d.moe.top_k,
            norm_topk_prob=True,  # engine.model.route renormalises the chosen weights
            activation="silu",  # SwiGLU: silu(gate) * up
            experts_min=0,  # tensor parallelism: every rank holds every expert, each one's share of the width
            experts_max=d.moe.num_experts - 1,
        )
    return numbers


def float32_values(value) -> np.ndarray:
    """A paddle tensor's (or a per-expert list's, stacked) values in float32, through its exact bits."""
    if isinstance(value, list):
        return np.stack([float32_values(v) for v in value])
    if value.dtype == paddle.float8_e4m3fn:
        return bits(value).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    if value.dtype == paddle.bfloat16:
        return bits(value).view(ml_dtypes.bfloat16).astype(np.float32)
    return value.numpy().astype(np.float32)


def created_parameters(model) -> dict[str, tuple[list[int], str, np.ndarray]]:
    return {name: (list(p.shape), str(p.dtype), bits(p).copy()) for name, p in model.named_parameters()}


def observe_creation() -> dict:
    """Record the model FastDeploy creates, as the hook receives it, before the hook fills it (the hook is unchanged)."""
    from hpu_fp8_loader.fastdeploy import plugin

    created: dict = {}
    fill = plugin.fill_model

    def observed(model, root, par):
        created.update(created_parameters(model))
        return fill(model, root, par)

    plugin.fill_model = observed
    return created


ROUTER = ".mlp.gate.weight"
ROUTERS_ROUNDED: dict[str, int] = {}  # a router FastDeploy built in bf16: how many of its float32 values that rounds
ALIGNED = "down_proj_in_scale"  # from PR 5855 convert_model pads it after loading (process_scales_alignment_after_loading)


def unpadded(name: str, value: np.ndarray) -> np.ndarray | None:
    """``value`` of ``name`` as loaded, where FastDeploy's runner padded it to ``[E, 1, slot]`` (the loaded value in
    slot 0, zeros after); None where it is padded otherwise."""
    if not name.endswith(ALIGNED) or value.ndim != 3:
        return value
    return value[..., 0] if not value[..., 1:].any() else None


def fill_problems(created: dict, model) -> list[str]:
    """Parameters that FastDeploy created and the loaded model lacks, holds with another shape or dtype, or left as
    created. A parameter FastDeploy's runner padded after loading (PR 5855 and later) is found among the buffers,
    padded, and checked unpadded."""
    loaded = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    problems = [f"{name}: not created by FastDeploy" for name in sorted(set(loaded) - set(created))]
    for name in sorted(created):
        shape, dtype, initial = created[name]
        tensor = loaded.get(name, buffers.get(name) if name.endswith(ALIGNED) else None)
        if tensor is None:
            problems.append(f"{name}: FastDeploy created it, the loaded model lacks it")
            continue
        value = unpadded(name, bits(tensor))
        if value is None or [list(value.shape), str(tensor.dtype)] != [shape, dtype]:
            problems.append(f"{name}: created {shape} {dtype}, loaded {list(tensor.shape)} {tensor.dtype}")
        elif np.array_equal(value, initial):
            problems.append(f"{name}: left at its initial value")
    return problems


def per_expert_lists(model) -> dict[str, object]:
    """``down_proj_in_scale`` set as a per-expert list (FastDeploy's develop MoE layout), by name."""
    return {
        f"{name}.down_proj_in_scale": layer.__dict__["down_proj_in_scale"]
        for name, layer in model.named_sublayers()
        if isinstance(layer.__dict__.get("down_proj_in_scale"), list)
    }


def rope_difference(emulator, table) -> float:
    """Largest difference between FastDeploy's rotary table ``[2, 1, positions, 1, head_dim]`` (cos, sin of each
    angle, the half-width repeated: NeoX style) and the emulation's rotation of the same positions."""
    from hpu_fp8_loader.engine.model import rotary

    positions, head_dim = table.shape[2], table.shape[-1]
    unit = np.zeros((1, positions, 1, head_dim), np.float32)
    unit[..., : head_dim // 2] = 1  # rotating (1, 0) pairs gives (cos, sin)
    turned = rotary(unit, np.arange(positions), emulator.cfg.rope_theta, emulator.cfg.interleaved_rotary)[0, :, 0]
    cos, sin = turned[:, : head_dim // 2], turned[:, head_dim // 2 :]
    ours = np.stack([np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)])
    return float(np.abs(table.numpy()[:, 0, :, 0] - ours).max())


def _parameter_problem(where: str, parameter: str, value, feeds: dict, prefix: str) -> str | None:
    """A kernel argument that is model parameter ``parameter`` against what the emulation reads under that name."""
    if not parameter.startswith(prefix):
        return f"{where}: {parameter} belongs to another module"
    if parameter not in feeds:
        return f"{where}: {parameter} is never read by the emulation"
    ours, theirs = feeds[parameter], unpadded(parameter, float32_values(value))
    if parameter.endswith(ROUTER) and value.dtype == paddle.bfloat16 and ours.dtype == np.float32:
        # FastDeploy builds Qwen3-MoE's gate in bf16 from 53aaac69 (PR 6457) and casts the float32 router into it
        rounded = ours.astype(ml_dtypes.bfloat16).astype(np.float32)
        ROUTERS_ROUNDED[parameter] = int((rounded != ours).sum())
        ours = rounded
    if theirs is None:
        return f"{where}: {parameter} is padded with values other than zeros"
    if list(ours.shape) != list(theirs.shape):
        return f"{where}: {parameter} is {list(theirs.shape)}, the emulation's {list(ours.shape)}"
    if not np.array_equal(ours, theirs):
        return f"{where}: {parameter}: {int((ours != theirs).sum())} of {ours.size} values differ from the emulation's"
    return None


def account(
    op: tuple, layer: int, feeds: dict, numbers: dict, known: dict[int, str], inputs: set[int], prefix: str
) -> tuple[list[str], set[str], dict[str, object]]:
    """(what in ``op``'s arguments differs from what the emulation feeds its arithmetic, the parameter names passed,
    the numbers compared).

    ``known``: the model's parameters (and per-expert lists) by ``id``; ``inputs``: the ids of the tensors the case
    itself hands FastDeploy (the activation, FastDeploy's rotary table), the same on both sides by construction."""
    name, args, kwargs = op
    problems, passed, compared = [], set(), {}
    slots = [(i, POSITIONAL_NUMBERS.get(name, {}).get(i), v) for i, v in enumerate(args)]
    slots += [(key, key, v) for key, v in kwargs.items()]
    for slot, label, value in slots:
        where = f"layer {layer} {name} argument {slot}"
        found = None
        if value is None or label in NOT_ARITHMETIC:
            continue  # an absent input: the converse check finds one the emulation reads
        if id(value) in known:
            passed.add(known[id(value)])
            found = _parameter_problem(where, known[id(value)], value, feeds, prefix)
        elif isinstance(value, paddle.Tensor):
            found = None if id(value) in inputs else f"{where}: a tensor that is neither a parameter nor an input"
        elif label is None or label not in numbers:
            found = f"{where}: {value!r} has no counterpart in the emulation"
        else:
            compared[label] = value
            if value != numbers[label]:
                found = f"{where} ({label}): FastDeploy passes {value!r}, the emulation uses {numbers[label]!r}"
        problems += [found] if found else []
    return problems, passed, compared


def converse(layer: int, feeds: dict, passed: set[str], prefix: str, later: tuple[str, ...]) -> list[str]:
    """Arrays the emulation reads for the module that reach neither its first op nor (attention) the next one."""
    missing = [n for n in sorted(feeds) if n.startswith(prefix) and n not in passed and not n.endswith(later)]
    return [f"layer {layer}: the emulation reads {n}, which FastDeploy hands no kernel" for n in missing]


def kernel_problems(runner, emulator, feeds: dict, numbers: dict) -> tuple[list[str], dict[str, dict]]:
    """(every argument problem in every layer's first attention and MoE op; per module, the op reached, the
    parameters it was handed, as names below the module, and the numbers compared)."""
    model = runner.model
    known: dict = {id(p): name for name, p in model.named_parameters()}
    known.update({id(b): name for name, b in model.named_buffers() if name.endswith(ALIGNED)})
    known.update({id(v): name for name, v in per_expert_lists(model).items()})
    meta = one_sequence(runner, TOKENS, decode=False)
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((TOKENS, emulator.d.hidden_size)).astype(np.float32))
    x = x.astype(paddle.bfloat16)
    inputs = {id(x), id(meta.rotary_embs_encoder)}
    problems, reached = [], {}
    prefix_of = {}
    for name, layer in model.named_sublayers():
        if name.endswith(".self_attn") and hasattr(layer, "qkv_proj"):
            prefix_of[name] = (lambda layer=layer: layer.forward(meta, x), LATER_ATTENTION_OP)
        elif name.endswith(".mlp") and hasattr(layer, "experts"):
            prefix_of[name] = (lambda layer=layer: layer.forward(x, None), ())
    for name, (call, later) in prefix_of.items():
        index = int(name.split(".layers.")[1].split(".")[0])
        op = first_hpu_op(call)
        if op is None:
            problems.append(f"{name}: reached no HPU op")
            continue
        found, passed, compared = account(op, index, feeds[index], numbers, known, inputs, name + ".")
        problems += found + converse(index, feeds[index], passed, name + ".", later)
        below = sorted(parameter.removeprefix(name + ".") for parameter in passed)
        reached[name] = {"op": op[0], "parameters": below, "numbers": compared}
    return problems, reached


def run(case: dict) -> dict:
    tp, rank = case["tp"], case["rank"]
    if case.get("moe_layout") == "pr5855":
        import pr5855_moe

        pr5855_moe.apply()
    config = fd_config(case["hook"], tp, rank, "hpu_fp8")
    emulator, feeds = emulation_feeds(case["hook"], tp, rank, config.model_config.hidden_size)
    if case.get("inject"):
        inject(case["inject"])
    created = observe_creation()
    runner = loaded_runner(config)
    feeds = model_named(feeds, runner.model)
    problems, reached = kernel_problems(runner, emulator, feeds, emulation_numbers(emulator, tp))
    lists = per_expert_lists(runner.model)
    return {
        "architecture": config.model_config.architectures[0],
        "parameters": len(created),
        "fill_problems": fill_problems(created, runner.model),
        "per_expert_lists": {name: [len(v), *map(str, {t.dtype for t in v})] for name, v in lists.items()},
        "kernel_problems": problems,
        "kernel_calls": reached,
        "rope_difference": rope_difference(emulator, runner.share_inputs["rope_emb"]),
        "routers_rounded_to_bf16": ROUTERS_ROUNDED,
    }


if __name__ == "__main__":
    report_case(run)

"""The float32 forward of Ernie4.5 (MoE and dense), Qwen2 and Qwen3 (dense and MoE), layer by layer.

Conventions (and where they come from):
- RMSNorm with config ``rms_norm_eps``; SwiGLU ``silu(gate) * up`` with gate first.
- Rotary: ERNIE interleaved (pairs 2i, 2i+1; FastDeploy's ``use_neox_rotary_style=False`` and
  transformers' Ernie4.5), Qwen2 and Qwen3 rotate-half (NeoX) (docs/spec.md section 4.4); ``rope_theta`` from config.
- Qwen3: q and k RMSNorm over each head (weights ``[head_dim]``, ``rms_norm_eps``) before RoPE, as
  FastDeploy's ``Qwen3Attention`` (models/qwen3.py) and transformers' Qwen3 compute it.
- GQA: each KV head serves ``num_heads / num_kv_heads`` query heads; causal softmax attention.
- MoE (FastDeploy's HPU op ``fused_gate_moe_fp8``, PaddleCustomDevice
  ``backends/intel_hpu/custom_ops/llama_infer/fused_gate_moe.cc``): float32 router logits, softmax
  over all experts, top-k chosen on probabilities plus the correction bias, the chosen *unbiased*
  probabilities renormalised (sum clamped below at 1e-12); shared experts always added; MoE layers
  by FastDeploy's rule. Qwen3-MoE routes the same way without a bias or shared experts (its
  ``norm_topk_prob`` is true: the config keys refuse anything else).

An observer, when given, sees the tensors FastDeploy's measurement mode measures (docs/fastdeploy.md
section 10, "Measurement mode"), keyed by spec module names: that is all calibration needs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from hpu_fp8_loader.arch import ModelDescriptor
from hpu_fp8_loader.console import human_bytes
from hpu_fp8_loader.engine.layer_major import Stage, StageLoader, Workspace, emit, run_batch
from hpu_fp8_loader.engine.weights import ATTENTION, HEAD, MLP, ROUTER, EngineWeights, Part
from hpu_fp8_loader.errors import ConfigError, HpuFp8Error
from hpu_fp8_loader.spec import names

__all__ = [
    "HEAD_BLOCK_BYTES",
    "HEAD_WHOLE_BYTES",
    "EngineConfig",
    "Observer",
    "ReferenceModel",
    "forward",
    "head_product",
    "rms_norm",
    "rotary",
    "route",
    "silu",
]


@dataclass(frozen=True)
class EngineConfig:
    rms_norm_eps: float
    rope_theta: float
    interleaved_rotary: bool
    router_norm_min: float = 1e-12

    @classmethod
    def from_config(cls, config: dict, descriptor: ModelDescriptor, source: str = "config.json") -> EngineConfig:
        """The engine's settings from config.json; a setting that changes the arithmetic in a way this engine
        does not compute is refused naming the key (statistics or a comparison from another model's
        arithmetic would be wrong without any sign of it). Convert reads no activations and needs none of this."""
        for key, value, supported in _arithmetic_settings(config):
            if not supported:
                raise ConfigError(
                    f"{source}: '{key}' is {json.dumps(value)}; the reference engine computes only the plain "
                    "SiLU, unscaled-RoPE, full-attention models FastDeploy's HPU path serves (calibrate with "
                    "FastDeploy's own measurement mode instead)"
                )
        ernie = descriptor.prefix == "ernie"
        rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
        return cls(
            rms_norm_eps=float(config.get("rms_norm_eps") or (1e-5 if ernie else 1e-6)),
            rope_theta=float(rope or (500000.0 if ernie else 1000000.0)),
            interleaved_rotary=ernie,
            router_norm_min=float(config.get("moe_norm_min") or 1e-12),
        )


def _default_rope(value: object) -> bool:
    return value in (None, {}) or (isinstance(value, dict) and value.get("rope_type", value.get("type")) in ("default", None))


def _arithmetic_settings(config: dict) -> list[tuple[str, object, bool]]:
    """(key, value, whether the engine computes it) for each config.json key that changes the arithmetic."""
    return [
        (key, config[key], ok(config[key]))
        for key, ok in (
            ("hidden_act", lambda v: v == "silu"),
            ("rope_scaling", _default_rope),
            ("rope_parameters", _default_rope),
            ("use_sliding_window", lambda v: v is False),
        )
        if key in config and config[key] is not None
    ]


class Observer:
    """Receives activations; the default ignores them (a plain forward)."""

    def record(self, module: str, values: np.ndarray) -> None:
        """Whole-tensor activation at a spec module's input (or attention point)."""

    def record_expert(self, layer: int, expert: int, intermediate: np.ndarray, routed_tokens: int) -> None:
        """An expert's SwiGLU output over the tokens routed to it (all tokens with --all-experts)."""

    def enter_weights(self, layer: int, weights: dict[str, np.ndarray]) -> None:
        """A part of layer ``layer`` (its attention, its MLP, its router, one expert) is about to run on these
        float32 weights (spec names, ``[in, out]``): what a report needs to relate each linear's input to its
        weight without reading it a second time. A routed expert's up_gate input (the layer's shared input) is
        recorded before that expert's weights are entered."""

    wants_all_experts = False


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(variance + np.float32(eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1) + np.exp(-x))


def rotary(x: np.ndarray, positions: np.ndarray, theta: float, interleaved: bool) -> np.ndarray:
    """x: [B, T, heads, hd]."""
    hd = x.shape[-1]
    inv_freq = (1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)).astype(np.float32)
    angles = positions[:, None].astype(np.float32) * inv_freq[None, :]  # [T, hd/2]
    cos, sin = np.cos(angles)[None, :, None, :], np.sin(angles)[None, :, None, :]
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = odd * cos + even * sin
        return out
    first, second = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def _attention(
    d: ModelDescriptor, cfg: EngineConfig, w: dict, m: names.LayerNames, x: np.ndarray, observer: Observer
) -> np.ndarray:
    b, t, _ = x.shape
    observer.record(m.qkv, x)
    qkv = x @ w[names.tensor(m.qkv, names.WEIGHT)]
    if d.qkv_bias:
        qkv = qkv + w[names.tensor(m.qkv, names.BIAS)]
    hd = d.head_dim
    q = qkv[..., : d.q_width].reshape(b, t, d.num_heads, hd)
    k = qkv[..., d.q_width : d.q_width + d.kv_width].reshape(b, t, d.num_kv_heads, hd)
    v = qkv[..., d.q_width + d.kv_width :].reshape(b, t, d.num_kv_heads, hd)
    if d.qk_norm:
        q = rms_norm(q, w[names.tensor(m.q_norm, names.WEIGHT)], cfg.rms_norm_eps)
        k = rms_norm(k, w[names.tensor(m.k_norm, names.WEIGHT)], cfg.rms_norm_eps)
    positions = np.arange(t)
    q = rotary(q, positions, cfg.rope_theta, cfg.interleaved_rotary)
    k = rotary(k, positions, cfg.rope_theta, cfg.interleaved_rotary)
    observer.record(m.attention_point("q"), q)
    observer.record(m.attention_point("cache_k"), k)
    observer.record(m.attention_point("cache_v"), v)
    group = d.num_heads // d.num_kv_heads
    q = np.ascontiguousarray(q.transpose(0, 2, 1, 3))  # [B, heads, T, hd]: batched matmuls go to BLAS
    k = np.repeat(k, group, axis=2).transpose(0, 2, 3, 1)  # [B, heads, hd, T]
    v = np.repeat(v, group, axis=2).transpose(0, 2, 1, 3)  # [B, heads, T, hd]
    scores = (q @ k) * np.float32(hd**-0.5)
    scores = np.where(np.triu(np.ones((t, t), bool), 1), np.float32(-np.inf), scores)
    scores -= scores.max(axis=-1, keepdims=True)
    probabilities = np.exp(scores)
    probabilities /= probabilities.sum(axis=-1, keepdims=True)
    # FastDeploy's decode path quantizes unnormalised exp scores peaking at exactly 1 (docs/fastdeploy.md section 10).
    observer.record(m.attention_point("s"), np.ones(1, np.float32))
    out = (probabilities @ v).transpose(0, 2, 1, 3).reshape(b, t, d.q_width)
    observer.record(m.o_proj, out)
    return out @ w[names.tensor(m.o_proj, names.WEIGHT)]


def _mlp(module: str, w: dict, x: np.ndarray, observer: Observer) -> np.ndarray:
    observer.record(names.tensor(module, names.UP_GATE), x)
    gate_up = x @ w[names.tensor(names.tensor(module, names.UP_GATE), names.WEIGHT)]
    half = gate_up.shape[-1] // 2
    hidden = silu(gate_up[..., :half]) * gate_up[..., half:]
    observer.record(names.tensor(module, names.DOWN), hidden)
    return hidden @ w[names.tensor(names.tensor(module, names.DOWN), names.WEIGHT)]


def route(x: np.ndarray, gate: np.ndarray, bias: np.ndarray | None, top_k: int, norm_min: float):
    """(chosen experts [N, k], their weights [N, k]): FastDeploy's routing (``fused_gate_moe_fp8``) in float32."""
    logits = x.astype(np.float32) @ gate
    logits = logits - logits.max(axis=-1, keepdims=True)
    probabilities = np.exp(logits)
    probabilities /= probabilities.sum(axis=-1, keepdims=True)
    choice = probabilities + (bias.reshape(1, -1) if bias is not None else np.float32(0))
    chosen = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probabilities, chosen, axis=-1)
    return chosen, weights / np.maximum(weights.sum(axis=-1, keepdims=True), np.float32(norm_min))


# A head (lm_head, or the tied embedding) at most this large in float32 is multiplied in one product; a larger one
# a block of vocabulary columns of HEAD_BLOCK_BYTES in float32 at a time.
HEAD_WHOLE_BYTES = 1 << 30
HEAD_BLOCK_BYTES = 256 << 20


def head_product(x: np.ndarray, weight: np.ndarray, transposed: bool = False) -> np.ndarray:
    """``x @ weight`` (``transposed``: ``x @ weight.T``, a ``[vocab, hidden]`` table) in float32, whatever the
    weight's stored dtype.

    A weight of at most :data:`HEAD_WHOLE_BYTES` in float32 is converted whole: one product, as with a float32
    weight. A larger one (ERNIE-4.5-300B-A47B's 3.4 GB) is converted and multiplied a block of vocabulary columns
    (:data:`HEAD_BLOCK_BYTES`) at a time, so memory holds its stored bf16 and one block; BLAS may then round a
    logit differently in the last bit than one product would.
    """
    vocab, hidden = weight.shape if transposed else weight.shape[::-1]
    if 4 * vocab * hidden <= HEAD_WHOLE_BYTES:
        whole = weight.astype(np.float32, copy=False)
        return x @ (whole.T if transposed else whole)
    out = np.empty((*x.shape[:-1], vocab), np.float32)
    step = HEAD_BLOCK_BYTES // (4 * hidden)
    for start in range(0, vocab, step):
        block = (weight[start : start + step] if transposed else weight[:, start : start + step]).astype(np.float32)
        out[..., start : start + step] = x @ (block.T if transposed else block)
    return out


def _routed_expert(
    w: dict, module: str, layer: int, expert: int, flat: np.ndarray, out: np.ndarray, chosen, gates, observer: Observer
) -> None:
    """Expert ``expert``'s share of an MoE layer's output on one chunk (``flat``: its tokens), added into ``out``
    for the tokens routed to it: the arithmetic of a forward over the whole layer, for this expert."""
    up_gate = w[names.tensor(names.tensor(module, names.UP_GATE), names.WEIGHT)]
    down = w[names.tensor(names.tensor(module, names.DOWN), names.WEIGHT)]
    rows, slot = np.nonzero(chosen == expert)
    if not (observer.wants_all_experts or rows.size):
        observer.record_expert(layer, expert, np.zeros((0, down.shape[0]), np.float32), 0)
        return
    gate_up = (flat if observer.wants_all_experts else flat[rows]) @ up_gate
    half = gate_up.shape[-1] // 2
    hidden = silu(gate_up[..., :half]) * gate_up[..., half:]
    observer.record_expert(layer, expert, hidden, int(rows.size))
    if observer.wants_all_experts:
        hidden = hidden[rows]
    if rows.size:
        out[rows] += gates[rows, slot][:, None] * (hidden @ down)


class _Emitted(Observer):
    """An observer's events as the stages make them, each delivered through :func:`emit`: in chunk order, also when
    a stage's chunks run on several threads. Weights are entered by the caller's thread, between stages, directly."""

    def __init__(self, observer: Observer):
        self._observer = observer
        self.wants_all_experts = observer.wants_all_experts

    def record(self, module: str, values: np.ndarray) -> None:
        emit(partial(self._observer.record, module, values))

    def record_expert(self, layer: int, expert: int, intermediate: np.ndarray, routed_tokens: int) -> None:
        emit(partial(self._observer.record_expert, layer, expert, intermediate, routed_tokens))


class ReferenceModel:
    """The float32 engine in stages (a :class:`~hpu_fp8_loader.engine.layer_major.LayerModel`): what both the
    batch-major :func:`forward` and a layer-major run (:func:`~hpu_fp8_loader.engine.layer_major.run_layer_major`)
    run, so the two compute the same arithmetic.

    A decoder layer runs as the parts of its weights are read (:mod:`~hpu_fp8_loader.engine.weights`):
    attention (then both norms' outputs kept), the dense MLP; or the router (routing kept), each routed expert in
    turn over every chunk, then the shared experts and the sum. Each token's expert outputs are added in expert
    order, as one forward over the whole layer adds them: the results are the same to the bit, and memory holds
    one expert, not the layer. ``observer.enter_weights`` is called each time a part is read."""

    @property
    def stores(self) -> int:
        """The hidden states, the normed input of the MLP or experts, the routed experts' sum."""
        return 3

    def __init__(self, weights: EngineWeights, config: EngineConfig | None = None, observer: Observer | None = None):
        self.weights = weights
        self.config = config or EngineConfig.from_config(
            weights.checkpoint.config, weights.descriptor, str(weights.checkpoint.root / "config.json")
        )
        self.observer = observer or Observer()
        self._events = _Emitted(self.observer)

    @property
    def descriptor(self) -> ModelDescriptor:
        return self.weights.descriptor

    def largest_part_parameters(self) -> int:
        return self.weights.largest_part_parameters()

    def _part(self, layer: int, part: Part) -> dict[str, np.ndarray]:
        try:
            w = self.weights.part(layer, part)
        except MemoryError:
            size = self.weights.part_parameters(layer, part) * 4
            what = f"expert {part}" if isinstance(part, int) else f"the {part} part"
            raise HpuFp8Error(
                f"layer {layer}: {what} needs {human_bytes(size)} of float32 weights and that much memory is not "
                "available; the engine holds one part of a layer at a time, so this model cannot run on this machine"
            ) from None
        self.observer.enter_weights(layer, w)
        return w

    def embedding(self, space: Workspace) -> list[StageLoader]:
        """The lookup, one block of the table's rows at a time for all windows."""
        vocab = self.descriptor.vocab_size
        if space.windows.size and not (space.windows.min() >= 0 and space.windows.max() < vocab):
            raise HpuFp8Error(
                f"token ids must lie in 0..{vocab - 1} (the vocabulary); got {space.windows.min()}..{space.windows.max()}"
            )

        def block(start: int, stop: int) -> StageLoader:
            def load() -> Stage:
                rows = self.weights.embedding_rows(start, stop)

                def stage(part: slice) -> None:
                    ids = space.windows[part]
                    mine = (ids >= start) & (ids < stop)
                    hidden = space.hidden[part]  # a view: the rows are written into the store
                    hidden[mine] = rows[ids[mine] - start]

                return stage

            return load

        return [block(start, stop) for start, stop in self.weights.embedding_blocks()]

    def head(self) -> Callable[[np.ndarray], np.ndarray]:
        top = self.weights.part(None, HEAD)
        return lambda x: self.logits(top, x)

    def logits(self, top: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        """The final norm and lm_head (the embedding when tied) on the last layer's output."""
        d = self.descriptor
        norm = top[names.tensor(names.final_norm(d.prefix), names.WEIGHT)].astype(np.float32)
        x = rms_norm(x, norm, self.config.rms_norm_eps)
        if "lm_head.weight" in top:
            return head_product(x, top["lm_head.weight"])
        return head_product(x, top[names.tensor(names.embedding(d.prefix), names.WEIGHT)], transposed=True)

    def layer(self, index: int, space: Workspace) -> list[StageLoader]:
        d, cfg, observer = self.descriptor, self.config, self._events
        m = names.layer_names(d.prefix, index)
        hidden, normed = space.hidden, space.store("normed")

        def attention() -> Stage:
            w = self._part(index, ATTENTION)

            def stage(part: slice) -> None:
                x = np.array(hidden[part])
                x = x + _attention(
                    d, cfg, w, m, rms_norm(x, w[names.tensor(m.input_norm, names.WEIGHT)], cfg.rms_norm_eps), observer
                )
                hidden[part] = x
                normed[part] = rms_norm(x, w[names.tensor(m.post_attention_norm, names.WEIGHT)], cfg.rms_norm_eps)

            return stage

        if not d.is_moe_layer(index):

            def mlp() -> Stage:
                w = self._part(index, MLP)

                def stage(part: slice) -> None:
                    hidden[part] = np.array(hidden[part]) + _mlp(m.mlp, w, np.array(normed[part]), observer)

                return stage

            return [attention, mlp]
        moe = d.moe
        assert moe is not None  # is_moe_layer holds only when the model has an MoE config
        routed = space.store("routed")
        router: dict[str, np.ndarray] = {}  # the router part: read by route, used again by the shared experts
        routing: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # each chunk's (chosen experts, their weights)

        def flat(store: np.ndarray, part: slice) -> np.ndarray:
            return np.asarray(store[part]).reshape(-1, d.hidden_size)  # a view of the chunk

        def route_stage() -> Stage:
            router.update(self._part(index, ROUTER))

            def stage(part: slice) -> None:
                x = flat(normed, part)
                observer.record(names.shared_expert_input(d.prefix, index), x)
                gate = router[names.tensor(m.router, names.WEIGHT)]
                routing[part.start] = route(x, gate, router.get(m.score_bias), moe.top_k, cfg.router_norm_min)
                routed[part] = 0

            return stage

        def expert(e: int) -> StageLoader:
            def load() -> Stage:
                w = self._part(index, e)

                def stage(part: slice) -> None:
                    chosen, gates = routing[part.start]
                    _routed_expert(w, m.expert(e), index, e, flat(normed, part), flat(routed, part), chosen, gates, observer)

                return stage

            return load

        def finish() -> Stage:
            self.observer.enter_weights(index, router)  # in use again: the shared experts

            def stage(part: slice) -> None:
                out = np.array(flat(routed, part))
                if moe.num_shared_experts:
                    out += _mlp(m.shared_experts, router, np.array(flat(normed, part)), observer)
                x = np.array(hidden[part])
                hidden[part] = x + out.reshape(x.shape)
                del routing[part.start]

            return stage

        return [attention, route_stage, *(expert(e) for e in range(moe.num_experts)), finish]


def forward(
    weights: EngineWeights, ids: np.ndarray, observer: Observer | None = None, config: EngineConfig | None = None
) -> np.ndarray:
    """Logits ``[B, T, vocab]`` for token ids ``[B, T]``, reading one part of a layer at a time.

    Batch-major: one batch through every layer, as one chunk of a layer-major run. Many batches read every layer
    again for each (unless the weights are cached); :func:`~hpu_fp8_loader.engine.layer_major.run_layer_major`
    runs them as chunks of one run instead, each layer read once, with the same arithmetic.
    """
    return run_batch(ReferenceModel(weights, config, observer), ids, str(weights.checkpoint.root))

"""FastDeploy's HPU FP8 forward, emulated on CPU from the parameters the FastDeploy mapping produces.

One mapping, two users: this runs on exactly the arrays the plugin hands FastDeploy
(:func:`hpu_fp8_loader.fastdeploy.mapping.map_rank`), rank by rank and one part of a layer at a time (never the whole
model in float32), so a wrong mapping shows up as wrong logits here. Parameters and their meanings are those of docs/fastdeploy.md sections 4-6; the
arithmetic follows Habana's and PaddleCustomDevice's (PCD) public code, cited per rule:

- cast of a bf16 tensor with multiplier m: ``sat_fp8(bf16(x * bf16(m)))``, clamp then round to
  nearest even at ±240 (the cast tests of Habana's ``gaudi-pytorch-bridge``,
  ``test_hpu_fp8_ops_any_mode.py``: product in the input dtype, round-half-even, saturation at ±240 on Gaudi2);
- fp8 GEMM: float32 accumulation, times the operands' descales, output rounded to bf16 (``fp8_gemm_v2``);
  a bf16 input cast with multiplier ``s`` contributes the descale ``1/s`` (PCD ``kernels/hpu_funcs.h``,
  ``AddNodeFusedFP8Gemm``), except o_proj inside the fused SDPA op, which takes ``act_scale_inv``
  (docs/fastdeploy.md section 5, "Linear layers");
- Qwen2's q|k|v bias is added in bf16 after the GEMM (PCD ``custom_ops/llama_infer/fused_qkv_rope.cc``);
- Qwen3's q/k RMSNorm: FastDeploy hands ``q_norm.weight`` / ``k_norm.weight`` and ``epsilon=1e-6`` (a constant, not
  the config's ``rms_norm_eps``) to both FP8 attention ops (``hpu_attn_backend.py@8c3513a4``, ``fused_qkv_rope`` and
  ``fused_block_attention`` calls); with both weights given, PCD's op normalises each head of the bf16 q and k
  split off the q|k|v output with an RmsNorm node (bf16 out), then applies RoPE, then the fp8 cast
  (``custom_ops/llama_infer/fused_block_attention.cc@623f5bd4``, ``use_qk_rmsnorm``); the prefill op is taken to
  do the same, as FastDeploy passes it the same arguments [inferred];
- attention ``cache_fp8_sdpa_fp8``: Q, K and V cast with their multipliers, Q.K^T and P.V in fp8 with
  the q/k and s/v descales; prefill quantizes the normalised probabilities, decode the unnormalised
  exp(score - row max) and normalises after P.V (PCD ``custom_ops/llama_infer/fused_block_attention.cc``;
  docs/fastdeploy.md sections 6 and 10);
- MoE: one input multiplier for all experts, per-expert channel-wise weight descales, the SwiGLU output
  cast with 1/down_proj_in_scale[e], router weights applied and accumulated in bf16 (the eager
  decomposition of Habana's ``mixture_of_experts`` op; docs/fastdeploy.md section 5, "MoE").

[inferred], as the sources mark it: the accumulator precision (float32), bf16 rounding after each
node, the softmax precision (float32 here), the bias placement in the newest PCD op, and the RmsNorm node's
internal precision (float32 here; only its bf16 output is shown by the code).

Tensor parallelism: every rank's share runs and the row-parallel outputs (o_proj, down projections)
are rounded to bf16 per rank and summed, as an all-reduce of bf16 partial sums would; the vocabulary
split of the embedding and lm_head is reassembled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hpu_fp8_loader.arch import ModelDescriptor, Role, describe
from hpu_fp8_loader.engine.layer_major import Stage, StageLoader, Workspace, run_batch
from hpu_fp8_loader.engine.model import EngineConfig, head_product, rms_norm, rotary, route, silu
from hpu_fp8_loader.engine.weights import ATTENTION, HEAD, MLP, ROUTER, Part, largest_part, weight_parts
from hpu_fp8_loader.fastdeploy.mapping import (
    ACT_SCALE_INV_PARAMETER,
    ACT_SCALE_PARAMETER,
    EXPERT_PARAMETERS,
    FASTDEPLOY_FP8_MAX,
    LM_HEAD_PARAMETER,
    ROUTER_BIAS_PARAMETER,
    WEIGHT_SCALE_PARAMETER,
    Parallelism,
    attention_parameter,
    embedding_parameter,
    expert_parameter,
    map_rank,
)
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.numerics import e4m3
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import KvCacheScheme, QuantizationConfig, parse_quantization_config

__all__ = ["EmulationOptions", "Fp8Emulator", "Fp8Parameters"]


# The epsilon FastDeploy passes the FP8 attention ops for Qwen3's q/k RMSNorm (hpu_attn_backend.py@8c3513a4).
QK_NORM_EPS = 1e-6


def bf16(x) -> np.ndarray:
    """Round to bf16 (nearest even) and back to float32."""
    return np.asarray(x, np.float32).astype(e4m3.BF16_DTYPE).astype(np.float32)


def f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def quantize_by_multiplier(x: np.ndarray, multiplier, point: str) -> np.ndarray:
    """Gaudi's cast of a bf16 tensor: sat_fp8(bf16(x * bf16(m))), returned as the fp8 values in float32.

    ``point`` (the module or attention point) names the activation when it is not finite: the float32
    arithmetic before it overflowed."""
    return e4m3.cast_to_fp8(bf16(x * bf16(multiplier)), FASTDEPLOY_FP8_MAX, f"activation {point}").astype(np.float32)


def per_token_multiplier(x: np.ndarray) -> np.ndarray:
    """``fp8_max / max |x|`` of each token (the last axis) in bf16, ``[..., 1]``; 1 for a token of zeros: the multiplier
    of dynamic per-token activation scaling, which FastDeploy's HPU format does not serve (eval's ceiling row)."""
    peak = np.max(np.abs(x), axis=-1, keepdims=True).astype(np.float32)
    return bf16(np.where(peak > 0, np.float32(FASTDEPLOY_FP8_MAX) / np.where(peak > 0, peak, 1), np.float32(1)))


@dataclass(frozen=True)
class EmulationOptions:
    weights_only: bool = False  # FP8 weights, float32 activations everywhere (an ablation)
    fp8_attention: bool = True  # False: attention and KV cache in bf16 (an ablation, or the `none` scheme)
    decode_attention: bool = False  # the decode form of the attention probabilities
    # every FP8 linear's input cast with its own token's scale instead of the checkpoint's static one: not what the
    # HPU serves, a ceiling for any static scale (attention and the KV cache keep the checkpoint's scales)
    per_token: bool = False


EMBEDDING = "embedding"  # the emulation's part of layer None that looks tokens up (the head is weights.HEAD)


class Fp8Parameters:
    """The mapped parameters of every rank of one parallel layout, one part of a layer at a time, as the reference
    engine reads its weights (:func:`~hpu_fp8_loader.engine.weights.weight_parts`: attention; the dense MLP, or the
    router part and each routed expert), plus the embedding and the head (layer ``None``): never a whole MoE layer.
    Floats are float32, except the embedding and lm_head, kept as mapped (bf16: half the memory) and converted as
    they are used. The last part asked for is kept, so the rows of one evaluation, run one after another on the
    same part, map it once."""

    def __init__(self, root, tp: int = 1):
        self.checkpoint = Checkpoint.open(root)
        self.qc: QuantizationConfig = parse_quantization_config(self.checkpoint.config)
        self.d: ModelDescriptor = describe(self.checkpoint.config)
        self.tp = tp
        self.parts = weight_parts(self.d)
        self.parts[(None, EMBEDDING)] = [w for w in self.d.weights() if w.role is Role.EMBEDDING]
        self._last: tuple[tuple[int | None, Part], list[dict[str, np.ndarray]]] | None = None

    def part(self, layer: int | None, part: Part) -> list[dict[str, np.ndarray]]:
        """Each rank's parameters of one part of ``layer``, by FastDeploy name; an expert's stacked parameters
        hold it alone (``[1, ...]``)."""
        key = (layer, part)
        if self._last is None or self._last[0] != key:
            self._last = None  # drop the previous part before mapping the next
            self._last = key, [self._map(key, Parallelism(self.tp, r)) for r in range(self.tp)]
        return self._last[1]

    def _map(self, key: tuple[int | None, Part], par: Parallelism) -> dict[str, np.ndarray]:
        # The lookup needs no lm_head, the head no embedding (map_rank gives a tied one's lm_head from it).
        unused = (
            {EMBEDDING: LM_HEAD_PARAMETER, HEAD: embedding_parameter(self.d.prefix)}.get(str(key[1])) if key[0] is None else None
        )
        params: dict[str, np.ndarray] = {}
        experts: dict[str, list[np.ndarray]] = {}  # a stacked expert parameter, one array per local expert
        for piece in map_rank(self.checkpoint, self.qc, self.d, par, weights=self.parts[key]):
            if piece.name == unused:
                continue
            if piece.name in (LM_HEAD_PARAMETER, embedding_parameter(self.d.prefix)):
                params[piece.name] = piece.array
            elif piece.expert is None:
                params[piece.name] = f32(piece.array)
            else:
                experts.setdefault(piece.name, []).append(f32(piece.array))
        params.update((name, np.stack(stack)) for name, stack in experts.items())
        return params


class Fp8Emulator:
    """The FP8 model of every rank of one parallel layout, in stages (a
    :class:`~hpu_fp8_loader.engine.layer_major.LayerModel`) or as a batch-major :meth:`forward`."""

    def __init__(
        self, root, tp: int = 1, options: EmulationOptions = EmulationOptions(), parameters: Fp8Parameters | None = None
    ):
        self.parameters = parameters or Fp8Parameters(root, tp)
        self.qc, self.d = self.parameters.qc, self.parameters.d
        self.cfg = EngineConfig.from_config(
            self.parameters.checkpoint.config, self.d, str(self.parameters.checkpoint.root / "config.json")
        )
        self.options = options
        self.fp8_attention = options.fp8_attention and self.qc.kv_cache_scheme is KvCacheScheme.FP8
        # Activations between ops: bf16 as on the HPU, or float32 in the weights-only ablation.
        self.round = (lambda x: np.asarray(x, np.float32)) if options.weights_only else bf16

    @property
    def descriptor(self) -> ModelDescriptor:
        return self.d

    def with_options(self, options: EmulationOptions) -> Fp8Emulator:
        """The same checkpoint and parallel layout with other options, sharing the mapped parameters."""
        return Fp8Emulator(None, self.parameters.tp, options, self.parameters)

    # ------------------------------------------------------------------ ops

    def _linear(self, p: dict, module: str, x: np.ndarray, descale_name: str | None = None) -> np.ndarray:
        """An FP8 linear: cast x with act_scale, fp8 GEMM, descales, bf16 out (docs/fastdeploy.md section 5, "Linear layers").

        A linear kept in BF16 (no weight_scale: FastDeploy's unquantized layer) is a BF16 GEMM, bf16 out.
        """
        weight = p[names.tensor(module, names.WEIGHT)]
        if names.tensor(module, WEIGHT_SCALE_PARAMETER) not in p:
            return self.round(x @ weight)
        weight_scale = p[names.tensor(module, WEIGHT_SCALE_PARAMETER)][0]
        if self.options.weights_only:
            return x @ (weight * weight_scale)
        if self.options.per_token:
            multiplier = per_token_multiplier(x)
            descale = np.float32(1) / multiplier
        else:
            multiplier = p[names.tensor(module, ACT_SCALE_PARAMETER)][0]
            descale = p[names.tensor(module, descale_name)][0] if descale_name else np.float32(1) / multiplier
        return bf16((quantize_by_multiplier(x, multiplier, module) @ weight) * descale * weight_scale)

    def _attention(self, p: dict, layer: int, x: np.ndarray) -> np.ndarray:
        d, hd = self.d, self.d.head_dim
        b, t, _ = x.shape
        m = names.layer_names(d.prefix, layer)
        qkv = self._linear(p, m.qkv, x)
        if d.qkv_bias:
            qkv = self.round(qkv + p[names.tensor(m.qkv, names.BIAS)])
        heads = p[names.tensor(m.o_proj, names.WEIGHT)].shape[0] // hd
        kv_heads = (qkv.shape[-1] - heads * hd) // (2 * hd)
        q = qkv[..., : heads * hd].reshape(b, t, heads, hd)
        k = qkv[..., heads * hd : (heads + kv_heads) * hd].reshape(b, t, kv_heads, hd)
        v = qkv[..., (heads + kv_heads) * hd :].reshape(b, t, kv_heads, hd)
        if d.qk_norm:  # each head of this rank's q and k; the [head_dim] weights are the same on every rank
            q = self.round(rms_norm(q, p[names.tensor(m.q_norm, names.WEIGHT)], QK_NORM_EPS))
            k = self.round(rms_norm(k, p[names.tensor(m.k_norm, names.WEIGHT)], QK_NORM_EPS))
        positions = np.arange(t)
        q = self.round(rotary(q, positions, self.cfg.rope_theta, self.cfg.interleaved_rotary))
        k = self.round(rotary(k, positions, self.cfg.rope_theta, self.cfg.interleaved_rotary))
        scale = np.float32(hd**-0.5)

        def attn(scale_name: str) -> np.float32:
            return p[attention_parameter(d.prefix, layer, scale_name)][0]

        if self.fp8_attention and not self.options.weights_only:
            q = quantize_by_multiplier(q, attn("q_scale"), m.attention_point("q"))
            k = quantize_by_multiplier(k, attn("cache_k_scale"), m.attention_point("cache_k"))  # the fp8 KV cache
            v = quantize_by_multiplier(v, attn("cache_v_scale"), m.attention_point("cache_v"))
            scale = scale * attn("q_out_scale") * attn("cache_k_out_scale")
        group = heads // kv_heads
        q = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
        k = np.repeat(k, group, axis=2).transpose(0, 2, 3, 1)
        v = np.repeat(v, group, axis=2).transpose(0, 2, 1, 3)
        scores = (q @ k) * scale
        scores = np.where(np.triu(np.ones((t, t), bool), 1), np.float32(-np.inf), scores)
        scores -= scores.max(axis=-1, keepdims=True)
        exp = np.exp(scores)
        total = exp.sum(axis=-1, keepdims=True)
        if self.fp8_attention and not self.options.weights_only:
            probabilities = exp if self.options.decode_attention else exp / total
            out = (
                (quantize_by_multiplier(probabilities, attn("s_scale"), m.attention_point("s")) @ v)
                * attn("s_out_scale")
                * attn("cache_v_out_scale")
            )
            if self.options.decode_attention:
                out = out / total
        else:
            out = (exp / total) @ v
        out = self.round(out.transpose(0, 2, 1, 3).reshape(b, t, heads * hd))
        return self._linear(p, m.o_proj, out, descale_name=ACT_SCALE_INV_PARAMETER)

    def _mlp(self, p: dict, module: str, x: np.ndarray) -> np.ndarray:
        gate_up = self._linear(p, names.tensor(module, names.UP_GATE), x)
        half = gate_up.shape[-1] // 2
        hidden = silu(gate_up[..., :half]) * gate_up[..., half:]
        return self._linear(p, names.tensor(module, names.DOWN), self.round(hidden))

    def _expert(self, p: dict, layer: int, expert: int, qx: np.ndarray, flat: np.ndarray, chosen, gates, out: np.ndarray):
        """Routed expert ``expert``'s share on one rank (``p``: its parameters, stacked alone), added into this
        rank's ``out`` as FastDeploy's MoE accumulates it (docs/fastdeploy.md section 5, "MoE"): ``qx`` is the
        layer's input cast once with the shared input scale (``flat`` itself when emulating weights only)."""
        prefix = self.d.prefix
        kept_bf16 = expert_parameter(prefix, layer, EXPERT_PARAMETERS[2]) not in p  # BF16 GEMMs, bf16 between the ops
        # read whether or not a token reaches the expert, as FastDeploy's MoE kernel is handed every expert's
        parameters = [p[expert_parameter(prefix, layer, n)] for n in EXPERT_PARAMETERS[: 2 if kept_bf16 else None]]
        rows, slot = np.nonzero(chosen == expert)
        if not rows.size:
            return
        if kept_bf16:
            up, down = parameters[0][0], parameters[1][0]
            gate_up = self.round(flat[rows] @ up)
            half = gate_up.shape[-1] // 2
            y = self.round(self.round(silu(gate_up[:, :half]) * gate_up[:, half:]) @ down)
            out[rows] = self.round(out[rows] + self.round(gates[rows, slot][:, None] * y))
            return
        up, down, up_scale, down_scale, in_scale, down_in = parameters
        up, down, up_scale, down_scale, down_in = up[0], down[0], up_scale[0], down_scale[0], down_in[0, 0]
        if self.options.weights_only:
            x_descale = np.float32(1)
        else:
            x_descale = np.float32(1) / (per_token_multiplier(flat[rows]) if self.options.per_token else in_scale[0])
        gate_up = (qx[rows] @ up) * x_descale * up_scale
        half = gate_up.shape[-1] // 2
        if self.options.weights_only:
            y = (silu(gate_up[:, :half]) * gate_up[:, half:]) @ (down * down_scale)
            out[rows] += gates[rows, slot][:, None] * y
            return
        gate_up = bf16(gate_up)
        hidden = bf16(silu(gate_up[:, :half]) * gate_up[:, half:])
        point = names.expert(prefix, layer, expert, names.DOWN)
        if self.options.per_token:
            multiplier = per_token_multiplier(hidden)
            down_in = np.float32(1) / multiplier
        else:
            multiplier = np.float32(1) / down_in
        y = bf16((quantize_by_multiplier(hidden, multiplier, point) @ down) * down_in * down_scale)
        out[rows] = bf16(out[rows] + bf16(gates[rows, slot][:, None] * y))

    # ------------------------------------------------------------------ forward

    def _reduce(self, partials: list[np.ndarray]) -> np.ndarray:
        """A row-parallel all-reduce: bf16 per rank, summed (float32 when emulating weights only)."""
        return self.round(np.sum([self.round(x) for x in partials], axis=0))

    def embed(self, ranks: list[dict], ids: np.ndarray) -> np.ndarray:
        """The vocabulary-parallel embedding: each rank looks up its rows."""
        embed_name = embedding_parameter(self.d.prefix)
        rows = ranks[0][embed_name].shape[0]
        x = np.zeros((*ids.shape, self.d.hidden_size), np.float32)
        for r, p in enumerate(ranks):
            local = ids - r * rows
            mine = (local >= 0) & (local < rows)
            x[mine] = p[embed_name][local[mine]]
        return x

    def logits(self, ranks: list[dict], x: np.ndarray) -> np.ndarray:
        """The final norm, then each rank's lm_head columns (a tied model's too: FastDeploy's copy of the embedding),
        concatenated."""
        first = ranks[0]
        x = self.round(rms_norm(x, first[names.tensor(names.final_norm(self.d.prefix), names.WEIGHT)], self.cfg.rms_norm_eps))
        return np.concatenate([head_product(x, p[LM_HEAD_PARAMETER]) for p in ranks], axis=-1)

    @property
    def stores(self) -> int:
        """The hidden states, the normed input of the MLP or experts, the experts' cast input, each rank's sum."""
        return 3 + self.parameters.tp

    def largest_part_parameters(self) -> int:
        return largest_part(self.parameters.parts)

    def embedding(self, space: Workspace) -> list[StageLoader]:
        def load() -> Stage:
            ranks = self.parameters.part(None, EMBEDDING)

            def stage(part: slice) -> None:
                space.hidden[part] = self.embed(ranks, space.windows[part])

            return stage

        return [load]

    def head(self) -> Callable[[np.ndarray], np.ndarray]:
        ranks = self.parameters.part(None, HEAD)
        return lambda x: self.logits(ranks, x)

    def layer(self, index: int, space: Workspace) -> list[StageLoader]:
        """Layer ``index`` of every rank in the reference engine's stages, each part mapped once for all windows
        (and shared with the other rows): attention, then the dense MLP, or the router, each routed expert in turn
        and the sum. Each rank adds its experts in expert order and the ranks' partial sums are reduced as one
        whole-layer step reduces them: the same arithmetic, with one expert mapped at a time."""
        d, round_ = self.d, self.round
        m = names.layer_names(d.prefix, index)
        hidden, normed = space.hidden, space.store("normed")

        def attention() -> Stage:
            ranks = self.parameters.part(index, ATTENTION)
            first = ranks[0]

            def stage(part: slice) -> None:
                x = np.array(hidden[part])
                h = round_(rms_norm(x, first[names.tensor(m.input_norm, names.WEIGHT)], self.cfg.rms_norm_eps))
                x = round_(x + self._reduce([self._attention(p, index, h) for p in ranks]))
                hidden[part] = x
                normed[part] = round_(
                    rms_norm(x, first[names.tensor(m.post_attention_norm, names.WEIGHT)], self.cfg.rms_norm_eps)
                )

            return stage

        if not d.is_moe_layer(index):

            def mlp() -> Stage:
                ranks = self.parameters.part(index, MLP)

                def stage(part: slice) -> None:
                    x, h = np.array(hidden[part]), np.array(normed[part])
                    hidden[part] = round_(x + self._reduce([self._mlp(p, m.mlp, h) for p in ranks]))

                return stage

            return [attention, mlp]
        moe = d.moe
        assert moe is not None  # is_moe_layer holds only when the model has an MoE config
        cast, sums = space.store("cast input"), [space.store(f"rank {r} experts") for r in range(self.parameters.tp)]
        router: list[dict] = []  # each rank's router part: read by route, used again by the shared experts
        routing: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # each chunk's (chosen experts, their bf16 weights)

        def flat(store: np.ndarray, part: slice) -> np.ndarray:
            return np.asarray(store[part]).reshape(-1, d.hidden_size)  # a view of the chunk

        def route_stage() -> Stage:
            router[:] = self.parameters.part(index, ROUTER)
            first = router[0]

            def stage(part: slice) -> None:
                bias = first.get(expert_parameter(d.prefix, index, ROUTER_BIAS_PARAMETER))
                gate = first[names.tensor(m.router, names.WEIGHT)]
                chosen, gates = route(flat(normed, part), gate, bias, moe.top_k, self.cfg.router_norm_min)
                routing[part.start] = chosen, self.round(gates)
                for store in sums:
                    store[part] = 0

            return stage

        def expert(e: int) -> StageLoader:
            def load() -> Stage:
                ranks = self.parameters.part(index, e)
                in_scale = expert_parameter(d.prefix, index, EXPERT_PARAMETERS[4])

                def stage(part: slice) -> None:
                    x = flat(normed, part)
                    if e == 0 and in_scale in ranks[0] and not self.options.weights_only:  # once per chunk and layer
                        point = names.shared_expert_input(d.prefix, index)
                        multiplier = per_token_multiplier(x) if self.options.per_token else ranks[0][in_scale][0]
                        flat(cast, part)[:] = quantize_by_multiplier(x, multiplier, point)
                    qx = x if self.options.weights_only else flat(cast, part)
                    chosen, gates = routing[part.start]
                    for p, store in zip(ranks, sums, strict=True):
                        self._expert(p, index, e, qx, x, chosen, gates, flat(store, part))

                return stage

            return load

        def finish() -> Stage:
            def stage(part: slice) -> None:
                x = flat(normed, part)
                partials = [np.array(flat(store, part)) for store in sums]
                if moe.num_shared_experts:
                    partials += [self._mlp(p, m.shared_experts, x) for p in router]
                before = np.array(hidden[part])
                hidden[part] = round_(before + self._reduce(partials).reshape(before.shape))
                del routing[part.start]

            return stage

        return [attention, route_stage, *(expert(e) for e in range(moe.num_experts)), finish]

    def forward(self, ids: np.ndarray) -> np.ndarray:
        """Logits ``[B, T, vocab]`` (float32) of the emulated FP8 model, batch-major: one batch through every layer,
        as one chunk of a layer-major run (:func:`~hpu_fp8_loader.engine.layer_major.run_layer_major`)."""
        return run_batch(self, ids, str(self.parameters.checkpoint.root))

"""What a model consists of, read from config.json: every tensor with its role, shape and source layout.

One :class:`ModelDescriptor` serves both architectures; the per-architecture modules only read their
config keys into it. The descriptor knows three views of each weight:

* the spec view (FastDeploy's Paddle layout: ``[in, out]``, q|k|v and gate|up fused, ``ernie.`` /
  ``qwen2.`` / ``model.`` (Qwen3) prefix),
* the Paddle source layout (the same tensors, unquantized),
* the Hugging Face torch layout (``[out, in]``, separate projections, ``model.`` prefix),

and how the spec tensor is assembled from source parts (transpose, then concatenate along the
output axis). No column permutation is ever applied (docs/spec.md section 4.4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.choices import Bf16Group

__all__ = ["LINEAR_ROLES", "Layout", "ModelDescriptor", "MoeConfig", "Role", "SourcePart", "WeightTensor", "linear_group"]


class Role(str, Enum):
    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    NORM = "norm"
    ATTN_QKV = "attn_qkv"
    ATTN_QKV_BIAS = "attn_qkv_bias"
    ATTN_O = "attn_o"
    MLP_UP_GATE = "mlp_up_gate"
    MLP_DOWN = "mlp_down"
    SHARED_UP_GATE = "shared_up_gate"
    SHARED_DOWN = "shared_down"
    EXPERT_UP_GATE = "expert_up_gate"
    EXPERT_DOWN = "expert_down"
    ROUTER = "router"
    ROUTER_BIAS = "router_bias"


class Layout(str, Enum):
    PADDLE = "paddle"
    TORCH = "torch"


LINEAR_ROLES = frozenset(
    {
        Role.ATTN_QKV,
        Role.ATTN_O,
        Role.MLP_UP_GATE,
        Role.MLP_DOWN,
        Role.SHARED_UP_GATE,
        Role.SHARED_DOWN,
        Role.EXPERT_UP_GATE,
        Role.EXPERT_DOWN,
    }
)
_FLOAT32_ROLES = frozenset({Role.ROUTER, Role.ROUTER_BIAS})


def linear_group(role: Role) -> Bf16Group | None:
    """The group FastDeploy quantizes a linear of ``role`` with: the routed experts, or every other linear
    (docs/fastdeploy.md section 3, "Keeping linears in BF16"); None for a role that is no linear."""
    if role not in LINEAR_ROLES:
        return None
    return Bf16Group.EXPERTS if role in (Role.EXPERT_UP_GATE, Role.EXPERT_DOWN) else Bf16Group.DENSE


_TORCH_PREFIX = "model"


@dataclass(frozen=True)
class SourcePart:
    """One tensor of a source checkpoint; ``transpose`` when its 2-D layout is ``[out, in]``."""

    name: str
    shape: tuple[int, ...]
    transpose: bool = False


@dataclass(frozen=True)
class WeightTensor:
    """A model weight in the spec's layout (before quantization)."""

    name: str  # spec name of the unquantized tensor (``<module>.weight`` for linears)
    role: Role
    shape: tuple[int, ...]
    layer: int | None = None
    expert: int | None = None
    parts: tuple[tuple[str, int], ...] = ()  # torch layout: (projection name, output width) fused in order

    @property
    def is_linear(self) -> bool:
        return self.role in LINEAR_ROLES

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]

    @property
    def group(self) -> Bf16Group | None:
        """The group FastDeploy quantizes this linear with (routed experts, or every other linear); None for the rest."""
        return linear_group(self.role)

    def quantized(self, kept_bf16: frozenset[Bf16Group]) -> bool:
        """Stored in FP8: a linear whose group is not kept in BF16."""
        return self.is_linear and self.group not in kept_bf16

    @property
    def source_dtype(self) -> str:
        """BF16 for everything but the router and its correction bias, which stay float32."""
        return "F32" if self.role in _FLOAT32_ROLES else "BF16"

    @property
    def channel_wise(self) -> bool:
        return self.role in (Role.EXPERT_UP_GATE, Role.EXPERT_DOWN)

    def source_parts(self, layout: Layout, prefix: str) -> tuple[SourcePart, ...]:
        """The source tensors this spec tensor is made of, in fusion order."""
        if layout is Layout.PADDLE:
            return (SourcePart(self.name, self.shape),)
        torch_name = _TORCH_PREFIX + self.name[len(prefix) :] if self.name.startswith(prefix + ".") else self.name
        if self.role in (Role.EMBEDDING, Role.NORM, Role.ROUTER_BIAS):
            return (SourcePart(torch_name, self.shape),)
        if self.role is Role.ATTN_QKV_BIAS:
            module = torch_name.rpartition(".")[0].rpartition(".")[0]
            return tuple(SourcePart(names.tensor(names.tensor(module, p), names.BIAS), (w,)) for p, w in self.parts)
        if self.parts:  # fused linear: q|k|v or gate|up
            module = torch_name.rpartition(".")[0].rpartition(".")[0]
            return tuple(
                SourcePart(names.tensor(names.tensor(module, p), names.WEIGHT), (w, self.shape[0]), True) for p, w in self.parts
            )
        return (SourcePart(torch_name, self.shape[::-1], True),)


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int
    start: int
    end: int
    interval: int
    correction_bias: bool

    def is_moe_layer(self, index: int) -> bool:
        """The checkpoint's MoE layers: start <= L <= end and (L - start) % interval == 0.

        transformers writes (L + 1) % interval == 0; the two agree for interval 1 only. FastDeploy's
        ERNIE builds MoE at every L >= start instead; the FastDeploy mapping refuses models where that
        differs (docs/fastdeploy.md section 12).
        """
        return self.start <= index <= self.end and (index - self.start) % self.interval == 0


@dataclass(frozen=True)
class ModelDescriptor:
    model_type: str
    architecture: str  # the name FastDeploy registers
    prefix: str  # FastDeploy's module prefix: ernie / qwen2 / model (Qwen3)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    moe: MoeConfig | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head (weights [head_dim]) between qkv_proj and RoPE

    # ----- derived sizes -----
    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        return self.q_width + 2 * self.kv_width

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(index)

    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    # ----- the tensors -----
    def weights(self) -> list[WeightTensor]:
        """Every weight of the model in the spec's layout and a stable order."""
        p, h = self.prefix, self.hidden_size
        out = [WeightTensor(names.tensor(names.embedding(p), names.WEIGHT), Role.EMBEDDING, (self.vocab_size, h))]
        for i in range(self.num_layers):
            out.extend(self._layer_weights(i))
        out.append(WeightTensor(names.tensor(names.final_norm(p), names.WEIGHT), Role.NORM, (h,)))
        if not self.tie_word_embeddings:
            out.append(WeightTensor("lm_head.weight", Role.LM_HEAD, (h, self.vocab_size)))
        return out

    def _layer_weights(self, i: int) -> list[WeightTensor]:
        m, h = names.layer_names(self.prefix, i), self.hidden_size
        qkv_parts = (("q_proj", self.q_width), ("k_proj", self.kv_width), ("v_proj", self.kv_width))
        out = [
            WeightTensor(names.tensor(m.input_norm, names.WEIGHT), Role.NORM, (h,), i),
            WeightTensor(names.tensor(m.qkv, names.WEIGHT), Role.ATTN_QKV, (h, self.qkv_width), i, parts=qkv_parts),
        ]
        if self.qkv_bias:
            out.append(WeightTensor(names.tensor(m.qkv, names.BIAS), Role.ATTN_QKV_BIAS, (self.qkv_width,), i, parts=qkv_parts))
        if self.qk_norm:
            out.extend(WeightTensor(names.tensor(n, names.WEIGHT), Role.NORM, (self.head_dim,), i) for n in (m.q_norm, m.k_norm))
        out.append(WeightTensor(names.tensor(m.o_proj, names.WEIGHT), Role.ATTN_O, (self.q_width, h), i))
        out.append(WeightTensor(names.tensor(m.post_attention_norm, names.WEIGHT), Role.NORM, (h,), i))
        if not self.is_moe_layer(i):
            out.extend(_mlp(m.mlp, h, self.intermediate_size, Role.MLP_UP_GATE, Role.MLP_DOWN, i, None))
            return out
        moe = self.moe
        assert moe is not None  # is_moe_layer(i) holds only when the model has a MoE config
        out.append(WeightTensor(names.tensor(m.router, names.WEIGHT), Role.ROUTER, (h, moe.num_experts), i))
        if moe.correction_bias:
            out.append(WeightTensor(m.score_bias, Role.ROUTER_BIAS, (1, moe.num_experts), i))
        for e in range(moe.num_experts):
            out.extend(_mlp(m.expert(e), h, moe.intermediate_size, Role.EXPERT_UP_GATE, Role.EXPERT_DOWN, i, e))
        if moe.num_shared_experts:
            width = moe.num_shared_experts * moe.intermediate_size
            out.extend(_mlp(m.shared_experts, h, width, Role.SHARED_UP_GATE, Role.SHARED_DOWN, i, None))
        return out

    def act_modules(self, attention_fp8: bool, ignore: frozenset[str] = frozenset()) -> list[str]:
        """Every module whose input needs an act_amax / act_scale, in model order.

        The attention points follow ``attention_fp8`` alone: FastDeploy's FP8 KV cache method does not depend on
        whether qkv_proj is FP8 (docs/fastdeploy.md section 3, "Keeping linears in BF16").
        """
        out: list[str] = []
        for w in self.weights():
            if not w.is_linear:
                continue
            assert w.layer is not None  # every linear weight belongs to a decoder layer
            if w.role is Role.ATTN_QKV and attention_fp8:
                out.extend(names.attention_point(self.prefix, w.layer, p) for p in names.ATTENTION_POINTS)
            if w.module in ignore:
                continue
            if w.role is Role.EXPERT_UP_GATE:
                shared = names.shared_expert_input(self.prefix, w.layer)
                if shared not in out:
                    out.append(shared)
                continue
            out.append(w.module)
        return out

    def parameter_count(self) -> int:
        return sum(math.prod(w.shape) for w in self.weights())


def _mlp(
    module: str, hidden: int, width: int, up_role: Role, down_role: Role, layer: int, expert: int | None
) -> list[WeightTensor]:
    return [
        WeightTensor(
            names.tensor(names.tensor(module, names.UP_GATE), names.WEIGHT),
            up_role,
            (hidden, 2 * width),
            layer,
            expert,
            parts=(("gate_proj", width), ("up_proj", width)),
        ),
        WeightTensor(names.tensor(names.tensor(module, names.DOWN), names.WEIGHT), down_role, (width, hidden), layer, expert),
    ]

"""The config.json keys the architectures read, as strict pydantic models with sane bounds.

A config value of the wrong JSON type is an error, never Python truthiness or ``int()``: a boolean
must be ``true``/``false`` (not ``"false"``, which ``bool()`` reads as true), an integer a JSON
integer (not ``3.0``, ``"3"`` or ``true``). Sizes are bounded (the ``MAX_*`` constants below, a few
times the largest released model) so that a 100-byte config declaring 10^8 layers is refused before
anything is enumerated or allocated. Keys we do not read are kept as they are (``extra="allow"``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hpu_fp8_loader.errors import ConfigError
from hpu_fp8_loader.spec.config import FASTDEPLOY_ARCHITECTURES, validation_error_text

__all__ = [
    "MAX_EXPERTS",
    "MAX_EXPERT_MODULES",
    "MAX_HEADS",
    "MAX_HEAD_DIM",
    "MAX_HIDDEN_SIZE",
    "MAX_INTERMEDIATE_SIZE",
    "MAX_LAYERS",
    "MAX_VOCAB_SIZE",
    "ErnieConfig",
    "ErnieMoeConfig",
    "ModelConfig",
    "Qwen2Config",
    "Qwen3Config",
    "Qwen3MoeConfig",
    "check_against_tensors",
    "read_model_config",
]

# Largest released values (Qwen2-72B, Qwen3-235B-A22B, ERNIE-4.5-300B, DeepSeek-V3, Llama-3.1-405B) are far below these.
MAX_LAYERS = 1024
MAX_HIDDEN_SIZE = 65_536
MAX_INTERMEDIATE_SIZE = 1_048_576
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_VOCAB_SIZE = 4_194_304
MAX_EXPERTS = 1024
MAX_EXPERT_MODULES = 131_072  # num_hidden_layers * moe_num_experts: 2 weights each, enumerated before any I/O


class ModelConfig(BaseModel):
    """The shape-defining keys every supported architecture has, plus the ones the reference engine reads."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    model_type: str
    architectures: list[str] | None = None
    hidden_size: int = Field(ge=1, le=MAX_HIDDEN_SIZE)
    num_hidden_layers: int = Field(ge=1, le=MAX_LAYERS)
    num_attention_heads: int = Field(ge=1, le=MAX_HEADS)
    num_key_value_heads: int | None = Field(default=None, ge=1, le=MAX_HEADS)
    head_dim: int | None = Field(default=None, ge=1, le=MAX_HEAD_DIM)
    vocab_size: int = Field(ge=1, le=MAX_VOCAB_SIZE)
    intermediate_size: int = Field(ge=1, le=MAX_INTERMEDIATE_SIZE)
    tie_word_embeddings: bool
    max_position_embeddings: int | None = Field(default=None, ge=1)
    rope_theta: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    rms_norm_eps: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _heads_fit(self) -> ModelConfig:
        """Grouped-query attention needs whole groups; without head_dim the hidden size must split evenly."""
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads {self.kv_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}; set head_dim"
            )
        return self

    @model_validator(mode="after")
    def _one_model(self) -> ModelConfig:
        """``architectures`` naming the class of another supported model contradicts ``model_type``: FastDeploy builds
        by the one, this tool reads by the other, and rewriting either would serve a model nobody chose. (A name of no
        supported model, such as a fine-tune's own class, is left to the writer, which says what it writes.)"""
        other = {cls: kind for kind, cls in FASTDEPLOY_ARCHITECTURES.items() if kind != self.model_type}
        clash = next((name for name in self.architectures or () if name in other), None)
        if clash is not None:
            raise ValueError(
                f"architectures names {clash} (a {other[clash]} model) but model_type is {self.model_type!r}; "
                "which model is this? fix config.json so that both say the same"
            )
        return self

    @property
    def kv_heads(self) -> int:
        """num_key_value_heads, or num_attention_heads when absent or null (no grouping)."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def resolved_head_dim(self) -> int:
        """head_dim when present and not null, else hidden_size / num_attention_heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def common_sizes(self) -> dict:
        """The ModelDescriptor fields every architecture shares."""
        return {
            "hidden_size": self.hidden_size,
            "num_layers": self.num_hidden_layers,
            "num_heads": self.num_attention_heads,
            "num_kv_heads": self.kv_heads,
            "head_dim": self.resolved_head_dim,
            "vocab_size": self.vocab_size,
            "intermediate_size": self.intermediate_size,
            "tie_word_embeddings": self.tie_word_embeddings,
        }


class Qwen2Config(ModelConfig):
    tie_word_embeddings: bool = False


class Qwen3Config(ModelConfig):
    """Qwen3 dense (FastDeploy's ``Qwen3ForCausalLM``): no q/k/v bias, q/k RMSNorm over an explicit head_dim.

    ``head_dim`` must be written: transformers' Qwen3 defaults an absent one to 128, FastDeploy's config to
    hidden_size / num_attention_heads (fastdeploy/config.py@8c3513a4), and the two differ for most sizes.
    """

    head_dim: int = Field(ge=1, le=MAX_HEAD_DIM)
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    @model_validator(mode="after")
    def _no_bias(self) -> Qwen3Config:
        if self.attention_bias:
            raise ValueError(
                "attention_bias is true, but FastDeploy's Qwen3Attention builds qkv_proj with_bias=False "
                "(fastdeploy/model_executor/models/qwen3.py@8c3513a4); no released Qwen3 has a bias"
            )
        return self


class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE (FastDeploy's ``Qwen3MoeForCausalLM``): routed experts in every layer, a float32 router, no shared
    experts and no correction bias; only what FastDeploy's HPU path can run is accepted.

    Absent optional keys take transformers' Qwen3-MoE defaults; that is why an absent ``norm_topk_prob`` is
    refused like ``false``.
    """

    num_experts: int = Field(ge=1, le=MAX_EXPERTS)
    num_experts_per_tok: int = Field(ge=1, le=MAX_EXPERTS)
    moe_intermediate_size: int = Field(ge=1, le=MAX_INTERMEDIATE_SIZE)
    norm_topk_prob: bool = False
    decoder_sparse_step: int = Field(default=1, ge=1, le=MAX_LAYERS)
    mlp_only_layers: list[int] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _expert_count_spelling(cls, data: object) -> object:
        if isinstance(data, dict) and "num_experts" not in data and "num_local_experts" in data:
            raise ValueError(
                "'num_experts' is missing: this config spells it num_local_experts (as transformers 5 saves it), but "
                "the released Qwen3-MoE configs and FastDeploy (model_config.num_experts) read num_experts; rename the key"
            )
        return data

    @model_validator(mode="after")
    def _hpu_runs_it(self) -> Qwen3MoeConfig:
        """Refuse what FastDeploy's HPU path computes differently from the model, naming the key and the code."""
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} is more than num_experts {self.num_experts}")
        if not self.norm_topk_prob:
            raise ValueError(
                "norm_topk_prob is false (transformers' default when absent), but FastDeploy's HPU MoE always "
                "renormalises the top-k weights (norm_topk_prob=True in "
                "fastdeploy/model_executor/layers/backends/intel_hpu/moe/fused_moe_hpu_backend.py@8c3513a4)"
            )
        dense = (
            f"mlp_only_layers is {self.mlp_only_layers}"
            if self.mlp_only_layers
            else f"decoder_sparse_step is {self.decoder_sparse_step}"
            if self.decoder_sparse_step != 1
            else None
        )
        if dense:
            raise ValueError(
                f"{dense}: layers with a dense MLP; FastDeploy's Qwen3-MoE builds them as its own Qwen3MLP, which is no "
                "Qwen2MLP, so HPUModelRunner.convert_model never gives them the fused FP8 forward "
                "(fastdeploy/worker/hpu_model_runner.py@8c3513a4); only every-layer-MoE models are served"
            )
        if self.tie_word_embeddings:
            raise ValueError(
                "tie_word_embeddings is true, but FastDeploy's Qwen3MoeForCausalLM never ties lm_head to the embedding "
                "(fastdeploy/model_executor/models/qwen3moe.py@8c3513a4); no released Qwen3-MoE is tied"
            )
        if self.num_hidden_layers * self.num_experts > MAX_EXPERT_MODULES:
            raise ValueError(
                f"num_hidden_layers {self.num_hidden_layers} x num_experts {self.num_experts} is more than "
                f"{MAX_EXPERT_MODULES:,} expert modules"
            )
        return self


class ErnieConfig(ModelConfig):
    tie_word_embeddings: bool = True
    use_bias: bool = False

    @model_validator(mode="after")
    def _no_bias(self) -> ErnieConfig:
        if self.use_bias:
            raise ValueError("use_bias=true ERNIE models are not supported (no released model uses it)")
        return self


class ErnieMoeConfig(ErnieConfig):
    """The moe_* keys; absent optional ones take the defaults of ERNIE's own modelling code."""

    moe_num_experts: int = Field(ge=1, le=MAX_EXPERTS)
    moe_k: int = Field(ge=1, le=MAX_EXPERTS)
    moe_intermediate_size: int = Field(ge=1, le=MAX_INTERMEDIATE_SIZE)
    moe_num_shared_experts: int | None = Field(default=0, ge=0, le=MAX_EXPERTS)
    moe_layer_start_index: int = Field(default=1, ge=0, le=MAX_LAYERS)
    moe_layer_end_index: int | None = Field(default=-1, ge=-1, le=MAX_LAYERS)
    moe_layer_interval: int = Field(default=1, ge=1, le=MAX_LAYERS)
    moe_use_aux_free: bool = True
    moe_norm_min: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _moe_fits(self) -> ErnieMoeConfig:
        """The MoE keys must describe experts and layers the model has, and a count we can enumerate."""
        if self.moe_k > self.moe_num_experts:
            raise ValueError(f"moe_k {self.moe_k} is more than moe_num_experts {self.moe_num_experts}")
        if self.moe_layer_start_index >= self.num_hidden_layers:
            raise ValueError(
                f"moe_layer_start_index {self.moe_layer_start_index} is not a layer of the "
                f"{self.num_hidden_layers} (num_hidden_layers)"
            )
        if not self.moe_layer_start_index <= self.last_moe_layer < self.num_hidden_layers:
            raise ValueError(
                f"moe_layer_end_index {self.moe_layer_end_index} is not between moe_layer_start_index "
                f"{self.moe_layer_start_index} and the last layer {self.num_hidden_layers - 1} (or -1)"
            )
        if self.num_hidden_layers * self.moe_num_experts > MAX_EXPERT_MODULES:
            raise ValueError(
                f"num_hidden_layers {self.num_hidden_layers} x moe_num_experts {self.moe_num_experts} is more than "
                f"{MAX_EXPERT_MODULES:,} expert modules"
            )
        return self

    @property
    def last_moe_layer(self) -> int:
        """moe_layer_end_index, with -1 or null meaning the last layer."""
        end = self.moe_layer_end_index
        return self.num_hidden_layers - 1 if end in (None, -1) else end


def read_model_config(model: type[ModelConfig], config: dict, source: str) -> ModelConfig:
    """``config`` as ``model``, or one :class:`ConfigError` line naming ``source`` and every key at fault."""
    try:
        return model.model_validate(config)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {validation_error_text(exc)}") from None


_LAYER = re.compile(r"\.layers\.([0-9]+)\.")
_EXPERT = re.compile(r"\.experts\.([0-9]+)\.")


def check_against_tensors(config: ModelConfig, tensors: Iterable[str], source: str) -> None:
    """The layer and expert counts the config declares are the ones the checkpoint's tensor names hold.

    Checked from the names alone, before a descriptor enumerates anything: a config that declares
    more (or fewer) layers or experts than the files hold is refused naming the key.
    """
    layers: set[int] = set()
    experts: set[int] = set()
    for name in tensors:
        if match := _LAYER.search(name):
            layers.add(int(match.group(1)))
        if match := _EXPERT.search(name):
            experts.add(int(match.group(1)))
    _check_count(source, "num_hidden_layers", config.num_hidden_layers, layers, "layers")
    if isinstance(config, ErnieMoeConfig):
        _check_count(source, "moe_num_experts", config.moe_num_experts, experts, "experts")
    elif isinstance(config, Qwen3MoeConfig):
        _check_count(source, "num_experts", config.num_experts, experts, "experts")


def _check_count(source: str, key: str, declared: int, present: set[int], what: str) -> None:
    held = max(present) + 1 if present else 0
    if declared != held:
        holds = f"{what} 0..{held - 1}" if held else f"no {what}"
        raise ConfigError(f"{source}: '{key}' is {declared}, but the checkpoint's tensors hold {holds}")

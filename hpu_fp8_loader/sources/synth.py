"""Deterministic random-init BF16 checkpoints of either architecture in either source layout.

Every later test and demo starts from real files made this way. A tensor's values depend only on
the seed and its spec name, so the Paddle and the torch layout of the same model hold the same
numbers (transposed and split): a converter must produce identical output from both.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import shutil
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

from hpu_fp8_loader.arch import Layout, Role, WeightTensor, config_keys_of, describe
from hpu_fp8_loader.console import human_bytes
from hpu_fp8_loader.errors import ConfigError
from hpu_fp8_loader.io.own_files import write_new
from hpu_fp8_loader.io.writer import CheckpointWriter, PlannedTensor
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import AmaxSourceKind
from hpu_fp8_loader.spec.measurements import MeasurementProvenance, Measurements, ModelIdentity

__all__ = ["PRESETS", "preset_config", "source_arrays", "synthesize", "synthetic_measurements", "weight_values"]

_ERNIE_MOE_TINY = {
    "model_type": "ernie4_5_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "moe_num_experts": 4,
    "moe_k": 2,
    "moe_intermediate_size": 32,
    "moe_num_shared_experts": 1,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": 2,
    "moe_layer_interval": 1,
    "moe_use_aux_free": True,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
_QWEN2_TINY = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Qwen3: head_dim 24 is not hidden / heads (16), as in Qwen3-0.6B, so every place that must take head_dim from
# the config (q/k norms, o_proj's input, RoPE) is exercised; dense is tied like the small releases, MoE is not.
_QWEN3_TINY = {**_QWEN2_TINY, "model_type": "qwen3", "head_dim": 24, "tie_word_embeddings": True, "attention_bias": False}
_QWEN3_MOE_TINY = {
    **_QWEN3_TINY,
    "model_type": "qwen3_moe",
    "intermediate_size": 128,
    "tie_word_embeddings": False,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
PRESETS: dict[str, dict] = {
    "ernie-moe-tiny": _ERNIE_MOE_TINY,
    "ernie-dense-tiny": {
        **{k: v for k, v in _ERNIE_MOE_TINY.items() if not k.startswith("moe_")},
        "model_type": "ernie4_5",
        "num_hidden_layers": 2,
    },
    "qwen2-tiny": _QWEN2_TINY,
    "qwen3-tiny": _QWEN3_TINY,
    "qwen3-moe-tiny": _QWEN3_MOE_TINY,
}
_HF_ARCHITECTURES = {
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_OUTLIER_FRACTION = 1e-4


def preset_config(preset: str, overrides: dict | None = None) -> dict:
    """A preset's config with overrides applied (unknown presets name the known ones), ready for :func:`synthesize`.

    An override must name a key of the preset or one the model's descriptor reads: a typo such as
    ``hiden_size`` would otherwise be written into config.json and silently change nothing. The values
    themselves are checked when the model is described (by :func:`synthesize`).

    Args:
        preset: ``"ernie-moe-tiny"``, ``"ernie-dense-tiny"``, ``"qwen2-tiny"``, ``"qwen3-tiny"`` or
            ``"qwen3-moe-tiny"`` (the keys of ``PRESETS``).
        overrides: config.json keys to set or replace, such as ``{"num_hidden_layers": 4}``.

    Returns:
        A new config.json dict (the preset itself is not modified).

    Raises:
        ConfigError: ``preset`` is unknown, or an override names a key neither the preset nor the model reads
            (the message suggests close matches), or ``model_type`` is overridden with a non-string.
        UnknownArchitectureError: ``model_type`` is overridden with a model type no descriptor exists for.

    Example:
        >>> from hpu_fp8_loader import preset_config
        >>> config = preset_config("qwen2-tiny", {"num_hidden_layers": 4})
        >>> config["model_type"], config["num_hidden_layers"]
        ('qwen2', 4)
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    config = {**PRESETS[preset], **(overrides or {})}
    known = PRESETS[preset].keys() | config_keys_of(config, f"synth --preset {preset}")
    for key in overrides or {}:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"did you mean {', '.join(close)}?" if close else f"known keys: {', '.join(sorted(known))}"
            raise ConfigError(f"synth --set: unknown config key {key!r} for {preset}; {hint}")
    return config


def weight_values(weight: WeightTensor, seed: int) -> np.ndarray:
    """The float32 values of one weight in the spec's layout, a pure function of (seed, name)."""
    rng = np.random.default_rng([seed, zlib.crc32(weight.name.encode())])
    shape = weight.shape
    if weight.role is Role.NORM:
        return (1.0 + 0.05 * rng.standard_normal(shape, np.float32)).astype(np.float32)
    if weight.role is Role.ROUTER_BIAS:
        return (0.01 * rng.standard_normal(shape, np.float32)).astype(np.float32)
    if weight.role is Role.ATTN_QKV_BIAS:
        return (0.05 * rng.standard_normal(shape, np.float32)).astype(np.float32)
    values = rng.standard_normal(shape, np.float32)
    values *= np.float32(0.02)
    if weight.is_linear or weight.role in (Role.EMBEDDING, Role.LM_HEAD):
        flat = values.reshape(-1)
        count = max(1, int(flat.size * _OUTLIER_FRACTION))
        where = rng.choice(flat.size, size=count, replace=False)
        flat[where] *= rng.uniform(8.0, 20.0, size=count).astype(np.float32)
    return values


def source_arrays(weight: WeightTensor, values: np.ndarray, layout: Layout, prefix: str, dtype: np.dtype | type):
    """(name, array) of the source tensors of ``layout`` that hold one weight's spec-layout ``values`` (split into
    its fused parts and transposed as the layout stores them), in ``dtype``: what a reader fuses back."""
    parts = weight.source_parts(layout, prefix)
    offset = 0
    for part in parts:
        width = part.shape[0] if part.transpose else part.shape[-1]
        piece = values[..., offset : offset + width] if len(parts) > 1 else values
        offset += width
        if part.transpose:
            piece = piece.T
        yield part.name, np.ascontiguousarray(piece.astype(dtype))


def generation_config(config: dict) -> dict:
    return {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}


def _source_config(config: dict, layout: Layout) -> dict:
    out = {"architectures": [_HF_ARCHITECTURES[config["model_type"]]], **config}
    if layout is Layout.PADDLE:
        out["dtype"] = "bfloat16"
    else:
        out["torch_dtype"] = "bfloat16"
        out["transformers_version"] = "5.24.0"
    return out


def _check_room(weights: list[WeightTensor], out: Path) -> None:
    """Refuse, before writing, a model the disk or this machine's memory cannot hold.

    Every tensor is generated whole in float32 (about 8 bytes an element with its BF16 copy), so a
    config within the per-key bounds can still be too big to make here; better one line now than
    MemoryError or a full disk halfway.
    """
    size = sum(math.prod(w.shape) * (4 if w.source_dtype == "F32" else 2) for w in weights)
    largest = max(weights, key=lambda w: math.prod(w.shape))
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if 8 * math.prod(largest.shape) > memory:
        raise ConfigError(
            f"synth: tensor {largest.name} {list(largest.shape)} needs {human_bytes(8 * math.prod(largest.shape))} "
            f"of memory to generate, more than this machine's {human_bytes(memory)}; make the config smaller"
        )
    existing = next(p for p in [out.absolute(), *out.absolute().parents] if p.exists())
    free = shutil.disk_usage(existing).free
    if size > free:
        raise ConfigError(f"synth: {out}: the model needs {human_bytes(size)}, {existing} has {human_bytes(free)} free")


def synthesize(
    out: str | Path,
    config: dict,
    layout: Layout = Layout.PADDLE,
    seed: int = 0,
    max_shard_bytes: int = 5 * 10**9,
    force: bool = False,
    progress=None,
) -> Path:
    """Write a BF16 source checkpoint of ``config`` to ``out``, with deterministic random weights; returns the directory.

    For tests and demos of the pipeline without downloading a model. A tensor's values depend only on ``seed``
    and its name, so both layouts of one config hold the same numbers, and converting either gives the same
    output. The room it needs (memory for the largest tensor, disk for the whole model) is checked before writing.

    Args:
        out: the directory to write; made via ``OUT.partial`` and renamed when complete.
        config: the model's config.json, such as :func:`preset_config` returns.
        layout: ``Layout.PADDLE`` (``"paddle"``, FastDeploy's layout: fused, ``[in, out]``) or ``Layout.TORCH``
            (``"torch"``, Hugging Face's: separate q/k/v and gate/up, ``[out, in]``).
        seed: the random seed of every tensor's values.
        max_shard_bytes: the largest shard file to write (a bigger tensor gets a shard of its own).
        force: replace an existing ``out`` (only a checkpoint this tool wrote, or an empty directory).
        progress: called with the byte count of each tensor written.

    Returns:
        ``Path(out)``, holding config.json, generation_config.json, the safetensors shards, their index and
        the manifest.

    Raises:
        ConfigError: a config key is invalid or out of bounds, or the model needs more memory or disk than there is.
        UnknownArchitectureError: ``config["model_type"]`` is not a supported model type.
        OutputExistsError: ``out`` exists and ``force`` is false, or it is not a checkpoint this tool wrote.
        OutputLockedError: another run is writing ``out``.
        UnsafePathError: ``OUT.partial`` is not this tool's (a link, a file, a user's directory).
        WriteFailedError: writing failed (no space left, an I/O error); nothing was published.

    Example:
        >>> from hpu_fp8_loader import preset_config, synthesize
        >>> synthesize("qwen2-synth", preset_config("qwen2-tiny"), layout="torch", seed=0)
        PosixPath('qwen2-synth')
    """
    layout = Layout(layout)
    descriptor = describe(config)
    weights = descriptor.weights()
    _check_room(weights, Path(out))
    planned = [
        PlannedTensor(part.name, w.source_dtype, part.shape)
        for w in weights
        for part in w.source_parts(layout, descriptor.prefix)
    ]
    writer = CheckpointWriter(out, planned, max_shard_bytes, force, {"format": "pt" if layout is Layout.TORCH else "pd"})
    for weight in weights:
        dtype = np.float32 if weight.source_dtype == "F32" else ml_dtypes.bfloat16
        for name, array in source_arrays(weight, weight_values(weight, seed), layout, descriptor.prefix, dtype):
            writer.write(name, array)
            if progress:
                progress(array.nbytes)
    write_new(writer.staging / "generation_config.json", (json.dumps(generation_config(config), indent=2) + "\n").encode())
    writer.finish(_source_config(config, layout))
    return Path(out)


def synthetic_measurements(config: dict, seed: int = 0) -> Measurements:
    """Plausible made-up activation amax for every act point of the model, labelled ``synthetic``.

    Only for tests and demos of the converter before a calibration exists; the provenance says so,
    and so does every checkpoint converted from it.
    """
    descriptor = describe(config)
    rng = np.random.default_rng([seed, 0x5EED])
    amax = {}
    for module in descriptor.act_modules(attention_fp8=True):
        if names.attention_point_of(module) == "s":
            amax[module] = 1.0
        elif ".experts." in module and module.endswith("down_proj"):
            amax[module] = float(rng.uniform(0.5, 5.0))
        else:
            amax[module] = float(rng.uniform(2.0, 20.0))
    experts = descriptor.moe.num_experts if descriptor.moe else 0
    return Measurements(
        provenance=MeasurementProvenance(kind=AmaxSourceKind.SYNTHETIC, tool="hpu-fp8 synth", dataset=f"seed {seed}"),
        model=ModelIdentity(model_type=descriptor.model_type, num_hidden_layers=descriptor.num_layers, moe_num_experts=experts),
        amax=amax,
    )

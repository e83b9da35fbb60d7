"""FastDeploy's legacy HPU FP8 layout (PaddleCustomDevice ``Model_convert.py``): its rules, and export to it.

The legacy layout (docs/fastdeploy.md section 9, "The legacy layout") stores each linear as ``P.quant_weight`` (the e4m3fn
bytes as int8, in the source's own layout), ``P.weight_scale`` (bf16, amax_W / 240, ``[1]``, or
``[out]`` for routed experts in the newer converter) and one ``P.activation_scale`` per measured
point whose meaning depends on the key: the **raw amax** when the key contains ``self_attn``, and
**amax / 240** otherwise (docs/fastdeploy.md section 5, "Linear layers"). This module is the only place that rule lives.

Import (:mod:`hpu_fp8_loader.conversion.legacy_import`) resolves both meanings into the spec's act_amax; export writes them back, which stock
FastDeploy's v0 loader reads without our hook (ERNIE at any tensor parallelism, Qwen2 and Qwen3 at tensor
parallelism 1: docs/fastdeploy.md section 5, "Tensor-parallel splits"). Qwen3-MoE has no legacy layout
FastDeploy can read (docs/fastdeploy.md, "Qwen3 and Qwen3-MoE").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpu_fp8_loader.arch import ModelDescriptor, Role
from hpu_fp8_loader.checks.validate import open_validated
from hpu_fp8_loader.errors import HpuFp8Error
from hpu_fp8_loader.fastdeploy.mapping import (
    FASTDEPLOY_FP8_MAX,
    Parallelism,
    activation_scale_value,
    check_parallelism,
    holds_raw_amax,
    rank_share,
    scale_share,
    share_shape,
)
from hpu_fp8_loader.io.writer import CheckpointWriter, PlannedTensor
from hpu_fp8_loader.numerics import e4m3
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import KvCacheScheme

__all__ = [
    "ACTIVATION_SCALE",
    "LEGACY_QUANTIZATION_CONFIG",
    "QUANT_WEIGHT",
    "QWEN3_MOE_REFUSAL",
    "LegacyExportResult",
    "amax_from_legacy",
    "amax_to_legacy",
    "check_exportable",
    "export_legacy",
    "legacy_key",
    "stock_fastdeploy_layouts",
]

QUANT_WEIGHT = "quant_weight"
ACTIVATION_SCALE = "activation_scale"
# What Model_convert.py writes into config.json (docs/fastdeploy.md section 9, "The legacy layout").
LEGACY_QUANTIZATION_CONFIG = {
    "quantization": "mix_quant",
    "dense_quant_type": "tensor_wise_fp8",
    "moe_quant_type": "tensor_wise_fp8",
    "kv_cache_quant_type": "float8_e4m3",
    "is_quantized": True,
}


def amax_from_legacy(key: str, value: float) -> float:
    """The amax a legacy ``activation_scale`` value stands for."""
    if holds_raw_amax(key):
        return float(value)
    with np.errstate(over="ignore"):  # an absurd value becomes inf, which the caller refuses by name
        return float(np.float32(value) * np.float32(FASTDEPLOY_FP8_MAX))


def amax_to_legacy(key: str, amax: float) -> np.ndarray:
    """The bf16 ``[1]`` value the legacy layout stores for an amax (bf16 storage moves it by up to 2^-8 relative)."""
    return np.array([activation_scale_value(key, amax)], np.float32).astype(e4m3.BF16_DTYPE)


def legacy_key(part_name: str, suffix: str) -> str:
    return part_name.removesuffix(".weight") + "." + suffix


# ----------------------------------------------------------------------------- export


@dataclass
class LegacyExportResult:
    """What :func:`export_legacy` wrote.

    Attributes:
        out: the published legacy-layout checkpoint directory.
        tensors: tensors written.
        warnings: such as, for Qwen2, that its legacy layout is inferred from FastDeploy's code (no FP8 Qwen2 has
            been seen served by stock FastDeploy).

    Example:
        >>> from hpu_fp8_loader import export_legacy
        >>> result = export_legacy("qwen2-fp8", "qwen2-legacy")
        >>> result.out, result.tensors
        (PosixPath('qwen2-legacy'), 41)
    """

    out: Path
    tensors: int
    warnings: list[str] = field(default_factory=list)


# Models whose v0 tensor-parallel split rules (``_get_tensor_parallel_mappings``) list only unquantized ``.weight`` /
# ``.bias`` keys, so that FP8 tensors would reach every rank whole (docs/fastdeploy.md section 5; models/qwen2.py,
# models/qwen3.py@8c3513a4).
_UNSPLIT_FP8 = {"qwen2": "Qwen2", "qwen3": "Qwen3"}
# Why no legacy export of a Qwen3-MoE can be served by stock FastDeploy (docs/fastdeploy.md, "Qwen3 and Qwen3-MoE").
QWEN3_MOE_REFUSAL = (
    "Qwen3-MoE has no legacy layout stock FastDeploy can read: Qwen3MoeBlock.weight_key_map holds only the two expert "
    "'.weight' keys (fastdeploy/model_executor/models/qwen3moe.py@8c3513a4), so FastDeploy's v0 loading finds no "
    "key for any expert scale; serve the hpu-fp8 checkpoint with the hpu_fp8 loader hook instead"
)


def _check_servable(descriptor: ModelDescriptor, tp: int) -> None:
    """Refuse what stock FastDeploy's v0 loader would load wrongly (docs/fastdeploy.md section 5, "Tensor-parallel splits").

    Its ERNIE split rules cover every FP8 key, the expert up_gate weight scales gate|up-paired (since
    FastDeploy 44a13e45); its Qwen2 and Qwen3 rules list only ``.weight`` and ``.bias`` keys, so FP8
    tensors would reach every rank whole.
    """
    name = _UNSPLIT_FP8.get(descriptor.model_type)
    if tp > 1 and name:
        raise HpuFp8Error(
            f"tensor parallelism {tp}: FastDeploy's v0 loader does not split {name} FP8 tensors; "
            "export for TP 1, or serve the hpu-fp8 checkpoint with the hpu_fp8 loader hook"
        )


def check_exportable(src: str | Path, descriptor: ModelDescriptor, rank: Parallelism) -> None:
    """Refuse, before anything is written, what no export of ``src`` can serve: a Qwen3-MoE (FastDeploy's v0 loading
    reads none of its expert scales), or a rank the model cannot be split into."""
    if descriptor.model_type == "qwen3_moe":
        raise HpuFp8Error(f"{src}: {QWEN3_MOE_REFUSAL}")
    check_parallelism(descriptor, rank)


def stock_fastdeploy_layouts(model_type: str) -> str:
    """What an export of this model serves on stock FastDeploy, as :func:`_check_servable` and section 5 of
    docs/fastdeploy.md have it (``export-legacy --help`` and the model cards say this)."""
    if model_type == "qwen3_moe":
        return "none: `hpu-fp8 export-legacy` refuses Qwen3-MoE (FastDeploy's Qwen3MoeBlock reads no expert scale key)"
    name = _UNSPLIT_FP8.get(model_type)
    if name:
        return f"tensor parallelism 1 only (FastDeploy's v0 loader does not split {name} FP8 tensors); no expert parallelism"
    return (
        "any tensor-parallel size the model divides into (FastDeploy's v0 loader splits ERNIE's FP8 tensors since "
        "44a13e45, on Python 3.10); no expert parallelism (FastDeploy's v0 expert-parallel loader drops the MoE input "
        "scale this layout carries)"
    )


def _tied_lm_head_key(descriptor: ModelDescriptor) -> str | None:
    """The key a tied model's v0 path still reads for its lm_head, holding the embedding ``[vocab, hidden]``.

    FastDeploy's Qwen2 ``set_state_dict`` hands the checkpoint to ``ParallelLMHead.load_state_dict``,
    which pops ``lm_head.weight`` and, tied, transposes it (docs/fastdeploy.md, "lm_head"); ERNIE
    passes its embedding parameter instead and reads no key.
    """
    return "lm_head.weight" if descriptor.model_type == "qwen2" and descriptor.tie_word_embeddings else None


def export_legacy(
    src: str | Path,
    out: str | Path,
    tp: int = 1,
    max_shard_bytes: int = 5 * 10**9,
    force: bool = False,
    rank: Parallelism | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> LegacyExportResult:
    """hpu-fp8 v1 -> the legacy layout stock FastDeploy reads (v0 loader, ``--load-choices default``).

    ``tp`` says how it will be served (refused where the v0 loader splits wrongly). ``rank`` writes only
    that tensor-parallel rank's share, for FastDeploy's pre-sharded ``rank{N}/`` path. Expert
    parallelism is not offered: FastDeploy's HPU MoE method runs it only from PR 5855 on, and the v0
    expert-parallel loader before it drops the MoE input scale this layout carries (docs/fastdeploy.md
    section 5, "Expert parallelism"). For serving without the hpu_fp8 loader hook; each
    ``activation_scale`` is written in its key's meaning (raw amax for ``self_attn`` keys, amax / 240 otherwise),
    in bf16.

    Args:
        src: the hpu-fp8 checkpoint directory (fp8_max 240).
        out: the directory to write.
        tp: the tensor parallelism it will be served at (ERNIE at any, Qwen2 and Qwen3 at 1); ignored when ``rank``
            is given.
        max_shard_bytes: the largest output shard.
        force: replace an existing ``out`` (only a checkpoint this tool wrote, or an empty directory).
        rank: write only this tensor-parallel rank's share (``Parallelism(tp_size, tp_rank)``).
        progress: called after each write with the bytes written and the total (e.g. ``Progress.show``).

    Returns:
        A :class:`~hpu_fp8_loader.LegacyExportResult`.

    Raises:
        HpuFp8Error: ``src`` fails the quick validation; its fp8_max is not 240 (retarget it first); a Qwen2 or Qwen3
            model with ``tp`` above 1 (the v0 loader does not split its FP8 tensors); a Qwen3-MoE model (FastDeploy's v0
            loading reads none of its expert scales).
        ConfigError: ``tp`` or ``rank`` cannot serve this model (a width it does not split evenly, fewer KV heads
            than ranks).
        NonFiniteError: a value read holds a NaN code, a value beyond ±240 or a NaN/inf kept value.
        CheckpointNotFoundError: ``src`` is not a directory.
        NotHpuFp8CheckpointError: ``src`` is not an hpu-fp8 checkpoint.
        UnsupportedFormatVersionError: ``src`` declares another format_version.
        OutputExistsError: ``out`` exists and ``force`` is false.
        OutputLockedError: another run is writing ``out``.
        UnsafePathError: ``out`` is, lies inside or contains ``src``, or ``OUT.partial`` is not this tool's (a link, a file, a user's directory).
        WriteFailedError: writing failed (no space left, an I/O error).

    Example:
        >>> from hpu_fp8_loader import export_legacy
        >>> result = export_legacy("ERNIE-4.5-21B-A3B-hpu-fp8", "ernie-legacy", tp=4)  # FastDeploy splits it for 4 ranks
        >>> result.warnings
        []
    """
    opened = open_validated(src)
    checkpoint, qc, descriptor = opened.checkpoint, opened.qc, opened.descriptor
    if qc.fp8_max != FASTDEPLOY_FP8_MAX:
        raise HpuFp8Error(
            f"{src}: fp8_max is {qc.fp8_max:g}; FastDeploy assumes 240. Run `hpu-fp8 retarget --target gaudi2` first"
        )
    if rank is None:  # a whole checkpoint that FastDeploy's v0 loader will split for ``tp`` ranks itself
        check_exportable(src, descriptor, Parallelism(tp))
        _check_servable(descriptor, tp)
        rank = Parallelism()
    check_exportable(src, descriptor, rank)
    attention = qc.kv_cache_scheme is KvCacheScheme.FP8
    modules = descriptor.act_modules(attention, frozenset(qc.ignore))
    tied_key = _tied_lm_head_key(descriptor)
    planned: list[PlannedTensor] = []
    for w in descriptor.weights():
        shape = share_shape(descriptor, w, rank)
        if w.is_linear and w.module not in qc.ignore:
            planned.append(PlannedTensor(legacy_key(w.name, QUANT_WEIGHT), "I8", shape))
            planned.append(PlannedTensor(legacy_key(w.name, "weight_scale"), "BF16", (shape[-1],) if w.channel_wise else (1,)))
        else:
            planned.append(PlannedTensor(w.name, checkpoint.tensors[w.name].dtype, shape))
            if tied_key and w.role is Role.EMBEDDING:
                planned.append(PlannedTensor(tied_key, checkpoint.tensors[w.name].dtype, shape))
    planned += [PlannedTensor(names.fastdeploy_key_from_module(m), "BF16", (1,)) for m in modules]
    writer = CheckpointWriter(out, planned, max_shard_bytes, force, {"format": "pd"}, [src], progress)
    for w in descriptor.weights():
        share = rank_share(checkpoint, descriptor, w, rank)
        if w.is_linear and w.module not in qc.ignore:
            writer.write(legacy_key(w.name, QUANT_WEIGHT), share.view(np.int8))
            scale = scale_share(checkpoint, descriptor, w, rank).astype(e4m3.BF16_DTYPE)  # bf16-exact by the spec
            writer.write(legacy_key(w.name, "weight_scale"), scale)
        else:
            writer.write(w.name, share)
            if tied_key and w.role is Role.EMBEDDING:
                writer.write(tied_key, share)
    for module in modules:
        key = names.fastdeploy_key_from_module(module)
        amax = float(np.asarray(checkpoint.get(names.tensor(module, names.ACT_AMAX)), np.float32)[0])
        writer.write(key, amax_to_legacy(key, amax))
    config = {k: v for k, v in checkpoint.config.items() if k != "quantization_config"}
    # the types FastDeploy reads as absent build their group unquantized, from the ``P.weight`` keys written above
    absent = {"kv_cache_quant_type": not attention, "dense_quant_type": qc.dense_quant_type is None}
    absent["moe_quant_type"] = qc.moe_quant_type is None
    config["quantization_config"] = {k: v for k, v in LEGACY_QUANTIZATION_CONFIG.items() if not absent.get(k)}
    writer.finish(config, copy_from=Path(src))
    report = LegacyExportResult(Path(out), len(planned))
    name = _UNSPLIT_FP8.get(descriptor.model_type)
    if name:
        report.warnings.append(
            f"{name} in the legacy layout is [inferred] from FastDeploy's code: no FP8 {name} has been "
            "seen served by stock FastDeploy"
        )
    return report

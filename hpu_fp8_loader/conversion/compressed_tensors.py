"""compressed-tensors FP8 checkpoints (llm-compressor's output, what vLLM reads) -> hpu-fp8 v1.

Such a checkpoint (compressed-tensors' ``float-quantized`` format, ``quant_method:
compressed-tensors``, as documented by llm-compressor and compressed-tensors) stores each linear of
the Hugging Face torch layout as an F8_E4M3 ``weight`` (OCP range ±448) with a ``weight_scale`` (``[1]`` tensor-wise or
``[out, 1]`` per channel, in bf16 or float32), a static ``input_scale`` when activations are static,
and optional ``k_scale`` / ``v_scale``. Gaudi2 and the spec want q|k|v and gate|up fused under one
tensor-wise scale in ``[in, out]`` at ±240, so every fused group is dequantized to float32 from the
source's own FP8 values and requantized exactly once (never from a lossy intermediate); the error
that adds is measured per tensor. Activation amax comes from ``input_scale`` x 448 where the source
has it (provenance ``imported-input-scale``), the rest from measurements or a calibration of the
dequantized model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hpu_fp8_loader.arch import Layout, ModelDescriptor, Role, describe
from hpu_fp8_loader.conversion.convert import ConvertProgress, convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.errors import ConfigError, MeasurementError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.sources.source_tensors import read_scale
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import AmaxSourceKind
from hpu_fp8_loader.spec.fp8 import E4M3FN_MAX, act_amax_problem
from hpu_fp8_loader.spec.measurements import MeasurementProvenance, Measurements

__all__ = ["CompressedTensorsImportResult", "compressed_tensors_scheme", "import_compressed_tensors"]


@dataclass
class CompressedTensorsImportResult:
    """What :func:`import_compressed_tensors` wrote, and what requantizing the source cost.

    Attributes:
        out: the published hpu-fp8 v1 checkpoint directory.
        scheme: the source's FP8 scheme, in words, such as ``"FP8 weights per channel, activations dynamic"``.
        errors: ``(spec tensor, relative RMSE)`` the requantization to the spec's scales and range added to the
            source's own error, worst first.
        warnings: what the import had to change, such as a router quantized in the source (dequantized to float32,
            as FastDeploy keeps the router unquantized).

    Example:
        >>> from hpu_fp8_loader import ConvertOptions, import_compressed_tensors
        >>> result = import_compressed_tensors("Qwen2-7B-Instruct-FP8", "qwen2-7b-hpu-fp8", ConvertOptions(kv_cache="none"))
        >>> print(result.scheme)
        FP8 weights per tensor, activations static tensor
        >>> worst_tensor, worst_error = result.errors[0]  # e.g. ('qwen2.layers.0.self_attn.o_proj.weight', 0.03)
    """

    out: Path
    scheme: str
    errors: list[tuple[str, float]] = field(default_factory=list)  # (spec tensor, relative RMSE added to the source's)
    warnings: list[str] = field(default_factory=list)


class _Lenient(BaseModel):
    """The keys this importer reads, typed; every other key of compressed-tensors' config is allowed and ignored."""

    model_config = ConfigDict(extra="allow")


class _QuantizationArgs(_Lenient):
    type: str | None = None
    num_bits: int | None = None
    strategy: str | None = None
    block_structure: list[int] | str | None = None
    group_size: int | None = None
    symmetric: bool = True
    dynamic: bool | str = False  # compressed-tensors also writes "local"


class _ConfigGroup(_Lenient):
    weights: _QuantizationArgs = Field(default_factory=_QuantizationArgs)
    input_activations: _QuantizationArgs | None = None
    format: str | None = None


class _CompressedTensorsConfig(_Lenient):
    quant_method: str | None = None
    format: str | None = None
    config_groups: dict[str, _ConfigGroup] = Field(default_factory=dict)
    sparsity_config: dict | None = None


def _parse_config(src: Path, raw: object) -> _CompressedTensorsConfig:
    """config.json's quantization_config, typed, or a :class:`ConfigError` naming the key at fault."""
    where = f"{src / 'config.json'}: quantization_config"
    if raw is None:
        raise ConfigError(f"{src / 'config.json'} has no quantization_config; not a compressed-tensors checkpoint")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} is a {type(raw).__name__} ({raw!r:.60}), not an object")
    if raw.get("quant_method") != "compressed-tensors":
        found = repr(raw["quant_method"]) if "quant_method" in raw else "missing"
        raise ConfigError(
            f"{where}.quant_method is {found}; `hpu-fp8 import` reads compressed-tensors FP8 (quant_method "
            "'compressed-tensors'), Hugging Face block FP8 (quant_method 'fp8' with weight_block_size) and FastDeploy's "
            "Paddle block FP8 (quantization 'mix_quant', block_wise_fp8); a legacy FastDeploy FP8 checkpoint "
            "(mix_quant, tensor_wise_fp8) goes through `hpu-fp8 import-legacy`"
        )
    try:
        return _CompressedTensorsConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(part) for part in first["loc"])
        raise ConfigError(f"{where}.{key}: {first['msg']}") from None


def _check_scheme(src: Path, qc: _CompressedTensorsConfig) -> str:
    """The FP8 scheme found, or a refusal naming what was found instead (and config.json, where it was found)."""
    config = src / "config.json"
    sparsity = (qc.sparsity_config or {}).get("format")
    if sparsity not in (None, "dense"):
        raise ConfigError(
            f"{config}: sparsity_config.format is {sparsity!r}; only dense weights import (no 2:4 or bitmask sparsity)"
        )
    described = []
    for name, group in qc.config_groups.items():
        weights, group_format = group.weights, group.format or qc.format
        found = f"{weights.type or 'untyped'}{weights.num_bits or ''} {weights.strategy or ''}".strip()
        if group_format != "float-quantized" or weights.type != "float" or weights.num_bits != 8:
            raise ConfigError(
                f"{config}: config group {name!r} is {found} ({group_format or 'no format'}); "
                "only FP8 (float, 8 bits, float-quantized) imports"
            )
        if not weights.symmetric:
            raise ConfigError(f"{config}: config group {name!r} is asymmetric (zero points); only symmetric FP8 imports")
        if weights.block_structure or weights.group_size or weights.strategy not in ("tensor", "channel"):
            shape = ", ".join(
                f"{key} {value}" for key, value in (("block", weights.block_structure), ("group", weights.group_size)) if value
            )
            raise ConfigError(
                f"{config}: config group {name!r} uses {weights.strategy or 'unstated'} weight scales"
                + (f" ({shape})" if shape else "")
                + "; only tensor or channel import"
            )
        inputs = group.input_activations
        activation = "none" if inputs is None else ("dynamic" if inputs.dynamic else f"static {inputs.strategy}")
        if inputs is not None and not inputs.dynamic and inputs.strategy != "tensor":
            raise ConfigError(
                f"{config}: config group {name!r} has {activation} activation scales; only tensor-wise static ones import"
            )
        described.append(f"FP8 weights per {weights.strategy}, activations {activation}")
    if not described:
        raise ConfigError(f"{config}: compressed-tensors config without config_groups")
    return "; ".join(sorted(set(described)))


def _input_range(raw: dict) -> float:
    """The range the input scales were made for: 448 (compressed-tensors' own), or what an ``export-compressed-tensors
    --fp8-max 240`` recorded under ``quantization_config.hpu_fp8.fp8_max``, so that its act_amax comes back exactly."""
    exported = raw.get("hpu_fp8")
    return 240.0 if isinstance(exported, dict) and exported.get("fp8_max") == 240 else E4M3FN_MAX


def _imported_amax(checkpoint: Checkpoint, d: ModelDescriptor, fp8_max: float) -> tuple[dict[str, float], set[str]]:
    """input_scale x ``fp8_max`` per act module (max over the parts that share the input), k/v scales likewise;
    and the names of the scale tensors read."""
    amax: dict[str, float] = {}
    read: set[str] = set()

    def add(module: str, tensor: str) -> None:
        value = float(read_scale(checkpoint, tensor).reshape(-1).max())
        if not np.isfinite(value) or value <= 0:
            raise ConfigError(f"{checkpoint.root}: '{tensor}' is {value}; an input scale must be finite and > 0")
        problem = act_amax_problem(value * fp8_max)
        if problem:
            raise ConfigError(f"{checkpoint.root}: '{tensor}' is {value:g}, so its {problem}")
        amax[module] = max(amax.get(module, 0.0), value * fp8_max)
        read.add(tensor)

    for w in d.weights():
        if not w.is_linear:
            continue
        assert w.layer is not None  # every linear weight belongs to a decoder layer
        module = names.shared_expert_input(d.prefix, w.layer) if w.role is Role.EXPERT_UP_GATE else w.module
        for p in w.source_parts(Layout.TORCH, d.prefix):
            tensor = p.name.removesuffix("weight") + "input_scale"
            if tensor in checkpoint.tensors:
                add(module, tensor)
        if w.role is Role.ATTN_QKV:
            base = w.source_parts(Layout.TORCH, d.prefix)[0].name.rsplit(".", 2)[0]
            for point, stem in (("cache_k", "k"), ("cache_v", "v")):
                for tensor in (f"{base}.{stem}_scale", f"{base}.{stem}_proj.output_scale"):
                    if tensor in checkpoint.tensors:
                        add(names.attention_point(d.prefix, w.layer, point), tensor)
    return amax, read


def compressed_tensors_scheme(src: str | Path) -> str:
    """The scheme of a compressed-tensors FP8 checkpoint this importer reads, or a named refusal: checked before any work."""
    return _scheme(Path(src), Checkpoint.open(src).config)


def _scheme(src: Path, config: dict) -> str:
    """The scheme named by ``config``'s quantization_config, or a named refusal."""
    return _check_scheme(src, _parse_config(src, config.get("quantization_config")))


def import_compressed_tensors(
    src: str | Path,
    out: str | Path,
    options: ConvertOptions | None = None,
    measurements: Sequence[Measurements] = (),
    progress: Callable[[ConvertProgress], None] | None = None,
) -> CompressedTensorsImportResult:
    """A compressed-tensors FP8 checkpoint -> hpu-fp8 v1 at ``options.fp8_max`` (±240 for Gaudi2).

    For llm-compressor's FP8 output (what vLLM reads): OCP-range (±448) weights with tensor-wise or per-channel
    scales. Every linear is dequantized from the source's own FP8 values and requantized exactly once to the
    spec's scales and range (q|k|v and gate|up fused under one tensor-wise scale); the error that adds is measured
    per tensor. The source's static input scales become act_amax (``input_scale`` x 448, provenance
    ``imported-input-scale``), and so do its ``k_scale`` / ``v_scale``; ``measurements`` fill the points it lacks
    (for dynamic activations: a calibration of ``src`` itself, which the reference engine reads as
    fp8 x weight_scale). The scheme is checked before any work.

    Args:
        src: the compressed-tensors checkpoint directory (``quant_method: compressed-tensors``,
            ``float-quantized`` format, Hugging Face torch layout).
        out: the checkpoint directory to write.
        options: as for :func:`~hpu_fp8_loader.convert`; ``ConvertOptions()`` by default (Gaudi2, FP8 KV cache).
        measurements: activation measurements for the points the source has no static scale for; where both
            have a point, the source's own scale wins.
        progress: called after each tensor with a :class:`~hpu_fp8_loader.conversion.convert.ConvertProgress`, as
            :func:`~hpu_fp8_loader.convert` calls it.

    Returns:
        A :class:`~hpu_fp8_loader.CompressedTensorsImportResult`: the scheme found, the requantization error per
        tensor, and warnings.

    Raises:
        ConfigError: no ``quantization_config``, or not compressed-tensors, or a scheme that does not import (not
            FP8 float-quantized, asymmetric, block or group weight scales, non-tensor static activation scales,
            sparse weights, no config groups); an input scale that is not finite and positive or gives an amax out
            of range; and everything :func:`~hpu_fp8_loader.convert` refuses as ConfigError.
        MeasurementError: activations are dynamic (no input scales) and no ``measurements`` were given, or what
            :func:`~hpu_fp8_loader.convert` refuses about measurements (points still lacking, another model).
        UnknownArchitectureError: config.json's model_type is not supported.
        CheckpointNotFoundError: ``src`` is not a directory, or a shard is missing.
        NonFiniteError: a weight holds NaN or inf, or its dequantized values overflow float32.
        OutputExistsError: ``out`` exists and ``options.force`` is false.
        HpuFp8Error: every other refusal of :func:`~hpu_fp8_loader.convert` (output, index and shard errors are
            its subclasses listed there).

    Example:
        >>> from hpu_fp8_loader import calibrate, import_compressed_tensors
        >>> # dynamic activations: calibrate the FP8 source itself for the points it has no scale for
        >>> calibration = calibrate("Qwen2-7B-FP8-dynamic", samples=64, seq_len=512)
        >>> result = import_compressed_tensors("Qwen2-7B-FP8-dynamic", "qwen2-7b-fp8", measurements=[calibration.measurements])
        >>> result.out
        PosixPath('qwen2-7b-fp8')
    """
    options = options or ConvertOptions()
    checkpoint = Checkpoint.open(src)
    raw = checkpoint.config.get("quantization_config")
    scheme = _scheme(Path(src), checkpoint.config)  # the checkpoint is opened once
    assert isinstance(raw, dict)  # compressed_tensors_scheme refused a config without a quantization_config object
    d = describe(checkpoint.config)
    result = CompressedTensorsImportResult(Path(out), scheme)
    imported, scale_tensors = _imported_amax(checkpoint, d, _input_range(raw))
    sources = []
    if imported:
        sources.append(
            Measurements(
                provenance=MeasurementProvenance(kind=AmaxSourceKind.IMPORTED_INPUT_SCALE, files=[Path(src).name]), amax=imported
            )
        )
    for m in measurements:  # the source's own static scales take precedence; the rest fill the gaps
        sources.append(m.model_copy(update={"amax": {k: v for k, v in m.amax.items() if k not in imported}}))
    if not sources:
        raise MeasurementError(f"{src}: dynamic activations carry no statistics; pass --measurements or --calibrate")
    routers = [
        p for w in d.weights() if w.role in (Role.ROUTER, Role.ROUTER_BIAS) for p in w.source_parts(Layout.TORCH, d.prefix)
    ]
    for part in routers:
        if part.name in checkpoint.tensors and checkpoint.tensors[part.name].dtype == "F8_E4M3":
            result.warnings.append(
                f"{part.name}: quantized in the source (its ignore list {raw.get('ignore')} misses the router); "
                "dequantized to float32, as FastDeploy keeps the router unquantized"
            )
    # the converter reads FP8 sources as fp8 x weight_scale
    converted = convert(src, out, sources, options, progress, used_elsewhere=scale_tensors)
    result.errors = list(converted.requantization_errors.items())
    return result

"""Block-wise FP8 checkpoints (Qwen3-*-FP8, DeepSeek, ERNIE-4.5-300B-A47B-FP8-Paddle) -> hpu-fp8 v1.

FastDeploy's HPU path holds no 128x128 blocks: one tensor-wise scale per dense linear (q|k|v and gate|up fused)
and one scale per output channel for routed experts, at ±240 on Gaudi2. So every linear is dequantized block by
block as the converter's workers read it (fp8 x its block's scale, float32, a row block at a time, never a whole
model) and quantized once to those scales; the relative error that adds is measured per linear, as the
compressed-tensors import measures it. Block checkpoints quantize activations dynamically and carry no statistics:
they come from measurements, or from a calibration of the dequantized source itself (the reference engine reads
it through the same dequantizing view). MTP draft weights are left out with a warning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpu_fp8_loader.arch import Layout, ModelDescriptor, describe
from hpu_fp8_loader.conversion.convert import ConvertProgress, convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.errors import ConfigError, MeasurementError
from hpu_fp8_loader.io.checkpoint import CONFIG_FILE, Checkpoint
from hpu_fp8_loader.sources.block_fp8 import block_fp8_scheme, open_source
from hpu_fp8_loader.sources.source_tensors import check_source, detect_layout
from hpu_fp8_loader.spec.measurements import Measurements

__all__ = ["BlockFp8ImportResult", "import_block_fp8"]


@dataclass
class BlockFp8ImportResult:
    """What :func:`import_block_fp8` wrote, and what requantizing the blocks cost.

    Attributes:
        out: the published hpu-fp8 v1 checkpoint directory.
        scheme: the source's scheme, in words, such as ``"block-wise FP8 (Hugging Face layout, 128x128 blocks, ...)"``.
        errors: ``(spec tensor, relative RMSE)`` that requantizing the dequantized blocks to one tensor-wise scale
            (channel-wise for routed experts) added, worst first.
        left_out: the source tensors not carried over, in words, such as ERNIE's MTP draft weights (the converter
            also logs each as a warning).

    Example:
        >>> result = import_block_fp8("ERNIE-4.5-300B-A47B-FP8-Paddle", "ernie-300b-fp8", measurements=[amax])
        >>> print(result.scheme, result.errors[:3], result.left_out)
    """

    out: Path
    scheme: str
    errors: list[tuple[str, float]] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)


def _check_blocks_stored(checkpoint: Checkpoint, descriptor: ModelDescriptor, layout: Layout, scheme: str) -> None:
    """Refuse a checkpoint whose config.json claims block FP8 while a linear is stored otherwise (a BF16 checkpoint
    given a block-FP8 config): its output would say it came from block FP8, and the requantization errors printed
    would be of a quantization that never happened."""
    for w in descriptor.weights():
        for part in w.source_parts(layout, descriptor.prefix) if w.is_linear else ():
            stored = checkpoint.tensors[part.name]
            if stored.dtype != "F8_E4M3":
                raise ConfigError(
                    f"{checkpoint.root}: config.json names {scheme}, but '{stored.name}' is {stored.dtype}; "
                    "a block-FP8 checkpoint stores every linear as F8_E4M3 blocks (a BF16 checkpoint converts "
                    "with `hpu-fp8 convert`)"
                )


def import_block_fp8(
    src: str | Path,
    out: str | Path,
    options: ConvertOptions | None = None,
    measurements: Sequence[Measurements] = (),
    progress: Callable[[ConvertProgress], None] | None = None,
) -> BlockFp8ImportResult:
    """A block-wise FP8 checkpoint (Hugging Face or FastDeploy Paddle layout) -> hpu-fp8 v1 at ``options.fp8_max``.

    Args:
        src: the checkpoint directory (``quant_method: fp8`` with ``weight_block_size``, or ``mix_quant`` with
            ``block_wise_fp8``).
        out: the checkpoint directory to write (the output-path and resume rules of :func:`~hpu_fp8_loader.convert`).
        options: as for :func:`~hpu_fp8_loader.convert`.
        measurements: activation statistics for every point (the source has none): measurement files, or a
            calibration of ``src`` itself.
        progress: called after each tensor with a :class:`~hpu_fp8_loader.conversion.convert.ConvertProgress`, as
            :func:`~hpu_fp8_loader.convert` calls it.

    Returns:
        A :class:`BlockFp8ImportResult`: the scheme, the error the requantization added per linear, what was left out.

    Raises:
        ConfigError: config.json names no block FP8, a block size that is missing or not two positive integers,
            static activations; in the Paddle layout, a quant type missing or not block_wise_fp8, another block
            size, ``is_quantized`` not true; a linear not stored as F8_E4M3; a weight without its
            ``weight_scale_inv`` (``weight_scale`` in the Paddle layout), with a scale grid of the wrong shape or a
            scale that is not floating point; and everything :func:`~hpu_fp8_loader.convert` refuses.
        MeasurementError: no ``measurements``, or what :func:`~hpu_fp8_loader.convert` refuses about them.
        HpuFp8Error: every other refusal of :func:`~hpu_fp8_loader.convert`.

    Example:
        >>> from hpu_fp8_loader import calibrate
        >>> from hpu_fp8_loader.conversion.block_fp8 import import_block_fp8
        >>> calibration = calibrate("Qwen3-8B-FP8", samples=64, seq_len=512)  # reads the blocks dequantized
        >>> result = import_block_fp8("Qwen3-8B-FP8", "qwen3-8b-hpu-fp8", measurements=[calibration.measurements])
        >>> worst_tensor, worst_error = result.errors[0]
    """
    options = options or ConvertOptions()
    checkpoint = open_source(src)
    scheme = block_fp8_scheme(checkpoint.config, Path(src) / CONFIG_FILE)
    if scheme is None:
        raise ConfigError(f"{src}: config.json names no block-wise FP8 quantization_config; not a block-FP8 checkpoint")
    if not measurements:
        raise MeasurementError(
            f"{src}: a block-wise FP8 checkpoint quantizes activations dynamically and carries no statistics; "
            "pass --measurements or --calibrate"
        )
    descriptor = describe(checkpoint.config, str(Path(src) / CONFIG_FILE), checkpoint.tensors)
    result = BlockFp8ImportResult(Path(out), scheme)
    layout = detect_layout(checkpoint, descriptor)
    result.left_out = check_source(checkpoint, descriptor, layout)  # refused before work
    _check_blocks_stored(checkpoint, descriptor, layout, scheme)
    converted = convert(src, out, measurements, options, progress)
    result.errors = list(converted.requantization_errors.items())
    return result

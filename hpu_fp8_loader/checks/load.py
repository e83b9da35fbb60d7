"""Loading an hpu-fp8 checkpoint for use: resolve a directory or Hub id, check it quickly, read its config.

What the FastDeploy hook, ``pull`` and ``doctor`` call before anyone reads a weight: a checkpoint that fails
here never reaches FastDeploy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpu_fp8_loader.checks.validate import validate
from hpu_fp8_loader.errors import ChecksumMismatchError, HpuFp8Error
from hpu_fp8_loader.io.checkpoint import read_config
from hpu_fp8_loader.sources.resolve import SPEC_PATTERNS, resolve_checkpoint
from hpu_fp8_loader.spec.config import QuantizationConfig, parse_quantization_config

__all__ = ["LoadedCheckpoint", "load"]


@dataclass
class LoadedCheckpoint:
    """An hpu-fp8 checkpoint that passed :func:`load`'s checks, ready to use.

    Attributes:
        path: the local directory: the one given, or the Hub snapshot in the Hugging Face cache.
        quantization_config: the checkpoint's parsed :class:`~hpu_fp8_loader.QuantizationConfig`.
        warnings: what the validation found valid but worth knowing (such as an fp8_max FastDeploy cannot serve).

    Example:
        >>> from hpu_fp8_loader import load
        >>> checkpoint = load("qwen2-fp8")  # or a Hub repo id: then path is its snapshot in the Hugging Face cache
        >>> checkpoint.path, checkpoint.quantization_config.kv_cache_scheme
        (PosixPath('qwen2-fp8'), <KvCacheScheme.FP8: 'fp8'>)
    """

    path: Path
    quantization_config: QuantizationConfig
    warnings: list[str]


def load(location: str | Path, revision: str | None = None, hashes: bool = True) -> LoadedCheckpoint:
    """An hpu-fp8 checkpoint from a directory or the Hub, checked before anyone uses it.

    Checks: it is an hpu-fp8 checkpoint (a legacy FastDeploy one gets the import-legacy command),
    its format_version, the manifest (sizes, and sha256 when ``hashes``), and the quick validation
    (headers, index, config, scales). The offline cache is used when ``HF_HUB_OFFLINE=1``. What the
    FastDeploy hook, ``hpu-fp8 pull`` and ``doctor`` call before anyone reads a weight.

    Args:
        location: a local checkpoint directory, or a Hub repo id (``ORG/NAME``), downloaded through huggingface_hub
            (its cache, token and ``HF_ENDPOINT`` apply).
        revision: the Hub branch, tag or commit (``main`` by default); ignored for a local directory.
        hashes: also check every file's sha256 against the manifest (a download's guard against corruption).

    Returns:
        A :class:`~hpu_fp8_loader.LoadedCheckpoint`: the local path, the parsed quantization_config and warnings.

    Raises:
        CheckpointNotFoundError: no such directory and not a repo id; a file, not a directory; the Hub repository
            is missing, gated or private, or the revision does not exist; offline and not in the cache.
        HubError: the Hub cannot be reached or refused the request, or ``HF_ENDPOINT`` is no URL.
        NotHpuFp8CheckpointError: not an hpu-fp8 checkpoint (the message names the command for a BF16 source or a
            legacy FastDeploy checkpoint).
        UnsupportedFormatVersionError: the checkpoint declares a format_version this reader does not implement.
        ConfigError: config.json is missing or invalid.
        UnknownArchitectureError: config.json's model_type is not supported.
        ChecksumMismatchError: files disagree with the manifest (sizes, or sha256 with ``hashes``): a corrupt or
            partial download.
        HpuFp8Error: any other violation of the spec (the first five are listed), or a revision that is no valid
            git ref name.

    Example:
        >>> from hpu_fp8_loader import load
        >>> checkpoint = load("qwen2-fp8")
        >>> checkpoint.quantization_config.target, checkpoint.warnings
        (<Target.GAUDI2: 'gaudi2'>, [])
    """
    path = resolve_checkpoint(location, revision, SPEC_PATTERNS)
    report = validate(path, full=False, hashes=hashes)  # raises for "not hpu-fp8", format_version, unreadable
    manifest = [v for v in report.violations if v.rule == "container.manifest"]
    if manifest:
        raise ChecksumMismatchError(f"{location}: " + "; ".join(v.message for v in manifest[:5]))
    if not report.valid:
        listing = "; ".join(f"[{v.rule}] {v.where}: {v.message}" for v in report.violations[:5])
        raise HpuFp8Error(f"{location}: not a valid hpu-fp8 checkpoint: {listing}")
    return LoadedCheckpoint(path, parse_quantization_config(read_config(path)), report.warnings)

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
    path: Path
    quantization_config: QuantizationConfig
    warnings: list[str]


def load(location: str | Path, revision: str | None = None, hashes: bool = True) -> LoadedCheckpoint:
    """An hpu-fp8 checkpoint from a directory or the Hub, checked before anyone uses it.

    Checks: it is an hpu-fp8 checkpoint (a legacy FastDeploy one gets the import-legacy command),
    its format_version, the manifest (sizes, and sha256 when ``hashes``), and the quick validation
    (headers, index, config, scales). The offline cache is used when ``HF_HUB_OFFLINE=1``.
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

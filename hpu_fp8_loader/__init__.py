"""hpu-fp8-loader: FP8 checkpoints for FastDeploy on Intel Gaudi, made, checked and loaded on a CPU.

The front door: every name a user needs, imported on first use, so that ``import hpu_fp8_loader``
stays cheap (FastDeploy imports the package when its plugin is registered). The pipeline reads
top to bottom:

    >>> from hpu_fp8_loader import TINY_MODELS, calibrate, convert, validate, evaluate
    >>> source = TINY_MODELS["qwen2-bytes"]
    >>> calibration = calibrate(source, samples=8, seq_len=64)   # float32 reference engine, on a CPU
    >>> result = convert(source, "qwen2-fp8", [calibration.measurements])
    >>> validate("qwen2-fp8", full=True).valid
    True
    >>> evaluation = evaluate(source, "qwen2-fp8", samples=2, seq_len=64)  # Gaudi FP8, emulated

README.md's "From Python" section runs this flow on the embedded tiny model (tests/test_front_door.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# module -> the names it lends the front door, in pipeline order
_EXPORTS: dict[str, tuple[str, ...]] = {
    "hpu_fp8_loader.sources.tiny_models": ("TINY_MODELS",),
    "hpu_fp8_loader.sources.synth": ("preset_config", "synthesize"),
    "hpu_fp8_loader.conversion.folds": ("Fold",),
    "hpu_fp8_loader.quality.stress": ("StressResult", "stress_model"),
    "hpu_fp8_loader.sources.measurements": ("load_measurement_sets", "load_measurements", "read_measurements", "write_measurements"),
    "hpu_fp8_loader.spec.measurements": ("Measurements",),
    "hpu_fp8_loader.spec.config": ("Bf16Group", "KvCacheScheme", "QuantizationConfig", "Target"),
    "hpu_fp8_loader.quality.calibrate": ("CalibrationOptions", "CalibrationResult", "calibrate"),
    "hpu_fp8_loader.conversion.plan": ("ConvertOptions",),
    "hpu_fp8_loader.conversion.convert": ("ConvertResult", "convert"),
    "hpu_fp8_loader.quality.quantize": ("QuantizeResult", "quantize"),
    "hpu_fp8_loader.conversion.block_fp8": ("BlockFp8ImportResult", "import_block_fp8"),
    "hpu_fp8_loader.conversion.compressed_tensors": ("CompressedTensorsImportResult", "import_compressed_tensors"),
    "hpu_fp8_loader.conversion.legacy_import": ("LegacyImportResult", "import_legacy"),
    "hpu_fp8_loader.conversion.retarget": ("RetargetResult", "retarget"),
    "hpu_fp8_loader.checks.validate": ("ValidationReport", "validate"),
    "hpu_fp8_loader.checks.inspection": ("Inspection", "inspect_checkpoint"),
    "hpu_fp8_loader.checks.load": ("LoadedCheckpoint", "load"),
    "hpu_fp8_loader.quality.evaluate": ("EvaluationResult", "evaluate"),
    "hpu_fp8_loader.quality.report": ("Report",),
    "hpu_fp8_loader.fastdeploy.mapping": ("MappedPiece", "Parallelism"),
    "hpu_fp8_loader.fastdeploy.rankfiles": ("rank_parameters",),
    "hpu_fp8_loader.fastdeploy.plan": ("DeploymentPlan", "describe_model", "plan_deployment"),
    "hpu_fp8_loader.fastdeploy.legacy": ("LegacyExportResult", "export_legacy"),
    "hpu_fp8_loader.conversion.ct_export": ("CompressedTensorsExportResult", "export_compressed_tensors"),
    "hpu_fp8_loader.errors": (
        "CheckpointIndexError", "CheckpointNotFoundError", "ChecksumMismatchError", "ConfigError", "DatasetError",
        "HpuFp8Error", "HubError", "MeasurementError", "MissingDependencyError", "NonFiniteError", "NotHpuFp8CheckpointError",
        "OutOfMemoryError", "OutputExistsError", "OutputLockedError", "SafetensorsFormatError", "TokenizerError",
        "UnknownArchitectureError", "UnsafePathError", "UnsupportedFormatVersionError", "UploadError", "WorkerDiedError",
        "WriteFailedError",
    ),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["__version__", *sorted(_MODULE_OF)]


def __getattr__(name: str) -> Any:
    """Import the module that holds ``name`` on first use, then keep the name here."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'hpu_fp8_loader' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)


if TYPE_CHECKING:  # what type checkers and editors see; the same names __getattr__ lends at run time
    from hpu_fp8_loader.checks.inspection import Inspection as Inspection
    from hpu_fp8_loader.checks.inspection import inspect_checkpoint as inspect_checkpoint
    from hpu_fp8_loader.checks.load import LoadedCheckpoint as LoadedCheckpoint
    from hpu_fp8_loader.checks.load import load as load
    from hpu_fp8_loader.checks.validate import ValidationReport as ValidationReport
    from hpu_fp8_loader.checks.validate import validate as validate
    from hpu_fp8_loader.conversion.block_fp8 import BlockFp8ImportResult as BlockFp8ImportResult
    from hpu_fp8_loader.conversion.block_fp8 import import_block_fp8 as import_block_fp8
    from hpu_fp8_loader.conversion.compressed_tensors import CompressedTensorsImportResult as CompressedTensorsImportResult
    from hpu_fp8_loader.conversion.compressed_tensors import import_compressed_tensors as import_compressed_tensors
    from hpu_fp8_loader.conversion.convert import ConvertResult as ConvertResult
    from hpu_fp8_loader.conversion.convert import convert as convert
    from hpu_fp8_loader.conversion.ct_export import CompressedTensorsExportResult as CompressedTensorsExportResult
    from hpu_fp8_loader.conversion.ct_export import export_compressed_tensors as export_compressed_tensors
    from hpu_fp8_loader.conversion.folds import Fold as Fold
    from hpu_fp8_loader.conversion.legacy_import import LegacyImportResult as LegacyImportResult
    from hpu_fp8_loader.conversion.legacy_import import import_legacy as import_legacy
    from hpu_fp8_loader.conversion.plan import ConvertOptions as ConvertOptions
    from hpu_fp8_loader.conversion.retarget import RetargetResult as RetargetResult
    from hpu_fp8_loader.conversion.retarget import retarget as retarget
    from hpu_fp8_loader.errors import CheckpointIndexError as CheckpointIndexError
    from hpu_fp8_loader.errors import CheckpointNotFoundError as CheckpointNotFoundError
    from hpu_fp8_loader.errors import ChecksumMismatchError as ChecksumMismatchError
    from hpu_fp8_loader.errors import ConfigError as ConfigError
    from hpu_fp8_loader.errors import DatasetError as DatasetError
    from hpu_fp8_loader.errors import HpuFp8Error as HpuFp8Error
    from hpu_fp8_loader.errors import HubError as HubError
    from hpu_fp8_loader.errors import MeasurementError as MeasurementError
    from hpu_fp8_loader.errors import MissingDependencyError as MissingDependencyError
    from hpu_fp8_loader.errors import NonFiniteError as NonFiniteError
    from hpu_fp8_loader.errors import NotHpuFp8CheckpointError as NotHpuFp8CheckpointError
    from hpu_fp8_loader.errors import OutOfMemoryError as OutOfMemoryError
    from hpu_fp8_loader.errors import OutputExistsError as OutputExistsError
    from hpu_fp8_loader.errors import OutputLockedError as OutputLockedError
    from hpu_fp8_loader.errors import SafetensorsFormatError as SafetensorsFormatError
    from hpu_fp8_loader.errors import TokenizerError as TokenizerError
    from hpu_fp8_loader.errors import UnknownArchitectureError as UnknownArchitectureError
    from hpu_fp8_loader.errors import UnsafePathError as UnsafePathError
    from hpu_fp8_loader.errors import UnsupportedFormatVersionError as UnsupportedFormatVersionError
    from hpu_fp8_loader.errors import UploadError as UploadError
    from hpu_fp8_loader.errors import WorkerDiedError as WorkerDiedError
    from hpu_fp8_loader.errors import WriteFailedError as WriteFailedError
    from hpu_fp8_loader.fastdeploy.legacy import LegacyExportResult as LegacyExportResult
    from hpu_fp8_loader.fastdeploy.legacy import export_legacy as export_legacy
    from hpu_fp8_loader.fastdeploy.mapping import MappedPiece as MappedPiece
    from hpu_fp8_loader.fastdeploy.mapping import Parallelism as Parallelism
    from hpu_fp8_loader.fastdeploy.plan import DeploymentPlan as DeploymentPlan
    from hpu_fp8_loader.fastdeploy.plan import describe_model as describe_model
    from hpu_fp8_loader.fastdeploy.plan import plan_deployment as plan_deployment
    from hpu_fp8_loader.fastdeploy.rankfiles import rank_parameters as rank_parameters
    from hpu_fp8_loader.quality.calibrate import CalibrationOptions as CalibrationOptions
    from hpu_fp8_loader.quality.calibrate import CalibrationResult as CalibrationResult
    from hpu_fp8_loader.quality.calibrate import calibrate as calibrate
    from hpu_fp8_loader.quality.evaluate import EvaluationResult as EvaluationResult
    from hpu_fp8_loader.quality.evaluate import evaluate as evaluate
    from hpu_fp8_loader.quality.quantize import QuantizeResult as QuantizeResult
    from hpu_fp8_loader.quality.quantize import quantize as quantize
    from hpu_fp8_loader.quality.report import Report as Report
    from hpu_fp8_loader.quality.stress import StressResult as StressResult
    from hpu_fp8_loader.quality.stress import stress_model as stress_model
    from hpu_fp8_loader.sources.measurements import load_measurement_sets as load_measurement_sets
    from hpu_fp8_loader.sources.measurements import load_measurements as load_measurements
    from hpu_fp8_loader.sources.measurements import read_measurements as read_measurements
    from hpu_fp8_loader.sources.measurements import write_measurements as write_measurements
    from hpu_fp8_loader.sources.synth import preset_config as preset_config
    from hpu_fp8_loader.sources.synth import synthesize as synthesize
    from hpu_fp8_loader.sources.tiny_models import TINY_MODELS as TINY_MODELS
    from hpu_fp8_loader.spec.config import Bf16Group as Bf16Group
    from hpu_fp8_loader.spec.config import KvCacheScheme as KvCacheScheme
    from hpu_fp8_loader.spec.config import QuantizationConfig as QuantizationConfig
    from hpu_fp8_loader.spec.config import Target as Target
    from hpu_fp8_loader.spec.measurements import Measurements as Measurements

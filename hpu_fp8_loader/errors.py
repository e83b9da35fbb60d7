"""Every failure a user can cause has its own exception class.

The CLI catches :class:`HpuFp8Error` once and prints its message as a single line, so each message
names the file, tensor or key at fault and, where there is one, what to do next. A bug of ours is a
``RuntimeError`` ("internal error: ..."), never one of these: no input can fix it, and its traceback is
what a bug report needs.
"""

from __future__ import annotations

__all__ = [
    "CheckpointIndexError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "ConfigError",
    "HpuFp8Error",
    "HubError",
    "MeasurementError",
    "NonFiniteError",
    "NotHpuFp8CheckpointError",
    "OutputExistsError",
    "OutputLockedError",
    "SafetensorsFormatError",
    "UnknownArchitectureError",
    "UnsafePathError",
    "UnsupportedFormatVersionError",
    "UploadError",
    "WorkerDiedError",
    "WriteFailedError",
    "one_line",
]


def one_line(value: object) -> str:
    """``value`` as text on one line, as an error line (or a card's line) must be: line breaks and other
    control characters become single spaces. For the messages of libraries, which span lines."""
    return " ".join("".join(c if c.isprintable() else " " for c in str(value)).split())


class HpuFp8Error(Exception):
    """Base class: an error caused by the input or the environment, never a bug of ours."""


class CheckpointNotFoundError(HpuFp8Error):
    """The checkpoint directory or one of its required files does not exist."""


class ConfigError(HpuFp8Error):
    """config.json is missing, is not JSON, or breaks the schema."""


class NotHpuFp8CheckpointError(ConfigError):
    """A checkpoint without an hpu-fp8 quantization_config was given where one was required."""


class UnsupportedFormatVersionError(ConfigError):
    """The checkpoint declares a format_version this reader does not implement."""


class UnknownArchitectureError(ConfigError):
    """config.json names a model_type no descriptor exists for."""


class SafetensorsFormatError(HpuFp8Error):
    """A safetensors file is truncated, has a corrupt header, or its offsets do not fit the file."""


class UnsafePathError(HpuFp8Error):
    """An index entry points outside the checkpoint directory (absolute path, `..`, symlink escape)."""


class CheckpointIndexError(HpuFp8Error):
    """model.safetensors.index.json is missing, malformed, or disagrees with the shard files."""


class NonFiniteError(HpuFp8Error):
    """A tensor that must be quantized holds NaN or inf; FP8 casts must never see them."""


class MeasurementError(HpuFp8Error):
    """A measurement file is malformed or does not fit the model."""


class OutputExistsError(HpuFp8Error):
    """The output path exists and overwriting it was not asked for."""


class WorkerDiedError(HpuFp8Error):
    """A worker process was killed (the out-of-memory killer, a signal) in the middle of its work."""


class WriteFailedError(HpuFp8Error):
    """Writing output failed (no space left, a file-size limit, an I/O error); nothing was published.

    ``reason`` is the system's reason alone, for a caller that words the message for its own output.
    """

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


class OutputLockedError(HpuFp8Error):
    """Another run is writing the same output; two writers in one staging directory corrupt each other."""


class HubError(HpuFp8Error):
    """The Hub refused a request or could not be reached (no network, an HF_ENDPOINT that is no URL, HTTP errors)."""


class ChecksumMismatchError(HpuFp8Error):
    """Files of a checkpoint disagree with its manifest (a corrupt or partial download)."""


class UploadError(HubError):
    """The Hub refused or interrupted the upload, or the uploaded files differ from the local ones."""

"""Every failure a user can cause has its own exception class.

The CLI catches :class:`HpuFp8Error` once and prints its message as a single line, so each message
names the file, tensor or key at fault and, where there is one, what to do next. A bug of ours is a
``RuntimeError`` ("internal error: ..."), never one of these: no input can fix it, and its traceback is
what a bug report needs.

The classes for malformed input (config, safetensors, index, measurements, values, checksums, unsafe paths) also
derive from ``ValueError``, so that code catching it catches ours too. None derives from ``OSError``: the code
turns a system's ``OSError`` into ``WriteFailedError`` and the like, and must never mistake one of ours for one.

One exception class lives elsewhere, on purpose: ``quality/chat_template.py``'s ``_OutputLimitError`` is a private
signal inside the child interpreter that renders a chat template (a template whose output passes the limit), caught
there and reported as a :class:`TokenizerError` naming the record; it never reaches a caller, so it is no user error.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "OPTIONAL_DEPENDENCIES",
    "CheckpointIndexError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "ConfigError",
    "DatasetError",
    "HpuFp8Error",
    "HubError",
    "MalformedReplyError",
    "MeasurementError",
    "MissingDependencyError",
    "NonFiniteError",
    "NotHpuFp8CheckpointError",
    "OutOfMemoryError",
    "OutputExistsError",
    "OutputLockedError",
    "SafetensorsFormatError",
    "TokenizerError",
    "UnknownArchitectureError",
    "UnsafePathError",
    "UnsupportedFormatVersionError",
    "UploadError",
    "WorkerDiedError",
    "WriteFailedError",
    "command_line",
    "force_flag",
    "one_line",
    "require_optional",
    "spelled",
]

# True while the ``hpu-fp8`` command runs a command: messages then name its options, otherwise Python's parameters.
_COMMAND_LINE = contextvars.ContextVar("hpu_fp8_command_line", default=False)


@contextmanager
def command_line() -> Iterator[None]:
    """While the block runs, messages name the command line's options (the CLI wraps every command in it)."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def spelled(option: str, parameter: str) -> str:
    """A choice as the reader of a message makes it: ``option`` (``--force``) under the ``hpu-fp8`` command,
    ``parameter`` (``force=True``) from Python. One message then serves both, instead of telling a Python caller
    to pass a command-line flag."""
    return option if _COMMAND_LINE.get() else parameter


def force_flag() -> str:
    """``--force`` on the command line, ``force=True`` from Python: what every refusal to replace an output names."""
    return spelled("--force", "force=True")


def one_line(value: object) -> str:
    """``value`` as text on one line, as an error line (or a card's line) must be: line breaks and other
    control characters become single spaces. For the messages of libraries, which span lines."""
    return " ".join("".join(c if c.isprintable() else " " for c in str(value)).split())


class HpuFp8Error(Exception):
    """Base class: an error caused by the input or the environment, never a bug of ours.

    Every failure a user can cause is a subclass (or, for a few rarer refusals, this class itself); its message is
    one line that names the file, tensor or key at fault. Catch it to handle them all, as the CLI does.

    Example:
        >>> from hpu_fp8_loader import HpuFp8Error, validate
        >>> try:
        ...     validate("not-a-checkpoint")
        ... except HpuFp8Error as exc:
        ...     print(f"hpu-fp8: error: {exc}")
        hpu-fp8: error: not-a-checkpoint: no such checkpoint directory
    """


class CheckpointNotFoundError(HpuFp8Error):
    """The checkpoint directory or one of its required files does not exist.

    Also raised by :func:`~hpu_fp8_loader.load` for a Hub repository that is missing, gated or private, a
    revision that does not exist, or a repo id that is neither cached nor reachable offline.

    Example:
        >>> try:
        ...     validate("qwen2-fp8-typo")
        ... except CheckpointNotFoundError as exc:
        ...     print(exc)
        qwen2-fp8-typo: no such checkpoint directory
    """


class ConfigError(HpuFp8Error, ValueError):
    """config.json is missing, is not JSON, or breaks the schema.

    Also raised for a model config or option that cannot be served or made: an unknown preset or config key, a
    tensor parallelism that does not split the model, a source tensor that does not fit its config.

    Example:
        >>> try:
        ...     preset_config("qwen2-tiny", {"hiden_size": 64})
        ... except ConfigError as exc:
        ...     print(exc)
        synth --set: unknown config key 'hiden_size' for qwen2-tiny; did you mean hidden_size, hidden_act?
    """


class NotHpuFp8CheckpointError(ConfigError):
    """A checkpoint without an hpu-fp8 quantization_config was given where one was required.

    Its message says what the checkpoint looks like instead (a BF16 source, a legacy FastDeploy one) and which
    command takes it.

    Example:
        >>> try:
        ...     load(TINY_MODELS["qwen2-bytes"])  # a BF16 source, not yet converted
        ... except NotHpuFp8CheckpointError:
        ...     convert(TINY_MODELS["qwen2-bytes"], "qwen2-fp8", [measurements])
    """


class UnsupportedFormatVersionError(ConfigError):
    """The checkpoint declares a format_version this reader does not implement.

    Example:
        >>> try:
        ...     load("org/made-by-a-newer-hpu-fp8-loader")
        ... except UnsupportedFormatVersionError as exc:
        ...     print(exc)  # "...: format_version is 2, but this reader implements format_version 1 only; upgrade ..."
    """


class UnknownArchitectureError(ConfigError):
    """config.json names a model_type no descriptor exists for (the supported ones: ernie4_5_moe, ernie4_5, qwen2, qwen3, qwen3_moe).

    Example:
        >>> try:
        ...     describe_model("Llama-3.1-8B")
        ... except UnknownArchitectureError as exc:
        ...     print(exc)  # "Llama-3.1-8B/config.json: model_type 'llama' is not supported; supported: ..."
    """


class SafetensorsFormatError(HpuFp8Error, ValueError):
    """A safetensors file is truncated, has a corrupt header, or its offsets do not fit the file.

    Example:
        >>> try:
        ...     convert("qwen2-bf16-partial-download", "qwen2-fp8", [measurements])
        ... except SafetensorsFormatError as exc:
        ...     print(exc)  # names the shard and what is wrong with it; download it again
    """


class UnsafePathError(HpuFp8Error, ValueError):
    """An index entry points outside the checkpoint directory (absolute path, `..`, symlink escape).

    Also raised for an output that is, lies inside or contains its source (which is never modified), and for
    a staging path ``OUT.partial`` this tool did not make: a link, a file, or a directory without its marker.

    Example:
        >>> try:
        ...     convert("qwen2-bf16", "qwen2-bf16/fp8", [measurements])
        ... except UnsafePathError as exc:
        ...     print(exc)
        qwen2-bf16/fp8: it lies inside the source qwen2-bf16; the source is never modified, choose another OUT
    """


class CheckpointIndexError(HpuFp8Error, ValueError):
    """model.safetensors.index.json is missing, malformed, or disagrees with the shard files.

    Example:
        >>> try:
        ...     convert("qwen2-bf16", "qwen2-fp8", [measurements])
        ... except CheckpointIndexError as exc:
        ...     print(exc)  # e.g. "qwen2-bf16/model.safetensors.index.json: tensor '...' is not in model-00001-of-00002..."
    """


class NonFiniteError(HpuFp8Error, ValueError):
    """A tensor that must be quantized holds NaN or inf; FP8 casts must never see them.

    Also raised when calibration or evaluation meets a NaN or inf activation or logit, and when a command reads a
    NaN code or value from an hpu-fp8 checkpoint; the message names the tensor (and the index of the first bad value).

    Example:
        >>> try:
        ...     calibrate("qwen2-bf16-diverged")
        ... except NonFiniteError as exc:
        ...     print(exc)  # "qwen2-bf16-diverged: activation qwen2.layers.3.mlp.down_proj holds inf on calibration ..."
    """


class MeasurementError(HpuFp8Error, ValueError):
    """A measurement file is malformed or does not fit the model.

    Example:
        >>> try:
        ...     convert("qwen2-bf16", "qwen2-fp8", [])
        ... except MeasurementError as exc:
        ...     print(exc)
        no measurements given; pass --measurements
    """


class DatasetError(HpuFp8Error, ValueError):
    """A calibration or evaluation dataset cannot be used: missing, not a regular UTF-8 file, a record without its
    text field (or ``messages``), a parquet file without the column, a directory without dataset files, a Hub
    dataset that is missing or not cached while offline.

    Example:
        >>> try:
        ...     calibrate("qwen2-bf16", dataset="corpus.parquet", text_field="content")
        ... except DatasetError as exc:
        ...     print(exc)  # "corpus.parquet: no column 'content' (columns: text, url)"
    """


class TokenizerError(HpuFp8Error, ValueError):
    """The model's tokenizer cannot be found, loaded or used: no tokenizer file for a vocabulary too large for byte
    tokens, a corrupt tokenizer.json / tokenizer.model / tokenizer_config.json, a token id beyond the model's
    vocab_size, a chat template that is missing or fails to render.

    Example:
        >>> try:
        ...     calibrate("Qwen2-7B-weights-only")  # a copy without its tokenizer files
        ... except TokenizerError as exc:
        ...     print(exc)  # "Qwen2-7B-weights-only: no tokenizer.json or tokenizer.model, and a vocabulary of ..."
    """


class OutputExistsError(HpuFp8Error):
    """The output path exists and overwriting it was not asked for.

    With ``force``, an output is replaced only if it is a checkpoint this tool wrote (it holds
    ``hpu_fp8_manifest.json``) or an empty directory; anything else is refused with this error too.

    Example:
        >>> try:
        ...     convert("qwen2-bf16", "qwen2-fp8", [measurements])
        ... except OutputExistsError:
        ...     convert("qwen2-bf16", "qwen2-fp8", [measurements], ConvertOptions(force=True))
    """


class MissingDependencyError(HpuFp8Error):
    """A command needs a library that a plain install leaves out; the message names the extra that brings it.

    The hook and the commands that make, check and serve checkpoints need only the package's own requirements, so
    that installing it into FastDeploy's environment adds little; reading a real model's tokenizer, a parquet
    dataset or drawing a report's plots needs an extra (:data:`OPTIONAL_DEPENDENCIES`).

    Example:
        >>> try:
        ...     calibrate("./Qwen2-7B-Instruct")  # tokenizer.json, without the calibrate extra
        ... except MissingDependencyError as exc:
        ...     print(exc)  # "...tokenizer.json: reading it needs tokenizers, not installed: pip install 'hpu-fp8-loader[calibrate]'"
    """


OPTIONAL_DEPENDENCIES: dict[str, str] = {
    "tokenizers": "calibrate",
    "sentencepiece": "calibrate",
    "pyarrow": "calibrate",
    "matplotlib": "report",
}
"""Module (and PyPI project) -> the extra of pyproject.toml that installs it (tests/test_packaging.py holds them equal)."""


def require_optional(module: str, needed_for: str) -> None:
    """Raise :class:`MissingDependencyError` if ``module`` (a key of :data:`OPTIONAL_DEPENDENCIES`) is not installed.

    Found without importing it, so a command checks before its work rather than failing at its end; ``needed_for``
    names what needs it ("eval-report: the report's plots").
    """
    import importlib.util

    extra = OPTIONAL_DEPENDENCIES[module]
    if importlib.util.find_spec(module) is None:
        raise MissingDependencyError(
            f"{needed_for} needs {module}, which is not installed: pip install 'hpu-fp8-loader[{extra}]' "
            f"(or pip install {module})"
        )


class WorkerDiedError(HpuFp8Error):
    """A worker process was killed (the out-of-memory killer, a signal) in the middle of its work.

    Nothing was published; the same call resumes from ``OUT.partial``, keeping the shards already finished.

    Example:
        >>> try:
        ...     convert("ERNIE-4.5-21B-A3B-PT", "ernie-fp8", [measurements], ConvertOptions(workers=16))
        ... except WorkerDiedError:  # out of memory? resume with fewer workers
        ...     convert("ERNIE-4.5-21B-A3B-PT", "ernie-fp8", [measurements], ConvertOptions(workers=4))
    """


class OutOfMemoryError(HpuFp8Error):
    """An allocation failed (a ``MemoryError``, numpy's included): the machine, ``ulimit -v`` or a container's limit
    leaves too little memory for the work asked.

    The message names the step (the tensor being converted, the model, windows and layer being run), what was
    being allocated (an array's shape, dtype and bytes, when numpy says) and the memory the process saw: RAM
    available, the ``ulimit -v`` limit and its use, a cgroup's headroom (:func:`hpu_fp8_loader.memory.out_of_memory`).

    Example:
        >>> try:
        ...     evaluate("qwen2-bf16", "qwen2-fp8", samples=256, seq_len=2048)
        ... except OutOfMemoryError as exc:
        ...     print(exc)  # "bf16: windows 0..3, layer 0: out of memory allocating 256 MiB for an array of shape ..."
    """


class WriteFailedError(HpuFp8Error):
    """Writing output failed (no space left, a file-size limit, an I/O error); nothing was published.

    ``reason`` is the system's reason alone, for a caller that words the message for its own output.

    Attributes:
        reason: the system's reason alone (such as ``"no space left on the device"``); the message itself when
            none was given.

    Example:
        >>> try:
        ...     convert("qwen2-bf16", "/mnt/small/qwen2-fp8", [measurements])
        ... except WriteFailedError as exc:
        ...     print(exc.reason)
        no space left on the device
    """

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


class OutputLockedError(HpuFp8Error):
    """Another run is writing the same output; two writers in one staging directory corrupt each other.

    The message names the other run (its pid and command line); the lock dies with that process.

    Example:
        >>> try:
        ...     convert("qwen2-bf16", "qwen2-fp8", [measurements])
        ... except OutputLockedError as exc:
        ...     print(exc)  # "qwen2-fp8: another hpu-fp8 run is writing it (pid 4242: ...); wait for it to finish ..."
    """


class HubError(HpuFp8Error):
    """The Hub refused a request or could not be reached (no network, an HF_ENDPOINT that is no URL, HTTP errors).

    The message names the repo id, the endpoint and the reason, never the token.

    Example:
        >>> try:
        ...     load("org/qwen2-7b-hpu-fp8")
        ... except HubError as exc:
        ...     print(exc)  # "org/qwen2-7b-hpu-fp8: the connection to the Hub at https://huggingface.co failed while ..."
    """


class MalformedReplyError(HubError):
    """A reply of the Hub that huggingface_hub must not act on (a revision that is no commit, a JSON body of another
    shape); ``what`` says what was wrong, for the message of the code that called the client.

    Raised from inside huggingface_hub's response hook (``sources/hub_replies.py``), which lets it through untouched;
    ``sources.resolve.hub_error`` turns it into that code's own one-line error, naming the repo id.
    """

    def __init__(self, what: str):
        super().__init__(f"the Hub sent {what}")
        self.what = what


class ChecksumMismatchError(HpuFp8Error, ValueError):
    """Files of a checkpoint disagree with its manifest (a corrupt or partial download).

    Example:
        >>> try:
        ...     load("org/qwen2-7b-hpu-fp8")
        ... except ChecksumMismatchError as exc:
        ...     print(exc)  # which files differ from hpu_fp8_manifest.json; delete them from the cache and load again
    """


class UploadError(HubError):
    """The Hub refused or interrupted the upload, or the uploaded files differ from the local ones.

    Raised by ``hpu-fp8 push`` (:func:`hpu_fp8_loader.hub.publish.push`); a subclass of :class:`HubError`.

    Example:
        >>> from hpu_fp8_loader.hub.publish import PushOptions, push
        >>> try:
        ...     push("qwen2-bf16", PushOptions(repo_id="me/qwen2-hpu-fp8", base_model="Qwen/Qwen2-7B", calibrate=True))
        ... except UploadError as exc:
        ...     print(exc)  # here: no token; checked before any conversion
        me/qwen2-hpu-fp8: not logged in to the Hub; log in with `hf auth login` or set HF_TOKEN
    """

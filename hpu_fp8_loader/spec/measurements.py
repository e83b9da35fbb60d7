"""The measurement format: activation abs-max per spec module, with provenance (reading and writing the file:
:mod:`hpu_fp8_loader.sources.measurements`).

Shared by the converter (which reads it) and the calibrator (which writes it); FastDeploy's own
text files are mapped onto the same module names by :mod:`hpu_fp8_loader.spec.names`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import Provenance as MeasurementProvenance

__all__ = [
    "MEASUREMENTS_FILE",
    "MeasurementProvenance",
    "Measurements",
    "ModelIdentity",
    "check_module_numbers",
    "measurement_file_names",
    "measurement_files",
]

FORMAT: Final = "hpu-fp8-measurements"
# The activation statistics a checkpoint was made from, kept inside it (docs/spec.md section 1); numbered when
# several sets were merged (llm-compressor keeps its recipe.yaml beside its checkpoints alike).
MEASUREMENTS_FILE: Final = "hpu_fp8_measurements.json"


def measurement_file_names(count: int) -> list[str]:
    """Names of a checkpoint's measurement files: one ``hpu_fp8_measurements.json``, or numbered as the sets are."""
    if count == 1:
        return [MEASUREMENTS_FILE]
    stem = MEASUREMENTS_FILE.removesuffix(".json")
    return [f"{stem}-{i}.json" for i in range(1, count + 1)]


def measurement_files(measurements: Sequence[Measurements]) -> dict[str, bytes]:
    """Each set as the file a checkpoint keeps it in, by :func:`measurement_file_names`."""
    texts = [m.model_dump_json(indent=2, exclude_none=True) + "\n" for m in measurements]
    return {name: text.encode("utf-8") for name, text in zip(measurement_file_names(len(texts)), texts, strict=True)}


_PLAIN_NUMBER = re.compile(names.PLAIN_NUMBER)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelIdentity(_Strict):
    """Enough of the model to refuse measurements taken on another one."""

    model_type: str
    num_hidden_layers: int = Field(ge=1)
    moe_num_experts: int = Field(default=0, ge=0)


def check_module_numbers(name: str) -> None:
    """Refuse a layer or expert number written other than plainly: ``01`` or a non-ASCII digit reads as
    the same int as ``1``, so two keys would name one module and one of them would be lost."""
    for part in name.split("."):
        if part.isdecimal() and not _PLAIN_NUMBER.fullmatch(part):
            shown = part if part.isascii() else f"{part} ({' '.join(f'U+{ord(c):04X}' for c in part)})"
            raise ValueError(f"{name!r}: '{shown}' is not a plain decimal number (ASCII digits, no leading zero)")


class Measurements(_Strict):
    """A measurement file: the activation abs-max of every spec module (``amax``), where it came from
    (``provenance``), the model it was measured on, and the tokens each expert saw.

    What :func:`~hpu_fp8_loader.calibrate` makes and :func:`~hpu_fp8_loader.convert` reads. Keys are checked on
    construction: an amax key must be a spec activation module with plainly written layer and expert numbers
    (``01`` would name the same module as ``1``), and every value finite and >= 0 (zero: a point no token reached).
    The JSON Schema ships with the package (``hpu-fp8 schema measurements``).

    Attributes:
        format: always ``"hpu-fp8-measurements"``.
        version: always 1.
        provenance: where the values came from: ``kind`` (reference engine, FastDeploy measurement, ...), dataset,
            samples, tokens, seq_len, date, tool and its version, source files.
        model: model_type, num_hidden_layers and moe_num_experts of the model measured, to refuse measurements
            of another model; None for FastDeploy's files, which do not say.
        amax: spec activation module (such as ``"qwen2.layers.0.self_attn.qkv_proj"``) -> its abs-max.
        expert_tokens: ``"<prefix>.layers.L.mlp.experts.E"`` -> tokens routed to that expert during calibration.

    Example:
        >>> from hpu_fp8_loader import read_measurements
        >>> measurements = read_measurements("measurements.json")
        >>> measurements.amax["qwen2.layers.0.self_attn.qkv_proj"]
        4.144025802612305
        >>> measurements.provenance.kind, measurements.provenance.tokens
        (<AmaxSourceKind.REFERENCE_ENGINE: 'reference-engine'>, 512)
    """

    format: Literal["hpu-fp8-measurements"] = FORMAT
    version: Literal[1] = 1
    provenance: MeasurementProvenance
    model: ModelIdentity | None = None  # absent for FastDeploy's files, which do not say
    amax: dict[str, float]
    expert_tokens: dict[str, int] = Field(default_factory=dict)

    @field_validator("amax")
    @classmethod
    def _amax_keys_and_values(cls, amax: dict[str, float]) -> dict[str, float]:
        for key, value in amax.items():
            check_module_numbers(key)  # first: its message says what is wrong with the number
            if not names.is_act_module(key):
                raise ValueError(f"amax key {key!r} is not a spec activation module (e.g. 'ernie.layers.3.self_attn.qkv_proj')")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"amax[{key!r}] = {value} must be finite and >= 0")
        return amax

    @field_validator("expert_tokens")
    @classmethod
    def _token_counts(cls, counts: dict[str, int]) -> dict[str, int]:
        for key, value in counts.items():
            if not key.rpartition(".")[2].isdecimal() or ".mlp.experts." not in key:
                raise ValueError(f"expert_tokens key {key!r} is not '<prefix>.layers.L.mlp.experts.E'")
            check_module_numbers(key)
            if value < 0:
                raise ValueError(f"expert_tokens[{key!r}] = {value} is negative")
        return counts

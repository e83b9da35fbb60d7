"""The measurement file: activation abs-max per spec module, with provenance.

Shared by the converter (which reads it) and the calibrator (which writes it); FastDeploy's own
text files are mapped onto the same module names by :mod:`hpu_fp8_loader.spec.names`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hpu_fp8_loader.errors import MeasurementError
from hpu_fp8_loader.io.file_output import write_text_atomically
from hpu_fp8_loader.io.jsonfile import read_json_object
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import Provenance as MeasurementProvenance
from hpu_fp8_loader.spec.fp8 import act_amax_problem

__all__ = [
    "MeasurementProvenance",
    "Measurements",
    "ModelIdentity",
    "check_module_numbers",
    "read_measurements",
    "write_measurements",
]

FORMAT = "hpu-fp8-measurements"
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

    Example:
        >>> from hpu_fp8_loader import load_measurements
        >>> load_measurements("measurements.json").measurements.amax["qwen2.layers.0.self_attn.qkv_proj"]  # doctest: +SKIP
        3.52
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


def _first_error(exc: ValidationError) -> str:
    """Pydantic's first error as ``where: what``, in the file's own terms (JSON values, no "Value error," prefix)."""
    first = exc.errors()[0]
    where = "".join(f"[{json.dumps(p)}]" if i else str(p) for i, p in enumerate(first["loc"]))
    if first["type"] == "value_error":
        return f"{where}: {first['ctx']['error']}"
    if first["type"] == "missing":
        return f"{where}: missing"
    return f"{where}: {first['msg'].lower()}, got {json.dumps(first['input'])[:80]}"


def read_measurements(path: str | Path) -> Measurements:
    """A measurement file, validated strictly: a number written as a string or a boolean is an error, not a value.

    ``read_json_object`` names the file for every way it can fail to be one JSON object; the fields are
    then checked in pydantic's strict JSON mode, where ``"3.5"`` and ``true`` are not numbers.
    """
    path = Path(path)
    data = read_json_object(path, MeasurementError, "no such measurement file")
    if data.get("format") != FORMAT:
        raise MeasurementError(f"{path}: 'format' is not {FORMAT!r}")
    version = data.get("version")
    if type(version) is not int or version != 1:
        raise MeasurementError(f"{path}: version {json.dumps(version)}; this reader implements version 1")
    try:
        measurements = Measurements.model_validate_json(json.dumps(data), strict=True)
    except ValidationError as exc:
        raise MeasurementError(f"{path}: {_first_error(exc)}") from None
    for module, amax in measurements.amax.items():  # here, where the file can be named; zero is a dead point
        problem = act_amax_problem(amax) if amax else None
        if problem:
            raise MeasurementError(f"{path}: amax[{json.dumps(module)}]: {problem}")
    return measurements


def write_measurements(path: str | Path, measurements: Measurements, replace: bool = True) -> None:
    """The measurement file, written atomically (see :func:`write_text_atomically`)."""
    write_text_atomically(path, measurements.model_dump_json(indent=2, exclude_none=True) + "\n", replace)

"""The measurement file: activation abs-max per spec module, with provenance.

Shared by the converter (which reads it) and the calibrator (which writes it); FastDeploy's own
text files are mapped onto the same module names by :mod:`hpu_fp8_loader.spec.names`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import MeasurementError
from ..io.jsonfile import read_json_object
from . import names
from .config import Provenance as MeasurementProvenance

__all__ = ["MeasurementProvenance", "Measurements", "ModelIdentity", "read_measurements", "write_measurements"]

FORMAT = "hpu-fp8-measurements"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelIdentity(_Strict):
    """Enough of the model to refuse measurements taken on another one."""

    model_type: str
    num_hidden_layers: int = Field(ge=1)
    moe_num_experts: int = Field(default=0, ge=0)


class Measurements(_Strict):
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
            if not names.is_act_module(key):
                raise ValueError(f"amax key {key!r} is not a spec activation module (e.g. 'ernie.layers.3.self_attn.qkv_proj')")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"amax[{key!r}] = {value} must be finite and >= 0")
        return amax

    @field_validator("expert_tokens")
    @classmethod
    def _token_counts(cls, counts: dict[str, int]) -> dict[str, int]:
        for key, value in counts.items():
            if not key.rpartition(".")[2].isdigit() or ".mlp.experts." not in key:
                raise ValueError(f"expert_tokens key {key!r} is not '<prefix>.layers.L.mlp.experts.E'")
            if value < 0:
                raise ValueError(f"expert_tokens[{key!r}] = {value} is negative")
        return counts


def read_measurements(path: str | Path) -> Measurements:
    path = Path(path)
    data = read_json_object(path, MeasurementError, "no such measurement file")
    if data.get("format") != FORMAT:
        raise MeasurementError(f"{path}: 'format' is not {FORMAT!r}")
    if data.get("version") != 1:
        raise MeasurementError(f"{path}: version {data.get('version')!r}; this reader implements version 1")
    try:
        return Measurements.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise MeasurementError(f"{path}: {where}: {first['msg']}") from None


def write_measurements(path: str | Path, measurements: Measurements) -> None:
    Path(path).write_text(measurements.model_dump_json(indent=2, exclude_none=True) + "\n", encoding="utf-8")

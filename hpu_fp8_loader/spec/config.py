"""``quantization_config`` of an hpu-fp8 v1 checkpoint, and the config.json rules FastDeploy imposes.

The pydantic models are the only parser of the config; their JSON Schema ships with the package
(``hpu-fp8 schema quantization-config``).
"""

from __future__ import annotations

import json
from functools import partial
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from hpu_fp8_loader.errors import ConfigError, NotHpuFp8CheckpointError, UnsupportedFormatVersionError
from hpu_fp8_loader.spec import FORMAT_VERSION
from hpu_fp8_loader.spec.choices import AmaxSourceKind, Bf16Group, DeadExpertPolicy, KvCacheScheme, ScaleRounding, Target
from hpu_fp8_loader.spec.fp8 import GAUDI2_FP8_MAX, GAUDI3_FP8_MAX

__all__ = [
    "FASTDEPLOY_ARCHITECTURES",
    "FASTDEPLOY_EXCLUSION_KEYS",
    "FOREIGN_KEYS",
    "FP8_MAX_BY_TARGET",
    "AmaxSourceKind",
    "Bf16Group",
    "Calibration",
    "CalibrationSource",
    "DeadExpertPolicy",
    "ExpertRef",
    "KvCacheScheme",
    "Provenance",
    "QuantizationConfig",
    "Rebalancing",
    "ScaleRounding",
    "Target",
    "fastdeploy_config_problems",
    "is_hpu_fp8",
    "json_schema",
    "parse_quantization_config",
    "validation_error_text",
]


FP8_MAX_BY_TARGET = {Target.GAUDI2: GAUDI2_FP8_MAX, Target.GAUDI3: GAUDI3_FP8_MAX}
# Architectures FastDeploy registers, by model_type (docs/spec.md section 2; FastDeploy builds the class
# named by architectures[0], docs/fastdeploy.md section 2 ("Load dispatch")).
FASTDEPLOY_ARCHITECTURES = {
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The JSON Schema of a format model, every description cut to its docstring's first paragraph.

    The docstrings carry Python examples for readers of the code; a schema's reader gets the prose only.

    Example:
        >>> json_schema(QuantizationConfig)["title"]
        'QuantizationConfig'
    """

    def summarise(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("description"), str):
                node["description"] = node["description"].split("\n\n")[0]
            for value in node.values():
                summarise(value)
        elif isinstance(node, list):
            for value in node:
                summarise(value)

    schema = model.model_json_schema()
    summarise(schema)
    return schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _same_type(expected: object, value: object) -> object:
    """Reject a value equal to the literal but of another JSON type (1.0 or true for 1, 1 for true)."""
    if type(value) is not type(expected):
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": json.dumps(expected)})
    return value


def _exact_type(value: object) -> BeforeValidator:
    """With ``Annotated[Literal[value], _exact_type(value)]``: like the JSON Schema ``const`` it publishes, the
    field also requires the value's type.

    pydantic's Literal compares with ``==`` even in strict mode, so ``Literal[1]`` alone takes 1.0 and true.
    """
    return BeforeValidator(partial(_same_type, value))


class WeightStrategies(_Strict):
    """v1 fixes the strategy of each group: tensor-wise where FastDeploy's linear has a [1] scale."""

    attention: Literal["tensor"] = "tensor"
    dense_mlp: Literal["tensor"] = "tensor"
    shared_experts: Literal["tensor"] = "tensor"
    routed_experts: Literal["channel"] = "channel"


class Activations(_Strict):
    strategy: Literal["tensor"] = "tensor"
    dynamic: Annotated[Literal[False], _exact_type(False)] = False


class ExpertRef(_Strict):
    layer: int = Field(ge=0)
    expert: int = Field(ge=0)


class DeadExperts(_Strict):
    policy: DeadExpertPolicy = DeadExpertPolicy.ERROR
    filled: list[ExpertRef] = Field(default_factory=list, description="experts whose amax came from siblings")

    @model_validator(mode="after")
    def _filled_needs_policy(self) -> DeadExperts:
        if self.filled and self.policy is DeadExpertPolicy.ERROR:
            raise ValueError("dead_experts.filled lists experts but the policy is 'error'")
        return self


class MoePolicy(_Strict):
    shared_up_gate_input: Literal["max_over_experts"] = "max_over_experts"
    dead_experts: DeadExperts = Field(default_factory=DeadExperts)


class Provenance(_Strict):
    """Where activation statistics came from; a measurement file carries one, a checkpoint one per source."""

    kind: AmaxSourceKind
    dataset: str | None = None
    samples: int | None = Field(default=None, ge=0)
    tokens: int | None = Field(default=None, ge=0)
    seq_len: int | None = Field(default=None, ge=1)
    date: str | None = None
    tool: str | None = None
    tool_version: str | None = None
    files: list[str] = Field(default_factory=list)
    tokenizer: str | None = None  # what made the tokens: "tokenizer.json", "tokenizer.model (sentencepiece)", "bytes"
    dataset_revision: str | None = None  # the commit of a Hub dataset's snapshot the tokens were read from


class CalibrationSource(Provenance):
    id: str = Field(min_length=1)


class Calibration(_Strict):
    """Where each act_amax came from: a default source plus per-module overrides."""

    sources: list[CalibrationSource] = Field(min_length=1)
    default_source: str
    overrides: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _references_exist(self) -> Calibration:
        ids = [s.id for s in self.sources]
        if len(set(ids)) != len(ids):
            raise ValueError(f"calibration source ids are not unique: {ids}")
        for module, source in [("default_source", self.default_source), *self.overrides.items()]:
            if source not in ids:
                raise ValueError(f"calibration: {module} refers to unknown source {source!r} (known: {ids})")
        return self

    def source_of(self, module: str) -> CalibrationSource:
        wanted = self.overrides.get(module, self.default_source)
        return next(s for s in self.sources if s.id == wanted)


class Producer(_Strict):
    name: str
    version: str


class Rebalancing(_Strict):
    """How convert rebalanced the model before quantizing (docs/spec.md section 2, ``rebalancing``): exact
    power-of-two channel folds from an activation into the next linear's rows. The stored weights and amax already
    carry them, so a loader reads nothing here: it records what was done.

    Attributes:
        method: always ``"pow2-channel-folds"``.
        mode: ``flagged`` (only where a point's range failed) or ``all``.
        migration: SmoothQuant's alpha the exponents were chosen with, in (0, 1).
        sites: the fold sites moved, by the consumer input each names (``...qkv_proj``, ``...post_attention_layernorm``,
            a ``...down_proj``, ``...o_proj``), in model order.
        largest_exponent: the largest power of two any channel was moved by (its exponent's magnitude).
        exponents_sha256: sha256 of every site's name and int32 exponents, in order (identifies the folds).
    """

    method: Literal["pow2-channel-folds"] = "pow2-channel-folds"
    mode: Literal["flagged", "all"]
    migration: float = Field(gt=0, lt=1)
    sites: list[str] = Field(min_length=1)
    largest_exponent: int = Field(ge=1)
    exponents_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class QuantizationConfig(_Strict):
    """The ``quantization_config`` object: FastDeploy's mix_quant keys first, then the spec's own.

    The one parser of an hpu-fp8 v1 config (strict, frozen, unknown keys refused); its JSON Schema ships with the
    package (``hpu-fp8 schema quantization-config``). The constant keys have one allowed value each and are
    not listed below; docs/spec.md section 2 describes every key.

    Attributes:
        dense_quant_type: ``"tensor_wise_fp8"``, or None when every linear outside the routed experts is kept in BF16
            (FastDeploy's key; ``ignore`` then lists those linears).
        moe_quant_type: ``"tensor_wise_fp8"``, or None when every routed expert is kept in BF16 (FastDeploy's key).
        kv_cache_quant_type: ``"float8_e4m3"`` exactly when ``kv_cache_scheme`` is FP8 (FastDeploy's key), else None.
        fp8_max: the FP8 range the values are stored at: 240.0 (Gaudi2) or 448.0 (Gaudi3/OCP).
        target: the Gaudi generation the checkpoint is made for; ``gaudi2`` requires fp8_max 240.
        kv_cache_scheme: whether attention and the KV cache run in FP8 or stay BF16.
        scale_rounding: ``none``, or ``pow2`` when every stored scale was rounded up to a power of two.
        ignore: linear modules kept in BF16: exactly those of the groups whose FastDeploy type is None.
        kept_bf16: those groups (read-only), from the two FastDeploy types.
        moe: the MoE policy (shared-expert input, dead experts filled from siblings); present exactly for MoE models.
        calibration: where each act_amax came from: the sources, the default one and per-module overrides.
        rebalancing: the exact channel folds applied before quantizing, when ``convert --rebalance`` moved any.
        producer: the name and version of the tool that wrote the checkpoint.
        servable_by_fastdeploy: whether FastDeploy's HPU path can serve it today (fp8_max 240).

    Example:
        >>> from hpu_fp8_loader import load
        >>> qc = load("qwen2-fp8").quantization_config
        >>> qc.target, qc.kv_cache_scheme, qc.fp8_max
        (<Target.GAUDI2: 'gaudi2'>, <KvCacheScheme.FP8: 'fp8'>, 240.0)
        >>> qc.calibration.sources[0].kind
        <AmaxSourceKind.REFERENCE_ENGINE: 'reference-engine'>
    """

    quantization: Literal["mix_quant"] = "mix_quant"
    # absent means None, as FastDeploy reads them: that group is built in BF16
    dense_quant_type: Literal["tensor_wise_fp8"] | None = None
    moe_quant_type: Literal["tensor_wise_fp8"] | None = None
    kv_cache_quant_type: Literal["float8_e4m3"] | None = None
    is_quantized: Annotated[Literal[True], _exact_type(True)] = True

    quant_method: Literal["hpu_fp8"] = "hpu_fp8"
    format_version: Annotated[Literal[1], _exact_type(FORMAT_VERSION)] = FORMAT_VERSION
    fp8_dtype: Literal["float8_e4m3fn"] = "float8_e4m3fn"
    fp8_max: float = GAUDI2_FP8_MAX
    target: Target = Target.GAUDI2
    weights: WeightStrategies = Field(default_factory=WeightStrategies)
    activations: Activations = Field(default_factory=Activations)
    kv_cache_scheme: KvCacheScheme
    scale_dtype: Literal["float32"] = "float32"
    scale_rounding: ScaleRounding = ScaleRounding.NONE
    ignore: list[str] = Field(default_factory=list, description="linear modules kept in BF16")
    moe: MoePolicy | None = None
    calibration: Calibration
    rebalancing: Rebalancing | None = None
    producer: Producer

    @field_validator("fp8_max")
    @classmethod
    def _known_range(cls, value: float) -> float:
        if value not in FP8_MAX_BY_TARGET.values():
            raise ValueError(
                f"fp8_max must be {GAUDI2_FP8_MAX} (Gaudi2 range) or {GAUDI3_FP8_MAX} (Gaudi3/OCP range), got {value}"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> QuantizationConfig:
        if self.target is Target.GAUDI2 and self.fp8_max != GAUDI2_FP8_MAX:
            raise ValueError(f"target gaudi2 requires fp8_max {GAUDI2_FP8_MAX}: Gaudi2 saturates at ±{GAUDI2_FP8_MAX:g}")
        wants_kv = self.kv_cache_scheme is KvCacheScheme.FP8
        if wants_kv != (self.kv_cache_quant_type == "float8_e4m3"):
            raise ValueError(
                "kv_cache_quant_type must be 'float8_e4m3' exactly when kv_cache_scheme is 'fp8' "
                f"(got {self.kv_cache_quant_type!r} with scheme {self.kv_cache_scheme.value!r})"
            )
        return self

    @property
    def kept_bf16(self) -> frozenset[Bf16Group]:
        """The groups FastDeploy builds in BF16 from this config: those whose mix_quant type is absent."""
        types = {Bf16Group.DENSE: self.dense_quant_type, Bf16Group.EXPERTS: self.moe_quant_type}
        return frozenset(group for group, kind in types.items() if kind is None)

    @property
    def servable_by_fastdeploy(self) -> bool:
        """FastDeploy's HPU path assumes 240 everywhere (docs/fastdeploy.md section 4, "FP8 storage and the 240 bound")."""
        return self.fp8_max == GAUDI2_FP8_MAX


def _json_text(value: object, limit: int = 60) -> str:
    """A value as it appears in JSON (``"false"``, ``3.0``, ``null``), cut to ``limit`` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


FASTDEPLOY_EXCLUSION_KEYS = "FastDeploy from 82057cb7 builds every linear its entries match unquantized"
FOREIGN_KEYS = {
    "modules_to_not_convert": (
        f"; {FASTDEPLOY_EXCLUSION_KEYS} (layers/utils.py modules_to_convert), which the spec does not mean: linears "
        "are kept in BF16 only by group, through dense_quant_type, moe_quant_type and ignore (docs/spec.md section 2)"
    ),
}
"""Keys the spec does not have that a reader of quantization_config acts on, each with why it is refused."""


def _error_text(err: ErrorDetails) -> str:
    """One pydantic error for a human: the key, what it should be and the JSON value found, no "Value error," prefix."""
    where = ".".join(str(p) for p in err["loc"])
    if err["type"] == "value_error":  # our own validators' messages name their keys
        return str(err["ctx"]["error"])
    if err["type"] == "missing":
        return f"'{where}' is missing"
    if err["type"] == "extra_forbidden":
        return f"'{where}' is not a known key" + FOREIGN_KEYS.get(where, "")
    message = err["msg"].removeprefix("Input ")
    return f"'{where}' {message}, got {_json_text(err['input'])}" if where else f"{message}, got {_json_text(err['input'])}"


def validation_error_text(exc: ValidationError) -> str:
    """Every error of a pydantic validation on one line, each naming its key."""
    return "; ".join(_error_text(err) for err in exc.errors())


def is_hpu_fp8(config: dict) -> bool:
    """Whether a config.json says it is an hpu-fp8 checkpoint (whether it is a valid one is validate's question)."""
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == "hpu_fp8"


def parse_quantization_config(config: dict, source: str = "config.json") -> QuantizationConfig:
    """The checkpoint's QuantizationConfig, or a typed error that says what the checkpoint is instead."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise NotHpuFp8CheckpointError(
            f"{source}: no quantization_config; this looks like a source (BF16) checkpoint. "
            "Make an hpu-fp8 checkpoint from it with `hpu-fp8 convert`."
        )
    if not is_hpu_fp8(config):
        found = json.dumps(qc["quant_method"]) if "quant_method" in qc else "missing"
        hint = ""
        exported = qc.get("hpu_fp8")  # what export-compressed-tensors records (conversion/ct_export.py)
        if qc.get("quant_method") == "compressed-tensors" and isinstance(exported, dict):
            hint = (
                f" This is a compressed-tensors export of an hpu-fp8 checkpoint (±{_json_text(exported.get('fp8_max'))}), "
                "for vLLM and transformers; `hpu-fp8 import SRC OUT` brings it back to hpu-fp8 for FastDeploy."
            )
        elif qc.get("quant_method") == "compressed-tensors":  # llm-compressor's, vLLM's
            hint = " This is a compressed-tensors checkpoint; convert it with `hpu-fp8 import SRC OUT`."
        elif qc.get("quant_method") == "fp8" or "block_wise_fp8" in (qc.get("dense_quant_type"), qc.get("moe_quant_type")):
            hint = " This is a block-wise FP8 checkpoint; bring it in with `hpu-fp8 import SRC OUT --calibrate`."
        elif qc.get("quantization") == "mix_quant":
            hint = " It looks like a checkpoint of FastDeploy's legacy converter; bring it in with `hpu-fp8 import-legacy`."
        raise NotHpuFp8CheckpointError(f'{source}: quantization_config.quant_method is {found}, not "hpu_fp8".{hint}')
    version = qc.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version != FORMAT_VERSION:
        raise UnsupportedFormatVersionError(
            f"{source}: format_version is {version!r}, but this reader implements format_version {FORMAT_VERSION} "
            "only; upgrade hpu-fp8-loader or convert the checkpoint again."
        )
    try:  # strict, in JSON mode: JSON types as the published schema has them ("240" is no number), enums by value
        return QuantizationConfig.model_validate_json(json.dumps(qc), strict=True)
    except ValidationError as exc:
        raise ConfigError(f"{source}: quantization_config: {validation_error_text(exc)}") from None


def _version_tuple(text: str) -> tuple[int, ...]:
    numbers = []
    for part in str(text).split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def fastdeploy_config_problems(config: dict) -> list[str]:
    """Why FastDeploy's Paddle-format path would not accept this config.json (docs/fastdeploy.md section 3, "config.json")."""
    problems = []
    if "dtype" not in config:
        problems.append("config.json has no 'dtype': FastDeploy needs it to treat the checkpoint as Paddle format")
    if "torch_dtype" in config:
        problems.append("config.json has 'torch_dtype': FastDeploy would treat the checkpoint as torch format")
    version = config.get("transformers_version")
    if version is not None and _version_tuple(version) > (4, 56, 0):
        problems.append(f"config.json has transformers_version {version} > 4.56.0: FastDeploy would treat it as torch format")
    if "head_dim" in config and config["head_dim"] is None:
        problems.append(
            "config.json has 'head_dim': null: FastDeploy derives head_dim only where the key is absent and fails "
            "building its rotary table (convert writes it explicitly)"
        )
    model_type = config.get("model_type")
    expected = FASTDEPLOY_ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if expected is None:
        problems.append(f"config.json model_type {model_type!r} is not one FastDeploy's HPU FP8 path serves")
    elif config.get("architectures") != [expected]:
        problems.append(f"config.json architectures is {config.get('architectures')!r}; FastDeploy registers [{expected!r}]")
    return problems

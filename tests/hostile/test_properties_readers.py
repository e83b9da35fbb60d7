"""Generated hostile inputs for every reader of untrusted bytes: each either reads the input as documented or refuses
it with its documented one-line error (a class from errors.py); never another exception, never a hang, never a write.

Issue 28 item 8. The readers: strict JSON (``parse_json``) and each JSON file kind read through it (config.json, the
shard index, the manifest, measurement files, tokenizer_config.json, tokenizer.json, generation_config.json, the
resume journal), safetensors headers (checked against the safetensors library itself: what we accept, it accepts),
FastDeploy's measurement text files, and chat templates. Inputs are generated from the real files, mutated, and from
raw bytes. The number of examples comes from tests/conftest.py's profiles: few in the inner loop, many in CI.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hostile.refusal import tree_digest, within_deadline
from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.conversion.compressed_tensors import _scheme as compressed_tensors_config_scheme
from hpu_fp8_loader.conversion.journal import JOURNAL, reusable_shards
from hpu_fp8_loader.errors import (
    CheckpointIndexError,
    ConfigError,
    MeasurementError,
    SafetensorsFormatError,
    TokenizerError,
    UnsafePathError,
)
from hpu_fp8_loader.io.checkpoint import copied_source_files, read_config, read_index
from hpu_fp8_loader.io.jsonfile import JsonFormatError, parse_json
from hpu_fp8_loader.io.manifest import MANIFEST_FILE, check_manifest
from hpu_fp8_loader.io.safetensors_file import SafetensorsFile
from hpu_fp8_loader.io.writer import Shard
from hpu_fp8_loader.quality.chat_template import ChatRenderer
from hpu_fp8_loader.quality.tokenizer import load_tokenizer
from hpu_fp8_loader.sources.block_fp8 import block_fp8_scheme
from hpu_fp8_loader.sources.measurements import read_fastdeploy_file, read_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements
from hpu_fp8_loader.spec import names

# A generated file per example, not per test: hypothesis refuses a function-scoped tmp_path.
EXAMPLES_SHARE_NO_FIXTURE = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@contextmanager
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="hpu-fp8-property-") as where:
        yield Path(where)


def one_line(exc: BaseException) -> str:
    """The refusal's message, checked to be one line; counted for --hypothesis-show-statistics."""
    message = str(exc)
    assert message and "\n" not in message and "Traceback" not in message, message
    event(f"refused: {type(exc).__name__}")
    return message


# ----- generated JSON -----

JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
# What RFC 8259 or Python's int() and float() cannot take, or what a lenient parser takes silently.
FRAGMENTS = [
    "NaN", "Infinity", "-Infinity", "1e999", "-1e400", "1" * 5000, "-" + "9" * 4301, '"\\ud800"', '"\\udfff x"',
    '{"k": 1, "k": 2}', "[" * 3000 + "]" * 3000, "\ufeff", "\x00", "\\", '"', "}", "]", ",", "'", "tru", "01", "-",
    ".5", "1.", "1e", "\u2028",
]  # fmt: skip


@st.composite
def spliced(draw, base: st.SearchStrategy[str]) -> bytes:
    """A JSON text with a hostile fragment spliced in somewhere (or replacing a part of it)."""
    text = draw(base)
    at = draw(st.integers(0, len(text)))
    cut = draw(st.integers(0, min(8, len(text) - at)))
    return (text[:at] + draw(st.sampled_from(FRAGMENTS)) + text[at + cut :]).encode("utf-8", "surrogatepass")


def documents(base: st.SearchStrategy[str]) -> st.SearchStrategy[bytes]:
    """Bytes for a JSON file: a real one (``base``), the real one spliced, any JSON value, any text, any bytes."""
    return st.one_of(
        base.map(str.encode),
        spliced(base),
        JSON_VALUES.map(json.dumps).map(str.encode),
        spliced(JSON_VALUES.map(json.dumps)),
        st.text(max_size=60).map(lambda t: t.encode("utf-8", "surrogatepass")),
        st.binary(max_size=60),
    )


@st.composite
def edited(draw, original: dict) -> dict:
    """``original`` with a few keys (nested ones too) set to any JSON value, or removed."""
    result = json.loads(json.dumps(original))
    for _ in range(draw(st.integers(1, 3))):
        target = result
        while isinstance(target, dict) and target and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(target)))
            if not isinstance(target[key], dict):
                break
            target = target[key]
        if not isinstance(target, dict) or not target:
            continue
        key = draw(st.sampled_from(sorted(target)))
        if draw(st.booleans()):
            target[key] = draw(JSON_VALUES)
        else:
            del target[key]
    return result


def edited_text(original: dict) -> st.SearchStrategy[str]:
    return edited(original).map(json.dumps)


# ----- strict JSON -----


@given(documents(JSON_VALUES.map(json.dumps)))
@within_deadline
def test_parse_json_gives_a_value_or_a_one_line_json_format_error(data):
    try:
        value = parse_json(data)
    except JsonFormatError as exc:
        one_line(exc)
        return
    assert json.loads(json.dumps(value)) == value  # what it gives is plain JSON again: no NaN, no lone surrogate


# ----- each JSON file kind, through the code that reads it -----

QWEN2 = preset_config("qwen2-tiny")


@EXAMPLES_SHARE_NO_FIXTURE
@given(documents(edited_text(QWEN2)))
@within_deadline
def test_config_json_gives_a_model_or_a_config_error_naming_it(data):
    with folder() as root:
        (root / "config.json").write_bytes(data)
        before = tree_digest(root)
        try:
            describe(read_config(root), str(root / "config.json"))
        except ConfigError as exc:
            assert "config.json" in one_line(exc)
        assert tree_digest(root) == before


# quantization_config as the releases write it: block-wise FP8 (Hugging Face and FastDeploy's Paddle kind) and
# llm-compressor's compressed-tensors FP8 (the static fixture's own, tests/fixtures).
BLOCK_HF = {
    **QWEN2,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}
BLOCK_PADDLE = {
    **QWEN2,
    "quantization_config": {
        "quantization": "mix_quant",
        "dense_quant_type": "block_wise_fp8",
        "moe_quant_type": "block_wise_fp8",
    },
}
COMPRESSED = {
    **QWEN2,
    "quantization_config": json.loads(
        (Path(__file__).parents[1] / "fixtures" / "qwen2-bytes-fp8-static" / "config.json").read_text()
    )["quantization_config"],
}


@EXAMPLES_SHARE_NO_FIXTURE
@given(documents(st.sampled_from([BLOCK_HF, BLOCK_PADDLE, COMPRESSED]).flatmap(edited_text)))
@within_deadline
def test_a_quantization_config_gives_its_scheme_or_a_config_error_naming_config_json(data):
    """What import reads first, block-wise or compressed-tensors: a scheme in words, 'not this kind' (None), or one
    ConfigError line naming config.json; never another exception."""
    with folder() as root:
        (root / "config.json").write_bytes(data)
        before = tree_digest(root)
        try:
            config = read_config(root)
            scheme = block_fp8_scheme(config, root / "config.json")
            if scheme is None:
                scheme = compressed_tensors_config_scheme(root, config)
            assert isinstance(scheme, str) and scheme
            event("scheme: " + scheme.split(" (")[0])
        except ConfigError as exc:
            assert "config.json" in one_line(exc)
        assert tree_digest(root) == before


INDEX = {"metadata": {"total_size": 4096}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b": "x.safetensors"}}


@EXAMPLES_SHARE_NO_FIXTURE
@given(documents(edited_text(INDEX)))
@within_deadline
def test_the_index_gives_a_weight_map_of_file_names_or_an_index_error_naming_it(data):
    with folder() as root:
        (root / "model.safetensors.index.json").write_bytes(data)
        try:
            weight_map, metadata = read_index(root)
        except CheckpointIndexError as exc:
            assert "model.safetensors.index.json" in one_line(exc)
            return
        assert isinstance(metadata, dict)
        assert all(isinstance(name, str) and isinstance(file, str) and file for name, file in weight_map.items())


@pytest.fixture(scope="module")
def checkpoint(spec_factory) -> Path:
    return spec_factory("qwen2-tiny")


@EXAMPLES_SHARE_NO_FIXTURE
@given(data=st.data())
@within_deadline
def test_the_manifest_gives_a_list_of_one_line_problems_and_never_raises(checkpoint, data):
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    content = data.draw(documents(edited_text(manifest)))
    with folder() as where:
        root = where / "ckpt"
        shutil.copytree(checkpoint, root)
        (root / MANIFEST_FILE).write_bytes(content)
        before = tree_digest(root)
        problems = check_manifest(root, hashes=False)
        assert tree_digest(root) == before
    for problem in problems:
        assert problem and "\n" not in problem
    if content == (checkpoint / MANIFEST_FILE).read_bytes():
        assert problems == []


MEASUREMENTS = json.loads(synthetic_measurements(QWEN2).model_dump_json())
MEASUREMENTS.update(format="hpu-fp8-measurements", version=1)


@EXAMPLES_SHARE_NO_FIXTURE
@given(documents(edited_text(MEASUREMENTS)))
@within_deadline
def test_a_measurement_file_gives_measurements_or_a_measurement_error_naming_it(data):
    with folder() as root:
        (root / "m.json").write_bytes(data)
        try:
            measurements = read_measurements(root / "m.json")
        except MeasurementError as exc:
            assert "m.json" in one_line(exc)
            return
        assert all(isinstance(v, float) and v >= 0 for v in measurements.amax.values())


def _word_tokenizer() -> dict:
    """A real tokenizers WordLevel tokenizer.json, as a dict."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "hello": 2, "world": 3}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return json.loads(tokenizer.to_str())


TOKENIZER_JSON = _word_tokenizer()
TOKENIZER_CONFIG = {
    "add_bos_token": True,
    "bos_token": {"content": "<s>", "special": True},
    "eos_token": "</s>",
    "added_tokens_decoder": {"1": {"content": "<s>"}},
    "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
}


@EXAMPLES_SHARE_NO_FIXTURE
@given(config=documents(edited_text(TOKENIZER_CONFIG)), tokenizer=documents(edited_text(TOKENIZER_JSON)))
@within_deadline
def test_tokenizer_files_give_a_tokenizer_or_a_tokenizer_error_naming_the_file(config, tokenizer):
    with folder() as root:
        (root / "tokenizer_config.json").write_bytes(config)
        (root / "tokenizer.json").write_bytes(tokenizer)
        before = tree_digest(root)
        try:
            model = load_tokenizer(root, 512)
            ids = model.tokens(["hello world", "world"])
        except TokenizerError as exc:
            assert "tokenizer" in one_line(exc)
        else:
            assert ids.dtype.kind == "i" and (ids.size == 0 or (ids.min() >= 0 and ids.max() < 512))
        assert tree_digest(root) == before


@EXAMPLES_SHARE_NO_FIXTURE
@given(documents(edited_text({"bos_token_id": 1, "eos_token_id": 2, "max_length": 64})))
@within_deadline
def test_a_sources_generation_config_is_copied_only_when_it_is_a_json_object(source_factory, data):
    with folder() as where:
        root = where / "src"
        shutil.copytree(source_factory("qwen2-tiny"), root)
        (root / "generation_config.json").write_bytes(data)
        try:
            found = copied_source_files(root)
        except (ConfigError, UnsafePathError) as exc:
            assert "generation_config.json" in one_line(exc)
            return
        assert isinstance(parse_json(data), dict) and found["generation_config.json"].name == "generation_config.json"


@EXAMPLES_SHARE_NO_FIXTURE
@given(documents(JSON_VALUES.map(lambda v: json.dumps({"fingerprint": "another", "shards": v}))))
@within_deadline
def test_a_resume_journal_that_vouches_for_nothing_clears_the_staging_directory(data):
    with folder() as staging:
        (staging / JOURNAL).write_bytes(data)
        (staging / "model-00001-of-00001.safetensors").write_bytes(b"left over")
        assert reusable_shards(staging, "this conversion", [Shard("model-00001-of-00001.safetensors", ())]) == {}
        assert [p.name for p in staging.iterdir()] == []  # nothing kept that a resume would trust


# ----- safetensors headers -----

DTYPES = ["F32", "F16", "BF16", "F8_E4M3", "I8", "U8", "I32", "I64", "BOOL", "F64", "X9", ""]


@st.composite
def shards(draw) -> bytes:
    """A safetensors file: a header of generated entries (often consistent, often not) and a data area."""
    entries: dict[str, object] = {}
    offset = 0
    for number in range(draw(st.integers(0, 3))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        size = 4
        for n in shape:
            size *= n
        begin, end = offset, offset + size
        if draw(st.integers(0, 3)) == 0:  # a byte range that does not fit
            begin, end = draw(st.integers(-2, 40)), draw(st.integers(-2, 40))
        entry: object = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        if draw(st.integers(0, 5)) == 0:
            entry = draw(JSON_VALUES)
        entries[draw(st.sampled_from([f"t{number}", "__metadata__", "t\n", ""]))] = entry
        offset = end if isinstance(end, int) and end > offset else offset
    header = json.dumps(entries).encode()
    if draw(st.integers(0, 3)) == 0:
        header = draw(spliced(st.just(header.decode())))
    data = bytes(draw(st.integers(0, 48)))
    declared = draw(st.sampled_from([len(header), len(header), len(header) + 1, len(header) - 1, 2**63]))
    return struct.pack("<Q", max(declared, 0)) + header + data


@EXAMPLES_SHARE_NO_FIXTURE
@given(shards())
@within_deadline
def test_a_safetensors_header_we_accept_the_safetensors_library_accepts_too(data):
    from safetensors import safe_open

    with folder() as root:
        path = root / "model.safetensors"
        path.write_bytes(data)
        try:
            with SafetensorsFile(path) as ours:
                names_ours = sorted(ours.tensors)
        except SafetensorsFormatError as exc:
            assert "model.safetensors" in one_line(exc)
            return
        with safe_open(str(path), "numpy") as theirs:  # raises if the library refuses what we took
            assert sorted(theirs.keys()) == names_ours


# ----- FastDeploy measurement text files -----

KEYS = [names.fastdeploy_key_from_module(m) for m in sorted(synthetic_measurements(QWEN2).amax)][:6]
VALUES = ["1.5", "0", "0.0", "3e-2", ".5", "1_0", "nan", "inf", "-1", "1" * 400, "1e999", "\u0663", " 2.0 ", "", "x"]


@st.composite
def fastdeploy_text(draw) -> bytes:
    lines = []
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.integers(0, 4)):  # most lines well formed, so that whole files are read too
            lines.append(f"{draw(st.sampled_from(KEYS))}\t{draw(st.floats(0, 1e6))!r}")
            continue
        key = draw(st.sampled_from([*KEYS, "model.layers.x.foo", "", "ernie.layers.01.mlp.down_proj.activation_scale"]))
        value = draw(st.sampled_from(VALUES) | st.text(max_size=6))
        separator = draw(st.sampled_from(["\t", "\t", " ", "", "\t\t"]))
        lines.append(f"{key}{separator}{value}")
    text = "\n".join(lines)
    encoded = text.encode("utf-8", "surrogatepass")
    return draw(st.sampled_from([encoded, encoded, text.encode("utf-16"), draw(st.binary(max_size=40))]))


@EXAMPLES_SHARE_NO_FIXTURE
@given(fastdeploy_text())
@within_deadline
def test_a_fastdeploy_measurement_file_gives_finite_amax_or_a_measurement_error_naming_it(data):
    with folder() as root:
        path = root / "model_measurement.txt"
        path.write_bytes(data)
        try:
            amax = read_fastdeploy_file(path)
        except MeasurementError as exc:
            assert "model_measurement.txt" in one_line(exc)
            return
        assert amax and all(0 <= v < float("inf") for v in amax.values())


# ----- chat templates -----

PIECES = [
    "{{ m.content }}", "{{ m.role|upper }}", "{% for m in messages %}", "{% endfor %}", "{% if m.role == 'user' %}",
    "{% endif %}", "{% else %}", "{{ bos_token }}", "{{ messages|length }}", "{{ 1/0 }}", "{{ range(99999)|list|length }}",
    "{% for a in range(99999) %}", "{{ 'x' * 99999 }}", "{{ 'x' * 10**10 }}", "{% include 'x' %}", "{{ raise_exception('no') }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "{{ ''.__class__ }}", "{{ messages.append(1) }}", "{{ loop.index }}",
    "{% set ns = namespace(s='x') %}", "{% set ns.s = ns.s ~ ns.s %}", "{{ ns.s|length }}", "text", "{{", "}}", "{%",
]  # fmt: skip


@pytest.mark.slow  # a child interpreter per example
@EXAMPLES_SHARE_NO_FIXTURE
@given(st.lists(st.sampled_from(PIECES), max_size=8).map("".join), st.lists(st.text(max_size=20), min_size=1, max_size=3))
@within_deadline
def test_a_chat_template_gives_text_or_a_tokenizer_error_naming_the_record_within_the_deadline(template, contents):
    messages = [{"role": "user", "content": content} for content in contents]
    with folder() as cwd:
        home = os.getcwd()
        os.chdir(cwd)  # the child renders here: it must leave nothing
        try:
            with ChatRenderer(
                template, Path("chat_template.jinja"), {"bos_token": "<s>"}, seconds=2, memory_bytes=2**28
            ) as render:
                text = render(messages, "chats.jsonl:1")
        except TokenizerError as exc:
            message = one_line(exc)
            assert message.startswith(("chat_template.jinja: the chat template ", "chats.jsonl:1: the chat template of "))
        else:
            assert isinstance(text, str) and len(text) <= 2**23
        finally:
            os.chdir(home)
        assert list(cwd.iterdir()) == []

"""Hostile measurement files given to `convert --measurements`: each is refused in one line naming the file
and the key or line at fault, before any output exists, and the inputs are left as they were (issue 14 item 14).

Our JSON format must not coerce (``"3.5"``, ``true`` and ``3.0`` are not the numbers they look like), and
FastDeploy's text format must not guess (``1_0``, non-ASCII digits, a repeated key, rank files ``_1`` and
``_01`` that an ``int()`` would fold into one rank).
"""

from __future__ import annotations

import json
import os

import pytest

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements
from hpu_fp8_loader.spec import names

KEY = "ernie.layers.0.self_attn.qkv_proj"
FD_KEY = names.fastdeploy_key_from_module(KEY)
O_PROJ = names.fastdeploy_key_from_module("ernie.layers.1.self_attn.o_proj")
SENTINEL = 123.25  # an amax value replaced textually where JSON itself cannot say it


def _ours() -> dict:
    """A valid measurement file of the default source, as JSON data."""
    measurements = synthetic_measurements(preset_config("ernie-moe-tiny"))
    data = json.loads(measurements.model_dump_json(exclude_none=True))
    data["amax"][KEY] = SENTINEL
    data["expert_tokens"] = {"ernie.layers.1.mlp.experts.0": 5}
    return data


def _set(path: str, value: object, raw: bool = False):
    """A JSON edit: the value at ``a/b/c`` (``raw``: replace the sentinel amax by this literal text)."""

    def edit(data: dict) -> str:
        if raw:
            return json.dumps(data).replace(str(SENTINEL), str(value))
        *parents, last = path.split("/")
        node = data
        for part in parents:
            node = node[part]
        node[last] = value
        return json.dumps(data)

    return edit


def _rename(old: str, new: str):
    def edit(data: dict) -> str:
        data["amax"][new] = data["amax"].pop(old)
        return json.dumps(data)

    return edit


JSON_CASES = {
    "amax-string": (_set(f"amax/{KEY}", "3.5"), KEY),
    "amax-true": (_set(f"amax/{KEY}", True), KEY),
    "amax-null": (_set(f"amax/{KEY}", None), KEY),
    "amax-list": (_set(f"amax/{KEY}", [3.5]), KEY),
    "amax-object": (_set(f"amax/{KEY}", {"value": 3.5}), KEY),
    "amax-negative": (_set(f"amax/{KEY}", -1.0), KEY),
    "amax-overflow-1e400": (_set(KEY, "1e400", raw=True), KEY),
    "amax-NaN-literal": (_set(KEY, "NaN", raw=True), "NaN"),
    "amax-Infinity-literal": (_set(KEY, "Infinity", raw=True), "Infinity"),
    "amax-duplicate-key": (_set(KEY, f'{SENTINEL}, "{KEY}": 7.0', raw=True), KEY),
    "layer-with-leading-zero": (_rename(KEY, "ernie.layers.00.self_attn.qkv_proj"), "ernie.layers.00.self_attn.qkv_proj"),
    "layer-in-arabic-digits": (_rename(KEY, "ernie.layers.\u0660.self_attn.qkv_proj"), "U+0660"),
    "expert-in-fullwidth-digits": (
        _rename("ernie.layers.1.mlp.experts.0.down_proj", "ernie.layers.1.mlp.experts.\uff10.down_proj"),
        "U+FF10",
    ),
    "not-a-module": (_rename(KEY, "ernie.layers.0.self_attn.k_proj"), "ernie.layers.0.self_attn.k_proj"),
    "expert-tokens-true": (_set("expert_tokens/ernie.layers.1.mlp.experts.0", True), "ernie.layers.1.mlp.experts.0"),
    "expert-tokens-string": (_set("expert_tokens/ernie.layers.1.mlp.experts.0", "5"), "ernie.layers.1.mlp.experts.0"),
    "expert-tokens-float": (_set("expert_tokens/ernie.layers.1.mlp.experts.0", 5.5), "ernie.layers.1.mlp.experts.0"),
    "expert-tokens-negative": (_set("expert_tokens/ernie.layers.1.mlp.experts.0", -5), "ernie.layers.1.mlp.experts.0"),
    "expert-tokens-key-leading-zero": (_set("expert_tokens/ernie.layers.1.mlp.experts.01", 5), "experts.01"),
    "layers-string": (_set("model/num_hidden_layers", "3"), "num_hidden_layers"),
    "layers-true": (_set("model/num_hidden_layers", True), "num_hidden_layers"),
    "layers-float": (_set("model/num_hidden_layers", 3.0), "num_hidden_layers"),
    "experts-string": (_set("model/moe_num_experts", "4"), "moe_num_experts"),
    "model-type-number": (_set("model/model_type", 4), "model_type"),
    "version-true": (_set("version", True), "version true"),
    "version-float": (_set("version", 1.0), "version 1.0"),
    "version-string": (_set("version", "1"), 'version "1"'),
    "version-2": (_set("version", 2), "version 2"),
    "format-other": (_set("format", "hpu-fp8-measurement"), "format"),
    "samples-string": (_set("provenance/samples", "32"), "samples"),
    "tokens-true": (_set("provenance/tokens", True), "tokens"),
    "kind-unknown": (_set("provenance/kind", "guess"), "kind"),
    "extra-top-level-key": (_set("amaxx", {}), "amaxx"),
    "top-level-array": (lambda data: json.dumps([data]), "JSON object"),
    "deeply-nested": (lambda data: "[" * 100_000 + "]" * 100_000, "not valid JSON"),
    "truncated": (lambda data: json.dumps(data)[:-40], "not valid JSON"),
}


@pytest.fixture
def refused_convert(tmp_path, source_factory):
    """Run convert with the given --measurements paths; assert a named refusal, no OUT, inputs unchanged."""

    def run(measurements, *names_in_line: str) -> str:
        source = source_factory()
        before = (tree_digest(tmp_path / "in"), tree_digest(source))
        result = run_cli("convert", source, tmp_path / "out", "--measurements", measurements, "-q")
        line = assert_refused(result, *names_in_line)
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
        assert (tree_digest(tmp_path / "in"), tree_digest(source)) == before
        return line

    (tmp_path / "in").mkdir()
    return run


@pytest.mark.parametrize("case", JSON_CASES)
@pytest.mark.parametrize("name", ["m.json", "m.txt"])  # ours is recognised by content, whatever the file is called
def test_hostile_json_measurements_are_refused_naming_file_and_key(tmp_path, refused_convert, case, name):
    edit, key = JSON_CASES[case]
    path = tmp_path / "in" / name
    path.write_text(edit(_ours()), encoding="utf-8")
    line = refused_convert(path, name, key)
    assert "Value error" not in line and "True" not in line and "None" not in line and "key<TAB>float" not in line


def _fd_lines(amax: dict[str, float]) -> str:
    return "".join(f"{names.fastdeploy_key_from_module(m)}\t{v!r}\n" for m, v in amax.items())


TEXT_CASES = {
    "underscore-number": (f"{FD_KEY}\t1_0", FD_KEY),
    "arabic-digits": (f"{FD_KEY}\t\u0663.\u0665", FD_KEY),
    "fullwidth-digits": (f"{FD_KEY}\t\uff13", FD_KEY),
    "nan": (f"{FD_KEY}\tnan", FD_KEY),
    "inf": (f"{FD_KEY}\tinf", FD_KEY),
    "overflow": (f"{FD_KEY}\t1e400", FD_KEY),
    "negative": (f"{FD_KEY}\t-1.0", FD_KEY),
    "hex": (f"{FD_KEY}\t0x10", FD_KEY),
    "two-values": (f"{FD_KEY}\t3.5\t4.0", FD_KEY),
    "empty-value": (f"{FD_KEY}\t", FD_KEY),
    "true": (f"{FD_KEY}\tTrue", FD_KEY),
    "no-tab": (f"{FD_KEY} 3.5", "no TAB"),
    "unknown-key": ("ernie.layers.0.self_attn.k_matmul.activation_scale\t1.0", "k_matmul"),
    "repeated-key": (f"{FD_KEY}\t9.0", "repeats line"),
    "layer-leading-zero": (O_PROJ.replace(".1.", ".01.") + "\t1.0", "'01'"),
    "layer-arabic-digit": (O_PROJ.replace(".1.", ".\u0661.") + "\t1.0", "U+0661"),
}


@pytest.mark.parametrize("case", TEXT_CASES)
def test_hostile_fastdeploy_lines_are_refused_naming_file_line_and_key(tmp_path, refused_convert, case):
    bad, named = TEXT_CASES[case]
    amax = synthetic_measurements(preset_config("ernie-moe-tiny")).amax
    path = tmp_path / "in" / "model_measurement.txt"
    path.write_text(_fd_lines(amax) + bad + "\n", encoding="utf-8")
    refused_convert(path, f"model_measurement.txt:{len(amax) + 1}:", named)


def _fifo(path):
    os.mkfifo(path)


UNREADABLE = {
    "utf-16": (lambda p: p.write_bytes(FD_KEY.encode("utf-16") + "\t1.0".encode("utf-16-le")), "UTF-8"),
    "empty": (lambda p: p.write_text("\n \n"), "no measurement lines"),
    "fifo": (_fifo, "not a regular file"),
    "directory": (lambda p: p.mkdir(), ""),  # given by name, a directory is searched for FastDeploy's files
}


@pytest.mark.parametrize("case", UNREADABLE)
@pytest.mark.parametrize(("name", "given"), [("model_measurement.txt", "model_measurement.txt"), ("model_measurement_1.txt", "")])
def test_unreadable_fastdeploy_files_are_refused_without_blocking(tmp_path, refused_convert, case, name, given):
    make, named = UNREADABLE[case]
    if name.endswith("_1.txt"):
        (tmp_path / "in" / "model_measurement_0.txt").write_text(f"{FD_KEY}\t1.0\n")
    make(tmp_path / "in" / name)
    refused_convert(tmp_path / "in" / given, name, named)


RANK_SETS = {
    "rank-1-and-01": (["_0", "_1", "_01"], "", "model_measurement_01.txt"),
    "arabic-rank": (["_0", "_\u0661"], "", "model_measurement_\u0661.txt"),
    "rank-1_0": (["_0", "_1", "_1_0"], "", "model_measurement_1_0.txt"),
    "rank-1_0-named": (["_0", "_1_0"], "model_measurement_1_0.txt", "model_measurement_1_0.txt"),
    "rank-01-named": (["_0", "_1", "_01"], "model_measurement_01.txt", "model_measurement_01.txt"),
    "rank-1-named-beside-01": (["_0", "_1", "_01"], "model_measurement_1.txt", "model_measurement_01.txt"),
    "fullwidth-rank-named": (["_0", "_\uff11"], "model_measurement_0.txt", "model_measurement_\uff11.txt"),
    "missing-rank": (["_0", "_2"], "", "rank(s) [1]"),
    "huge-rank": (["_0", "_99999"], "", "and 99990 more"),
    "single-beside-ranks": (["", "_0", "_1"], "model_measurement.txt", "both model_measurement.txt"),
    # recognised by content as ours, beside FastDeploy's text: a directory of both kinds, named
    "rank-file-holding-json": (["_0", "_1"], "", "JSON measurement files (model_measurement_1.txt"),
}


@pytest.mark.parametrize("case", RANK_SETS)
def test_ambiguous_rank_file_sets_are_refused_naming_the_file(tmp_path, refused_convert, case):
    tails, given, named = RANK_SETS[case]
    text = _fd_lines(synthetic_measurements(preset_config("ernie-moe-tiny")).amax)
    for tail in tails:
        (tmp_path / "in" / f"model_measurement{tail}.txt").write_text(text, encoding="utf-8")
    if case == "rank-file-holding-json":
        (tmp_path / "in" / "model_measurement_1.txt").write_text(json.dumps(_ours()), encoding="utf-8")
    refused_convert(tmp_path / "in" / given, named)

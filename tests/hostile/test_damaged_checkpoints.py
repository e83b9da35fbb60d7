"""Issue 14 items 10-11: every command that reads an hpu-fp8 checkpoint refuses what validate rejects.

Each damaged checkpoint is a real converted one with one defect: NaN/inf/zero/denormal scales, an act_amax
whose derived scales overflow, NaN or out-of-range fp8 codes, NaN/inf in a kept tensor (router, correction
bias, norm, embedding, lm_head), a missing tensor, no manifest, a config with fewer layers. ``validate``
rejects each one naming the rule; ``map``, ``export-legacy``, ``retarget`` and ``eval`` each refuse it in
one line naming the tensor or file at fault, leave the input unchanged and write nothing.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers.checkpoint_damage import overwrite_tensor_bytes
from safetensors.numpy import load_file, save_file

from hostile.refusal import assert_refused, run_cli, tree_digest
from hpu_fp8_loader.io.checkpoint import read_config
from hpu_fp8_loader.io.manifest import write_manifest
from hpu_fp8_loader.io.safetensors_file import read_header

np.float8_e4m3fn = ml_dtypes.float8_e4m3fn  # safetensors issue 682: its numpy path needs this alias for F8

L1 = "ernie.layers.1"
BF16_NAN, BF16_INF = np.array([0x7FC0], np.uint16), np.array([0x7F80], np.uint16)


def _poke(root: Path, name: str, index: int, value: np.ndarray) -> None:
    """Set element ``index`` (flat) of tensor ``name`` to the bytes of ``value``, in place."""
    shard = next(p for p in sorted(root.glob("*.safetensors")) if name in read_header(p)[0])
    info = read_header(shard)[0][name]
    data = bytearray(shard.read_bytes()[info.begin : info.end])
    item = value.itemsize
    data[index * item : (index + 1) * item] = value.tobytes()
    overwrite_tensor_bytes(root, name, bytes(data))


def _f32(name: str, *values: float) -> Callable[[Path], None]:
    """Damage: float32 scale/amax tensors set to ``values`` (each filling its whole tensor)."""

    def damage(root: Path) -> None:
        for tensor, value in zip(name.split("|"), values, strict=True):
            shard = next(p for p in sorted(root.glob("*.safetensors")) if tensor in read_header(p)[0])
            count = read_header(shard)[0][tensor].numel
            overwrite_tensor_bytes(root, tensor, np.full(count, value, np.float32).tobytes())

    return damage


def _element(name: str, value: np.ndarray, index: int = 5) -> Callable[[Path], None]:
    return lambda root: _poke(root, name, index, value)


def _drop_tensor(name: str) -> Callable[[Path], None]:
    """Damage: the tensor is gone from its shard and from the index, everything else consistent (the
    shard rewritten without it, the index total and the manifest made again), so only the tensor is missing."""

    def damage(root: Path) -> None:
        index_path = root / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        shard = root / index["weight_map"].pop(name)
        tensors = load_file(shard)
        index["metadata"]["total_size"] -= tensors.pop(name).nbytes
        save_file(tensors, shard, metadata={"format": "pd"})
        index_path.write_text(json.dumps(index))
        write_manifest(root)

    return damage


def _fewer_layers(root: Path) -> None:
    config = read_config(root)
    config.update(num_hidden_layers=2, moe_layer_end_index=1)
    (root / "config.json").write_text(json.dumps(config))


@dataclass(frozen=True)
class Damage:
    id: str
    damage: Callable[[Path], None]
    rule: str  # the rule validate names
    named: str  # what every refusal line must name
    preset: str = "ernie-moe-tiny"


QKV0, DOWN0 = "ernie.layers.0.self_attn.qkv_proj", "ernie.layers.0.mlp.down_proj"
CASES = [
    Damage("nan-weight-scale", _f32(f"{QKV0}.weight_scale", np.nan), "scales.finite-positive", f"{QKV0}.weight_scale"),
    Damage("inf-act-scale", _f32(f"{DOWN0}.act_scale", np.inf), "scales.finite-positive", f"{DOWN0}.act_scale"),
    Damage("zero-weight-scale", _f32(f"{L1}.mlp.experts.2.down_proj.weight_scale", 0.0), "scales.finite-positive", "experts.2"),
    Damage("denormal-weight-scale", _f32(f"{QKV0}.weight_scale", 2.0**-130), "scales.range", f"{QKV0}.weight_scale"),
    # act_scale consistent with the amax (the 2^-126 floor), so only the range rule fires
    Damage("tiny-act-amax", _f32(f"{DOWN0}.act_amax|{DOWN0}.act_scale", 1e-45, 2.0**-126), "scales.range", f"{DOWN0}.act_amax"),
    Damage(
        "huge-act-amax",
        _f32(f"{DOWN0}.act_amax|{DOWN0}.act_scale", 3e38, np.float32(3e38) / np.float32(240)),
        "scales.range",
        f"{DOWN0}.act_amax",
    ),
    Damage(
        "nan-code-7f",
        _element(f"{L1}.mlp.experts.3.up_gate_proj.weight", np.array([0x7F], np.uint8)),
        "weights.fp8-codes",
        f"{L1}.mlp.experts.3.up_gate_proj.weight",
    ),
    Damage("nan-code-ff", _element(f"{DOWN0}.weight", np.array([0xFF], np.uint8)), "weights.fp8-codes", f"{DOWN0}.weight"),
    Damage("code-beyond-240", _element(f"{QKV0}.weight", np.array([0x7E], np.uint8)), "weights.fp8-codes", f"{QKV0}.weight"),
    Damage(
        "nan-router", _element(f"{L1}.mlp.gate.weight", np.array([np.nan], np.float32)), "weights.finite", f"{L1}.mlp.gate.weight"
    ),
    Damage(
        "inf-correction-bias",
        _element(f"{L1}.mlp.moe_statics.e_score_correction_bias", np.array([np.inf], np.float32), 2),
        "weights.finite",
        "e_score_correction_bias",
    ),
    Damage("nan-norm", _element(f"{L1}.post_attention_layernorm.weight", BF16_NAN), "weights.finite", "post_attention_layernorm"),
    Damage("nan-embedding", _element("ernie.embed_tokens.weight", BF16_NAN, 4000), "weights.finite", "ernie.embed_tokens.weight"),
    Damage("inf-lm-head", _element("lm_head.weight", BF16_INF, 77), "weights.finite", "lm_head.weight", "qwen2-tiny"),
    Damage(
        "missing-tensor", _drop_tensor(f"{L1}.mlp.experts.1.down_proj.weight"), "tensors.expected", "experts.1.down_proj.weight"
    ),
    Damage("missing-manifest", lambda root: (root / "hpu_fp8_manifest.json").unlink(), "container.manifest", "manifest"),
    Damage("fewer-layers-in-config", _fewer_layers, "tensors.expected", "unexpected tensor"),
]


@pytest.fixture(scope="module")
def damaged(tmp_path_factory, spec_factory):
    """case id -> a private copy of the converted checkpoint with that one defect, made once."""
    made: dict[str, Path] = {}

    def make(case: Damage) -> Path:
        if case.id not in made:
            root = tmp_path_factory.mktemp("damaged") / case.id
            shutil.copytree(spec_factory(case.preset), root)
            case.damage(root)
            made[case.id] = root
        return made[case.id]

    return make


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_validate_rejects_it_naming_the_rule(damaged, case):
    result = run_cli("validate", damaged(case))
    assert result.exit_code == 1, result.output
    assert f"[{case.rule}]" in result.output and case.named in result.output


COMMANDS = {
    "map": lambda ckpt, out, source: ("map", ckpt, "-o", out / "rank0.safetensors"),
    "map-all-ranks": lambda ckpt, out, source: ("map", ckpt, "--all-ranks", "-o", out / "ranks"),
    "export-legacy": lambda ckpt, out, source: ("export-legacy", ckpt, out / "legacy"),
    "retarget": lambda ckpt, out, source: ("retarget", ckpt, out / "g3", "--target", "gaudi3"),
    "eval": lambda ckpt, out, source: ("eval", source, ckpt, "--samples", "1", "--seq-len", "16", "--weights-only"),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_reader_refuses_it_in_one_line_and_writes_nothing(damaged, source_factory, tmp_path, case, command):
    checkpoint = damaged(case)
    before = tree_digest(checkpoint)
    out = tmp_path / "out"
    out.mkdir()
    result = run_cli(*COMMANDS[command](checkpoint, out, source_factory(case.preset)))
    assert_refused(result, case.named)
    assert tree_digest(checkpoint) == before
    left = sorted(p.name for p in out.iterdir())
    if case.rule.startswith("weights."):  # found while reading: at most the unpublished staging directory stays
        assert all(name.endswith(".partial") for name in left), left
    else:  # found by the quick check, before anything is written
        assert not left, left


@pytest.mark.parametrize("case", [c for c in CASES if c.rule != "container.manifest"], ids=lambda c: c.id)
def test_pull_refuses_it_even_when_the_publisher_wrote_a_matching_manifest(tmp_path, spec_factory, case):
    """A damaged checkpoint whose manifest vouches for it (as a careless publisher's would): pull reads every
    byte for the sha256 anyway, and checks the values on the way. A local directory gets a download's checks."""
    root = tmp_path / case.id
    shutil.copytree(spec_factory(case.preset), root)
    case.damage(root)
    write_manifest(root)
    assert_refused(run_cli("pull", root), case.named)


@pytest.mark.parametrize("case", [c for c in CASES if not c.rule.startswith("weights.")], ids=lambda c: c.id)
def test_inspect_refuses_what_the_quick_validation_rejects(damaged, case):
    """inspect summarises only a checkpoint the quick check accepts: its summary of another would describe a model
    that is not there (e.g. three layers when config.json was edited to say so)."""
    assert_refused(run_cli("inspect", damaged(case)), case.named)

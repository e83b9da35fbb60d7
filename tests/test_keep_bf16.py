"""Linears kept in BF16: only the groups FastDeploy's mix_quant builds unquantized, everywhere the checkpoint goes.

FastDeploy keeps linears in BF16 by group (``dense_quant_type`` / ``moe_quant_type`` left out), never one
module (docs/fastdeploy.md section 3, "Keeping linears in BF16"). These tests make such checkpoints with
the converter and check what each stage does with them; that FastDeploy's own loading fills the same
parameters is the conformance suite's (tests/fastdeploy_real/test_keep_bf16_conformance.py).
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from hostile.refusal import assert_refused, run_cli, tree_digest

from hpu_fp8_loader import ConfigError, ConvertOptions, HpuFp8Error, convert, evaluate, validate
from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.fastdeploy.legacy import export_legacy
from hpu_fp8_loader.fastdeploy.mapping import Parallelism, map_rank, parameter_specs
from hpu_fp8_loader.fastdeploy.plan import describe_model, plan_deployment
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.config import Bf16Group, parse_quantization_config

MEASUREMENTS = synthetic_measurements(preset_config("ernie-moe-tiny"))


@pytest.fixture(scope="module")
def kept(tmp_path_factory, source_factory):
    """group -> an ERNIE MoE hpu-fp8 checkpoint with that group in BF16 (FP8 KV cache), made once."""
    made = {}

    def make(group: str):
        if group not in made:
            out = tmp_path_factory.mktemp("kept") / group
            convert(source_factory("ernie-moe-tiny"), out, [MEASUREMENTS], ConvertOptions(keep_bf16={group}))
            made[group] = out
        return made[group]

    return make


@pytest.mark.parametrize(
    ("choice", "why"),
    [
        ("ernie.layers.1.mlp.experts.3.down_proj", "all of them in FP8 or all in BF16, never one expert or one layer"),
        ("ernie.layers.2.mlp.experts", "never one expert or one layer"),
        ("ernie.layers.0.self_attn.qkv_proj", "every linear outside the routed experts with one method"),
        ("lm_head", "never quantized"),
        ("kv_cache", "--kv-cache none"),
        ("everything", "names no group FastDeploy quantizes as one"),
    ],
)
def test_a_choice_fastdeploy_cannot_serve_is_refused_saying_why(choice, why):
    with pytest.raises(ConfigError, match=f"{choice!r} cannot be kept in BF16: .*{why}.*choose 'dense' or 'experts'"):
        ConvertOptions(keep_bf16={choice})


@pytest.mark.parametrize(
    ("preset", "groups", "why"),
    [
        ("qwen2-tiny", {"experts"}, "has no routed experts"),
        ("qwen2-tiny", {"dense"}, "no linear is left in FP8"),
        ("ernie-moe-tiny", {"dense", "experts"}, "no linear is left in FP8"),
    ],
)
def test_a_group_this_model_cannot_keep_is_refused_before_anything_is_written(tmp_path, source_factory, preset, groups, why):
    with pytest.raises(ConfigError, match=why):
        convert(source_factory(preset), tmp_path / "out", [synthetic_measurements(preset_config(preset))],
                ConvertOptions(keep_bf16=groups))  # fmt: skip
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("group", "other"), [("experts", "dense"), ("dense", "experts")])
def test_the_group_is_stored_as_its_source_bf16_and_named_as_fastdeploy_reads_it(kept, source_factory, group, other):
    out = kept(group)
    qc = parse_quantization_config(json.loads((out / "config.json").read_text()))
    written = json.loads((out / "config.json").read_text())["quantization_config"]
    key = {"experts": "moe_quant_type", "dense": "dense_quant_type"}
    assert key[group] not in written and written[key[other]] == "tensor_wise_fp8"  # absent: FastDeploy builds BF16
    assert qc.kept_bf16 == {Bf16Group(group)}
    d = describe(json.loads((out / "config.json").read_text()))
    source, checkpoint = Checkpoint.open(source_factory("ernie-moe-tiny")), Checkpoint.open(out)
    linears = [w for w in d.weights() if w.is_linear]
    assert qc.ignore == [w.module for w in linears if w.group is Bf16Group(group)] != []
    for w in linears:
        scale = names.tensor(w.module, names.WEIGHT_SCALE)
        if w.group is Bf16Group(group):  # the source's bits, no scale and no act tensors
            assert checkpoint.tensors[w.name].dtype == "BF16" and scale not in checkpoint.tensors
            assert np.array_equal(checkpoint.get(w.name).view(np.uint16), source.get(w.name).view(np.uint16)), w.name
            assert names.tensor(w.module, names.ACT_AMAX) not in checkpoint.tensors
        else:
            assert checkpoint.tensors[w.name].dtype == "F8_E4M3" and scale in checkpoint.tensors
    # the FP8 KV cache keeps its four points in every layer, whether or not qkv_proj is FP8
    for layer in range(d.num_layers):
        for point in names.ATTENTION_POINTS:
            assert names.tensor(names.attention_point(d.prefix, layer, point), names.ACT_AMAX) in checkpoint.tensors
    assert validate(out, full=True, hashes=True).valid


@pytest.mark.parametrize(
    ("start", "edit", "says"),
    [
        ("fp8", lambda q: q.update(ignore=["ernie.layers.1.mlp.experts.0.up_gate_proj"]), "FP8 or every one in BF16"),
        ("fp8", lambda q: q.pop("moe_quant_type"), "moe_quant_type absent, so FastDeploy builds those linears in BF16"),
        ("experts", lambda q: q.update(ignore=q["ignore"][:-1]), "ignore misses 1 of them"),
    ],
)
def test_an_ignore_list_fastdeploy_would_build_otherwise_is_refused(tmp_path, spec_factory, kept, start, edit, says):
    """A hand-edited config whose ignore list and FastDeploy types disagree: FastDeploy would build other layers
    than ignore declares, so validate names the rule and why, and the mapping (what the hook fills) refuses it."""
    out = tmp_path / "ckpt"
    shutil.copytree(spec_factory("ernie-moe-tiny") if start == "fp8" else kept(start), out)
    config = json.loads((out / "config.json").read_text())
    edit(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    found = [v.message for v in validate(out).violations if v.rule == "config.ignore"]
    assert len(found) == 1 and says in found[0], found
    checkpoint = Checkpoint.open(out)
    with pytest.raises(HpuFp8Error, match=f"quantization_config.ignore: .*{says}"):
        next(map_rank(checkpoint, parse_quantization_config(config), describe(config), Parallelism()))


@pytest.mark.parametrize("group", ["experts", "dense"])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_mapping_fills_fastdeploys_unquantized_layers_with_the_stored_bf16(kept, group, tp):
    """Every rank's pieces match parameter_specs (FastDeploy's BF16 weight, no scales for the group), and the
    stacked expert weights hold each expert's share of the stored BF16 bits."""
    out = kept(group)
    checkpoint = Checkpoint.open(out)
    qc, d = parse_quantization_config(checkpoint.config), describe(checkpoint.config)
    for rank in range(tp):
        par = Parallelism(tp, rank)
        specs = parameter_specs(d, qc.kv_cache_scheme, par, qc.kept_bf16)
        pieces = list(map_rank(checkpoint, qc, d, par))
        assert {p.name for p in pieces} == set(specs)
        for piece in pieces:
            spec = specs[piece.name]
            shape = spec.shape[1:] if piece.expert is not None else spec.shape
            assert (piece.array.dtype.name, piece.array.shape) == ({"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
                                                                     "F32": "float32"}[spec.dtype], shape), piece.name  # fmt: skip
        scales = [n for n in specs if n.endswith(("weight_scale", "act_scale", "_in_scale"))]
        if group == "experts":
            assert (
                not [n for n in scales if ".mlp.experts." in n]
                and specs["ernie.layers.1.mlp.experts.up_gate_proj_weight"].dtype == "BF16"
            )
            first = next(p for p in pieces if p.name == "ernie.layers.1.mlp.experts.down_proj_weight" and p.expert == 0)
            stored = checkpoint.get("ernie.layers.1.mlp.experts.0.down_proj.weight")
            rows = stored.shape[0] // tp
            assert np.array_equal(first.array.view(np.uint16), stored[rank * rows : (rank + 1) * rows].view(np.uint16))
        else:
            assert not [n for n in scales if ".mlp.experts." not in n]
            assert specs["ernie.layers.0.self_attn.qkv_proj.weight"].dtype == "BF16"
            assert "ernie.layers.0.self_attn.attn.cache_k_scale" in specs  # the FP8 KV cache stays


def test_plan_sizes_a_kept_group_as_two_bytes_a_weight_and_no_scales(kept):
    d = describe_model(kept("experts"))
    fp8, bf16 = plan_deployment(d), plan_deployment(d, keep_bf16=frozenset({Bf16Group.EXPERTS}))
    moe = d.moe
    weights = len(d.moe_layers()) * moe.num_experts * 3 * d.hidden_size * moe.intermediate_size  # up|gate and down
    assert bf16.bytes_per_rank["routed_experts"] == 2 * weights
    assert fp8.bytes_per_rank["routed_experts"] > weights  # one byte a weight plus the scales
    assert {g: b for g, b in bf16.bytes_per_rank.items() if g != "routed_experts"} == {
        g: b for g, b in fp8.bytes_per_rank.items() if g != "routed_experts"
    }
    assert bf16.keep_bf16 == ["experts"] and fp8.keep_bf16 == []
    assert math.isclose(bf16.total_bytes_per_rank - fp8.total_bytes_per_rank,
                        2 * weights - fp8.bytes_per_rank["routed_experts"])  # fmt: skip


@pytest.mark.parametrize(("group", "absent"), [("experts", "moe_quant_type"), ("dense", "dense_quant_type")])
def test_export_legacy_leaves_out_the_type_fastdeploy_then_builds_in_bf16(tmp_path, kept, group, absent):
    result = export_legacy(kept(group), tmp_path / "legacy")
    config = json.loads((tmp_path / "legacy" / "config.json").read_text())["quantization_config"]
    assert absent not in config and config["quantization"] == "mix_quant" and config["kv_cache_quant_type"] == "float8_e4m3"
    index = json.loads((tmp_path / "legacy" / "model.safetensors.index.json").read_text())["weight_map"]
    module = {"experts": "ernie.layers.1.mlp.experts.0.up_gate_proj", "dense": "ernie.layers.0.self_attn.qkv_proj"}[group]
    assert f"{module}.weight" in index and f"{module}.quant_weight" not in index and result.tensors == len(index)


@pytest.mark.slow
def test_eval_emulates_the_kept_experts_in_bf16(tmp_path):
    """On the tiny trained ERNIE MoE, the same calibration converted twice: with the experts kept in BF16 the
    emulated model runs them unquantized, so it departs less from the BF16 reference than the all-FP8 one."""
    from hpu_fp8_loader import calibrate

    source = TINY_MODELS["ernie-moe-bytes"]
    measurements = [calibrate(source, samples=8, seq_len=64).measurements]
    rows = {}
    for name, keep in (("fp8", set()), ("experts-bf16", {"experts"})):
        convert(source, tmp_path / name, measurements, ConvertOptions(keep_bf16=keep, dead_experts="sibling-max"))
        rows[name] = evaluate(source, tmp_path / name, samples=4, seq_len=64).rows[0]
    assert rows["experts-bf16"].mean_kl < rows["fp8"].mean_kl
    assert rows["experts-bf16"].relative_logit_rmse < rows["fp8"].relative_logit_rmse


def test_the_command_line_refuses_an_unservable_keep_bf16_in_one_line(tmp_path, source_factory):
    source = source_factory("ernie-moe-tiny")
    measurements = tmp_path / "m.json"
    measurements.write_text(MEASUREMENTS.model_dump_json())
    before = tree_digest(source)
    args = ["convert", source, tmp_path / "out", "--measurements", measurements, "--workers", "1"]
    line = assert_refused(run_cli(*args, "--keep-bf16", "ernie.layers.1.mlp.experts.2.up_gate_proj"), "--keep-bf16", code=2)
    assert "never one expert or one layer" in line
    assert_refused(run_cli(*args, "--keep-bf16", "dense", "--keep-bf16", "experts"), "no linear is left in FP8", code=1)
    assert tree_digest(source) == before and not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    done = run_cli(*args, "--keep-bf16", "experts")
    assert done.exit_code == 0 and "kept in BF16: experts" in done.stdout, done.stderr


@pytest.mark.parametrize(("model", "servable"), [("ernie-moe-bytes", True), ("qwen2-bytes", False)])
def test_the_report_names_each_groups_worst_linear_and_the_servable_choice(model, servable):
    """report.json's keep_bf16: per group its worst linear; the suggestion keeps the worst linear's group in BF16
    where the model can serve that (an MoE model), and is null where the group is every linear (Qwen2)."""
    from hpu_fp8_loader import Report, calibrate

    report = Report()
    calibrate(TINY_MODELS[model], samples=4, seq_len=32, report=report)
    data = report.to_dict()["keep_bf16"]
    worst = report.worst(1)[0]
    group = "experts" if ".mlp.experts." in worst["module"] else "dense"
    assert data["groups"][group] == {"worst_module": worst["module"], "relative_error": worst["relative_error"]}
    assert set(data["groups"]) == ({"dense", "experts"} if servable else {"dense"})
    assert data["suggestion"] == (f"--keep-bf16 {group}" if servable else None)

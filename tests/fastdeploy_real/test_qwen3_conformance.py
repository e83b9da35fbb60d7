"""Qwen3 and Qwen3-MoE against FastDeploy's own classes (models/qwen3.py, models/qwen3moe.py at the commit under test).

The two models have different kinds of evidence (docs/fastdeploy.md section 13, "Qwen3 and Qwen3-MoE"):

- **Qwen3 dense**: FastDeploy's own v0 loading of our ``export-legacy`` copy is the oracle, as for Qwen2
  (runtime/conformance.py): every parameter and every MLP kernel argument agree to the bit at TP 1. FastDeploy's v0
  loader does not split Qwen3's FP8 tensors (``Qwen3PretrainedModel._get_tensor_parallel_mappings`` lists only
  ``.weight`` / ``.bias`` keys), which a test shows on FastDeploy's own loading; at TP 2 the oracle is its
  pre-sharded ``rank{r}/`` loading, the split itself ours on both sides.
- **Qwen3-MoE**: FastDeploy has no FP8 loading of its own (``Qwen3MoeBlock.weight_key_map`` holds only the two expert
  ``.weight`` keys), so nothing of FastDeploy's can produce the values. runtime/fill_case.py checks what can be
  checked on its code: every parameter FastDeploy creates is filled, with the shape and dtype it created, and
  every argument of each layer's first attention op and first MoE op equals what the project's emulation feeds
  its own arithmetic. Dense Qwen3 runs the same case, which adds its attention kernel's arguments.

All of it runs FastDeploy's code on a CPU with the suite's stand-ins for the compiled HPU ops; nothing here ran on a
Gaudi. Skipped, saying why, without FastDeploy's source (``HPU_FP8_FASTDEPLOY_SRC``; see fd_environment.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_conformance import assert_attention_driven, assert_conforms, legacy_exact

from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.fastdeploy.legacy import export_legacy
from hpu_fp8_loader.fastdeploy.rankfiles import write_presharded
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements

pytestmark = pytest.mark.slow

FILL_CASE = "fill_case.py"
# float32 rounding of the rotation angle: FastDeploy computes base ** (-i / d) in float32, the emulation in float64
# rounded once; over the suite's 256 positions that moves cos and sin by a few float32 ulps of the angle
ROPE_ROUNDING = 1e-5


@pytest.fixture(scope="module")
def norms(fastdeploy_env) -> str:
    """Where FastDeploy under test holds Qwen3's q/k norms below ``self_attn``, read from its source: ``qk_norm.`` from
    2533836d (PR 5880: a ``QKRMSNorm``), else nothing."""
    source = fastdeploy_env["environment"].source / "fastdeploy/model_executor/models/qwen3.py"
    return "qk_norm." if "QKRMSNorm(" in source.read_text() else ""


@pytest.fixture(scope="module")
def bf16_gate(fastdeploy_env) -> bool:
    """Whether FastDeploy under test builds Qwen3-MoE's router gate in bf16 (from 53aaac69, PR 6457: float32 only with
    ``--moe-gate-fp32``), read from its source."""
    source = fastdeploy_env["environment"].source / "fastdeploy/model_executor/models/qwen3moe.py"
    return "moe_gate_fp32" in source.read_text()


def restored_qk_norms(norms: str, layers: int) -> list[tuple[str, str]]:
    """What FastDeploy's own loading does not hand the attention ops where it holds the norms in ``qk_norm`` (its
    runner asks ``hasattr(self, "q_norm")``) and the hook does: both norms of each layer, in prefill and decode."""
    if not norms:
        return []
    return [(f"model.layers.{i}.self_attn ({mode})", f"model.layers.{i}.self_attn.{norms}{norm}.weight")
            for i in range(layers) for mode in ("prefill", "decode") for norm in ("q_norm", "k_norm")]  # fmt: skip


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(preset, kv_cache) -> the hpu-fp8 checkpoint (amax the legacy layout stores exactly), made once."""
    made: dict[tuple[str, str], Path] = {}

    def make(preset: str, kv_cache: str = "fp8") -> Path:
        if (preset, kv_cache) not in made:
            root = tmp_path_factory.mktemp(f"{preset}-{kv_cache}")
            config = preset_config(preset)
            synthesize(root / "bf16", config, seed=11)
            options = ConvertOptions(kv_cache=kv_cache)
            convert(root / "bf16", root / "spec", [legacy_exact(synthetic_measurements(config))], options)
            made[(preset, kv_cache)] = root / "spec"
        return made[(preset, kv_cache)]

    return make


@pytest.fixture(scope="module")
def legacy(qwen3):
    """kv_cache -> the dense Qwen3 checkpoint's TP 1 legacy export (FastDeploy's v0 layout), made once."""
    made: dict[str, Path] = {}

    def make(kv_cache: str = "fp8") -> Path:
        if kv_cache not in made:
            spec = qwen3("qwen3-tiny", kv_cache)
            made[kv_cache] = export_legacy(spec, spec.parent / "legacy").out
        return made[kv_cache]

    return make


@pytest.mark.parametrize("kv_cache", ["fp8", "none"])
def test_qwen3_loads_as_fastdeploys_own_loading_of_the_legacy_export(run_case, qwen3, legacy, norms, kv_cache):
    report = run_case({"oracle": legacy(kv_cache), "hook": qwen3("qwen3-tiny", kv_cache), "tp": 1, "rank": 0})
    assert_conforms(report, restored_qk_norms(norms, preset_config("qwen3-tiny")["num_hidden_layers"]))
    assert_attention_driven(report, preset_config("qwen3-tiny", {}), 1, kv_cache)
    assert report["oracle_zero"] == [] and report["loader"] == "HpuFp8ModelLoader"
    print(f"Qwen3 kv={kv_cache} TP1: {report['parameters']} parameters and {report['kernel_calls']} attention and MLP "
          "kernel calls identical to FastDeploy's own loading, but for the q/k norms FastDeploy's own hands no kernel "
          f"and the hook does: {len(report['restored_qk_norms'])}")  # fmt: skip


def test_fastdeploys_own_loading_does_not_split_qwen3_fp8_tensors(run_case, qwen3, legacy):
    """Why export-legacy refuses Qwen3 at TP > 1: FastDeploy's v0 loader, given the TP 1 export at TP 2, silently
    gives each rank every FP8 linear weight whole (twice the rank's width, no error), while every other tensor (the
    split embedding and lm_head, the norms, the scales) agrees with the hook's share."""
    linears = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.up_gate_proj", "mlp.down_proj")
    whole = {f"model.layers.{i}.{linear}.weight" for i in range(2) for linear in linears}
    for rank in range(2):
        report = run_case({"oracle": legacy(), "hook": qwen3("qwen3-tiny"), "tp": 2, "rank": rank})
        assert "error" not in report, report["error"]
        shapes = {name: json_shapes(rest) for name, _, rest in (d.partition(": ") for d in report["differences"])}
        assert set(shapes) == whole, report["differences"]
        for fastdeploys, hooks in shapes.values():  # the rank's width doubled: the whole tensor on this rank
            assert sorted(f // h for f, h in zip(fastdeploys, hooks, strict=True)) == [1, 2], (fastdeploys, hooks)
    print("FastDeploy's own v0 loading of Qwen3 FP8 at TP 2:", report["differences"][0])


def json_shapes(difference: str) -> tuple[list[int], list[int]]:
    """The two shapes in a ``FastDeploy {'shape': [...], ...}, hook {'shape': [...], ...}`` difference."""
    found = re.findall(r"'shape': \[([0-9, ]*)\]", difference)
    assert len(found) == 2, difference
    fastdeploys, hooks = ([int(n) for n in shape.split(",")] for shape in found)
    return fastdeploys, hooks


def test_qwen3_at_tp2_against_fastdeploys_presharded_loading(run_case, qwen3, norms, tmp_path):
    spec = qwen3("qwen3-tiny")
    write_presharded(spec, tmp_path / "ranks", tp=2)
    for rank in range(2):
        report = run_case({"oracle": tmp_path / "ranks", "hook": spec, "tp": 2, "rank": rank})
        assert_conforms(report, restored_qk_norms(norms, preset_config("qwen3-tiny")["num_hidden_layers"]))
        assert_attention_driven(report, preset_config("qwen3-tiny", {}), 2, "fp8")
        print(f"Qwen3 TP2 rank {rank}, pre-sharded: {report['parameters']} parameters identical")


def assert_filled_and_emulated(report: dict) -> None:
    assert "error" not in report, report["error"] + "\n" + report["stderr"][-6000:]
    assert report["fill_problems"] == [], "\n".join(report["fill_problems"])
    assert report["kernel_problems"] == [], "\n".join(report["kernel_problems"])
    assert report["parameters"] > 0 and report["kernel_calls"]
    assert report["rope_difference"] <= ROPE_ROUNDING, report["rope_difference"]


FILL_CASES = [
    # (preset, kv_cache, tp, moe_layout)
    ("qwen3-moe-tiny", "fp8", 1, "develop"),
    ("qwen3-moe-tiny", "fp8", 2, "develop"),
    ("qwen3-moe-tiny", "none", 2, "develop"),
    ("qwen3-moe-tiny", "fp8", 2, "pr5855"),
    ("qwen3-tiny", "fp8", 1, "develop"),
    ("qwen3-tiny", "fp8", 2, "develop"),
]
# What each first op is handed (below its module), every one compared with the emulation's reads; the q/k norms
# below where FastDeploy holds them (the ``norms`` fixture)
QKV_LINEAR = ["qkv_proj.act_scale", "qkv_proj.weight", "qkv_proj.weight_scale"]
KV_FP8 = ["attn.cache_k_scale", "attn.cache_v_scale", "attn.q_scale"]
EXPERTS = ["down_proj_in_scale", "down_proj_weight", "down_proj_weight_scale", "up_gate_proj_in_scale",
           "up_gate_proj_weight", "up_gate_proj_weight_scale"]  # fmt: skip
MOE = sorted(["gate.weight", *(f"experts.{name}" for name in EXPERTS)])
ATTENTION_NUMBERS = {"epsilon", "head_dim", "num_heads", "total_batch_encoder", "transpose", "use_neox_style"}
MOE_NUMBERS = {"activation", "experts_max", "experts_min", "norm_topk_prob", "permuted_weights", "top_k"}


@pytest.mark.parametrize(("preset", "kv_cache", "tp", "moe_layout"), FILL_CASES)
def test_every_parameter_fastdeploy_creates_is_filled_and_every_kernel_argument_is_the_emulations(
    run_case, qwen3, norms, moe_layouts, bf16_gate, preset, kv_cache, tp, moe_layout
):
    layers = preset_config(preset)["num_hidden_layers"]
    qkv = [*QKV_LINEAR, f"{norms}k_norm.weight", f"{norms}q_norm.weight"]
    for rank in range(tp):
        case = {"hook": qwen3(preset, kv_cache), "tp": tp, "rank": rank, "moe_layout": moe_layout}
        report = run_case(case, script=FILL_CASE)
        assert_filled_and_emulated(report)
        calls = report["kernel_calls"]
        attention = [calls.pop(f"model.layers.{i}.self_attn") for i in range(layers)]
        assert all(c["op"] == "fused_qkv_rope" and set(c["numbers"]) == ATTENTION_NUMBERS for c in attention), attention
        assert all(c["parameters"] == sorted(qkv + (KV_FP8 if kv_cache == "fp8" else [])) for c in attention), attention
        moe = [calls.pop(f"model.layers.{i}.mlp") for i in range(layers)] if "moe" in preset else []
        assert all(c["op"] == "fused_gate_moe_fp8" and c["parameters"] == MOE for c in moe), moe
        assert all(set(c["numbers"]) == MOE_NUMBERS for c in moe) and calls == {}, calls
        routers = {f"model.layers.{i}.mlp.gate.weight" for i in range(layers)} if moe and bf16_gate else set()
        assert set(report["routers_rounded_to_bf16"]) == routers, report["routers_rounded_to_bf16"]
        lists = report["per_expert_lists"]  # the develop MoE method's down_proj_in_scale: a per-expert bf16 list
        if moe and moe_layouts[moe_layout] == "list":
            experts = preset_config(preset)["num_experts"]
            assert len(lists) == layers and all(v == [experts, "paddle.bfloat16"] for v in lists.values()), lists
        else:  # PR 5855's is a parameter, among those checked as filled
            assert lists == {}, lists
        print(f"{report['architecture']} kv={kv_cache} TP{tp} rank {rank} {moe_layout}: {report['parameters']} parameters filled as "
              f"created; {len(attention) + len(moe)} first kernel calls' arguments are the emulation's; rotary table "
              f"within {report['rope_difference']:.1e}; bf16 router gate, values the cast rounds: "
              f"{report['routers_rounded_to_bf16'] or 'none (a float32 gate)'}")  # fmt: skip


@pytest.mark.parametrize(
    ("preset", "fault", "where"),
    [
        ("qwen3-tiny", "qk-norms-swapped", "self_attn.q_norm.weight"),
        ("qwen3-moe-tiny", "qk-norms-swapped", "self_attn.q_norm.weight"),
        ("qwen3-moe-tiny", "expert-scales-swapped", "mlp.experts.down_proj_in_scale"),
        ("qwen3-moe-tiny", "zero-moe-in-scale", "mlp.experts.up_gate_proj_in_scale"),
    ],
)
def test_a_fault_in_the_hooks_output_is_reported(run_case, qwen3, norms, preset, fault, where):
    """Negative control: one wrong value in what the hook hands FastDeploy is found and named by the fill case."""
    where = where.replace("self_attn.", f"self_attn.{norms}")
    report = run_case({"hook": qwen3(preset), "tp": 1, "rank": 0, "inject": fault}, script=FILL_CASE)
    assert "error" not in report, report["error"]
    found = report["kernel_problems"] + report["fill_problems"]
    assert found and all(where in problem or where.replace("q_norm", "k_norm") in problem for problem in found), found
    if fault == "zero-moe-in-scale":  # a multiplier left as FastDeploy created it
        assert report["fill_problems"] == [f"model.layers.0.{where}: left at its initial value"], report["fill_problems"]
    print(f"{preset} {fault}:", found)


def test_the_oracle_names_swapped_qk_norms_of_dense_qwen3(run_case, qwen3, legacy, norms):
    """Negative control of the oracle case: q_norm and k_norm exchanged differ from FastDeploy's own loading (and,
    where FastDeploy's own loading hands the attention no norm, are not counted as restored)."""
    report = run_case({"oracle": legacy(), "hook": qwen3("qwen3-tiny"), "tp": 1, "rank": 0, "inject": "qk-norms-swapped"})
    assert "error" not in report, report["error"]
    assert [d.split(":")[0] for d in report["differences"]] == [
        f"model.layers.0.self_attn.{norms}k_norm.weight",
        f"model.layers.0.self_attn.{norms}q_norm.weight",
    ], report["differences"]
    assert all(".layers.0." not in label for label in report["restored_qk_norms"]), report["restored_qk_norms"]
    for norm in ("q_norm", "k_norm"):  # handed to the attention op, in prefill and decode
        assert [d.split(" -> ")[0] for d in report["kernel_differences"] if f".{norm}.weight" in d] == [
            "model.layers.0.self_attn (decode)",
            "model.layers.0.self_attn (prefill)",
        ], report["kernel_differences"]

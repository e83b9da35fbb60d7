"""Tensor and expert parallelism on PR 5855's own files (issue 27 item 5), not on the suite's re-creation of them.

PR 5855 ("[Intel HPU] enable MoE EP for hpu") merged as fbcccaa7 (2026-01-15): on a source from there (release/2.5,
release/2.6, develop e53f5184) this module runs on that source itself, its own load_weight_utils.py included. On an
older one (8c3513a4, CI's) it lays two of the PR's files over it; the public search index holds single files of
PaddlePaddle/FastDeploy. ``pr5855_overlay.json`` names the two this module lays over FastDeploy
8c3513a4, with their sources and sha256: ``fastdeploy/worker/hpu_model_runner.py`` at 029e4cf8 (``convert_model``
calls ``process_scales_alignment_after_loading`` on every ``FusedMoE``, replacing the ``[E, 1]``
``down_proj_in_scale`` parameter by an ``[E, 1, 64]`` tensor after loading) and the HPU MoE backend as PR 5855 leaves
it (``down_proj_in_scale`` created as a parameter, ``init_ep`` building no GPU buffers, ``apply`` calling the fused
kernel for EP and TP alike). ``HPU_FP8_FASTDEPLOY_OVERLAY`` names a directory holding them (fd_environment.py);
everything else is 8c3513a4's. Without it the module is skipped and says so; nothing of the files is committed here.

The oracle is FastDeploy's v0 loader with the same worker config. At TP it reads the legacy export, as in
test_conformance.py. At EP it reads a rank's experts through its own ``load_ep_checkpoint``, which at 8c3513a4 keeps
an expert key only in the indexed form ``experts.{j}.…``: the shared MoE input scale FD's measurement and
PaddleCustomDevice's converter write (``experts.up_gate_proj.activation_scale``, as ``export-legacy`` does) is dropped
there, and the backend then fails on it (a case pins that; PR 5855's description says its ``load_weight_utils.py``
change adds that key, and no readable version of that file has it). The EP oracle therefore reads the export with the
indexed form FastDeploy's EP loader reads (``experts.{j}.up_gate_proj.activation_scale``, every expert the same value,
which the backend's ``_extract_descale_tensor`` reduces to the same ``1 / scale``). Both models then go through the
files' ``convert_model`` and MoE forward (``FusedMoE.forward`` -> ``forward_normal`` or, at EP with TP 2,
``forward_split_allgather`` -> ``apply``) to the first HPU op; attention to its first op in prefill and decode.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_conformance import assert_attention_driven, assert_conforms, checkpoints  # noqa: F401

from hpu_fp8_loader.fastdeploy.plugin import ANNOUNCEMENT_PREFIX, MOE_PARAMETER_LAYOUT
from hpu_fp8_loader.sources.synth import preset_config

pytestmark = pytest.mark.slow
PRESET = "ernie-moe-tiny"
ALIGNMENT = 64  # process_scales_alignment_after_loading: 0x80 bytes of bf16 a slot
SHARED_INPUT = ".mlp.experts.up_gate_proj.activation_scale"
INDEX = "model.safetensors.index.json"


def with_indexed_moe_input_scales(legacy: Path, out: Path) -> Path:
    """A copy of ``legacy`` with each MoE layer's shared input scale also stored under every expert's indexed key
    (one added shard), the form FastDeploy 8c3513a4's ``load_ep_checkpoint`` keeps; nothing else changes."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if not out.exists():
        shutil.copytree(legacy, out)
        index = json.loads((out / INDEX).read_text())
        weight_map = index["weight_map"]
        experts = preset_config(PRESET, {})["moe_num_experts"]
        added = {}
        for key in [k for k in weight_map if k.endswith(SHARED_INPUT)]:
            with safe_open(out / weight_map[key], framework="pt") as shard:  # that one tensor, not its whole shard
                value = shard.get_tensor(key)
            for expert in range(experts):
                added[key.replace(".experts.", f".experts.{expert}.")] = value.clone()
        assert added, f"no {SHARED_INPUT} in {legacy}"
        save_file(added, out / "indexed-moe-input-scales.safetensors")
        weight_map.update(dict.fromkeys(added, "indexed-moe-input-scales.safetensors"))
        (out / INDEX).write_text(json.dumps(index, indent=2))
    return out


def assert_on_pr5855s_files(report: dict, ranks: int, rank: int, expert_parallel: bool) -> None:
    """The hook filled FastDeploy's [E, 1] parameter, the files' convert_model padded it, and each MoE layer's kernel
    was handed the rank's experts (EP rank = the worker's rank among all ``ranks``) with that padded scale."""
    experts = preset_config(PRESET, {})["moe_num_experts"]
    local = experts // ranks if expert_parallel else experts
    first = rank * local if expert_parallel else 0
    announced = [line for line in report["stderr"].splitlines() if ANNOUNCEMENT_PREFIX in line]
    assert announced and MOE_PARAMETER_LAYOUT in announced[-1], announced
    assert f"ep rank {rank if expert_parallel else 0} of {ranks if expert_parallel else 1}" in announced[-1], announced
    assert report["moe_calls"], report
    for name, call in report["moe_calls"].items():
        assert call["op"] == "fused_gate_moe_fp8", (name, call)
        assert call["experts"] == [first, first + local - 1], (name, call)
        down_in_scale = call["arguments"][6]  # fused_gate_moe_fp8(x, gate, bias, up_gate, down, up_gate_in, down_in, ...)
        assert down_in_scale == {"shape": [local, 1, ALIGNMENT], "dtype": "bfloat16"}, (name, call)
        assert call["arguments"][3]["shape"][0] == local, (name, call)  # the rank's experts' weights


def oracle_for(legacy: Path, expert_parallel: bool) -> Path:
    return with_indexed_moe_input_scales(legacy, legacy.parent / "legacy-indexed") if expert_parallel else legacy


@pytest.mark.parametrize("kv_cache", ["fp8", "none"])
@pytest.mark.parametrize(
    ("tp", "dp", "expert_parallel"),
    [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, True)],
    ids=["TP1", "TP2", "TP2-EP2", "DP2-EP2"],
)
def test_the_hook_on_pr5855s_own_files(run_overlay_case, checkpoints, tp, dp, expert_parallel, kv_cache):  # noqa: F811
    """At DP 2 x EP 2 every worker is tensor-parallel rank 0 and its EP rank is its data-parallel rank: a hook that took
    the expert range from the tensor-parallel rank would pass TP 2 x EP 2 (where the two coincide) and fail here."""
    spec, legacy = checkpoints(PRESET, True, kv_cache)
    for rank in range(tp * dp):
        case = {"oracle": oracle_for(legacy, expert_parallel), "hook": spec, "tp": tp, "dp": dp, "rank": rank,
                "expert_parallel": expert_parallel}  # fmt: skip
        report = run_overlay_case(case)
        assert_conforms(report)
        assert_attention_driven(report, preset_config(PRESET, {}), tp, kv_cache)
        assert_on_pr5855s_files(report, tp * dp, rank, expert_parallel)
        print(f"PR 5855 files, KV {kv_cache}, TP{tp} DP{dp}{' EP' if expert_parallel else ''} rank {rank}: {report['parameters']} "
              f"parameters and {report['kernel_calls']} kernel calls identical; experts {report['moe_calls']}")  # fmt: skip


def test_fastdeploys_own_ep_loading_of_the_shared_moe_input_scale(run_overlay_case, checkpoints, moe_layouts):  # noqa: F811
    """FastDeploy's v0 EP loading of the layout its measurement and PaddleCustomDevice's converter write (one shared
    ``experts.up_gate_proj.activation_scale`` a MoE layer). At 8c3513a4 with PR 5855's two files it fails on that key:
    its ``load_ep_checkpoint`` keeps only indexed expert keys (loud, never served; the hook reads the spec
    checkpoint). From fbcccaa7, PR 5855 merged with its ``load_weight_utils.py``, FastDeploy reads it, and its own
    loading is then an oracle for the hook on the very layout it writes."""
    spec, legacy = checkpoints(PRESET, True)
    report = run_overlay_case({"oracle": legacy, "hook": spec, "tp": 2, "rank": 0, "expert_parallel": True})
    if moe_layouts["develop"] == "parameter":  # the source's own PR 5855
        assert_conforms(report)
        assert_on_pr5855s_files(report, 2, 0, True)
        print(f"FastDeploy's own EP loading of the shared-key layout agrees with the hook: {report['parameters']} parameters")
    else:
        assert report.get("error", "").startswith("KeyError") and SHARED_INPUT in report["error"], report
        print("FastDeploy's own EP loading of the shared-key layout:", report["error"])


@pytest.mark.parametrize(("fault", "tp", "dp"), [("experts-of-ep-rank-0", 2, 1), ("ep-rank-from-tp-rank", 1, 2)])
def test_a_rank_given_another_ranks_experts_is_reported(run_overlay_case, checkpoints, fault, tp, dp):  # noqa: F811
    """Negative controls at EP rank 1 (runtime/faults.py): the hook mapping rank 0's experts (at TP 2 x EP 2), or taking
    its EP rank from its tensor-parallel rank (at DP 2 x EP 2, where that is 0), is named on every expert tensor of
    every MoE layer, and on nothing else."""
    spec, legacy = checkpoints(PRESET, True)
    case = {"oracle": oracle_for(legacy, True), "hook": spec, "tp": tp, "dp": dp, "rank": 1, "expert_parallel": True}
    report = run_overlay_case({**case, "inject": fault})
    assert "error" not in report, report["error"]
    named = sorted(line.split(":")[0] for line in report["differences"])
    config = preset_config(PRESET, {})
    moe_layers = range(config["moe_layer_start_index"], config["num_hidden_layers"])
    per_expert = ["up_gate_proj_weight", "down_proj_weight", "up_gate_proj_weight_scale", "down_proj_weight_scale",
                  "down_proj_in_scale"]  # fmt: skip
    expected = sorted(f"ernie.layers.{i}.mlp.experts.{name}" for i in moe_layers for name in per_expert)
    assert named == expected, report["differences"]
    assert report["kernel_differences"], report
    print(f"{fault} caught:", *report["differences"], sep="\n  ")

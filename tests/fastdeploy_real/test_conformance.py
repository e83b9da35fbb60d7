"""The hook against FastDeploy's own code: what its own loader makes of our export-legacy copy is the oracle.

Each case builds the same FastDeploy model twice through FastDeploy's worker code (config from
``worker_process``, ``HPUModelRunner.load_model``): once with ``--load-choices default`` from the
legacy export, once with ``--load-choices hpu_fp8`` from the hpu-fp8 checkpoint, with the plugin
found by FastDeploy through ``FD_PLUGINS``. Every parameter and buffer must agree to the bit, and so
must the arguments every attention layer (prefill and decode), MLP and MoE layer hands its first HPU
kernel, and the KV cache FastDeploy allocates. Checkpoints whose activation amax the legacy layout
stores exactly (bf16) make exact bits possible everywhere; ordinary calibrated amax is a separate case
with the legacy layout's own rounding stated. Skipped, saying why, without
FastDeploy's source (``HPU_FP8_FASTDEPLOY_SRC``; see fd_environment.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.fastdeploy.legacy import amax_from_legacy, amax_to_legacy, export_legacy
from hpu_fp8_loader.fastdeploy.plugin import MOE_LIST_LAYOUT, MOE_PARAMETER_LAYOUT
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.measurements import Measurements

pytestmark = pytest.mark.slow


# The legacy layout stores every activation amax in bf16 (2^-8 relative at most); FastDeploy then derives
# its scales from that value and rounds them to bf16 (or float32) again: 2^-7 bounds the two roundings.
LEGACY_ROUNDING = 2.0**-7


def legacy_exact(measurements: Measurements) -> Measurements:
    """The same measurements with every amax moved to the nearest value the legacy layout stores exactly."""
    exact = {}
    for module, amax in measurements.amax.items():
        key = names.fastdeploy_key_from_module(module)
        exact[module] = amax_from_legacy(key, float(amax_to_legacy(key, amax).astype(np.float32)[0]))
    return measurements.model_copy(update={"amax": exact})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(preset, tied, kv_cache, exact) -> (hpu-fp8 checkpoint, its TP 1 legacy export), made once."""
    made: dict[tuple, tuple[Path, Path]] = {}

    def make(preset: str, tied: bool | None = None, kv_cache: str = "fp8", exact: bool = True) -> tuple[Path, Path]:
        key = (preset, tied, kv_cache, exact)
        if key not in made:
            root = tmp_path_factory.mktemp(f"{preset}-{kv_cache}")
            config = preset_config(preset, {} if tied is None else {"tie_word_embeddings": tied})
            synthesize(root / "bf16", config, seed=11)
            measurements = synthetic_measurements(config)
            convert(
                root / "bf16",
                root / "spec",
                [legacy_exact(measurements) if exact else measurements],
                ConvertOptions(kv_cache=kv_cache),
            )
            export_legacy(root / "spec", root / "legacy")
            made[key] = (root / "spec", root / "legacy")
        return made[key]

    return make


def assert_conforms(report: dict, restored_qk_norms: list[tuple[str, str]] | None = None) -> None:
    """Every parameter and kernel argument to the bit, but the values named device-rounded (runtime/conformance.py:
    a bf16 tensor divided by a Python number, one bf16 ulp apart at most, each printed by name), and exactly the
    ``restored_qk_norms`` given ((call, parameter) pairs: a q/k norm only the hook hands its attention op)."""
    assert "error" not in report, report["error"] + "\n" + report["stderr"][-6000:]
    assert report["differences"] == [], "\n".join(report["differences"])
    assert report["kernel_differences"] == [], "\n".join(report["kernel_differences"])
    restored = sorted((label.split(" -> ")[0], label.rsplit("(", 1)[1].rstrip(")")) for label in report["restored_qk_norms"])
    assert restored == sorted(restored_qk_norms or []), report["restored_qk_norms"]
    assert report["parameters"] > 0 and report["kernel_calls"] > 0
    for entry in report.get("device_rounded", []):
        print(f"device-rounded: {entry['name']} FastDeploy on CPU paddle {entry['fastdeploy']!r}, hook {entry['hook']!r}")


KV_SCALES = {  # what each attention op is handed of the KV-cache quantization (layers/backends/intel_hpu/quantization/kv_cache.py)
    "fused_qkv_rope": ["attn.cache_k_scale", "attn.cache_v_scale", "attn.q_scale"],
    "fused_block_attention": ["attn.cache_k_scale", "attn.cache_v_scale", "attn.q_scaling_scale", "attn.s_scale"],
}


def assert_attention_driven(report: dict, config: dict, tp: int, kv_cache: str) -> None:
    """Every attention layer reached its first op in prefill and in decode, handed the KV-cache scales exactly when the
    cache is fp8, with the linears' weights and scales; the KV cache FastDeploy allocated has the dtype the
    checkpoint asks for and the rank's KV heads, and is the same for the oracle."""
    layers = config["num_hidden_layers"]
    calls = report["attention_calls"]
    assert sorted(calls.values()) == ["fused_block_attention"] * layers + ["fused_qkv_rope"] * layers, calls
    for call, handed in report["attention_parameters"].items():
        op = calls[call]
        expected = KV_SCALES[op] if kv_cache == "fp8" else []
        assert [name for name in handed if name.startswith("attn.")] == expected, (call, handed)
        linears = ["qkv_proj"] + (["o_proj"] if op == "fused_block_attention" else [])
        for linear in linears:
            assert {f"{linear}.weight", f"{linear}.act_scale", f"{linear}.weight_scale"} <= set(handed), (call, handed)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    cache = report["kv_cache"]
    assert cache["tensors"] == 2 * layers and not report["kv_cache_differs"], report["kv_cache"]
    assert cache["dtypes"] == ["float8_e4m3fn" if kv_cache == "fp8" else "bfloat16"], cache
    assert [shape[0] for shape in cache["shapes"]] == [cache["blocks_asked"]], cache
    assert [shape[2:] for shape in cache["shapes"]] == [[config["num_key_value_heads"] // tp, head_dim]], cache


CASES = [
    # (preset, tied, kv_cache, tp, moe_layout)
    ("ernie-moe-tiny", True, "fp8", 1, "develop"),
    ("ernie-moe-tiny", True, "fp8", 2, "develop"),
    ("ernie-moe-tiny", False, "fp8", 1, "develop"),
    ("ernie-moe-tiny", True, "none", 1, "develop"),
    ("ernie-moe-tiny", False, "none", 2, "develop"),
    ("ernie-moe-tiny", True, "fp8", 1, "pr5855"),
    ("ernie-moe-tiny", True, "fp8", 2, "pr5855"),
    ("ernie-dense-tiny", True, "fp8", 2, "develop"),
    ("qwen2-tiny", False, "fp8", 1, "develop"),
    ("qwen2-tiny", True, "fp8", 1, "develop"),
    ("qwen2-tiny", True, "none", 1, "develop"),
    ("qwen2-tiny", False, "none", 1, "develop"),
]


@pytest.mark.parametrize(("preset", "tied", "kv_cache", "tp", "moe_layout"), CASES)
def test_the_hook_fills_what_fastdeploys_own_loading_fills(
    run_case, checkpoints, moe_layouts, preset, tied, kv_cache, tp, moe_layout
):
    spec, legacy = checkpoints(preset, tied, kv_cache)
    for rank in range(tp):
        report = run_case({"oracle": legacy, "hook": spec, "tp": tp, "rank": rank, "moe_layout": moe_layout})
        assert_conforms(report)
        assert_attention_driven(report, preset_config(preset, {}), tp, kv_cache)
        if preset == "ernie-moe-tiny":
            assert report["moe_layout"] == moe_layouts[moe_layout]
        cache = report["kv_cache"]
        print(f"{preset} tied={tied} kv={kv_cache} TP{tp} rank {rank} {moe_layout}: {report['parameters']} "
              f"parameters and {report['kernel_calls']} kernel calls identical ({len(report['attention_calls'])} "
              f"attention, prefill and decode); KV cache {cache['tensors']} x {cache['shapes']} {cache['dtypes']}")  # fmt: skip


def test_every_parameter_fastdeploy_builds_is_filled_by_its_own_loading_too(run_case, checkpoints):
    """The oracle is only an oracle if FastDeploy's own loading fills every parameter (none left at zero)."""
    spec, legacy = checkpoints("ernie-moe-tiny", True)
    report = run_case({"oracle": legacy, "hook": spec, "tp": 1, "rank": 0})
    assert_conforms(report)
    assert report["oracle_zero"] == [] and report["loader"] == "HpuFp8ModelLoader"


def test_the_values_cpu_paddle_rounds_twice_are_the_hooks_rounded_once(run_case, checkpoints):
    """The device-rounded allowance is for one thing only. FastDeploy computes a self_attn linear's act_scale_inv as
    ``act_scale / 240.0`` on a bf16 tensor; CPU paddle's kernel multiplies by bf16(1 / 240) and rounds again, the
    hook evaluates ``amax / 240`` in float32 and rounds once. Where they differ (one bf16 ulp), the hook's value must
    be the nearer to the exact quotient; what an HPU's kernel gives is not known here."""
    from hpu_fp8_loader.io.checkpoint import Checkpoint

    spec, legacy = checkpoints("ernie-moe-tiny", True)
    report = run_case({"oracle": legacy, "hook": spec, "tp": 1, "rank": 0})
    assert_conforms(report)
    assert report["device_rounded"], "CPU paddle rounded every act_scale_inv once: the allowance would be moot"
    amax = Checkpoint.open(spec)
    for entry in report["device_rounded"]:
        module = entry["name"].removesuffix(".act_scale_inv")
        exact = float(np.asarray(amax.get(names.tensor(module, names.ACT_AMAX)), np.float64)[0]) / 240.0
        assert abs(entry["hook"] - exact) < abs(entry["fastdeploy"] - exact), entry


# Where the negative controls run: each setting a case of its own above (the ordinary-amax one with the legacy
# layout's rounding allowed), so a fault must stand out from what each allows.
FAULT_SETTINGS = {
    "TP1": {"tp": 1, "rank": 0},
    "TP2-rank1": {"tp": 2, "rank": 1},
    "TP2-rank1-pr5855": {"tp": 2, "rank": 1, "moe_layout": "pr5855"},
    "TP2-rank1-ordinary-amax": {"tp": 2, "rank": 1, "exact": False},
}


def run_with_fault(run_case, checkpoints, fault: str, setting: str) -> dict:
    case = dict(FAULT_SETTINGS[setting])
    exact = case.pop("exact", True)
    spec, legacy = checkpoints("ernie-moe-tiny", True if exact else None, "fp8", exact=exact)
    tolerance = {} if exact else {"tolerance": LEGACY_ROUNDING}
    report = run_case({"oracle": legacy, "hook": spec, "inject": fault, **case, **tolerance})
    assert "error" not in report, report["error"]
    return report


@pytest.mark.parametrize("setting", FAULT_SETTINGS)
@pytest.mark.parametrize(
    ("fault", "where"),
    [
        ("flip-weight-bit", "qkv_proj.weight"),
        ("act-scale-as-descale", "mlp.up_gate_proj.act_scale"),
        ("expert-scales-swapped", "down_proj_in_scale"),
    ],
)
def test_a_fault_in_the_hooks_output_is_reported(run_case, checkpoints, fault, where, setting):
    """Negative control: one wrong value in what the hook hands FastDeploy is found and named, on every setting."""
    report = run_with_fault(run_case, checkpoints, fault, setting)
    assert len(report["differences"]) == 1 and where in report["differences"][0], report["differences"]
    # every attention, MLP and MoE layer is driven to its kernels: the fault shows there too
    assert report["kernel_differences"] and all(where in d for d in report["kernel_differences"]), report["kernel_differences"]


@pytest.mark.parametrize(
    ("fault", "setting", "spoiled"),
    [
        # every parameter a rank holds a share of: each weight, embedding row, lm_head column and expert channel scale
        ("every-rank-as-rank-0", "TP2-rank1", (".weight", "_weight", "_weight_scale")),
        # both scales of every dense linear, attention and MLP
        ("linear-multiplier-as-descale", "TP1", (".act_scale", ".act_scale_inv")),
        ("expert-scale-split-before-5757", "TP2-rank1", (".mlp.experts.up_gate_proj_weight_scale",)),
        ("expert-activation-scales-swapped", "TP2-rank1-pr5855", (".mlp.experts.down_proj_in_scale",)),
    ],
)
def test_a_fault_in_the_hooks_own_rules_is_reported(run_case, checkpoints, fault, setting, spoiled):
    """Negative control inside the hook (runtime/faults.py HOOK_RULES): a rule gone wrong is found, and every
    parameter named is one the rule spoils, in every MoE layer for an expert rule."""
    report = run_with_fault(run_case, checkpoints, fault, setting)
    named = [difference.split(":")[0] for difference in report["differences"]]
    assert named and all(name.endswith(spoiled) for name in named), "\n".join(report["differences"])
    if fault == "every-rank-as-rank-0":
        assert any(name.endswith(".self_attn.qkv_proj.weight") for name in named), named
    if fault == "linear-multiplier-as-descale":
        for linear in (".self_attn.qkv_proj.", ".self_attn.o_proj.", ".mlp.up_gate_proj.", ".mlp.down_proj."):
            assert any(linear in name for name in named), (linear, named)
    if fault.startswith("expert-"):  # ernie-moe-tiny's MoE layers are 1 and 2
        assert sorted(name.split(".layers.")[1].split(".")[0] for name in named) == ["1", "2"], named
    print(f"{fault} at {setting}: {len(named)} parameters named, e.g. {named[0]}")


def test_the_hook_is_routed_whatever_fastdeploy_imports_first(run_case, checkpoints):
    """FastDeploy's loader package imported before its models package: the plugin then runs while that
    package is half-imported, and hpu_fp8 must still reach the hook."""
    spec, legacy = checkpoints("qwen2-tiny", False)
    report = run_case({"oracle": legacy, "hook": spec, "tp": 1, "rank": 0,
                       "import_first": "fastdeploy.model_executor.model_loader"})  # fmt: skip
    assert_conforms(report)
    assert report["loader"] == "HpuFp8ModelLoader"


def _v1_scale_defects(differences: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(reciprocals, op-order roundings, anything else) among ``differences`` of one-value scales: FastDeploy's v1
    loading against the hook's (v0's) value, as conformance.py words them."""
    reciprocal, rounding, other = [], [], []
    for line in differences:
        found = re.match(r"(\S+): 1 of 1 values differ, first at \[0\]: FastDeploy (\S+), hook (\S+)$", line)
        if not found:
            other.append(line)
            continue
        name, fastdeploys, hooks = found.group(1), float(found.group(2)), float(found.group(3))
        if name.endswith(("_out_scale",)) and abs(fastdeploys - hooks) <= 4 * np.spacing(np.float32(hooks)):
            rounding.append(name)  # 1 / (240 / amax) where v0 computes amax / 240, in float32
        elif name.endswith((".act_scale_inv", ".up_gate_proj_in_scale")) and abs(fastdeploys * hooks - 1) < 2**-6:
            reciprocal.append(name)  # within the two bf16 roundings
        else:
            other.append(line)
    return reciprocal, rounding, other


def test_fastdeploys_v1_loader_is_an_oracle_only_where_it_loads_its_own_fp8_keys(run_case, checkpoints):
    """FastDeploy's ``default_v1`` loader (its default on HPU since FastDeploy #5891) as a second oracle, on the same
    legacy export (FastDeploy's own FP8 key names). At 8c3513a4 it cannot load them: the renaming function its v1 path
    applies to every key (``rename_offline_ckpt_suffix_to_fd_suffix``, ``model_executor/utils.py@8c3513a4``
    l.487-508) binds ``fd_suffix_map`` inside ``fn`` only for ``block_wise_fp8``, so for ``tensor_wise_fp8`` Python
    reads an unbound local. On the later builds it loads them, and gets scales wrong: every dense MLP and shared-expert
    ``act_scale_inv`` and every MoE ``up_gate_proj_in_scale`` is the reciprocal of what its v0 loading (and the hook)
    sets, and the attention ``*_out_scale`` differ in float32's last bits (another order of operations). That pattern
    exactly, or the unbound local, or (a FastDeploy that fixed both) every parameter and kernel argument equal to the
    hook's: anything else fails."""
    spec, legacy = checkpoints("ernie-moe-tiny", True)
    report = run_case({"oracle": legacy, "hook": spec, "tp": 1, "rank": 0, "oracle_loader": "default_v1"})
    if "fd_suffix_map" in report.get("error", ""):
        assert report["error"].startswith("UnboundLocalError"), report["error"]
        print("FastDeploy's v1 loader on its own FP8 keys:", report["error"])
    elif report.get("differences"):
        reciprocal, rounding, other = _v1_scale_defects(report["differences"])
        assert other == [] and reciprocal and all(".self_attn." not in name for name in reciprocal), report["differences"]
        config = preset_config("ernie-moe-tiny", {})
        moe_layers = config["num_hidden_layers"] - config["moe_layer_start_index"]
        assert sum(name.endswith(".up_gate_proj_in_scale") for name in reciprocal) == moe_layers, reciprocal
        print(f"FastDeploy's v1 loader on its own FP8 keys: {len(reciprocal)} scales the reciprocal of its v0 loading's "
              f"({', '.join(reciprocal)}); {len(rounding)} attention scales in float32's last bits")  # fmt: skip
    else:
        assert_conforms(report)
        print(f"FastDeploy's v1 loader agrees with the hook: {report['parameters']} parameters")


def test_without_fd_plugins_fastdeploys_own_loader_fails_loudly_on_the_checkpoint(run_case, checkpoints):
    """FastDeploy never runs a plugin FD_PLUGINS does not name; --load-choices hpu_fp8 then reaches its v0
    loader, which must fail on an hpu-fp8 checkpoint rather than serve it (and `hpu-fp8 doctor` says why)."""
    spec, legacy = checkpoints("ernie-moe-tiny", True)
    report = run_case({"oracle": legacy, "hook": spec, "tp": 1, "rank": 0}, plugins="")
    assert report["loader"] == "DefaultModelLoader"
    assert "quant_weight" in report["hook_error"], report["hook_error"]
    print("without FD_PLUGINS:", report["hook_error"][:200])


def test_installing_the_package_leaves_fastdeploys_environment_alone(fastdeploy_env):
    before, after = fastdeploy_env["before"], fastdeploy_env["after"]
    changed = {name: (before.get(name), version) for name, version in after.items() if before.get(name) != version}
    assert set(changed) <= {"hpu-fp8-loader", "hpu_fp8_loader"}, changed
    assert after["paddlepaddle"] == before["paddlepaddle"]


@pytest.mark.parametrize(("preset", "tp"), [("ernie-moe-tiny", 2), ("qwen2-tiny", 1)])
def test_ordinary_amax_agree_within_the_legacy_layouts_own_rounding(run_case, checkpoints, preset, tp):
    """Calibrated amax the legacy layout cannot store exactly: every weight, weight scale, embedding, norm and
    router value still agrees to the bit; the scales derived from an amax differ by the legacy rounding at most."""
    spec, legacy = checkpoints(preset, None, "fp8", exact=False)
    for rank in range(tp):
        report = run_case({"oracle": legacy, "hook": spec, "tp": tp, "rank": rank, "tolerance": LEGACY_ROUNDING})
        assert_conforms(report)
        assert 0 < report["largest_relative_difference"] <= LEGACY_ROUNDING and report["rounded_values"] > 0
        print(f"{preset} TP{tp} rank {rank}, ordinary amax: {report['rounded_values']} derived scale values differ, "
              f"largest relative difference {report['largest_relative_difference']:.2e}")  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_qwen2_at_tp2_against_fastdeploys_presharded_loading(run_case, checkpoints, tmp_path, tied):
    """FastDeploy's v0 loader does not split FP8 Qwen2 tensors, so no FastDeploy code can split them for the
    oracle: `hpu-fp8 map --all-ranks` writes the rank{r}/ folders FastDeploy's pre-sharded path loads as they
    are. The split itself is then ours on both sides; everything FastDeploy does with a rank's share
    (names, shapes, dtypes, scale arithmetic, tied lm_head, kernel arguments) is still checked to the bit."""
    from hpu_fp8_loader.fastdeploy.rankfiles import write_presharded

    spec, _ = checkpoints("qwen2-tiny", tied)
    write_presharded(spec, tmp_path / "ranks", tp=2)
    for rank in range(2):
        assert_conforms(run_case({"oracle": tmp_path / "ranks", "hook": spec, "tp": 2, "rank": rank}))


def with_unfused_qkv_bias(legacy: Path, out: Path, config: dict) -> Path:
    """``legacy`` with each layer's fused ``qkv_proj.bias`` stored as the ``q_proj`` / ``k_proj`` / ``v_proj`` biases
    FastDeploy's v0 loader also reads (``QKVParallelLinear.load_state_dict`` concatenates them) and its Qwen2
    tensor-parallel mappings split: a plain cut at the head counts, no tensor-parallel arithmetic of ours."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(legacy, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    q_width, kv_width = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(shard)
        for key in [k for k in tensors if k.endswith(".self_attn.qkv_proj.bias")]:
            fused = tensors.pop(key)
            del index["weight_map"][key]
            assert fused.shape == (q_width + 2 * kv_width,), fused.shape
            for name, part in zip(("q", "k", "v"), np.split(fused, [q_width, q_width + kv_width]), strict=True):
                tensors[key.replace("qkv_proj", f"{name}_proj")] = part
                index["weight_map"][key.replace("qkv_proj", f"{name}_proj")] = shard.name
        save_file(tensors, shard, metadata={"format": "pd"})
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


QWEN2_SPLIT_ERROR = "AttributeError: 'PretrainedConfig' object has no attribute 'fuse_attention_qkv'"


def fastdeploys_qwen2_split_fails(report: dict) -> bool:
    """Whether FastDeploy's own v0 TP split of Qwen2 failed as it does from 2026-01 on: its requirements then name
    paddleformers>=1.1.1, whose config raises on a key config.json lacks, and ``Qwen2PretrainedModel``'s TP mappings
    read ``fuse_attention_qkv``, which no Qwen2 config.json holds. The split is then FastDeploy's to fix; the hook's is
    checked against pre-sharded ranks (test_qwen2_at_tp2_against_fastdeploys_presharded_loading). Printed, by name."""
    if report.get("error") != QWEN2_SPLIT_ERROR:
        return False
    print("FastDeploy's own v0 TP split of Qwen2 fails at this commit:", report["error"])
    return True


def test_fastdeploys_own_split_of_qwen2_at_tp2_agrees_with_the_hook_but_for_the_fp8_weights(run_case, checkpoints, tmp_path):
    """The Qwen2 split checked by FastDeploy's code, not ours. Its v0 loader, given the TP 1 export with separate
    q/k/v biases at TP 2, splits every tensor its tensor-parallel mappings list
    (``Qwen2PretrainedModel._get_tensor_parallel_mappings``: the q/k/v biases, the embedding, lm_head) and
    concatenates each rank's q|k|v bias itself; it gives each rank the FP8 linear weights whole (why export-legacy
    refuses Qwen2 at TP > 1). So on each rank exactly the FP8 weights may differ from the hook's share, each at twice
    the rank's width; every bias column, scale, norm, embedding row and lm_head column must equal FastDeploy's own
    split."""
    from test_qwen3_conformance import json_shapes

    config = preset_config("qwen2-tiny", {"tie_word_embeddings": False})
    spec, legacy = checkpoints("qwen2-tiny", False)
    oracle = with_unfused_qkv_bias(legacy, tmp_path / "legacy-unfused-bias", config)
    linears = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.up_gate_proj", "mlp.down_proj")
    whole = {f"qwen2.layers.{i}.{linear}.weight" for i in range(config["num_hidden_layers"]) for linear in linears}
    for rank in range(2):
        report = run_case({"oracle": oracle, "hook": spec, "tp": 2, "rank": rank})
        if fastdeploys_qwen2_split_fails(report):
            return
        assert "error" not in report, report["error"] + "\n" + report["stderr"][-6000:]
        differences = {name: rest for name, _, rest in (d.partition(": ") for d in report["differences"])}
        assert set(differences) == whole, "\n".join(report["differences"])  # names any other parameter that differs
        for fastdeploys, hooks in map(
            json_shapes, differences.values()
        ):  # the rank's width doubled: the whole tensor on this rank
            assert sorted(f // h for f, h in zip(fastdeploys, hooks, strict=True)) == [1, 2], (fastdeploys, hooks)
        assert report["parameters"] > len(whole)  # the rest, the q|k|v biases included, compared and equal


def test_fastdeploys_own_split_cannot_load_a_tied_qwen2_at_tp2(run_case, checkpoints, tmp_path):
    """Why the split above is checked untied only, pinned so a FastDeploy that fixes it is noticed: its v0 mappings
    cut ``lm_head.weight`` column-wise (``partial(fn, is_column=True)``), which for a tied model's key (the embedding,
    ``[vocab, hidden]``) halves the hidden axis, and ``ParallelLMHead.load_state_dict`` then transposes it, so the
    rank's ``[hidden, vocab / 2]`` parameter is handed ``[hidden / 2, vocab]``. A tied Qwen2 at TP > 1 loads only
    through the hook or pre-sharded ranks (test_qwen2_at_tp2_against_fastdeploys_presharded_loading)."""
    config = preset_config("qwen2-tiny", {"tie_word_embeddings": True})
    spec, legacy = checkpoints("qwen2-tiny", True)
    oracle = with_unfused_qkv_bias(legacy, tmp_path / "legacy-unfused-bias", config)
    report = run_case({"oracle": oracle, "hook": spec, "tp": 2, "rank": 0})
    if fastdeploys_qwen2_split_fails(report):
        return
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    assert "Shape not match" in report.get("error", ""), report
    assert f"[{hidden}, {vocab // 2}]" in report["error"] and f"[{hidden // 2}, {vocab}]" in report["error"], report["error"]


def doctor_path(environment) -> str:
    """PYTHONPATH for a doctor run: its child interpreter starts with the CPU stand-ins too (runtime/doctor_site)."""
    from fd_environment import RUNTIME

    return os.pathsep.join([str(environment.source), str(RUNTIME), str(RUNTIME / "doctor_site")])


LAYOUT_TEXT = {"list": MOE_LIST_LAYOUT, "parameter": MOE_PARAMETER_LAYOUT}


def test_doctor_in_fastdeploys_environment(fastdeploy_env, checkpoints, moe_layouts, tmp_path):
    """`hpu-fp8 doctor` where FastDeploy is: its commit and MoE layout, the entry point, FD_PLUGINS, routing
    through FastDeploy's own get_model_loader, and a checkpoint; without FD_PLUGINS it fails, naming the fix."""
    import json

    environment = fastdeploy_env["environment"]
    spec, _ = checkpoints("ernie-moe-tiny", True)
    command = ["-c", "import fd_bootstrap, sys; from hpu_fp8_loader.cli.main import main; sys.argv[0] = 'hpu-fp8'; main()",
               "doctor", str(spec), "--tp", "2", "--json"]  # fmt: skip
    ready = environment.run(command, cwd=tmp_path, PYTHONPATH=doctor_path(environment), FD_PLUGINS="hpu_fp8",
                            FD_ATTENTION_BACKEND="HPU_ATTN")  # fmt: skip
    checks = {c["name"]: c for c in json.loads(ready.stdout)["checks"]}
    assert ready.returncode == 0, ready.stdout + ready.stderr[-3000:]
    assert checks["python"]["status"] == "ok" and checks["routing"]["status"] == "ok"
    if environment.commit != "checkout":
        assert f"commit {environment.commit}" in checks["fastdeploy"]["detail"]
    assert checks["moe layout"]["detail"] == LAYOUT_TEXT[moe_layouts["develop"]], checks["moe layout"]
    assert checks["checkpoint"]["status"] == "ok" and checks["hpu device"]["status"] == "warn"  # no HPU here
    assert checks["model"]["status"] == "ok" and "the hook fills each of them" in checks["model"]["detail"], checks["model"]
    not_ready = environment.run(command, cwd=tmp_path, PYTHONPATH=doctor_path(environment), FD_ATTENTION_BACKEND="HPU_ATTN")
    checks = {c["name"]: c for c in json.loads(not_ready.stdout)["checks"]}
    assert not_ready.returncode == 1 and checks["FD_PLUGINS"]["status"] == "fail"
    print("doctor in FastDeploy's environment:", ready.stdout)


def test_the_model_check_names_what_fastdeploy_builds_differently(fastdeploy_env, checkpoints, moe_layouts, tmp_path):
    """A config.json without moe_use_aux_free: FastDeploy reads it as false and builds no correction bias,
    while the hook would fill one; the probe doctor uses names exactly those parameters."""
    import json
    import shutil

    spec, _ = checkpoints("ernie-moe-tiny", True)
    damaged = tmp_path / "spec"
    shutil.copytree(spec, damaged)
    config = json.loads((damaged / "config.json").read_text())
    del config["moe_use_aux_free"]
    (damaged / "config.json").write_text(json.dumps(config))
    probe = ("import fd_bootstrap, json, sys; from hpu_fp8_loader.fastdeploy.probe import mismatches; "
             "print(json.dumps(mismatches(sys.argv[1])))")  # fmt: skip
    done = fastdeploy_env["environment"].run(["-c", probe, str(damaged)], cwd=tmp_path, FD_PLUGINS="hpu_fp8")
    assert done.returncode == 0, done.stderr[-3000:]
    problems, layout, _ = json.loads(done.stdout.strip().splitlines()[-1])
    assert problems == [
        f"ernie.layers.{i}.mlp.experts.gate_correction_bias: the hook fills it, FastDeploy does not build it" for i in (1, 2)
    ]
    assert layout == LAYOUT_TEXT[moe_layouts["develop"]], layout


def test_doctor_compares_fastdeploys_commit_and_paddle_with_the_supported_range(fastdeploy_env, tmp_path):
    """At a checked build with paddle 3.3.0: the commit is known good, paddle has what FastDeploy's __init__ calls
    (``paddle.compat.enable_torch_proxy``, or from 8b6bbb35 ``paddle.enable_compat``), and FastDeploy's own import ran in
    doctor's child process."""
    import json

    from hpu_fp8_loader.fastdeploy import support

    environment = fastdeploy_env["environment"]
    command = ["-c", "import sys; from hpu_fp8_loader.cli.main import main; sys.argv[0] = 'hpu-fp8'; main()",
               "doctor", "--json"]  # fmt: skip
    done = environment.run(command, cwd=tmp_path, PYTHONPATH=doctor_path(environment), FD_PLUGINS="hpu_fp8",
                           FD_ATTENTION_BACKEND="HPU_ATTN")  # fmt: skip
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert checks["fastdeploy import"]["status"] == "ok" and checks["routing"]["status"] == "ok"
    calls = [call.attribute for call in support.PADDLE_CALLS if call.attribute in checks]
    source = (environment.source / "fastdeploy" / "__init__.py").read_text()
    assert calls == [call.attribute for call in support.PADDLE_CALLS if call.attribute in source], (calls, checks)
    assert calls and all(checks[call]["status"] == "ok" for call in calls), checks
    if environment.commit != "checkout":
        expected = "ok" if any(c.commit.startswith(environment.commit) for c in support.CHECKED_COMMITS) else "warn"
        assert checks["fastdeploy commit"]["status"] == expected, checks["fastdeploy commit"]


def test_installing_the_package_changes_no_fastdeploy_requirement(fastdeploy_env):
    """The environment holds FastDeploy's own requirements.txt at the commit under test (each one pinned at a URL
    replaced as fastdeploy_requirements_skipped.txt says, with its reason); installing this package leaves the
    version of every one of them as it was."""
    from fd_environment import installed_requirements
    from packaging.utils import canonicalize_name

    before = {canonicalize_name(name): version for name, version in fastdeploy_env["before"].items()}
    after = {canonicalize_name(name): version for name, version in fastdeploy_env["after"].items()}
    wanted, replaced = installed_requirements(fastdeploy_env["environment"].source)
    assert all(replacement.why for replacement in replaced.values()), replaced  # each replacement says why
    installed = {canonicalize_name(r.name): r for r in wanted}
    missing = sorted(name for name in installed if name not in before)
    assert missing == [], f"FastDeploy requirements the environment lacks: {missing}"
    unmet = sorted(f"{r} (installed {before[name]})" for name, r in installed.items()
                   if not r.specifier.contains(before[name], prereleases=True))  # fmt: skip
    assert unmet == [], unmet
    changed = {name: (before[name], after.get(name)) for name in installed if after.get(name) != before[name]}
    assert changed == {}, changed
    added = sorted(set(after) - set(before) - {"hpu-fp8-loader"})
    print(f"{len(installed)} FastDeploy requirements unchanged by installing hpu-fp8-loader; replaced: {sorted(replaced)}; "
          f"packages it added: {added or 'none'}")  # fmt: skip

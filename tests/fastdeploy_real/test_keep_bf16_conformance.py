"""Linears kept in BF16, against FastDeploy's own code: the groups its mix_quant builds unquantized.

FastDeploy keeps linears in BF16 by group only: ``dense_quant_type`` absent builds every linear outside the
routed experts with its unquantized linear method, ``moe_quant_type`` absent every routed expert with its
unquantized HPU MoE method (docs/fastdeploy.md section 3, "Keeping linears in BF16"). Each case converts with
``keep_bf16``, exports the legacy copy (FastDeploy's own ``--load-choices default`` reads its ``.weight`` keys
for those layers) and compares, as the rest of the suite does, every parameter and every MLP and MoE
kernel's arguments between FastDeploy's own loading and the hook.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_conformance import assert_conforms, legacy_exact

from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.fastdeploy.legacy import export_legacy
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kept_checkpoints(tmp_path_factory):
    """(keep, kv_cache) -> (hpu-fp8 ERNIE MoE checkpoint with those groups in BF16, its legacy export), made once."""
    made: dict[tuple, tuple[Path, Path]] = {}

    def make(keep: str, kv_cache: str = "fp8") -> tuple[Path, Path]:
        if (keep, kv_cache) not in made:
            root = tmp_path_factory.mktemp(f"keep-{keep}-{kv_cache}")
            config = preset_config("ernie-moe-tiny")
            synthesize(root / "bf16", config, seed=11)
            options = ConvertOptions(kv_cache=kv_cache, keep_bf16=frozenset({keep}))
            convert(root / "bf16", root / "spec", [legacy_exact(synthetic_measurements(config))], options)
            export_legacy(root / "spec", root / "legacy")
            made[(keep, kv_cache)] = (root / "spec", root / "legacy")
        return made[(keep, kv_cache)]

    return make


KEPT_CASES = [
    # (group kept in BF16, kv_cache, tp, moe_layout)
    ("experts", "fp8", 1, "develop"),
    ("experts", "fp8", 2, "develop"),
    ("experts", "none", 1, "pr5855"),
    ("dense", "fp8", 1, "develop"),
    ("dense", "fp8", 2, "pr5855"),
    ("dense", "none", 2, "develop"),
]


@pytest.mark.parametrize(("keep", "kv_cache", "tp", "moe_layout"), KEPT_CASES)
def test_a_group_kept_in_bf16_loads_as_fastdeploys_own_loading_fills_it(
    run_case, kept_checkpoints, moe_layouts, keep, kv_cache, tp, moe_layout
):
    spec, legacy = kept_checkpoints(keep, kv_cache)
    written = json.loads((legacy / "config.json").read_text())["quantization_config"]
    assert ("moe_quant_type" in written, "dense_quant_type" in written) == (keep != "experts", keep != "dense")
    for rank in range(tp):
        report = run_case({"oracle": legacy, "hook": spec, "tp": tp, "rank": rank, "moe_layout": moe_layout})
        assert_conforms(report)
        assert report["oracle_zero"] == []  # FastDeploy's own loading filled every parameter it built
        if keep == "experts":  # FastDeploy's unquantized MoE method: no scales, so no down_proj_in_scale layout
            assert report["moe_layout"] is None and report["bf16_weights"]["experts"] > 0
        else:
            assert report["moe_layout"] == moe_layouts[moe_layout]
            assert report["bf16_weights"]["dense"] > 0
        print(f"keep {keep} in BF16, kv={kv_cache} TP{tp} rank {rank} {moe_layout}: {report['parameters']} parameters "
              f"({report['bf16_weights']}) and {report['kernel_calls']} kernel calls identical")  # fmt: skip


@pytest.mark.parametrize("keep", ["experts", "dense"])
def test_doctors_model_check_finds_fastdeploy_building_what_the_hook_fills(fastdeploy_env, kept_checkpoints, tmp_path, keep):
    """`hpu-fp8 doctor`'s probe: FastDeploy builds the model from the kept checkpoint's config.json at meta shapes,
    and every parameter it builds (the BF16 ones of the kept group among them) is one the hook fills, alike."""
    spec, _ = kept_checkpoints(keep)
    probe = ("import fd_bootstrap, json, sys; from hpu_fp8_loader.fastdeploy.probe import mismatches; "
             "print(json.dumps(mismatches(sys.argv[1], 2, 1)))")  # fmt: skip
    done = fastdeploy_env["environment"].run(["-c", probe, str(spec)], cwd=tmp_path, FD_PLUGINS="hpu_fp8")
    assert done.returncode == 0, done.stderr[-3000:]
    problems, layout, built = json.loads(done.stdout.strip().splitlines()[-1])
    assert problems == [] and built > 0
    assert (layout is None) == (keep == "experts")

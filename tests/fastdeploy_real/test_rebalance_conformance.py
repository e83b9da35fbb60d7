"""A rebalanced checkpoint (``convert --calibrate --rebalance``), against FastDeploy's own code: it loads like any other.

Rebalancing changes values only (exact power-of-two channel folds: norms, the v columns of qkv, the up half of
every up_gate, and the rows of the linears after them), never a name, shape or dtype, and quantization_config
gains a ``rebalancing`` record FastDeploy does not read. Each case rebalances every fold site of the tiny ERNIE
MoE (``all``: every norm and linear of the model moves), exports the legacy copy and compares, as the rest of the
suite does, every parameter and kernel argument between FastDeploy's own loading and the hook.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_conformance import assert_conforms, legacy_exact

from hpu_fp8_loader.arch import describe
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.folds import Fold, fold_points
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.engine.weights import open_weights
from hpu_fp8_loader.fastdeploy.legacy import export_legacy
from hpu_fp8_loader.quality.calibrate import calibrate
from hpu_fp8_loader.quality.rebalance import choose_rebalancing
from hpu_fp8_loader.sources.synth import preset_config, synthesize
from hpu_fp8_loader.spec.choices import Rebalance

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rebalanced(tmp_path_factory) -> tuple[Path, Path]:
    """(the rebalanced hpu-fp8 ERNIE MoE checkpoint, its legacy export), made once."""
    root = tmp_path_factory.mktemp("rebalanced")
    config = preset_config("ernie-moe-tiny")
    synthesize(root / "bf16", config, seed=5)
    d = describe(config)
    result = calibrate(root / "bf16", samples=4, seq_len=64, channel_points=fold_points(d), all_experts=True)
    folds = choose_rebalancing(open_weights(root / "bf16"), result.channel_amax, result.ranges, Rebalance.ALL)
    assert {site.fold for site in folds.exponents} == set(Fold)  # every kind of fold moved a channel
    measurements = legacy_exact(folds.rebalanced(result.measurements, result.channel_amax, d))
    convert(root / "bf16", root / "spec", [measurements], ConvertOptions(rebalance="all"), folds=folds)
    export_legacy(root / "spec", root / "legacy")
    return root / "spec", root / "legacy"


@pytest.mark.parametrize(("tp", "moe_layout"), [(1, "develop"), (2, "pr5855")])
def test_a_rebalanced_checkpoint_loads_as_fastdeploys_own_loading_fills_it(run_case, rebalanced, moe_layouts, tp, moe_layout):
    spec, legacy = rebalanced
    assert "rebalancing" in json.loads((spec / "config.json").read_text())["quantization_config"]
    for rank in range(tp):
        report = run_case({"oracle": legacy, "hook": spec, "tp": tp, "rank": rank, "moe_layout": moe_layout})
        assert_conforms(report)
        assert report["oracle_zero"] == []
        assert report["moe_layout"] == moe_layouts[moe_layout]
        print(f"rebalanced (all folds) TP{tp} rank {rank} {moe_layout}: {report['parameters']} parameters and "
              f"{report['kernel_calls']} kernel calls identical")  # fmt: skip

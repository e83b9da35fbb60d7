"""The float32 reference engine against Hugging Face transformers (torch CPU, float32), and its
conventions: rotary per architecture, FastDeploy's MoE layer rule, lazy layers, every checkpoint kind."""

from __future__ import annotations

import dataclasses
import re
import resource  # noqa: F401  (used in the child process below)
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import transformers

from hpu_fp8_loader.engine.model import EngineConfig, forward
from hpu_fp8_loader.engine.weights import EngineWeights, open_weights
from hpu_fp8_loader.sources.synth import preset_config, synthesize
from hpu_fp8_loader.sources.tiny_models import TINY_MODELS

PRESETS = ("ernie-moe-tiny", "ernie-dense-tiny", "qwen2-tiny", "qwen3-tiny", "qwen3-moe-tiny")


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


@pytest.fixture(scope="module")
def reference_logits(source_factory):
    """(ids, transformers' float32 logits) of each preset's torch-layout checkpoint."""
    made = {}

    def make(preset):
        if preset not in made:
            config = preset_config(preset)
            ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 40))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = transformers.AutoModelForCausalLM.from_pretrained(source_factory(preset, "torch"), dtype=torch.float32)
            with torch.no_grad():
                made[preset] = ids, model(torch.tensor(ids)).logits.numpy()
        return made[preset]

    return make


@pytest.mark.slow  # imports transformers and torch
@pytest.mark.parametrize("preset", PRESETS)
def test_logits_match_transformers_in_float32(source_factory, reference_logits, preset):
    ids, reference = reference_logits(preset)
    ours = forward(open_weights(source_factory(preset, "torch")), ids)
    # Qwen3 (head_dim 24 != hidden/heads, tied dense, q/k norms, Qwen3-MoE routing) measured ~2e-7: float32 rounding
    assert relative_error(ours, reference) <= (1e-6 if preset.startswith("qwen3") else 1e-4)


@pytest.mark.slow  # imports transformers and torch
@pytest.mark.parametrize("model", ["qwen3-bytes", "qwen3-moe-bytes"])
def test_the_trained_qwen3_models_match_transformers_in_float32(model):
    """Trained weights: q/k norm weights far from 1 (0.93-1.86), larger logits; measured 6.6e-7 (dense), 1.4e-6 (MoE)."""
    ids = np.random.default_rng(1).integers(0, 256, (2, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODELS[model], dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits.numpy()
    assert relative_error(forward(open_weights(TINY_MODELS[model]), ids), expected) <= 3e-6


@pytest.mark.parametrize("preset", PRESETS)
def test_the_rotary_convention_is_pinned(source_factory, reference_logits, preset):
    ids, reference = reference_logits(preset)
    weights = open_weights(source_factory(preset, "torch"))
    right = EngineConfig.from_config(weights.checkpoint.config, weights.descriptor)
    assert right.interleaved_rotary == preset.startswith("ernie")  # ERNIE interleaved, Qwen2 and Qwen3 rotate-half
    wrong = EngineConfig(right.rms_norm_eps, right.rope_theta, not right.interleaved_rotary)
    assert relative_error(forward(weights, ids, config=wrong), reference) > 1e-3


@pytest.mark.parametrize("preset", PRESETS)
def test_both_layouts_give_the_same_logits(source_factory, preset):
    ids = np.arange(48).reshape(2, 24) % 500
    a = forward(open_weights(source_factory(preset, "paddle")), ids)
    b = forward(open_weights(source_factory(preset, "torch")), ids)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_the_qwen3_q_and_k_norms_are_pinned(source_factory, reference_logits, preset):
    ids, reference = reference_logits(preset)
    weights = open_weights(source_factory(preset, "torch"))
    without = EngineWeights(weights.checkpoint, dataclasses.replace(weights.descriptor, qk_norm=False))
    assert relative_error(forward(without, ids), reference) > 1e-2


def test_an_hpu_fp8_checkpoint_runs_with_dequantized_weights(source_factory, spec_factory):
    ids = np.arange(64).reshape(2, 32)
    bf16 = forward(open_weights(source_factory("qwen2-tiny", "paddle")), ids)
    fp8 = forward(open_weights(spec_factory("qwen2-tiny")), ids)
    assert 0 < relative_error(fp8, bf16) < 0.1  # FP8 weights: close, not equal


def test_moe_layers_follow_fastdeploys_rule_for_interval_two(tmp_path):
    from hpu_fp8_loader.quality.observers import AmaxObserver

    config = preset_config(
        "ernie-moe-tiny", {"num_hidden_layers": 5, "moe_layer_start_index": 2, "moe_layer_end_index": 4, "moe_layer_interval": 2}
    )
    synthesize(tmp_path / "m", config, "paddle")
    observer = AmaxObserver("ernie")
    forward(open_weights(tmp_path / "m"), np.arange(16).reshape(1, 16), observer)
    moe = sorted(int(m.split(".")[2]) for m in observer.amax if m.endswith(".mlp.experts.up_gate_proj"))
    assert moe == [2, 4]  # FastDeploy: (L - start) % interval == 0; transformers would pick layer 3
    assert "ernie.layers.3.mlp.up_gate_proj" in observer.amax


@pytest.mark.slow
def test_a_layer_that_cannot_fit_gets_a_clear_error(tmp_path):
    synthesize(tmp_path / "m", preset_config("qwen2-tiny", {"intermediate_size": 400_000}), "paddle")  # 150 MB in BF16
    script = f"""
import resource, numpy as np
from hpu_fp8_loader.engine.weights import EngineWeights, open_weights
from hpu_fp8_loader.engine.model import forward
from hpu_fp8_loader.errors import HpuFp8Error
weights = open_weights({str(tmp_path / "m")!r})
used = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
files = sum(p.stat().st_size for p in weights.checkpoint.files)
# room to map the files and a little more, not for a layer's MLP: 293 MiB of float32 weights
resource.setrlimit(resource.RLIMIT_AS, (used + files + (100 << 20), resource.RLIM_INFINITY))
try:
    forward(weights, np.arange(8).reshape(1, 8))
except HpuFp8Error as exc:
    print("ERROR", exc)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert (
        re.search(r"ERROR layer \d: the mlp part needs \d+ MiB of float32 weights", result.stdout)
        and "cannot run on this machine" in result.stdout
    ), result.stderr

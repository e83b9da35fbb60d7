"""`hpu-fp8 export-compressed-tensors`: the Hugging Face split, the scales, the ±240 -> ±448 requantization, and the
round trip through `hpu-fp8 import`; the slow tests load the export with compressed-tensors / transformers (the
readers themselves) and compare its logits with the hpu-fp8 emulation of the same checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from hpu_fp8_loader.arch import Layout, Role, describe
from hpu_fp8_loader.checks.validate import validate
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.conversion.compressed_tensors import import_compressed_tensors
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.ct_export import export_compressed_tensors
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.errors import HpuFp8Error, NotHpuFp8CheckpointError, OutputExistsError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.numerics import e4m3
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements
from hpu_fp8_loader.spec import names

PRESETS = ("ernie-moe-tiny", "ernie-dense-tiny", "qwen2-tiny", "qwen3-tiny", "qwen3-moe-tiny")


def _dequantized(spec: Checkpoint, module: str) -> np.ndarray:
    """The real values of a spec FP8 linear, ``[in, out]`` float32."""
    scale = np.asarray(spec.get(names.tensor(module, names.WEIGHT_SCALE)), np.float32)
    return e4m3.dequantize(spec.get(names.tensor(module, names.WEIGHT)), scale if scale.size > 1 else scale.reshape(()))


def _has_preimage(amax: float, fp8_max: float) -> bool:
    """Whether some float32 s gives float32(s x fp8_max) == amax: then the export's input scale must carry amax exactly
    (searched here over a wide window of float32 values, independently of the exporter's own one-step search)."""
    first = np.float32(amax / fp8_max)
    window = first + np.spacing(first) * np.arange(-8, 9, dtype=np.float32)
    return any(np.float32(float(c) * fp8_max) == np.float32(amax) for c in window)


def _act_amax(root) -> dict[str, float]:
    checkpoint = Checkpoint.open(root)
    return {n: float(checkpoint.get(n)[0]) for n in checkpoint.tensors if n.endswith("." + names.ACT_AMAX)}


@pytest.mark.parametrize("preset", PRESETS)
def test_at_240_every_part_is_the_spec_columns_transposed_with_the_shared_scale(tmp_path, spec_factory, preset):
    src = spec_factory(preset)
    export_compressed_tensors(src, tmp_path / "ct", fp8_max=240)
    spec, ct = Checkpoint.open(src), Checkpoint.open(tmp_path / "ct")
    d = describe(spec.config)
    for w in (w for w in d.weights() if w.is_linear):
        codes, scale = spec.get(w.name), np.asarray(spec.get(names.tensor(w.module, names.WEIGHT_SCALE)), np.float32)
        shared_input = w.role is Role.EXPERT_UP_GATE  # every expert's gate|up reads the MoE layer's one input
        module = names.shared_expert_input(d.prefix, w.layer) if shared_input else w.module
        amax = float(spec.get(names.tensor(module, names.ACT_AMAX))[0])
        start = 0
        for p in w.source_parts(Layout.TORCH, d.prefix):
            stop = start + p.shape[0]
            np.testing.assert_array_equal(ct.get(p.name).view(np.uint8), codes[:, start:stop].T.view(np.uint8), err_msg=p.name)
            stem = p.name.removesuffix("weight")
            expected = scale[start:stop].reshape(-1, 1) if w.channel_wise else scale
            np.testing.assert_array_equal(ct.get(stem + "weight_scale"), expected, err_msg=p.name)
            assert abs(ct.get(stem + "input_scale")[0] - np.float32(amax) / np.float32(240)) <= np.spacing(np.float32(amax / 240))
            start = stop
    for layer in range(d.num_layers):
        k = float(spec.get(names.tensor(names.attention_point(d.prefix, layer, "cache_k"), names.ACT_AMAX))[0])
        back = np.float32(float(ct.get(f"model.layers.{layer}.self_attn.k_scale")[0]) * 240)
        assert back == np.float32(k) if _has_preimage(k, 240.0) else abs(back - np.float32(k)) <= np.spacing(np.float32(k))


@pytest.mark.parametrize("preset", PRESETS)
def test_import_of_a_240_export_gives_back_every_weight_scale_and_amax_exactly(tmp_path, spec_factory, preset):
    src = spec_factory(preset)
    export_compressed_tensors(src, tmp_path / "ct", fp8_max=240)
    # the q and s attention points have no place in compressed-tensors: they come back from measurements
    gaps = synthetic_measurements(preset_config(preset))
    import_compressed_tensors(tmp_path / "ct", tmp_path / "back", ConvertOptions(max_shard_bytes=64_000), [gaps])
    assert validate(tmp_path / "back").valid
    spec, back = Checkpoint.open(src), Checkpoint.open(tmp_path / "back")
    for name in spec.tensors:
        if not name.endswith(names.ACT_AMAX) and not name.endswith(names.ACT_SCALE):
            np.testing.assert_array_equal(back.get(name).view(np.uint8), spec.get(name).view(np.uint8), err_msg=name)
    amax, returned = _act_amax(src), _act_amax(tmp_path / "back")
    carried = {n for n in amax if not n.endswith((".self_attn.q.act_amax", ".self_attn.s.act_amax"))}
    exact = {n for n in carried if _has_preimage(amax[n], 240.0)}
    assert {n: returned[n] for n in exact} == {n: amax[n] for n in exact}
    np.testing.assert_allclose([returned[n] for n in carried], [amax[n] for n in carried], rtol=2.0**-23)


@pytest.mark.parametrize("preset", ["ernie-moe-tiny", "qwen2-tiny"])
def test_at_448_weights_are_requantized_once_and_come_back_within_one_code_step(tmp_path, spec_factory, preset):
    src = spec_factory(preset, "none")
    result = export_compressed_tensors(src, tmp_path / "ct")
    spec, ct = Checkpoint.open(src), Checkpoint.open(tmp_path / "ct")
    d = describe(spec.config)
    linears = [w for w in d.weights() if w.is_linear]
    assert result.requantized == len(linears) and result.fp8_max == 448
    for w in linears:
        real = _dequantized(spec, w.module)
        start, largest = 0, 0.0
        for p in w.source_parts(Layout.TORCH, d.prefix):
            stop = start + p.shape[0]
            scale = np.asarray(ct.get(p.name.removesuffix("weight") + "weight_scale"), np.float32)
            exported = e4m3.dequantize(ct.get(p.name), scale.reshape(-1, 1) if w.channel_wise else scale.reshape(()))
            largest = max(largest, float(np.abs(e4m3.fp8_to_float32(ct.get(p.name))).max()))
            # one rounding of e4m3 (3 mantissa bits): at most half a step, 2^-4 of the value, or of the smallest normal
            bound = np.maximum(np.abs(real[:, start:stop].T) * 2.0**-4, scale.reshape(-1, 1) * 2.0**-10)
            assert (np.abs(exported - real[:, start:stop].T) <= bound).all(), p.name
            start = stop
        assert largest > 240, w.name  # the group's shared scale is made for the OCP range
    import_compressed_tensors(tmp_path / "ct", tmp_path / "back", ConvertOptions(kv_cache="none"))
    amax, returned = _act_amax(src), _act_amax(tmp_path / "back")
    assert all(returned[n] == amax[n] for n in amax if _has_preimage(amax[n], 448.0))
    np.testing.assert_allclose([returned[n] for n in amax], list(amax.values()), rtol=2.0**-23)


def test_linears_kept_in_bf16_stay_bf16_and_are_ignored(tmp_path, source_factory):
    src = tmp_path / "spec"
    config = preset_config("ernie-moe-tiny")
    convert(source_factory("ernie-moe-tiny"), src, [synthetic_measurements(config)], ConvertOptions(keep_bf16={"experts"}))
    export_compressed_tensors(src, tmp_path / "ct")
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    ct = Checkpoint.open(tmp_path / "ct")
    assert list(qc["config_groups"]) == ["group_0"] and "model.layers.1.mlp.experts.3.up_proj" in qc["ignore"]
    assert ct.tensors["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == "BF16"
    assert "model.layers.1.mlp.experts.3.up_proj.weight_scale" not in ct.tensors
    assert {"lm_head", "model.layers.1.mlp.gate"} <= set(qc["ignore"])


def test_the_config_is_compressed_tensors_with_disjoint_targets(tmp_path, spec_factory):
    export_compressed_tensors(spec_factory("ernie-moe-tiny"), tmp_path / "ct")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    assert qc["config_groups"]["group_1"]["weights"]["strategy"] == "channel"
    assert qc["kv_cache_scheme"]["strategy"] == "tensor" and qc["hpu_fp8"]["fp8_max"] == 448
    modules = [t.removesuffix(".weight") for t in Checkpoint.open(tmp_path / "ct").tensors if t.endswith("proj.weight")]
    matches = {m: [g for g, s in qc["config_groups"].items() if re.match(s["targets"][0][3:], m)] for m in modules}
    assert all(len(groups) == 1 for groups in matches.values()), matches
    assert matches["model.layers.1.mlp.experts.0.down_proj"] == ["group_1"]
    assert matches["model.layers.1.mlp.shared_experts.down_proj"] == ["group_0"]


def test_what_is_no_hpu_fp8_checkpoint_or_no_range_is_refused_and_nothing_is_written(tmp_path, spec_factory):
    ct_source = Path(__file__).with_name("fixtures") / "qwen2-bytes-fp8-static"
    with pytest.raises(NotHpuFp8CheckpointError):
        export_compressed_tensors(ct_source, tmp_path / "a")
    with pytest.raises(HpuFp8Error, match="fp8_max 300: choose 448"):
        export_compressed_tensors(spec_factory(), tmp_path / "b", fp8_max=300)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        export_compressed_tensors(spec_factory(), tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and (tmp_path / "c" / "notes.txt").exists()


def test_cli_json_and_one_line_errors(tmp_path, spec_factory):
    out = tmp_path / "ct"
    result = CliRunner().invoke(main, ["export-compressed-tensors", str(spec_factory("qwen2-tiny")), str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["fp8_max"] == 448 and report["ignored"] == ["lm_head"] and (out / "config.json").is_file()
    again = CliRunner().invoke(main, ["export-compressed-tensors", str(spec_factory("qwen2-tiny")), str(out)])
    assert again.exit_code != 0 and again.output.count("\n") == 1 and "already exists" in again.output


# ----------------------------------------------------------------------------- the readers themselves (slow)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """model -> the tiny trained model calibrated and converted (FP8 KV cache), and its BF16 source."""
    from hpu_fp8_loader.quality.calibrate import calibrate
    from hpu_fp8_loader.sources.tiny_models import TINY_MODELS

    made = {}

    def make(model: str):
        if model not in made:
            root = tmp_path_factory.mktemp("trained") / model
            measurements = calibrate(TINY_MODELS[model], samples=8, seq_len=128).measurements
            convert(TINY_MODELS[model], root, [measurements], ConvertOptions(dead_experts="sibling-max"))
            made[model] = root
        return made[model], TINY_MODELS[model]

    return make


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen2-bytes", "ernie-moe-bytes", "qwen3-bytes", "qwen3-moe-bytes"])
def test_transformers_reads_the_export_as_the_same_quantized_model(tmp_path, trained, model):
    import torch
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from hpu_fp8_loader.engine.fp8 import Fp8Emulator
    from hpu_fp8_loader.engine.model import forward
    from hpu_fp8_loader.engine.weights import open_weights
    from hpu_fp8_loader.quality.datasets import builtin_text

    spec_dir, bf16_dir = trained(model)
    ids = np.frombuffer(builtin_text("held-out").encode()[:256], np.uint8).astype(np.int64).reshape(2, 128)
    emulated, reference = Fp8Emulator(spec_dir, 1).forward(ids), forward(open_weights(bf16_dir), ids)
    fp8_error = _relative(emulated, reference)
    spec = Checkpoint.open(spec_dir)
    for fp8_max in (240, 448):
        out = tmp_path / f"ct{fp8_max}"
        export_compressed_tensors(spec_dir, out, fp8_max=fp8_max)
        parsed = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
        assert parsed.config_groups["group_0"].weights.strategy == "tensor"
        assert parsed.config_groups["group_0"].input_activations.dynamic is False
        decompressed = CompressedTensorsConfig(run_compressed=False)  # compressed-tensors dequantizes every weight
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, quantization_config=decompressed)
        q_proj = loaded.model.layers[0].self_attn.q_proj
        prefix = describe(spec.config).prefix
        qkv = _dequantized(spec, f"{prefix}.layers.0.self_attn.qkv_proj")
        q = q_proj.weight.detach().numpy()
        if fp8_max == 240:  # the same codes and scales: transformers' dequantization is exactly the spec's
            np.testing.assert_array_equal(q, qkv[:, : q.shape[0]].T)
        else:
            np.testing.assert_allclose(q, qkv[:, : q.shape[0]].T, rtol=2.0**-4, atol=1e-6)
        if model == "ernie-moe-bytes":  # transformers fuses the experts: [E, 2I, H] gate|up, from channel scales
            gate_up = loaded.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()[2]
            expected = _dequantized(spec, f"{prefix}.layers.1.mlp.experts.2.up_gate_proj").T
            np.testing.assert_allclose(
                gate_up, expected, rtol=0 if fp8_max == 240 else 2.0**-4, atol=0 if fp8_max == 240 else 1e-6
            )
        with torch.no_grad():
            logits = loaded(torch.tensor(ids)).logits.numpy()
        # transformers runs the dequantized weights in float32; the emulation runs Gaudi's FP8 activations and bf16
        # arithmetic: they differ by about the FP8 error itself, far from what a wrong split or scale gives (~1)
        assert _relative(logits, emulated) < 1.5 * fp8_error, (fp8_max, _relative(logits, emulated), fp8_error)
        assert _relative(logits, reference) < 1.5 * fp8_error, (fp8_max, _relative(logits, reference), fp8_error)


@pytest.mark.parametrize("command", [["validate"], ["inspect"], pytest.param(["doctor", "--no-build"], marks=pytest.mark.slow)])
def test_validate_inspect_and_doctor_recognise_an_export_and_point_to_import(tmp_path, spec_factory, command):
    export_compressed_tensors(spec_factory("qwen2-tiny"), tmp_path / "ct", fp8_max=240)
    result = CliRunner().invoke(main, [*command, str(tmp_path / "ct")])
    assert result.exit_code != 0
    assert "compressed-tensors export of an hpu-fp8 checkpoint (±240.0)" in result.output, result.output
    assert "`hpu-fp8 import SRC OUT` brings it back" in result.output

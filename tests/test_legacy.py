"""import-legacy and export-legacy against checkpoints laid out exactly as docs/fastdeploy.md section 9
("The legacy layout") describes FastDeploy's legacy converter output (tests/doubles/legacy_model_convert.py)."""

from __future__ import annotations

import json
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from doubles.legacy_model_convert import LEGACY_CONFIG, model_convert

from hpu_fp8_loader.checks.validate import validate
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.conversion.legacy_import import import_legacy
from hpu_fp8_loader.conversion.plan import ConvertOptions
from hpu_fp8_loader.errors import ConfigError, HpuFp8Error, MeasurementError, NotHpuFp8CheckpointError
from hpu_fp8_loader.fastdeploy.legacy import amax_to_legacy, export_legacy
from hpu_fp8_loader.fastdeploy.mapping import Parallelism
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.sources.synth import preset_config, synthesize, synthetic_measurements
from hpu_fp8_loader.spec import names


def fd_measurement(preset: str, skip=lambda module: False) -> dict[str, float]:
    """FastDeploy measurement-mode keys -> raw amax for a preset model."""
    amax = synthetic_measurements(preset_config(preset)).amax
    return {names.fastdeploy_key_from_module(m): v for m, v in amax.items() if not skip(m)}


def bf16(value: float) -> float:
    return float(np.array([value], np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)[0])


@pytest.fixture(scope="module")
def legacy_ernie(tmp_path_factory, source_factory):
    made = {}

    def make(version: str) -> tuple:
        if version not in made:
            measurement = fd_measurement("ernie-moe-tiny")
            root = tmp_path_factory.mktemp("legacy") / version
            model_convert(source_factory("ernie-moe-tiny", "paddle"), root, measurement, version, shard_limit=60_000)
            made[version] = (root, measurement)
        return made[version]

    return make


@pytest.mark.parametrize("version", ["20c9eae8", "1dd4eef8"])
def test_import_resolves_both_activation_meanings_and_keeps_weights_bit_exact(tmp_path, legacy_ernie, version):
    legacy_root, measurement = legacy_ernie(version)
    report = import_legacy(legacy_root, tmp_path / "out")
    assert validate(tmp_path / "out").valid
    legacy, spec = Checkpoint.open(legacy_root), Checkpoint.open(tmp_path / "out")
    for name in spec.tensors:
        if name.endswith(".weight") and spec.tensors[name].dtype == "F8_E4M3":
            base = name.removesuffix(".weight")
            np.testing.assert_array_equal(spec.get(name).view(np.uint8), legacy.get(base + ".quant_weight").view(np.uint8))
            legacy_scale = legacy.get(base + ".weight_scale").astype(np.float32)
            np.testing.assert_array_equal(
                spec.get(base + ".weight_scale"), np.broadcast_to(legacy_scale, spec.tensors[base + ".weight_scale"].shape)
            )
    qkv, down = "ernie.layers.1.self_attn.qkv_proj", "ernie.layers.1.mlp.experts.2.down_proj"
    assert spec.get(f"{qkv}.act_amax")[0] == np.float32(bf16(measurement[f"{qkv}.activation_scale"]))  # raw amax
    stored = bf16(measurement[f"{down}.activation_scale"] / 240.0)  # amax / 240
    assert spec.get(f"{down}.act_amax")[0] == np.float32(stored) * np.float32(240.0)
    assert report.expert_scales == ("channel-wise" if version == "20c9eae8" else "tensor-wise (older converter)")
    calibration = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["calibration"]
    assert calibration["sources"][0]["kind"] == "legacy-checkpoint"


def test_the_older_converters_tensor_wise_expert_scales_become_exact_vectors(tmp_path, legacy_ernie):
    legacy_root, _ = legacy_ernie("1dd4eef8")
    assert Checkpoint.open(legacy_root).tensors["ernie.layers.1.mlp.experts.0.up_gate_proj.weight_scale"].shape == (1,)
    import_legacy(legacy_root, tmp_path / "out")
    scale = Checkpoint.open(tmp_path / "out").get("ernie.layers.1.mlp.experts.0.up_gate_proj.weight_scale")
    assert scale.shape == (64,) and len(set(scale.tolist())) == 1


def test_estimated_shard_counts_in_names_do_not_matter(legacy_ernie):
    legacy_root, _ = legacy_ernie("20c9eae8")
    files = sorted(p.name for p in legacy_root.glob("*.safetensors"))
    assert len(files) > 1 and not files[-1].endswith(f"-of-{len(files):05d}.safetensors")  # the 0.506 estimate


def test_a_zero_amax_stored_by_the_legacy_converter_is_refused_or_filled(tmp_path, source_factory):
    measurement = fd_measurement("ernie-moe-tiny")
    measurement["ernie.layers.2.mlp.experts.1.down_proj.activation_scale"] = 0.0
    legacy_root = model_convert(source_factory("ernie-moe-tiny", "paddle"), tmp_path / "legacy", measurement)
    with pytest.raises(MeasurementError, match=r"layer 2: expert 1 \(1 of 4\)"):
        import_legacy(legacy_root, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    import_legacy(legacy_root, tmp_path / "out", dead_experts="sibling-max")
    assert validate(tmp_path / "out").valid


def test_legacy_qwen2_with_hf_names_is_fused_with_one_requantization(tmp_path, source_factory):
    measurement = fd_measurement("qwen2-tiny", skip=lambda m: ".mlp." in m)  # FastDeploy never measures Qwen2's MLP
    legacy_root = model_convert(source_factory("qwen2-tiny", "torch"), tmp_path / "legacy", measurement)
    assert "model.layers.0.self_attn.q_proj.quant_weight" in Checkpoint.open(legacy_root).tensors
    with pytest.raises(MeasurementError, match="qwen2.layers.0.mlp.up_gate_proj.*--measurements"):
        import_legacy(legacy_root, tmp_path / "out")
    ours = synthetic_measurements(preset_config("qwen2-tiny"))
    report = import_legacy(legacy_root, tmp_path / "out", [ours])
    assert validate(tmp_path / "out").valid
    requantized = dict(report.requantized)
    assert set(requantized) == {
        f"qwen2.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.qkv_proj", "mlp.up_gate_proj")
    }
    assert all(0 < error < 0.05 for error in requantized.values())
    # o_proj and down_proj were one part each: their bytes are the legacy bytes, transposed.
    spec, legacy = Checkpoint.open(tmp_path / "out"), Checkpoint.open(legacy_root)
    np.testing.assert_array_equal(
        spec.get("qwen2.layers.1.mlp.down_proj.weight").view(np.uint8),
        legacy.get("model.layers.1.mlp.down_proj.quant_weight").view(np.uint8).T,
    )
    # the requantized q|k|v stays within one fp8 step of the legacy dequantized values
    q = legacy.get("model.layers.0.self_attn.q_proj.quant_weight").view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    q *= legacy.get("model.layers.0.self_attn.q_proj.weight_scale").astype(np.float32)
    fused = spec.get("qwen2.layers.0.self_attn.qkv_proj.weight").astype(np.float32)[:, : q.shape[0]]
    fused *= spec.get("qwen2.layers.0.self_attn.qkv_proj.weight_scale")
    scale = spec.get("qwen2.layers.0.self_attn.qkv_proj.weight_scale")[0]
    assert np.all(np.abs(fused - q.T) <= np.maximum(np.abs(q.T) / 16, scale * 2.0**-10) * 1.0001)


def _set_dtype(root, name: str, dtype: str) -> None:
    shard = next(
        p for p in root.glob("*.safetensors") if name in Checkpoint.open(root).tensors and name.encode() in p.read_bytes()[:65536]
    )
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header[name]["dtype"] = dtype
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


@pytest.mark.parametrize(
    ("damage", "error", "message"),
    [
        (
            lambda r: _drop_from_index(r, "ernie.layers.0.mlp.down_proj.quant_weight"),
            ConfigError,
            "down_proj.quant_weight' is missing",
        ),
        (
            lambda r: _set_dtype(r, "ernie.layers.0.mlp.down_proj.quant_weight", "BOOL"),
            ConfigError,
            "is BOOL.*expected int8 bytes",
        ),
        (
            lambda r: _replace(r, "ernie.layers.0.mlp.down_proj.weight_scale", np.array([0.0123456], np.float32)),
            ConfigError,
            "not bf16-representable",
        ),
        (
            lambda r: _replace(r, "ernie.layers.0.mlp.down_proj.quant_weight", np.full((128, 64), 0x7C, np.uint8).view(np.int8)),
            ConfigError,
            "beyond ±240",
        ),
        (
            lambda r: _replace(r, "ernie.layers.0.self_attn.k_matmul.activation_scale", np.ones(1, ml_dtypes.bfloat16)),
            ConfigError,
            "activation_scale keys of no known point",
        ),
        (
            lambda r: _edit_config(r, lambda c: c.pop("quantization_config")),
            NotHpuFp8CheckpointError,
            "not a legacy FastDeploy FP8 checkpoint",
        ),
        (
            lambda r: _edit_config(r, lambda c: c["quantization_config"].update(quant_method="hpu_fp8")),
            HpuFp8Error,
            "already an hpu-fp8",
        ),
    ],
)
def test_malformed_legacy_checkpoints_get_named_errors(tmp_path, legacy_ernie, damage, error, message):
    root = tmp_path / "legacy"
    shutil.copytree(legacy_ernie("20c9eae8")[0], root)
    damage(root)
    with pytest.raises(error, match=message):
        import_legacy(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _replace(root, name, array):
    """Put ``array`` under ``name`` in the shard that holds it (or the last one), through the library."""
    from safetensors.numpy import load_file, save_file

    index = json.loads((root / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].setdefault(name, sorted(set(index["weight_map"].values()))[-1])
    tensors = load_file(root / shard)
    tensors[name] = array
    save_file(tensors, root / shard)
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def _drop_from_index(root, name):
    index = json.loads((root / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].pop(name)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(root / shard)
    del tensors[name]
    save_file(tensors, root / shard)
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def _edit_config(root, edit):
    config = json.loads((root / "config.json").read_text())
    edit(config)
    (root / "config.json").write_text(json.dumps(config))


def test_export_writes_exactly_the_contract_key_set(tmp_path, spec_factory):
    out = export_legacy(spec_factory(), tmp_path / "legacy").out
    legacy = Checkpoint.open(out)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == LEGACY_CONFIG
    # the v0 key set (docs/fastdeploy.md section 9) for this model: 3 layers, layer 0 dense, layers 1-2 MoE with 4 experts and 1 shared expert
    expected = {"ernie.embed_tokens.weight", "ernie.norm.weight"}
    for i in range(3):
        p = f"ernie.layers.{i}"
        expected |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
        for m in ("qkv_proj", "o_proj"):
            expected |= {f"{p}.self_attn.{m}.{s}" for s in ("quant_weight", "weight_scale", "activation_scale")}
        expected |= {f"{p}.self_attn.{m}.activation_scale" for m in ("q_matmul", "cachek_matmul", "cachev_matmul", "s_matmul")}
        mlps = ["mlp"] if i == 0 else ["mlp.shared_experts"]
        for mlp in mlps:
            expected |= {
                f"{p}.{mlp}.{m}.{s}"
                for m in ("up_gate_proj", "down_proj")
                for s in ("quant_weight", "weight_scale", "activation_scale")
            }
        if i > 0:
            expected |= {
                f"{p}.mlp.gate.weight",
                f"{p}.mlp.moe_statics.e_score_correction_bias",
                f"{p}.mlp.experts.up_gate_proj.activation_scale",
            }
            for e in range(4):
                expected |= {
                    f"{p}.mlp.experts.{e}.{m}.{s}"
                    for m in ("up_gate_proj", "down_proj")
                    for s in ("quant_weight", "weight_scale")
                }
                expected.add(f"{p}.mlp.experts.{e}.down_proj.activation_scale")
    assert set(legacy.tensors) == expected
    assert legacy.tensors["ernie.layers.1.mlp.experts.0.up_gate_proj.quant_weight"].dtype == "I8"
    assert legacy.tensors["ernie.layers.1.mlp.experts.0.up_gate_proj.weight_scale"].shape == (64,)
    assert {legacy.tensors[k].dtype for k in expected if k.endswith(("activation_scale", "weight_scale"))} == {"BF16"}
    spec = Checkpoint.open(spec_factory())
    qkv, shared = "ernie.layers.1.self_attn.qkv_proj", "ernie.layers.1.mlp.experts.up_gate_proj"
    assert legacy.get(f"{qkv}.activation_scale").astype(np.float32)[0] == bf16(spec.get(f"{qkv}.act_amax")[0])
    assert legacy.get(f"{shared}.activation_scale").astype(np.float32)[0] == bf16(
        spec.get(f"{shared}.act_amax")[0] / np.float32(240)
    )


@pytest.mark.parametrize("preset", ["ernie-moe-tiny", "qwen2-tiny", "qwen3-tiny"])
def test_spec_to_legacy_to_spec_is_bit_identical_but_for_bf16_amax(tmp_path, spec_factory, preset):
    original = spec_factory(preset)
    export_legacy(original, tmp_path / "legacy")
    import_legacy(tmp_path / "legacy", tmp_path / "back")
    a, b = Checkpoint.open(original), Checkpoint.open(tmp_path / "back")
    assert set(a.tensors) == set(b.tensors)
    lost = 0
    for name in a.tensors:
        if name.endswith(names.ACT_AMAX):
            value = a.get(name)[0]
            module = name.removesuffix("." + names.ACT_AMAX)
            key = names.fastdeploy_key_from_module(module)
            expected = bf16(value) if "self_attn" in key else np.float32(bf16(value / np.float32(240))) * np.float32(240)
            assert b.get(name)[0] == np.float32(expected), name  # exactly the bf16 storage, nothing else
            lost += b.get(name)[0] != value
            assert abs(b.get(name)[0] - value) <= value * 2.0**-8, name  # bf16's half step, the bound README states
        elif not name.endswith(names.ACT_SCALE):
            np.testing.assert_array_equal(a.get(name).view(np.uint8), b.get(name).view(np.uint8), err_msg=name)
    assert lost > 0  # the legacy layout's bf16 storage of amax is a real loss; the README states it


def test_export_refuses_what_stock_fastdeploy_would_load_wrongly(tmp_path, spec_factory):
    with pytest.raises(HpuFp8Error, match="does not split Qwen2 FP8"):
        export_legacy(spec_factory("qwen2-tiny"), tmp_path / "a", tp=2)
    assert export_legacy(spec_factory(), tmp_path / "b", tp=2).tensors > 0  # its ERNIE rules pair gate|up scales
    assert export_legacy(spec_factory("ernie-dense-tiny"), tmp_path / "d", tp=2).tensors > 0


def test_cli_import_and_export(tmp_path, legacy_ernie, spec_factory):
    result = CliRunner().invoke(main, ["import-legacy", str(legacy_ernie("1dd4eef8")[0]), str(tmp_path / "in")])
    assert result.exit_code == 0, result.output
    assert "tensor-wise (older converter)" in result.output and "KV cache fp8" in result.output
    result = CliRunner().invoke(main, ["export-legacy", str(spec_factory("qwen2-tiny")), str(tmp_path / "ex"), "--tp", "2"])
    assert result.exit_code == 1 and "does not split Qwen2" in result.output


def test_bf16_storage_of_an_amax_moves_it_by_up_to_2_to_the_minus_8():
    """bf16 keeps 8 significant bits: round-to-nearest moves a value by up to half a step, 2^-8 relative
    (not 2^-9): 1 + 0.99 * 2^-8 rounds down to 1."""
    amax = np.float32(1 + 0.99 * 2.0**-8)
    stored = float(amax_to_legacy("ernie.layers.0.self_attn.qkv_proj.activation_scale", amax).astype(np.float32)[0])
    assert stored == 1.0
    assert 2.0**-9 < (amax - stored) / amax <= 2.0**-8


def test_export_of_a_tied_qwen2_writes_the_lm_head_key_its_v0_path_reads(tmp_path, spec_factory):
    """FastDeploy's Qwen2 set_state_dict pops lm_head.weight even when tied and transposes it: the embedding."""
    config = preset_config("qwen2-tiny", {"tie_word_embeddings": True})
    synthesize(tmp_path / "src", config, seed=3)
    convert(tmp_path / "src", tmp_path / "spec", [synthetic_measurements(config)], ConvertOptions())
    legacy = Checkpoint.open(export_legacy(tmp_path / "spec", tmp_path / "legacy").out)
    embedding = legacy.get("qwen2.embed_tokens.weight")
    assert legacy.tensors["lm_head.weight"].shape == embedding.shape
    np.testing.assert_array_equal(legacy.get("lm_head.weight").view(np.uint16), embedding.view(np.uint16))
    ernie = Checkpoint.open(export_legacy(spec_factory(), tmp_path / "legacy-ernie").out)  # tied too
    assert "lm_head.weight" not in ernie.tensors  # ERNIE hands its embedding parameter to the lm_head instead


def test_export_of_qwen3_writes_its_v0_keys_at_tp1_only(tmp_path, spec_factory):
    """Qwen3's v0 path reads Qwen2's keys without the bias, plus the q/k norms; tied, it hands lm_head the embedding
    parameter and reads no key (docs/fastdeploy.md section 14)."""
    result = export_legacy(spec_factory("qwen3-tiny"), tmp_path / "legacy")
    legacy = Checkpoint.open(result.out)
    layer = "model.layers.1.self_attn"
    assert {f"{layer}.q_norm.weight", f"{layer}.k_norm.weight", f"{layer}.qkv_proj.quant_weight"} <= set(legacy.tensors)
    assert not any(n.endswith("qkv_proj.bias") for n in legacy.tensors) and "lm_head.weight" not in legacy.tensors
    assert legacy.tensors[f"{layer}.q_norm.weight"].shape == (24,)  # head_dim, not hidden / heads
    assert result.warnings == [
        "Qwen3 in the legacy layout is [inferred] from FastDeploy's code: no FP8 Qwen3 has been seen served by stock FastDeploy"
    ]
    with pytest.raises(HpuFp8Error, match="tensor parallelism 2: FastDeploy's v0 loader does not split Qwen3 FP8"):
        export_legacy(spec_factory("qwen3-tiny"), tmp_path / "tp2", tp=2)
    assert not (tmp_path / "tp2").exists()


def test_export_of_qwen3_moe_is_refused_in_one_line_naming_why(tmp_path, spec_factory):
    with pytest.raises(HpuFp8Error, match=r"Qwen3MoeBlock\.weight_key_map holds only the two expert '\.weight' keys"):
        export_legacy(spec_factory("qwen3-moe-tiny"), tmp_path / "a", rank=Parallelism(2, 1))
    result = CliRunner().invoke(main, ["export-legacy", str(spec_factory("qwen3-moe-tiny")), str(tmp_path / "b")])
    assert result.exit_code == 1 and not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()
    (line,) = result.output.strip().splitlines()
    assert "Qwen3-MoE has no legacy layout stock FastDeploy can read" in line and "hpu_fp8 loader hook" in line


@pytest.mark.parametrize(("preset", "tp", "message"), [("qwen3-moe-tiny", 2, "Qwen3-MoE has no legacy layout"),
                                                      ("qwen3-tiny", 4, "num_key_value_heads // tp = 0")])  # fmt: skip
def test_map_all_ranks_refuses_before_making_the_output_directory(tmp_path, spec_factory, preset, tp, message):
    out = tmp_path / "presharded"
    result = CliRunner().invoke(main, ["map", str(spec_factory(preset)), "--all-ranks", "--tp", str(tp), "-o", str(out)])
    assert result.exit_code == 1 and message in result.output
    assert list(tmp_path.iterdir()) == []  # neither OUT nor OUT.partial

"""`calibrate`: activation amax at FastDeploy's measurement points, checked against hooks on the same
layers of transformers' model, and fed end to end into the converter."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner
from helpers.checkpoint_damage import overwrite_tensor_bytes

from hpu_fp8_loader.checks.validate import validate
from hpu_fp8_loader.cli.main import main
from hpu_fp8_loader.conversion.convert import convert
from hpu_fp8_loader.errors import HpuFp8Error, NonFiniteError
from hpu_fp8_loader.io.checkpoint import Checkpoint
from hpu_fp8_loader.memory import memory_budget
from hpu_fp8_loader.quality.calibrate import calibrate
from hpu_fp8_loader.quality.datasets import builtin_text, token_batches
from hpu_fp8_loader.quality.observers import AmaxObserver
from hpu_fp8_loader.sources.measurements import load_measurements


def hooked_amax(model_dir, ids: np.ndarray, points: dict[str, str]) -> dict[str, float]:
    """max |input| of transformers submodules (by their names) over one forward of ``ids``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seen: dict[str, float] = {}
    modules = dict(model.named_modules())
    for hf_name, ours in points.items():
        modules[hf_name].register_forward_pre_hook(
            lambda _m, args, ours=ours: seen.__setitem__(ours, max(seen.get(ours, 0.0), float(args[0].abs().max())))
        )
    with torch.no_grad():
        model(torch.tensor(ids))
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["qwen2-tiny", "ernie-dense-tiny"])
def test_amax_at_each_point_matches_hooks_on_transformers(source_factory, preset):
    root = source_factory(preset, "torch")
    result = calibrate(root, samples=2, seq_len=64, batch_size=2)
    prefix = "qwen2" if preset.startswith("qwen2") else "ernie"
    points = {}
    for i in range(2):
        points.update({
            f"model.layers.{i}.self_attn.q_proj": f"{prefix}.layers.{i}.self_attn.qkv_proj",
            f"model.layers.{i}.self_attn.o_proj": f"{prefix}.layers.{i}.self_attn.o_proj",
            f"model.layers.{i}.mlp.gate_proj": f"{prefix}.layers.{i}.mlp.up_gate_proj",
            f"model.layers.{i}.mlp.down_proj": f"{prefix}.layers.{i}.mlp.down_proj",
        })  # fmt: skip
    ids = np.frombuffer(builtin_text().encode(), np.uint8).astype(np.int64)  # a synthetic model: byte tokens
    expected = hooked_amax(root, ids[: 2 * 64].reshape(2, 64), points)
    for module, value in expected.items():
        assert result.measurements.amax[module] == pytest.approx(value, rel=1e-4), module
    assert result.measurements.amax[f"{prefix}.layers.1.self_attn.s"] == 1.0
    assert result.tokenizer == "bytes" and result.tokens == 128


@pytest.mark.parametrize(("preset", "layout"), [("ernie-moe-tiny", "paddle"), ("qwen2-tiny", "torch")])
def test_calibration_feeds_the_converter_end_to_end(tmp_path, source_factory, preset, layout):
    result = calibrate(source_factory(preset, layout), samples=4, seq_len=64)
    convert(source_factory(preset, layout), tmp_path / "out", [result.measurements])
    assert validate(tmp_path / "out").valid
    spec = Checkpoint.open(tmp_path / "out")
    for module, value in result.measurements.amax.items():
        assert spec.get(f"{module}.act_amax")[0] == np.float32(value)
    provenance = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["calibration"]["sources"][0]
    assert provenance["kind"] == "reference-engine" and provenance["tokens"] == 256 and provenance["seq_len"] == 64


def test_the_fastdeploy_format_reads_back_through_the_converters_reader(tmp_path, source_factory):
    result = CliRunner().invoke(
        main,
        [
            "calibrate",
            str(source_factory()),
            "-o",
            str(tmp_path / "m.json"),
            "--samples",
            "2",
            "--seq-len",
            "32",
            "--fastdeploy-format",
            str(tmp_path / "model_measurement.txt"),
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    ours = load_measurements(tmp_path / "m.json").measurements
    fastdeploy = load_measurements(tmp_path / "model_measurement.txt").measurements
    assert fastdeploy.amax == ours.amax and fastdeploy.provenance.kind.value == "fastdeploy-measurement"


def test_all_experts_widens_expert_statistics_without_changing_the_routing(source_factory):
    routed = calibrate(source_factory(), samples=2, seq_len=32)
    everything = calibrate(source_factory(), samples=2, seq_len=32, all_experts=True)
    assert routed.measurements.expert_tokens == everything.measurements.expert_tokens  # the forward is unchanged
    for module, value in routed.measurements.amax.items():
        if ".mlp.experts." in module and module.endswith("down_proj"):
            assert everything.measurements.amax[module] >= value
        else:
            assert everything.measurements.amax[module] == value
    assert "--all-experts" in everything.measurements.provenance.tool


def test_experts_no_token_reaches_are_listed_with_the_converter_options(tmp_path, source_factory):
    root = tmp_path / "m"
    shutil.copytree(source_factory(), root)
    bias = np.zeros((1, 4), np.float32)
    bias[0, 3] = -10.0  # expert 3 of layer 1 can never win the top-k
    overwrite_tensor_bytes(root, "ernie.layers.1.mlp.moe_statics.e_score_correction_bias", bias.tobytes())
    result = CliRunner().invoke(
        main, ["calibrate", str(root), "-o", str(tmp_path / "m.json"), "--samples", "2", "--seq-len", "32", "-q"]
    )
    assert result.exit_code == 0
    (warning,) = [line for line in result.stderr.splitlines() if line.startswith("hpu-fp8: warning:")]
    assert "1 expert(s): layer 1: expert 3 (1 of 4). " in warning and "--all-experts" in warning and "sibling-max" in warning
    assert load_measurements(tmp_path / "m.json").measurements.expert_tokens["ernie.layers.1.mlp.experts.3"] == 0
    full = CliRunner().invoke(
        main,
        ["calibrate", str(root), "-o", str(tmp_path / "all.json"), "--samples", "2", "--seq-len", "32", "--all-experts", "-q"],
    )
    assert (
        full.exit_code == 0
        and load_measurements(tmp_path / "all.json").measurements.amax["ernie.layers.1.mlp.experts.3.down_proj"] > 0
    )


def test_a_tokenizer_json_in_the_model_directory_is_used(tmp_path, source_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path / "m"
    shutil.copytree(source_factory("qwen2-tiny", "torch"), root)
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([builtin_text()[:20000]], trainers.WordLevelTrainer(vocab_size=500, special_tokens=["[UNK]"]))
    tokenizer.save(str(root / "tokenizer.json"))
    result = calibrate(root, samples=2, seq_len=32)
    assert result.tokenizer == "tokenizer.json"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": 5000}, "beyond the model's max_position_embeddings 4096"),
        ({"dataset": "empty.txt"}, "no text"),
        ({"dataset": "bad.jsonl"}, r"bad.jsonl:2: not valid JSON"),
        ({"dataset": "missing.txt"}, "no such dataset file"),
    ],
)
def test_bad_calibration_requests_get_clear_errors(tmp_path, source_factory, monkeypatch, kwargs, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(HpuFp8Error, match=message):
        calibrate(source_factory(), **kwargs)


def test_held_out_text_never_calibrates():
    calibration, held_out = builtin_text(), builtin_text("held-out")
    assert held_out and held_out not in calibration and len(held_out) < len(calibration) / 5


def test_an_unknown_architecture_is_named(tmp_path, source_factory):
    root = tmp_path / "m"
    shutil.copytree(source_factory(), root)
    config = json.loads((root / "config.json").read_text())
    config["model_type"] = "llama"
    (root / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["calibrate", str(root), "-o", str(tmp_path / "m.json")])
    assert result.exit_code == 1 and "model_type 'llama' is not supported" in result.output


def _kernel_files(root, files: dict[str, str]):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


MEMINFO = {"proc/meminfo": "MemTotal:       67108864 kB\nMemAvailable:   33554432 kB\n"}  # 32 GiB available


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({}, 32 * 2**30),
        ({"proc/self/cgroup": "0::/job\n", "cgroup/job/memory.max": "max\n"}, 32 * 2**30),
        (
            {
                "proc/self/cgroup": "0::/job\n",
                "cgroup/job/memory.max": f"{4 * 2**30}\n",
                "cgroup/job/memory.current": f"{2**30}\n",
            },
            3 * 2**30,
        ),
        ({"proc/self/cgroup": "0::/a/b\n", "cgroup/a/memory.max": f"{2 * 2**30}\n", "cgroup/a/b/memory.max": "max\n"}, 2 * 2**30),
        ({"proc/self/cgroup": "0::/\n", "cgroup/memory.max": f"{2**30}\n"}, 2**30),  # a container: its cgroup is the root
        (
            {
                "proc/self/cgroup": "5:cpu,cpuacct:/x\n4:memory:/docker/abc\n",
                "cgroup/memory/docker/abc/memory.limit_in_bytes": f"{3 * 2**30}\n",
                "cgroup/memory/docker/abc/memory.usage_in_bytes": f"{2**30}\n",
                "cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
            },
            2 * 2**30,
        ),
        ({"proc/self/cgroup": "4:memory:/gone\n"}, 32 * 2**30),  # a cgroup path this mount does not show
    ],
    ids=["meminfo", "v2-unlimited", "v2-limit-minus-usage", "v2-ancestor", "v2-container-root", "v1", "v1-hidden"],
)
def test_the_weight_cache_budget_respects_cgroup_limits(tmp_path, files, expected):
    _kernel_files(tmp_path, {**MEMINFO, **files})
    assert memory_budget(tmp_path / "proc", tmp_path / "cgroup") == expected


def test_the_weight_cache_budget_respects_ulimit_v():
    """A real RLIMIT_AS, set in a child process to 1 GiB beyond what it already maps: the budget is what is left."""
    script = (
        "import resource, re; from hpu_fp8_loader.memory import memory_budget\n"
        "size = int(re.search(r'VmSize:\\s+(\\d+) kB', open('/proc/self/status').read())[1]) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (size + 2**30, resource.RLIM_INFINITY))\n"
        "print(memory_budget())\n"
    )
    limited = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert 0.9 * 2**30 < limited <= 2**30


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_the_observer_refuses_a_non_finite_activation_by_module(value):
    observer = AmaxObserver("ernie")
    observer.record("ernie.layers.2.mlp.down_proj", np.array([1.0, 2.0], np.float32))
    with pytest.raises(NonFiniteError, match=r"activation ernie\.layers\.2\.mlp\.down_proj holds (NaN|inf)"):
        observer.record("ernie.layers.2.mlp.down_proj", np.array([1.0, value], np.float32))
    assert observer.amax == {"ernie.layers.2.mlp.down_proj": 2.0}


@pytest.mark.parametrize(
    ("samples", "seq_len", "batch_size", "named"), [(0, 8, 1, "samples"), (1, 0, 1, "seq_len"), (1, 8, -1, "batch_size")]
)
def test_windows_of_nothing_are_refused(samples, seq_len, batch_size, named):
    with pytest.raises(HpuFp8Error, match=f"{named} is .*; it must be at least 1"):
        list(token_batches(np.arange(100), samples, seq_len, batch_size))

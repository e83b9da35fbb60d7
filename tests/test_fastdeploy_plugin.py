"""The FastDeploy plugin against a stand-in of FastDeploy's module surface (tests/doubles/fastdeploy.py),
labelled as such: FastDeploy itself cannot be installed here."""

from __future__ import annotations

import importlib
import json
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import numpy as np
import paddle
import pytest
from doubles.fastdeploy import forget_standin, write_standin

from hpu_fp8_loader.errors import HpuFp8Error
from hpu_fp8_loader.fastdeploy import plugin
from hpu_fp8_loader.fastdeploy.mapping import Parallelism, map_rank
from hpu_fp8_loader.io.checkpoint import Checkpoint


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """The stand-in package on sys.path, our import hook and loader class removed afterwards."""
    monkeypatch.syspath_prepend(str(write_standin(tmp_path / "fd")))
    monkeypatch.setattr(plugin, "_LOADER", None)  # derived from this stand-in's BaseModelLoader when first used
    forget_standin()
    finders = list(sys.meta_path)
    yield
    sys.meta_path[:] = finders
    forget_standin()


def fd_config(root, tp=1, rank=0, load_choices="hpu_fp8", moe_list_layout=False, lm_head_fp32=False):
    config = json.loads((root / "config.json").read_text())
    return SimpleNamespace(
        load_config=SimpleNamespace(load_choices=load_choices),
        model_config=SimpleNamespace(
            model=str(root), architectures=config["architectures"], config=config, lm_head_fp32=lm_head_fp32
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, tensor_parallel_rank=rank, expert_parallel_size=1, expert_parallel_rank=0
        ),
        moe_list_layout=moe_list_layout,
    )


def test_the_entry_point_is_declared_for_fastdeploys_plugin_group():
    (point,) = [ep for ep in entry_points(group="fastdeploy.model_register_plugins") if ep.name == "hpu_fp8"]
    assert point.load() is plugin.register


def test_register_before_fastdeploy_imports_routes_hpu_fp8_to_our_loader(standin, spec_factory, capfd):
    plugin.register()
    assert plugin.is_registered()
    runner_module = importlib.import_module("fastdeploy.worker.hpu_model_runner")
    runner = runner_module.HPUModelRunner(fd_config(spec_factory()))
    model = runner.load_model()
    assert runner.converted  # convert_model still runs after our loader
    assert isinstance(model, importlib.import_module("fastdeploy.model_executor.models.model_base").StandInModel)
    assert not model.training  # FastDeploy's loaders call model.eval()
    line = capfd.readouterr().err
    assert "hpu_fp8: filled" in line and "Ernie4_5_MoeForCausalLM" in line and "PR 5855 layout" in line, line


def test_the_plugin_fastdeploy_runs_mid_import_still_routes(standin, spec_factory, monkeypatch):
    """FastDeploy runs plugins while model_loader is half-imported (default_loader imports the models
    package): nothing is left to wrap there, and hpu_fp8 must still reach our loader."""
    monkeypatch.setenv("FD_PLUGINS", "hpu_fp8")
    runner_module = importlib.import_module("fastdeploy.worker.hpu_model_runner")
    assert plugin.is_registered()
    assert runner_module.HPUModelRunner(fd_config(spec_factory())).load_model() != "v0 loader"


def test_without_fd_plugins_fastdeploy_never_runs_the_hook(standin, spec_factory, monkeypatch):
    """FastDeploy loads no plugin unless FD_PLUGINS names it; hpu_fp8 then reaches its v0 loader.
    `hpu-fp8 doctor` reports exactly this (FD_PLUGINS missing)."""
    monkeypatch.delenv("FD_PLUGINS", raising=False)
    runner_module = importlib.import_module("fastdeploy.worker.hpu_model_runner")
    assert not plugin.is_registered()
    assert runner_module.HPUModelRunner(fd_config(spec_factory())).load_model() == "v0 loader"


def test_register_after_import_routes_too_and_other_choices_are_untouched(standin, spec_factory):
    runner_module = importlib.import_module("fastdeploy.worker.hpu_model_runner")
    plugin.register()
    plugin.register()  # once per process in FastDeploy, but twice must not route twice
    assert runner_module.HPUModelRunner(fd_config(spec_factory())).load_model() != "v0 loader"
    for choice in ("default", "default_v1"):
        assert runner_module.HPUModelRunner(fd_config(spec_factory(), load_choices=choice)).load_model() == "v0 loader"


def test_a_half_imported_base_loader_is_a_loud_error(standin, monkeypatch):
    half = type(sys)(plugin.BASE_LOADER_MODULE)
    monkeypatch.setitem(sys.modules, plugin.BASE_LOADER_MODULE, half)
    with pytest.raises(HpuFp8Error, match="half-imported.*cannot be routed"):
        plugin.register()


@pytest.mark.parametrize(
    ("preset", "tp", "moe_list_layout"),
    [("ernie-moe-tiny", 1, False), ("ernie-moe-tiny", 2, False), ("ernie-moe-tiny", 2, True), ("qwen2-tiny", 2, False),
     ("ernie-dense-tiny", 2, False), ("qwen3-tiny", 1, False), ("qwen3-tiny", 2, False), ("qwen3-moe-tiny", 1, False),
     ("qwen3-moe-tiny", 2, False), ("qwen3-moe-tiny", 2, True)],
)  # fmt: skip
def test_every_parameter_is_filled_with_the_mapped_bits(standin, spec_factory, preset, tp, moe_list_layout):
    plugin.register()
    runner_module = importlib.import_module("fastdeploy.worker.hpu_model_runner")
    root = spec_factory(preset)
    for rank in range(tp):
        model = runner_module.HPUModelRunner(fd_config(root, tp, rank, moe_list_layout=moe_list_layout)).load_model()
        parameters = dict(model.named_parameters())
        layers = dict(model.named_sublayers())
        checkpoint = Checkpoint.open(root)
        from hpu_fp8_loader.arch import describe
        from hpu_fp8_loader.spec.config import parse_quantization_config

        for piece in map_rank(
            checkpoint, parse_quantization_config(checkpoint.config), describe(checkpoint.config), Parallelism(tp, rank)
        ):
            if piece.name.endswith("down_proj_in_scale") and moe_list_layout:
                scales = layers[piece.name.removesuffix(".down_proj_in_scale")].down_proj_in_scale
                assert isinstance(scales, list) and len(scales) == 4 and piece.name not in parameters
                assert {tuple(t.shape) for t in scales} == {(1,)} and {t.dtype for t in scales} == {paddle.bfloat16}
                value = paddle.stack(scales)
            else:
                value = parameters[piece.name]
            if piece.expert is not None:
                value = value[piece.expert]
            width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[piece.array.dtype.itemsize]
            paddle_width = {1: paddle.uint8, 2: paddle.uint16, 4: paddle.uint32}[piece.array.dtype.itemsize]
            got = value.view(paddle_width).numpy() if piece.array.dtype.itemsize < 4 else value.numpy().view(np.uint32)
            np.testing.assert_array_equal(got.astype(width), np.ascontiguousarray(piece.array).view(width), err_msg=piece.name)


def test_a_model_with_a_parameter_the_checkpoint_lacks_is_refused_by_name(standin, spec_factory):
    models = importlib.import_module("fastdeploy.model_executor.models.model_base")
    model = models.StandInModel(fd_config(spec_factory()))
    models._add(model, "ernie.layers.0.self_attn.attn.extra_scale", [1], "float32")
    with pytest.raises(HpuFp8Error, match="1 model parameter.*unfilled.*ernie.layers.0.self_attn.attn.extra_scale"):
        plugin.fill_model(model, spec_factory(), Parallelism())


def test_a_checkpoint_tensor_the_model_lacks_is_refused_by_name(standin, spec_factory):
    models = importlib.import_module("fastdeploy.model_executor.models.model_base")
    config = fd_config(spec_factory("qwen2-tiny", "none"))  # a model built without FP8 attention scales...
    model = models.StandInModel(config)
    with pytest.raises(HpuFp8Error, match="maps 20 tensor.*the model does not have.*self_attn.attn"):
        plugin.fill_model(model, spec_factory("qwen2-tiny"), Parallelism())  # ...given a checkpoint with them


def test_an_invalid_checkpoint_is_refused_before_the_model_is_built(standin, spec_copy):
    root = spec_copy()
    (root / "hpu_fp8_manifest.json").unlink()
    plugin.register()
    runner_module = importlib.import_module("fastdeploy.worker.hpu_model_runner")
    with pytest.raises(HpuFp8Error, match="never finished"):
        runner_module.HPUModelRunner(fd_config(root)).load_model()


def test_a_float32_lm_head_gets_the_bf16_values_cast_exactly(standin, spec_factory):
    """--lm_head-fp32 makes FastDeploy's lm_head float32; it casts the bf16 values, as the hook does."""
    models = importlib.import_module("fastdeploy.model_executor.models.model_base")
    root = spec_factory()
    model = models.StandInModel(fd_config(root, lm_head_fp32=True))
    plugin.fill_model(model, root, Parallelism())
    lm_head = dict(model.named_parameters())["lm_head.linear.weight"]
    embedding = dict(model.named_parameters())["ernie.embed_tokens.embeddings.weight"]
    assert lm_head.dtype == paddle.float32
    np.testing.assert_array_equal(lm_head.numpy(), embedding.astype(paddle.float32).numpy().T)


class _Norm(paddle.nn.Layer):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = self.create_parameter([width])


class _HeldNorms(paddle.nn.Layer):
    """What FastDeploy's QKRMSNorm holds from 2533836d: two RMSNorms (paddle layers, not FastDeploy's)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_norm, self.k_norm = _Norm(4), _Norm(4)


class _Attention(paddle.nn.Layer):
    def __init__(self, held: bool) -> None:
        super().__init__()
        self.qkv_proj = _Norm(8)
        if held:
            self.qk_norm = _HeldNorms()
        else:
            self.q_norm, self.k_norm = _Norm(4), _Norm(4)


class _Model(paddle.nn.Layer):
    def __init__(self, held: bool) -> None:
        super().__init__()
        self.layers = paddle.nn.LayerList([paddle.nn.Layer() for _ in range(2)])
        for layer in self.layers:
            layer.self_attn = _Attention(held)


def test_held_qk_norms_are_mapped_to_their_parameters_only_where_the_model_holds_them():
    mapped = ["m.layers.0.self_attn.q_norm.weight", "m.layers.0.self_attn.k_norm.weight", "m.layers.0.mlp.q_norm.weight",
              "m.layers.0.self_attn.qkv_proj.weight", "m.layers.0.self_attn.q_norm.bias"]  # fmt: skip
    held = plugin.model_parameter_names(mapped, ["m.layers.0.self_attn.qk_norm.q_norm.weight"])
    assert held == {
        "m.layers.0.self_attn.q_norm.weight": "m.layers.0.self_attn.qk_norm.q_norm.weight",
        "m.layers.0.self_attn.k_norm.weight": "m.layers.0.self_attn.qk_norm.k_norm.weight",
        **{name: name for name in mapped[2:]},
    }
    assert plugin.model_parameter_names(mapped, ["m.layers.0.self_attn.q_norm.weight"]) == {name: name for name in mapped}


def test_attached_qk_norms_are_the_held_layers_and_change_no_parameter_or_child():
    model = _Model(held=True)
    before = ([name for name, _ in model.named_parameters()], [name for name, _ in model.named_sublayers()])
    assert plugin.attach_qk_norms(model) == 2
    for layer in model.layers:
        attention = layer.self_attn
        assert attention.q_norm is attention.qk_norm.q_norm and attention.k_norm is attention.qk_norm.k_norm
        assert "q_norm" not in dict(attention.named_children())
    assert ([name for name, _ in model.named_parameters()], [name for name, _ in model.named_sublayers()]) == before
    assert plugin.attach_qk_norms(model) == 0  # attached already: each attention has its own now


def test_an_attention_with_its_own_qk_norms_gets_nothing_attached():
    model = _Model(held=False)
    own = [layer.self_attn.q_norm for layer in model.layers]
    assert plugin.attach_qk_norms(model) == 0
    assert [layer.self_attn.q_norm for layer in model.layers] == own


def test_only_the_router_is_cast_into_a_bf16_gate_and_rounded_to_nearest_even():
    import ml_dtypes

    routers = frozenset({"model.layers.0.mlp.gate.weight"})
    gate = paddle.create_parameter([2, 3], "bfloat16", default_initializer=paddle.nn.initializer.Constant(0.0))
    values = np.array([[1 + 2**-8, 1 + 3 * 2**-8, -0.1], [3.0, 1e-30, 65504.0]], np.float32)  # ties go to even
    cast = plugin._for_parameter("model.layers.0.mlp.gate.weight", gate, values, routers)
    expected = values.astype(ml_dtypes.bfloat16)
    assert cast.dtype == paddle.bfloat16
    assert np.array_equal(cast.view(paddle.uint16).numpy().astype(np.uint16), expected.view(np.uint16))
    with pytest.raises(
        HpuFp8Error, match=r"parameter model.layers.0.mlp.up.weight is paddle.bfloat16, the checkpoint gives float32"
    ):
        plugin._for_parameter("model.layers.0.mlp.up.weight", gate, values, routers)
    float_gate = paddle.create_parameter([2, 3], "float32", default_initializer=paddle.nn.initializer.Constant(0.0))
    with pytest.raises(HpuFp8Error, match="is paddle.float32, the checkpoint gives bfloat16"):  # never the other way
        plugin._for_parameter("model.layers.0.mlp.gate.weight", float_gate, expected, routers)


def test_sequence_parallel_moe_is_refused_naming_the_flag_that_turns_it_off():
    on = SimpleNamespace(parallel_config=SimpleNamespace(use_sequence_parallel_moe=True))
    with pytest.raises(HpuFp8Error, match="--disable-sequence-parallel-moe"):
        plugin.check_parallel_config(on)
    plugin.check_parallel_config(SimpleNamespace(parallel_config=SimpleNamespace(use_sequence_parallel_moe=False)))
    plugin.check_parallel_config(SimpleNamespace(parallel_config=SimpleNamespace()))  # a FastDeploy without the setting

"""The FastDeploy plugin against a stand-in of FastDeploy's module surface (tests/fastdeploy_standin.py),
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
from fastdeploy_standin import forget_standin, write_standin

from hpu_fp8_loader.errors import HpuFp8Error
from hpu_fp8_loader.fastdeploy import plugin
from hpu_fp8_loader.fastdeploy.mapping import Parallelism, map_rank
from hpu_fp8_loader.io.checkpoint import Checkpoint


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """The stand-in package on sys.path, our import hook removed afterwards."""
    monkeypatch.syspath_prepend(str(write_standin(tmp_path / "fd")))
    forget_standin()
    finders = list(sys.meta_path)
    yield
    sys.meta_path[:] = finders
    forget_standin()


def fd_config(root, tp=1, rank=0, load_choices="hpu_fp8"):
    config = json.loads((root / "config.json").read_text())
    return SimpleNamespace(
        load_config=SimpleNamespace(load_choices=load_choices),
        model_config=SimpleNamespace(model=str(root), architectures=config["architectures"], config=config),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, tensor_parallel_rank=rank, expert_parallel_size=1, expert_parallel_rank=0
        ),
    )


def test_the_entry_point_is_declared_for_fastdeploys_plugin_group():
    (point,) = [ep for ep in entry_points(group="fastdeploy.model_register_plugins") if ep.name == "hpu_fp8"]
    assert point.load() is plugin.register


def test_register_before_fastdeploy_imports_patches_both_lookups_lazily(standin, spec_factory):
    plugin.register()  # FastDeploy runs plugins while its models package is still importing
    runner_module = importlib.import_module("fastdeploy.worker.hpu_model_runner")
    loader_module = importlib.import_module("fastdeploy.model_executor.model_loader")
    for module in (runner_module, loader_module):
        assert getattr(module.get_model_loader, "_hpu_fp8_wrapped", False)
    runner = runner_module.HPUModelRunner(fd_config(spec_factory()))
    model = runner.load_model()
    assert runner.converted  # convert_model still runs after our loader
    assert isinstance(model, importlib.import_module("fastdeploy.model_executor.models").StandInModel)


def test_register_after_import_patches_too_and_other_choices_are_untouched(standin, spec_factory):
    runner_module = importlib.import_module("fastdeploy.worker.hpu_model_runner")
    plugin.register()
    plugin.register()  # once per process in FastDeploy, but twice must not double-wrap
    assert not getattr(runner_module.get_model_loader.__wrapped__, "_hpu_fp8_wrapped", False)
    for choice in ("default", "default_v1"):
        assert runner_module.HPUModelRunner(fd_config(spec_factory(), load_choices=choice)).load_model() == "v0 loader"


@pytest.mark.parametrize(
    ("preset", "tp"), [("ernie-moe-tiny", 1), ("ernie-moe-tiny", 2), ("qwen2-tiny", 2), ("ernie-dense-tiny", 2)]
)
def test_every_parameter_is_filled_with_the_mapped_bits(standin, spec_factory, preset, tp):
    plugin.register()
    runner_module = importlib.import_module("fastdeploy.worker.hpu_model_runner")
    root = spec_factory(preset)
    for rank in range(tp):
        model = runner_module.HPUModelRunner(fd_config(root, tp, rank)).load_model()
        parameters = dict(model.named_parameters())
        checkpoint = Checkpoint.open(root)
        from hpu_fp8_loader.arch import describe
        from hpu_fp8_loader.spec.config import parse_quantization_config

        for piece in map_rank(
            checkpoint, parse_quantization_config(checkpoint.config), describe(checkpoint.config), Parallelism(tp, rank)
        ):
            value = parameters[piece.name]
            if piece.expert is not None:
                value = value[piece.expert]
            width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[piece.array.dtype.itemsize]
            paddle_width = {1: paddle.uint8, 2: paddle.uint16, 4: paddle.uint32}[piece.array.dtype.itemsize]
            got = value.view(paddle_width).numpy() if piece.array.dtype.itemsize < 4 else value.numpy().view(np.uint32)
            np.testing.assert_array_equal(got.astype(width), np.ascontiguousarray(piece.array).view(width), err_msg=piece.name)


def test_a_model_with_a_parameter_the_checkpoint_lacks_is_refused_by_name(standin, spec_factory):
    models = importlib.import_module("fastdeploy.model_executor.models")
    model = models.StandInModel(fd_config(spec_factory()))
    models._add(model, "ernie.layers.0.self_attn.attn.extra_scale", [1], "float32")
    with pytest.raises(HpuFp8Error, match="1 model parameter.*unfilled.*ernie.layers.0.self_attn.attn.extra_scale"):
        plugin.fill_model(model, spec_factory(), Parallelism())


def test_a_checkpoint_tensor_the_model_lacks_is_refused_by_name(standin, spec_factory):
    models = importlib.import_module("fastdeploy.model_executor.models")
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

"""What installing the package into FastDeploy's environment brings with it."""

from __future__ import annotations

from importlib.metadata import requires


def test_paddle_is_never_a_runtime_requirement():
    """FastDeploy's Gaudi environment pins its own paddle with a PaddleCustomDevice wheel built against it;
    a requirement on paddle would let pip replace it. Only the dev extra (tests) pins one."""
    runtime = [r for r in requires("hpu-fp8-loader") or [] if "extra ==" not in r]
    assert runtime  # the metadata is there: numpy, safetensors, ...
    assert not [r for r in runtime if r.lower().startswith("paddle")], runtime
    dev = [r for r in requires("hpu-fp8-loader") or [] if 'extra == "dev"' in r]
    assert any(r.lower().startswith("paddlepaddle") for r in dev)

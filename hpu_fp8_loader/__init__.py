"""hpu-fp8-loader: FP8 checkpoints for FastDeploy on Intel Gaudi, made, checked and loaded on a CPU."""

__version__ = "0.1.0"

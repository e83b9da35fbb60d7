"""Writing hpu-fp8 checkpoints: BF16 conversion, compressed-tensors and legacy import, retargeting, activation amax."""

"""The two tiny models trained here that ship inside the package: the demo's sources, and the README's.

``ernie-moe-bytes`` (Ernie4.5-MoE) and ``qwen2-bytes`` (Qwen2), byte-level, under 2 MB together, made by
scripts/train_tiny.py; nothing is downloaded or trained at run time.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TINY_MODELS"]

TINY_MODELS: dict[str, Path] = {
    name: Path(__file__).parents[1] / "tiny_models" / name for name in ("ernie-moe-bytes", "qwen2-bytes")
}
"""name -> the model's directory (a BF16 Paddle-layout checkpoint: config.json and one safetensors file).

Example:
    >>> sorted(TINY_MODELS)
    ['ernie-moe-bytes', 'qwen2-bytes']
"""

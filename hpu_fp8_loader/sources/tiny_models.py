"""The tiny models trained here that ship inside the package: the demo's sources, and the README's.

``ernie-moe-bytes`` (Ernie4.5-MoE), ``qwen2-bytes`` (Qwen2), ``qwen3-bytes`` (Qwen3: head_dim 48 with hidden 128 and
4 heads, tied embeddings) and ``qwen3-moe-bytes`` (Qwen3-MoE: 4 experts, top 2, every layer MoE), byte-level, about
1 MB each, made by scripts/train_tiny.py; nothing is downloaded or trained at run time.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TINY_MODELS"]

TINY_MODELS: dict[str, Path] = {
    name: Path(__file__).parents[1] / "tiny_models" / name
    for name in ("ernie-moe-bytes", "qwen2-bytes", "qwen3-bytes", "qwen3-moe-bytes")
}
"""name -> the model's directory (a BF16 Hugging Face torch-layout checkpoint: config.json and one safetensors file).

Example:
    >>> sorted(TINY_MODELS)
    ['ernie-moe-bytes', 'qwen2-bytes', 'qwen3-bytes', 'qwen3-moe-bytes']
"""

"""Train the tiny models the demo and the accuracy tests use: byte-level Qwen2, Ernie4.5-MoE, Qwen3 and Qwen3-MoE.

Random-weight models have near-uniform outputs, so accuracy figures on them mean little. These
are trained on the calibration part of the built-in text (Python's own documentation; the held-out
10% is never seen) with transformers on CPU, then saved in BF16, Hugging Face torch layout, under
``hpu_fp8_loader/tiny_models/`` (package data, so the demo works from any install). CI and the demo never train; they use the committed files. Re-run to reproduce:

    pip install -e ".[dev]" && python scripts/train_tiny.py --minutes 3

(``--models qwen3-bytes qwen3-moe-bytes`` trains only the Qwen3 ones, which came later.)
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from hpu_fp8_loader.quality.datasets import builtin_text

MODELS = {
    "qwen2-bytes": transformers.Qwen2Config(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    ),
    "ernie-moe-bytes": transformers.Ernie4_5_MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
        moe_num_experts=4, moe_k=2, moe_intermediate_size=96, moe_num_shared_experts=1, moe_layer_start_index=1,
        moe_layer_end_index=1, moe_layer_interval=1, tie_word_embeddings=True, use_bias=False,
    ),
    # head_dim 48 != hidden / heads (32) and tied embeddings, as in Qwen3-0.6B
    "qwen3-bytes": transformers.Qwen3Config(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=48, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_bias=False, bos_token_id=None, eos_token_id=None,
    ),
    # every layer MoE, renormalised top-k (norm_topk_prob), untied: what FastDeploy's HPU path runs
    "qwen3-moe-bytes": transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_id=None,
    ),
}  # fmt: skip


def train(name: str, minutes: float, out: Path, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    config = MODELS[name]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    data = torch.tensor(np.frombuffer(builtin_text("calibration").encode("utf-8"), np.uint8).astype(np.int64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    batch, seq = 16, 128
    started, step, losses = time.perf_counter(), 0, []
    generator = torch.Generator().manual_seed(seed)
    while time.perf_counter() - started < minutes * 60:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
        window = torch.stack([data[s : s + seq + 1] for s in starts])
        logits = model(window[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), window[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        step += 1
    target = out / name
    shutil.rmtree(target, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(target, safe_serialization=True)
    _published_key_names(target / "config.json")
    recent = float(np.mean(losses[-50:]))
    note = {
        "steps": step,
        "minutes": minutes,
        "batch": batch,
        "seq_len": seq,
        "final_train_loss": recent,
        "train_perplexity": math.exp(recent),
        "seed": seed,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    (target / "training.json").write_text(json.dumps(note, indent=2) + "\n")
    return note


def _published_key_names(path: Path) -> None:
    """transformers 5 writes Qwen3-MoE's expert count as ``num_local_experts``; the released configs, and FastDeploy
    (which reads ``model_config.num_experts``), spell it ``num_experts``."""
    config = json.loads(path.read_text())
    if "num_local_experts" in config:
        config["num_experts"] = config.pop("num_local_experts")
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=3.0, help="training time per model")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "hpu_fp8_loader" / "tiny_models")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 trains faster on a shared, busy CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.models:
        print(name, train(name, args.minutes, args.out))


if __name__ == "__main__":
    main()

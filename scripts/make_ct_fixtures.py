"""Make the compressed-tensors FP8 fixtures of tests/fixtures/ with llm-compressor itself.

llm-compressor pins an older transformers, so this runs in its own environment (the one
``bench/peer_llmcompressor.py --setup`` makes), never in CI:

    /tmp/llmc-venv/bin/python scripts/make_ct_fixtures.py

From the two tiny trained models shipped with hpu-fp8-loader it writes:
- ``<model>-fp8-dynamic``: ``model_free_ptq(scheme="FP8_DYNAMIC")`` (per-channel weight scales, no
  activation scales), embeddings, lm_head and the MoE router ignored;
- ``<model>-fp8-static``: ``oneshot(scheme="FP8")`` on CPU (tensor-wise weight scales, static
  ``input_scale``) calibrated on the built-in text.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "hpu_fp8_loader" / "tiny_models"
OUT = ROOT / "tests" / "fixtures"
IGNORE = ["lm_head", "re:.*embed_tokens", "re:.*mlp.gate$"]


def dynamic(name: str) -> None:
    from llmcompressor import model_free_ptq

    target = OUT / f"{name}-fp8-dynamic"
    shutil.rmtree(target, ignore_errors=True)
    model_free_ptq(str(MODELS / name), str(target), scheme="FP8_DYNAMIC", ignore=IGNORE, max_workers=1, device="cpu")


def static(name: str) -> None:
    import pydoc_data.topics

    import numpy as np
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))[:200_000]
    ids = np.frombuffer(text.encode(), np.uint8).astype(np.int64)[: 32 * 128].reshape(32, 128)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(MODELS / name, dtype=torch.bfloat16)
    target = OUT / f"{name}-fp8-static"
    shutil.rmtree(target, ignore_errors=True)
    recipe = QuantizationModifier(targets="Linear", scheme="FP8", ignore=IGNORE)
    oneshot(
        model=model,
        dataset=data,
        recipe=recipe,
        num_calibration_samples=32,
        max_seq_length=128,
        output_dir=str(target),
        processor=byte_tokenizer(),
    )
    (target / "tokenizer.json").unlink(missing_ok=True)  # the models read bytes; keep no tokenizer that says otherwise
    (target / "tokenizer_config.json").unlink(missing_ok=True)
    (target / "special_tokens_map.json").unlink(missing_ok=True)


def byte_tokenizer():
    """A byte-level tokenizer (id = byte): oneshot wants a processor with a dataset; the models read bytes."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i) if 32 < i < 127 else f"<0x{i:02X}>": i for i in range(256)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<0x00>")), pad_token="<0x00>")


if __name__ == "__main__":
    for name in ("qwen2-bytes", "ernie-moe-bytes"):
        for make in (static,) if "--static-only" in sys.argv else (dynamic, static):
            try:
                make(name)
                print("made", name, make.__name__)
            except Exception as exc:  # report and go on: each fixture stands alone
                print("FAILED", name, make.__name__, type(exc).__name__, exc, file=sys.stderr)

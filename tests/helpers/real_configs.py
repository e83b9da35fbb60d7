"""The target models' real configurations.

Transcribed from the models' published config.json files on the Hugging Face Hub: ERNIE-4.5-21B-A3B-PT,
ERNIE-4.5-300B-A47B-PT and ERNIE-4.5-0.3B-PT (https://huggingface.co/baidu/), Qwen2-0.5B, Qwen2-1.5B, Qwen2-7B and
Qwen2-72B (https://huggingface.co/Qwen/).

The Qwen3 ones (https://huggingface.co/Qwen/Qwen3-0.6B, -8B, -32B, -30B-A3B, -235B-A22B) were written without the
published config.json files at hand (the project's machines reach no Hub), so each key is marked by what backs it:
- the layer counts, query and KV heads, experts and experts per token are those each model card states under "Model
  Overview", tied embeddings those of the Qwen3 Technical Report's architecture tables (arXiv 2505.09388), and
  tests/test_arch.py checks every size against the parameter counts the cards
  state (0.6B / 0.44B non-embedding, 8.2B / 6.95B, 32.8B / 31.2B, 30.5B total / 3.3B active, 235B / 22B), which
  hidden_size, intermediate_size, moe_intermediate_size, head_dim and vocab_size must then also fit;
- the rest (``max_position_embeddings``, ``rope_theta``, ``rms_norm_eps``, ``max_window_layers``, the router's
  flags) is [unverified]: no test here reads them for a shape, and a wrong one changes no count the tests check.
"""

ERNIE_21B = {
    "model_type": "ernie4_5_moe",
    "hidden_size": 2560,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 20,
    "num_key_value_heads": 4,
    "head_dim": None,
    "moe_num_experts": 64,
    "moe_num_shared_experts": 2,
    "moe_k": 6,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": 27,
    "moe_layer_interval": 1,
    "vocab_size": 103424,
    "tie_word_embeddings": True,
}
ERNIE_300B = {
    **ERNIE_21B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "moe_intermediate_size": 3584,
    "num_hidden_layers": 54,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "moe_num_shared_experts": 0,
    "moe_k": 8,
    "moe_layer_start_index": 3,
    "moe_layer_end_index": 53,
}
ERNIE_03B = {
    "model_type": "ernie4_5",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 18,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": 103424,
    "tie_word_embeddings": True,
}
QWEN2 = {
    "0.5B": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "1.5B": {
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "7B": {
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "72B": {
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 29568,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
}
QWEN2 = {size: {"model_type": "qwen2", **config} for size, config in QWEN2.items()}

_QWEN3_COMMON = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3 = {
    "0.6B": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "max_window_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "8B": {
        **_QWEN3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "max_window_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "32B": {
        **_QWEN3_COMMON,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "max_window_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
}
_QWEN3_MOE_COMMON = {
    **_QWEN3_COMMON,
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
}
QWEN3_MOE = {
    "30B-A3B": {
        **_QWEN3_MOE_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "max_window_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
    },
    "235B-A22B": {
        **_QWEN3_MOE_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "max_window_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
    },
}

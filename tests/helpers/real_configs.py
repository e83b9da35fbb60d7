"""The target models' real configurations.

Transcribed from the models' published config.json files on the Hugging Face Hub: ERNIE-4.5-21B-A3B-PT,
ERNIE-4.5-300B-A47B-PT and ERNIE-4.5-0.3B-PT (baidu/), Qwen2-0.5B, Qwen2-1.5B, Qwen2-7B and Qwen2-72B (Qwen/).
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

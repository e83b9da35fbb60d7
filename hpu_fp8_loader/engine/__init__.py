"""A compact float32 reference engine for Ernie4.5 (MoE and dense) and Qwen2 on CPU.

Paddle's CPU build has no bf16 matmul kernel, and paddleformers' Ernie4.5-MoE forward fails on CPU
(its MoE layer needs the GPU kernel ``expand_modality_expert_id``), so calibration without an HPU needs
its own forward.
"""

"""A compact float32 reference engine for Ernie4.5 (MoE and dense) and Qwen2 on CPU.

Paddle has no bf16 compute on CPU and paddleformers' Ernie4.5-MoE does not run on CPU
(environment-facts.md sections 3.3 and 5), so calibration without an HPU needs its own forward.
"""

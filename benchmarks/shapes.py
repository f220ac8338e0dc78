"""The model shapes the benchmarks build with random weights (no download): the configs of
the public checkpoints they stand for, weights left out."""

from __future__ import annotations

QWEN_1P5B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
"""DeepSeek-R1-Distill-Qwen-1.5B (Qwen2 architecture, untied head): 1,777,088,000 parameters."""

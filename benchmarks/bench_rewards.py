"""Rewards for benchmarks with random weights (reward.reward_fn="bench_rewards:<function>").

A random model answers every math prompt wrongly, so the math grader scores every answer of a
group the same, every advantage is 0 and the update changes nothing (its gradient is 0). These
rewards split a group's answers instead, so the benchmark's updates are real ones. The module
imports nothing: it runs in the reward's grading processes, which find it through PYTHONPATH
(bench_scale.py puts benchmarks/ there before it starts the cluster).
"""

from __future__ import annotations

from typing import Any


def parity(prompt: str, answer: str, row: dict[str, Any]) -> float:
    """1.0 when the answer's text has an even number of characters, else 0.0: about half the
    answers of a group each way."""
    return 1.0 if len(answer) % 2 == 0 else 0.0

"""HF math_verify as the grader (reward.grader=math_verify): parse the answer (its last number
when it has no \\boxed{}), correct when it verifies against any gold solution."""

from __future__ import annotations

from collections.abc import Sequence


def grade_math_verify(answer: str, solutions: Sequence[str]) -> bool:
    """True when math_verify finds `answer` equal to any of `solutions`.

    math_verify's signal-based timeouts are turned off (they fail outside a main thread); the
    caller bounds the time, as MathReward does with its worker processes. math_verify is
    imported on first use, in the grading process.
    """
    from math_verify import parse, verify

    predicted = parse(answer, parsing_timeout=None)
    if not predicted:
        return False
    for solution in solutions:
        gold = parse(solution, parsing_timeout=None)
        if gold and verify(gold, predicted, timeout_seconds=None):
            return True
    return False

"""HF math_verify as the grader (reward.grader=math_verify): parse the answer (its last number
when it has no \\boxed{}), correct when it verifies against any gold solution."""

from __future__ import annotations

import logging
from collections.abc import Sequence


def grade_math_verify(answer: str, solutions: Sequence[str]) -> bool:
    """True when math_verify finds `answer` equal to any of `solutions`.

    math_verify's signal-based timeouts are turned off (they fail outside a main thread); the
    caller bounds the time, as MathReward does with its worker processes. math_verify is
    imported on first use (in the grading processes' forkserver, which warms the grader up).
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


class _DropTimeoutNotice(logging.Filter):
    """math_verify warns once per process that its timeout is off; here that is by design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


def quiet_timeout_notice() -> None:
    """Drop math_verify's notice that its timeout is off, in this process (once is enough)."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTimeoutNotice) for f in logger.filters):
            logger.addFilter(_DropTimeoutNotice())

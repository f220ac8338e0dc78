"""Math rewards: RLinf's grader (the default), HF math_verify, and MathReward, which grades a
batch in worker processes under a per-answer time limit.

    from rlinf_twoworker.rewards import MathReward
    with MathReward(reward_scale=1.0) as reward:
        reward.score(["... \\boxed{2}"], [["2"]])  # [1.0]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlinf_twoworker.rewards.graders import GRADERS, Grader
from rlinf_twoworker.rewards.math_verify_grader import grade_math_verify
from rlinf_twoworker.rewards.rlinf_equal import math_equal, symbolic_equal
from rlinf_twoworker.rewards.rlinf_extract import extract_answer, strip_string
from rlinf_twoworker.rewards.rlinf_grader import grade_rlinf, verdict

if TYPE_CHECKING:
    from rlinf_twoworker.workers.reward import MathReward

__all__ = [
    "GRADERS",
    "Grader",
    "MathReward",
    "extract_answer",
    "grade_math_verify",
    "grade_rlinf",
    "math_equal",
    "strip_string",
    "symbolic_equal",
    "verdict",
]


def __getattr__(name: str) -> Any:
    # MathReward lives with the reward worker, which imports this package's graders: importing
    # it on first use keeps the two from importing each other.
    if name == "MathReward":
        from rlinf_twoworker.workers.reward import MathReward

        return MathReward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

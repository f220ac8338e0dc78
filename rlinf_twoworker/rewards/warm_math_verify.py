"""Preloaded by the grading processes' forkserver of a MathReward grading with math_verify
(reward.grader=math_verify): importing it imports that grader and grades one trivial answer, so
the grading processes forked afterwards have math_verify and sympy imported already."""

from rlinf_twoworker.rewards.grading_server import warm
from rlinf_twoworker.rewards.math_verify_grader import grade_math_verify

warm(grade_math_verify)

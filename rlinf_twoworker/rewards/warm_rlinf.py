"""Preloaded by the grading processes' forkserver of a MathReward grading with RLinf's grader
(reward.grader=rlinf): importing it imports that grader and grades one trivial answer, so the
grading processes forked afterwards have sympy and the LaTeX parsers imported already."""

from rlinf_twoworker.rewards.grading_server import warm
from rlinf_twoworker.rewards.rlinf_grader import grade_rlinf

warm(grade_rlinf)

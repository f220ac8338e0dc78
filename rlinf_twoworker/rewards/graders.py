"""The graders reward.grader names: each judges one answer against its gold solutions."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rlinf_twoworker.rewards.math_verify_grader import grade_math_verify
from rlinf_twoworker.rewards.rlinf_grader import grade_rlinf

Grader = Callable[[str, Sequence[str]], bool]
"""(answer, gold solutions) -> correct; a module-level function, so worker processes unpickle it."""

GRADERS: dict[str, Grader] = {"rlinf": grade_rlinf, "math_verify": grade_math_verify}
"""reward.grader's values, the default ('rlinf': RLinf's math verifier) first."""

"""The graders reward.grader names: each judges one answer against its gold solutions; and
reward.reward_fn's user function, which gives an answer its reward instead (checked and
resolved by name here)."""

from __future__ import annotations

import importlib
import math
import numbers
import re
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

from rlinf_twoworker.errors import ConfigError
from rlinf_twoworker.rewards.math_verify_grader import grade_math_verify
from rlinf_twoworker.rewards.rlinf_grader import grade_rlinf

Grader = Callable[[str, Sequence[str]], bool]
"""(answer, gold solutions) -> correct; a module-level function, so worker processes unpickle it."""

GRADERS: dict[str, Grader] = {"rlinf": grade_rlinf, "math_verify": grade_math_verify}
"""reward.grader's values, the default ('rlinf': RLinf's math verifier) first."""


# -- reward.reward_fn: a user's Python function instead of the math grader ----------------------

RewardFunction = Callable[[str, str, dict[str, Any]], float]
"""(prompt, answer, data row) -> the answer's reward, as it is (reward.reward_scale does not
apply); reward.reward_fn names one as 'package.module:function'."""

REWARD_FN_KEY = "reward.reward_fn"
_NAME = r"[A-Za-z_]\w*"
_SPEC = re.compile(rf"{_NAME}(?:\.{_NAME})*:{_NAME}(?:\.{_NAME})*")


def reward_fn_syntax_problem(spec: str) -> str | None:
    """Why `spec` is not of the form 'package.module:function', or None. Imports nothing (the
    schema checks this on every load, on any machine, the user's code installed or not)."""
    if _SPEC.fullmatch(spec):
        return None
    return (
        "must be 'package.module:function' (a module Python can import, a colon, a function "
        "defined at the module's top level), e.g. 'my_rewards:even_length'"
    )


def resolve_reward_fn(spec: str) -> RewardFunction:
    """The function `spec` ('package.module:function') names, imported in this process.

    Raises ConfigError naming reward.reward_fn, the value and what to do when the module cannot
    be imported, lacks the name, or the name is not callable. Called by the request check on
    the Driver and by every grading process of the reward (each resolves the name itself: the
    function must be importable on the reward's node, not only where the Driver runs)."""
    problem = reward_fn_syntax_problem(spec)
    if problem is not None:
        raise ConfigError(REWARD_FN_KEY, spec, problem)
    module_name, _, attribute = spec.partition(":")
    where = f"on {socket.gethostname()}"
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(
            REWARD_FN_KEY,
            spec,
            f"module {module_name!r} cannot be imported {where} ({type(exc).__name__}: {exc}); "
            "install it, or put its directory on PYTHONPATH, in the environment Ray starts "
            "with on every node (the reward's grading processes import it by name)",
        ) from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(
                REWARD_FN_KEY,
                spec,
                f"module {module_name!r} ({getattr(sys.modules[module_name], '__file__', '?')}) "
                f"has no attribute {attribute!r}; name a function defined at its top level",
            )
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(
            REWARD_FN_KEY,
            spec,
            f"{attribute!r} in module {module_name!r} is a {type(target).__name__}, not a "
            "function; name a function fn(prompt: str, answer: str, row: dict) -> float",
        )
    return cast(RewardFunction, target)


def reward_value_problem(value: object) -> str | None:
    """Why `value`, a reward function's return, is no reward, or None. A float or an int (or a
    NumPy scalar of either) that is finite is one; a bool is refused (return 1.0 or 0.0: a
    bool is more often a grader's verdict returned by mistake), and so is anything else."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"returned {value!r} of type {type(value).__name__}, not a float"
    if not math.isfinite(float(value)):
        return f"returned {value!r}, not a finite float"
    return None

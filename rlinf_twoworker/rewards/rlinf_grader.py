"""RLinf's math grader: the verdict of RLinf's process_results for one answer and its solutions.

RLinf (7d07a42, verify.py math_verify_call/process_results) reads the answer's last \\boxed{}
(else an 'answer is' phrase; else the answer is wrong), reads each solution the same way but
takes a whole unboxed solution as it is, and calls the answer correct when math_equal holds for
ANY solution. An exception while judging one solution makes that solution not match. The time
limit is the caller's (MathReward's worker processes, reward.timeout_s, RLinf's 10 s).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec

from rlinf_twoworker.errors import TwoWorkerError
from rlinf_twoworker.rewards.rlinf_equal import math_equal
from rlinf_twoworker.rewards.rlinf_extract import extract_answer

_NO_ANSWER = ("None", "none", "")


class GraderEnvironmentError(TwoWorkerError):
    """RLinf's grader would judge otherwise than RLinf here: a package it needs is missing."""


def environment_problem() -> str | None:
    """Why this Python environment cannot grade as RLinf does, or None. Imports nothing.

    sympy's LaTeX parser runs only on antlr4-python3-runtime 4.11 (RLinf's); under another
    version it refuses every input, RLinf's rules fall through to other parsers and verdicts
    change without an error, so that is checked up front.
    """
    try:
        antlr = version("antlr4-python3-runtime")
    except PackageNotFoundError:
        antlr = "not installed"
    missing = [m for m in ("sympy", "latex2sympy2", "word2number") if find_spec(m) is None]
    if not antlr.startswith("4.11") or missing:
        return (
            f"RLinf's math grader needs antlr4-python3-runtime 4.11 (found {antlr}) and the "
            f"modules sympy, latex2sympy2, word2number (missing: {missing or 'none'}); "
            "install this package's requirements (pip install rlinf_twoworker, or -e .) in the "
            "environment that grades, or set reward.grader=math_verify"
        )
    return None


@cache
def _require_environment() -> None:
    if problem := environment_problem():
        raise GraderEnvironmentError(problem)


def verdict(answer: str, solution: str) -> tuple[bool, str, str]:
    """(correct, extracted answer, extracted solution) for one solution, as RLinf judges it."""
    try:
        extracted = extract_answer(answer)
        gold = extract_answer(solution, must_match_pattern=False)
        if extracted.strip() in _NO_ANSWER or gold.strip() in _NO_ANSWER:
            return False, extracted, gold
        return math_equal(extracted, gold), extracted, gold
    except Exception:  # RLinf scores any failure while judging as not correct
        return False, "None", "None"


def grade_rlinf(answer: str, solutions: Sequence[str]) -> bool:
    """True when `answer` matches any of `solutions` under RLinf's rules (the default grader).

    RLinf judges the solutions in parallel jobs, so a slow solution does not hide a matching
    one; here they are judged in turn and the first match ends the search.
    """
    _require_environment()  # outside verdict(), which turns every exception into 'wrong'
    return any(verdict(answer, solution)[0] for solution in solutions)

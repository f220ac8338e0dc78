"""RLinf's math grader, the default reward: RLinf's own verdicts on the reference cases, its rules
on small crafted answers, and reward.grader=math_verify still grading with math_verify."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from support import RLINF_REF

from rlinf_twoworker.config import load_config, to_typed
from rlinf_twoworker.config.settings import reward_settings
from rlinf_twoworker.errors import ConfigError
from rlinf_twoworker.rewards import (
    GRADERS,
    MathReward,
    extract_answer,
    grade_math_verify,
    grade_rlinf,
    verdict,
)
from rlinf_twoworker.workers.reward import MathReward as WorkerMathReward
from rlinf_twoworker.workers.reward import RewardWorker

CASES = RLINF_REF / "grader_cases.json"


def reference_cases() -> list[dict[str, Any]]:
    if not CASES.is_file():
        pytest.skip(f"RLinf's reference verdicts are not here: {CASES} is missing")
    cases: list[dict[str, Any]] = json.loads(CASES.read_text())["cases"]
    return cases


@pytest.fixture(scope="module")
def reward() -> Iterator[MathReward]:
    # 5 s instead of RLinf's 10 keeps the test short; the timed-out case is wrong either way.
    with MathReward(reward_scale=1.0, timeout_s=5.0, num_workers=2) as reward:
        reward.warm_up()  # imports sympy and the parsers outside the timed grading
        yield reward


def test_default_math_reward_agrees_with_rlinf_on_every_reference_case(reward: MathReward):
    cases = reference_cases()
    scores = reward.score([c["response"] for c in cases], [c["solutions"] for c in cases])
    disagree = [
        (c["id"], c["rlinf_reward"], score)
        for c, score in zip(cases, scores, strict=True)
        if score != c["rlinf_reward"]
    ]
    assert not disagree, f"{len(disagree)} of {len(cases)} differ from RLinf: {disagree}"
    timed_out = sum(c["rlinf_timed_out"] for c in cases)
    assert reward.last_stats["timed_out"] == timed_out  # RLinf's slow ones time out here too


def test_extraction_matches_rlinf_on_the_reference_cases():
    for case in reference_cases():
        assert extract_answer(case["response"]) == case["rlinf_extracted_answer"], case["id"]
        if case["rlinf_timed_out"]:
            continue  # its comparison never ends in time; the extraction is checked above
        judged = [verdict(case["response"], s) for s in case["solutions"]]
        assert [gold for _, _, gold in judged] == case["rlinf_extracted_solutions"], case["id"]
        assert any(ok for ok, _, _ in judged) == case["rlinf_correct"], case["id"]


def test_the_public_math_reward_is_the_workers():
    assert MathReward is WorkerMathReward
    assert set(GRADERS) == {"rlinf", "math_verify"}


@pytest.mark.parametrize(
    ("answer", "solution", "correct"),
    [
        # The LAST \boxed{} is the answer, whatever came before it.
        ("First \\boxed{2}, no wait: \\boxed{3}", "3", True),
        ("First \\boxed{2}, no wait: \\boxed{3}", "2", False),
        # No box: only an 'answer is' phrase gives an answer; otherwise it is wrong.
        ("so it is 42", "42", False),
        ("", "42", False),
        ("The answer is 42.", "\\boxed{42}", True),
        # sympy's LaTeX parser reads \pi as a plain symbol: never equal to a decimal.
        ("\\boxed{3.14159}", "\\pi", False),
        ("\\boxed{\\pi}", "3.14159", False),
        # Numbers are equal within a relative 1e-4.
        ("\\boxed{1.0001}", "1", True),
        ("\\boxed{1.001}", "1", False),
        # Tuples are compared in order.
        ("\\boxed{2, 3}", "3, 2", False),
        ("\\boxed{2, 3}", "\\boxed{(2, 3)}", True),
        # Fractions, decimals and a/b.
        ("\\boxed{\\dfrac{2}{4}}", "0.5", True),
        ("\\boxed{1/2}", "\\frac12", True),
        ("\\boxed{0.333}", "\\frac{1}{3}", False),
        # Percent signs are dropped, and a reference also matches x100 or /100.
        ("\\boxed{25\\%}", "25", True),
        ("\\boxed{0.25}", "25", True),
        # Text answers: \text{} is dropped, case is ignored, number words become numbers.
        ("\\boxed{\\text{Even}}", "\\text{even}", True),
        ("\\boxed{\\text{No}}", "\\text{yes}", False),
        ("\\boxed{five}", "5", True),
        # Units, degrees and a variable name are dropped; symbolic equality through sympy.
        ("\\boxed{300 \\text{ miles}}", "300", True),
        ("\\boxed{90^\\circ}", "90", True),
        ("\\boxed{x = 3}", "3", True),
        ("\\boxed{x^2-1}", "(x-1)(x+1)", True),
    ],
)
def test_rlinf_rules_on_crafted_answers(answer: str, solution: str, correct: bool):
    assert grade_rlinf(answer, [solution]) is correct


def test_any_solution_may_match():
    assert grade_rlinf("\\boxed{\\frac{1}{4}}", ["\\boxed{B}", "\\boxed{0.25}"])
    assert not grade_rlinf("\\boxed{\\frac{1}{4}}", ["\\boxed{B}", "\\boxed{0.5}"])
    assert not grade_rlinf("\\boxed{1}", [])


def test_where_math_verify_judges_otherwise():
    """The cases of issue 33 where the two graders part: RLinf's verdict is the default now."""
    for answer, solution in [("so it is 42", "42"), ("\\boxed{3, 2}", "\\boxed{2, 3}")]:
        assert grade_math_verify(answer, [solution]) and not grade_rlinf(answer, [solution])
    assert grade_rlinf("\\boxed{1.0001}", ["1"]) and not grade_math_verify("\\boxed{1.0001}", ["1"])


def test_reward_grader_selects_the_grader():
    answers, solutions = ["so it is 42", "\\boxed{1.0001}"], [["42"], ["1"]]
    expected = {"rlinf": [-5.0, 5.0], "math_verify": [5.0, -5.0]}
    for name, scores in expected.items():
        overrides = [] if name == "rlinf" else [f"reward.grader={name}"]
        worker = RewardWorker(reward_settings(to_typed(load_config(None, overrides))))
        try:
            assert worker.grader.grader is GRADERS[name]
            assert asyncio.run(worker.score(answers, solutions)).scores == scores
        finally:
            worker.grader.close()


def test_an_unknown_grader_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"reward.grader.*'sympy'.*rlinf, math_verify"):
        load_config(None, ["reward.grader=sympy"])

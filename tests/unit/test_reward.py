"""Math reward: real math_verify grading, the hard per-answer timeout, threads and asyncio."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from rlinf_twoworker.workers.reward import MathReward, grade_one

HANG = "<hang>"
BOOM = "<boom>"


def hang_or_grade(answer: str, solutions: Sequence[str]) -> bool:
    """Test grader (module level, so spawned workers can import it): HANG never finishes."""
    if answer == HANG:
        time.sleep(600)
    if answer == BOOM:
        raise RuntimeError("grader bug")
    return grade_one(answer, solutions)


@pytest.fixture(scope="module")
def reward() -> Iterator[MathReward]:
    with MathReward(reward_scale=5.0, timeout_s=10.0, num_workers=2) as r:
        yield r


def test_grade_one_real_math_verify_behaviour():
    assert grade_one("so \\boxed{42}.", ["\\boxed{42}"])
    assert grade_one("\\boxed{\\frac{1}{2}}", ["\\boxed{0.5}"])
    assert not grade_one("\\boxed{41}", ["\\boxed{42}"])
    # Without \boxed, math_verify takes the number after an "answer is" anchor, else the last one
    assert grade_one("so the answer is 42", ["\\boxed{42}"])
    assert grade_one("first 41, then 42", ["\\boxed{42}"])
    assert not grade_one("The answer is 41. Wait, actually 42", ["\\boxed{42}"])
    assert not grade_one("", ["\\boxed{42}"])
    assert not grade_one("I cannot tell", ["\\boxed{42}"])


def test_any_of_several_solutions_counts():
    assert grade_one("\\boxed{0.5}", ["\\boxed{3}", "\\frac{1}{2}"])
    assert not grade_one("\\boxed{0.5}", ["\\boxed{3}", "\\boxed{4}"])


def test_score_is_plus_or_minus_scale(reward):
    answers = ["The answer is \\boxed{42}", "\\boxed{41}", "x = \\boxed{7}", "no idea"]
    scores = reward.score(answers, [["\\boxed{42}"], ["\\boxed{42}"], ["7", "seven"], ["3"]])
    assert scores == [5.0, -5.0, 5.0, -5.0]
    stats = reward.last_stats
    assert (stats["correct"], stats["wrong"], stats["timed_out"], stats["errors"]) == (2, 2, 0, 0)
    assert stats["seconds"] > 0
    assert reward.score([], []) == []
    with pytest.raises(ValueError, match="2 answers but 1 solution lists"):
        reward.score(["a", "b"], [["1"]])


def test_score_from_a_non_main_thread(reward):
    results: list[list[float]] = []
    thread = threading.Thread(target=lambda: results.append(reward.score(["\\boxed{4}"], [["4"]])))
    thread.start()
    thread.join(timeout=60)
    assert results == [[5.0]]


def test_score_async_does_not_block_the_event_loop(reward):
    async def main() -> tuple[list[float], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        scores = await reward.score_async(["\\boxed{2}"] * 4, [["2"]] * 4)
        task.cancel()
        return scores, ticks

    scores, ticks = asyncio.run(main())
    assert scores == [5.0] * 4
    assert ticks > 0


def test_a_hanging_answer_times_out_and_later_calls_still_work():
    with MathReward(timeout_s=1.0, num_workers=1, grader=hang_or_grade) as reward:
        reward.score(["\\boxed{1}"], [["1"]])  # start the worker outside the timed call
        start = time.monotonic()
        # One worker: the answers queued behind the stuck one must still be graded.
        scores = reward.score([HANG, "\\boxed{2}", "\\boxed{3}"], [["2"], ["2"], ["3"]])
        elapsed = time.monotonic() - start
        assert scores == [-5.0, 5.0, 5.0]
        assert reward.last_stats["timed_out"] == 1 and reward.last_stats["wrong"] == 1
        assert elapsed < 1.0 + 15.0  # the timeout plus a fresh worker's start-up
        assert reward.score(["\\boxed{9}"], [["9"]]) == [5.0]
        assert reward.last_stats["timed_out"] == 0


def test_a_grader_exception_scores_wrong_and_is_counted():
    with MathReward(timeout_s=10.0, num_workers=1, grader=hang_or_grade) as reward:
        assert reward.score([BOOM, "\\boxed{1}"], [["1"], ["1"]]) == [-5.0, 5.0]
        assert reward.last_stats["errors"] == 1


def test_grader_must_be_picklable():
    with pytest.raises(ValueError, match="picklable"):
        MathReward(grader=lambda answer, solutions: True)


def test_warm_up_starts_every_grading_process_before_the_first_step():
    with MathReward(num_workers=2, timeout_s=30.0) as grader:
        grader.warm_up()
        assert len(grader._workers) == 2 and all(w.ready for w in grader._workers)
        assert grader.last_stats == {}  # the warm-up is no step's grading
        pids = {w.process.pid for w in grader._workers}
        assert grader.score(["\\boxed{2}"], [["2"]]) == [5.0]
        assert {w.process.pid for w in grader._workers} == pids  # the same processes grade


def test_a_score_during_the_warm_up_waits_for_it_and_keeps_its_own_stats():
    """The run warms the grader up in a call of its own while step 1 may already score."""
    with MathReward(num_workers=2, timeout_s=30.0) as grader:
        warming = threading.Thread(target=grader.warm_up)
        warming.start()
        assert grader.score(["\\boxed{2}", "\\boxed{3}"], [["2"], ["4"]]) == [5.0, -5.0]
        stats = dict(grader.last_stats)
        warming.join(timeout=120)
        assert not warming.is_alive()
        assert (stats["correct"], stats["wrong"], stats["errors"]) == (1, 1, 0)
        assert len(grader._workers) == 2 and all(w.ready for w in grader._workers)

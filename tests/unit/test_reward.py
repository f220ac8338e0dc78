"""Math reward: real math_verify grading, the hard per-answer timeout, threads and asyncio."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence

import psutil
import pytest

from rlinf_twoworker.rewards import grade_rlinf
from rlinf_twoworker.workers import reward as reward_module
from rlinf_twoworker.workers.reward import WARM_UP_MODULES, MathReward, grade_one

HANG = "<hang>"
BOOM = "<boom>"


def hang_or_grade(answer: str, solutions: Sequence[str]) -> bool:
    """Test grader (module level, so spawned workers can import it): HANG never finishes."""
    if answer == HANG:
        time.sleep(600)
    if answer == BOOM:
        raise RuntimeError("grader bug")
    return grade_one(answer, solutions)


PRELOADED = ("sympy", "latex2sympy2", WARM_UP_MODULES[grade_rlinf])
"""What RLinf's grader imports to grade, and its warm-up module (its server's preload)."""
linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="grading processes are forked on Linux only"
)


def imports_inherited(answer: str, solutions: Sequence[str]) -> bool:
    """Test grader: True when this grading process has what RLinf's grader imports, though it
    never imports anything itself (it grades nothing): it came with its fork, from a server
    that warmed the grader up. HANG never finishes."""
    if answer == HANG:
        time.sleep(600)
    return all(name in sys.modules for name in PRELOADED)


def parent_of(pid: int) -> int:
    return psutil.Process(pid).ppid()


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


def test_scored_async_does_not_block_the_event_loop(reward):
    async def main() -> tuple[list[float], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        scores, _ = await reward.scored_async(["\\boxed{2}"] * 4, [["2"]] * 4)
        task.cancel()
        return scores, ticks

    scores, ticks = asyncio.run(main())
    assert scores == [5.0] * 4
    assert ticks > 0


def test_calls_at_once_each_get_their_own_stats_and_seconds_that_fit_the_wall_clock(reward):
    """Two calls at once (a pipelined step's chunks): each gets the counts of its own answers,
    and their grading seconds, spent one after the other under the grader's lock, add up to no
    more than the time both took, so a step's time/reward never exceeds its time/step."""

    async def both():
        began = time.monotonic()
        calls = await asyncio.gather(
            reward.scored_async(["\\boxed{1}"] * 6, [["1"]] * 6),
            reward.scored_async(["\\boxed{1}", "\\boxed{2}"], [["2"], ["2"]]),
        )
        return calls, time.monotonic() - began

    [(first, first_stats), (second, second_stats)], wall = asyncio.run(both())
    assert first == [5.0] * 6 and (first_stats["correct"], first_stats["wrong"]) == (6, 0)
    assert second == [-5.0, 5.0] and (second_stats["correct"], second_stats["wrong"]) == (1, 1)
    assert 0 < first_stats["seconds"] + second_stats["seconds"] <= wall


def test_a_hanging_answer_times_out_and_later_calls_still_work():
    # 8 s, not 1 or 3: the fresh worker's first grading (the grader's first parse) took more
    # than 1 s, and once more than 3 s, on a CPU-starved CI runner (the suite's two jobs on two
    # cores), so an answer behind the hang timed out too.
    with MathReward(timeout_s=8.0, num_workers=1, grader=hang_or_grade) as reward:
        reward.score(["\\boxed{1}"], [["1"]])  # start the worker outside the timed call
        start = time.monotonic()
        # One worker: the answers queued behind the stuck one must still be graded.
        scores = reward.score([HANG, "\\boxed{2}", "\\boxed{3}"], [["2"], ["2"], ["3"]])
        elapsed = time.monotonic() - start
        assert scores == [-5.0, 5.0, 5.0]
        assert reward.last_stats["timed_out"] == 1 and reward.last_stats["wrong"] == 1
        assert elapsed < 8.0 + 15.0  # the timeout plus a fresh worker's start-up
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


@linux_only
def test_grading_processes_are_forks_of_a_server_that_imported_the_grader_replacements_too():
    """The first grading process and the one that replaces it after a timeout are both forked
    from this MathReward's server, with the grader's modules imported there once."""
    warm = WARM_UP_MODULES[grade_rlinf]
    with MathReward(timeout_s=2.0, num_workers=1, grader=imports_inherited, preload=[warm]) as r:
        r.warm_up()
        assert r._server is not None and r._server.pid is not None
        server = r._server.pid
        assert parent_of(server) == os.getpid()
        (first,) = [w.process.pid for w in r._workers]
        assert parent_of(first) == server
        assert r.score(["a"], [["1"]]) == [5.0]
        # One process: the answer after the stuck one is graded by its replacement.
        assert r.score([HANG, "b"], [["1"], ["1"]]) == [-5.0, 5.0]
        assert r.last_stats["timed_out"] == 1
        (second,) = [w.process.pid for w in r._workers]
        assert second != first and parent_of(second) == server
    assert not psutil.pid_exists(server)  # close() ends the server too


@linux_only
def test_a_killed_server_is_started_again_and_its_dead_processes_replaced():
    """The server killed (as by the OOM killer) ends its idle grading processes with it: the
    next call starts a new server, forks new processes and grades every answer."""
    with MathReward(num_workers=2, timeout_s=30.0) as r:
        r.warm_up()
        assert r._server is not None and r._server.pid is not None
        server, before = r._server.pid, {w.process.pid for w in r._workers}
        os.kill(server, signal.SIGKILL)
        wait_until_gone = time.monotonic() + 10
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in before):
            assert time.monotonic() < wait_until_gone, "the server's processes outlived it"
            time.sleep(0.05)
        assert r.score(["\\boxed{2}", "\\boxed{3}"], [["2"], ["4"]]) == [5.0, -5.0]
        assert r.last_stats["errors"] == 0
        assert r._server.pid not in (None, server)
        assert not before & {w.process.pid for w in r._workers}


@linux_only
def test_spawned_grading_processes_import_the_grader_themselves(monkeypatch):
    """The control of the test above: where no server is used, imports_inherited says no."""
    monkeypatch.setattr(reward_module, "forkserver_available", lambda: False)
    with MathReward(timeout_s=30.0, num_workers=1, grader=imports_inherited) as r:
        assert r._server is None
        assert r.score(["a"], [["1"]]) == [-5.0]
        assert parent_of(r._workers[0].process.pid) == os.getpid()


def test_each_configuration_preloads_its_own_grader_and_never_a_reward_fn():
    """Servers are per MathReward, so two in one process import each its own grader."""
    if not sys.platform.startswith("linux"):
        assert MathReward()._server is None
        return
    # Made, not started: no process, no server yet.
    default, math_verify = MathReward(), MathReward(grader=grade_one)
    function = MathReward(reward_fn="test_reward:imports_inherited")
    assert default._server is not None and math_verify._server is not None
    assert function._server is not None
    assert default._server.preload[-1] == WARM_UP_MODULES[grade_rlinf]
    assert math_verify._server.preload[-1] == WARM_UP_MODULES[grade_one]
    assert not any("warm" in m or "test_reward" in m for m in function._server.preload)


@linux_only
def test_a_server_that_fails_to_start_a_process_gives_way_to_spawned_ones(
    tmp_path, monkeypatch, caplog
):
    """A preload module that raises ends the server: grading goes on in spawned processes,
    with a warning that names what happened."""
    (tmp_path / "raising_preload.py").write_text("raise RuntimeError('no')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    with (
        caplog.at_level(logging.WARNING, logger=reward_module.__name__),
        MathReward(num_workers=1, timeout_s=30.0, preload=["raising_preload"]) as r,
    ):
        assert r.score(["\\boxed{2}"], [["2"]]) == [5.0]
        assert r._server is None
        assert parent_of(r._workers[0].process.pid) == os.getpid()
    assert "forkserver did not start one" in caplog.text
    assert "raising_preload" in caplog.text


MAIN = textwrap.dedent(
    """
    import os, pathlib, sys
    pathlib.Path(sys.argv[1], str(os.getpid())).touch()  # each import of this module: a marker
    from rlinf_twoworker.workers.reward import MathReward

    def odd(answer, solutions):
        return int(answer) % 2 == 1

    if __name__ == "__main__":
        with MathReward(num_workers=2, grader=odd) as reward:
            reward.warm_up()  # both processes started
            print(reward.score(["1", "2"], [["-"], ["-"]]), len(os.listdir(sys.argv[1])))
        with MathReward(num_workers=2) as reward:
            reward.warm_up()
            print(reward.score(["\\\\boxed{2}"] * 2, [["2"]] * 2), len(os.listdir(sys.argv[1])))
    """
)


@linux_only
def test_grading_processes_import_the_main_module_only_for_a_grader_defined_there(tmp_path):
    """A script's grader works as with spawned processes, which import the main module; with
    a grader of its own module a process skips it (a Ray worker's main imports ray)."""
    script, markers = tmp_path / "main.py", tmp_path / "markers"
    script.write_text(MAIN)
    markers.mkdir()
    run = subprocess.run(
        [sys.executable, str(script), str(markers)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["[5.0, -5.0] 3", "[5.0, 5.0] 3"], run.stdout

"""Long use leaks nothing: the reward's grading processes die with the reward actor; a stalled
storage delays neither status() nor failure detection. On a real 2-node Ray cluster. (That
polling a step's future costs the controller one call however often it is polled is checked
on test_engine's cancelled run.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
from support import ONE_RANK

from rlinf_twoworker import ComponentError, run_grpo_two_worker
from rlinf_twoworker.api.demo import demo_config
from rlinf_twoworker.workers.reward import MathReward, RewardWorker

# Classes injected into a run travel by value: the workers cannot import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TIMEOUT = 300
ANSWER_S = 1.0
"""status() must answer within this (a correctness bound: it reads fields, it waits on nothing)."""
GRADERS = Path(tempfile.mkdtemp(prefix="rlinf-long-use-"))
# A grader module the grading processes can import (they unpickle the grader by name; their
# forkserver does not import it): it leaves a marker named by its pid, then grades for two
# minutes.
(GRADERS / "busy").mkdir()
(GRADERS / "hanging_grader.py").write_text(
    "import os, pathlib, time\n\n\n"
    "def grade(answer, solutions):\n"
    "    (pathlib.Path(__file__).parent / 'busy' / str(os.getpid())).touch()\n"
    "    time.sleep(120)\n"
    "    return False\n"
)


@pytest.fixture(scope="module")
def inputs(demo_inputs):
    return demo_inputs


class HangingReward(RewardWorker):
    """Grades with hanging_grader: its grading processes are busy when the test kills it."""

    def __init__(self, settings, rank=0):  # type: ignore[no-untyped-def]
        super().__init__(settings, rank)
        sys.path.insert(0, str(GRADERS))
        from hanging_grader import grade  # type: ignore[import-not-found]

        self.grader = MathReward(settings.reward.reward_scale, 600.0, grader=grade)


# ---- helpers ---------------------------------------------------------------------------------


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {timeout:g} s")
        time.sleep(0.2)
    return value


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    value = call()
    return value, time.monotonic() - started


def row(handle, component: str, rank: int) -> dict:
    return next(r for r in handle.topology() if (r["component"], r["rank"]) == (component, rank))


def components_ready(handle) -> bool:
    return handle.status()["phase"].startswith(("step", "validation", "checkpoint"))


def proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command (state, ppid, ...); None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"  # a zombie is dead, waiting for its reaping


def blocked_on_fifo(pid: int) -> bool:
    """A thread of `pid` waits in open() of a FIFO for a reader (Linux: wchan)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "wchan").read_text() == "wait_for_partner":
                return True
        except OSError:
            continue
    return False


def unstall(fifo: Path, kept: Path, timeout: float = 10) -> str:
    """Move the FIFO aside and put the real file back in its place, then open the FIFO for
    reading (the write blocked on it goes on) and return what came through it. In that order,
    every open after the blocked one lands in the real file: reading first would let a fast
    writer open the FIFO again before the file is back, and its lines would be piped away."""
    aside = fifo.with_name(fifo.name + ".stalled")
    os.replace(fifo, aside)  # the blocked open() already holds the FIFO itself, not its name
    os.replace(kept, fifo)
    reader = os.open(aside, os.O_RDONLY | os.O_NONBLOCK)
    try:
        piped, deadline = b"", time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = os.read(reader, 1 << 16)
            except BlockingIOError:  # a writer holds the FIFO open: more may come
                chunk = None
            if chunk == b"" and piped:  # its writer is done
                break
            piped += chunk or b""
            time.sleep(0.05)
        return piped.decode(errors="replace")
    finally:
        os.close(reader)
        os.unlink(aside)


# ---- the tests -------------------------------------------------------------------------------


PARENT = """
import sys
sys.path.insert(0, sys.argv[1])
from hanging_grader import grade
from rlinf_twoworker.workers.reward import MathReward
MathReward(timeout_s=600.0, num_workers=2, grader=grade).score(["1", "2"], [["1"], ["2"]])
"""


def parent_of(pid: int) -> int | None:
    stat = proc_stat(pid)
    return None if stat is None else int(stat[1])


def descends_from(pid: int, holder: int) -> bool:
    """`pid` is a child of `holder`, or a child's child...: the grading processes are forked
    by their MathReward's forkserver, itself a child of the process that holds the reward."""
    while (parent := parent_of(pid)) not in (None, 0, 1):
        if parent == holder:
            return True
        pid = parent
    return False


def graders_of(holder: int) -> list[int]:
    """The busy grading processes that descend from `holder`."""
    busy = [int(p.name) for p in (GRADERS / "busy").iterdir()]
    return [pid for pid in busy if descends_from(pid, holder)]


def with_servers(graders: list[int], holder: int) -> list[int]:
    """`graders` and the processes between them and `holder` (their forkserver): all that must
    end with `holder`."""
    between = set()
    for pid in graders:
        while (parent := parent_of(pid)) not in (None, 0, 1, holder):
            between.add(parent)
            pid = parent
    return graders + sorted(between)


def test_grading_processes_die_with_their_parent_killed_mid_grading():
    """The library's own guarantee, whatever process holds the reward (Ray's per-worker
    process groups also end a killed actor's children, on Ray's default settings): grading
    processes, and the forkserver they are forked from, killed with their parent's SIGKILL
    while they grade, not left to finish."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(GRADERS)])
    try:
        graders = wait_until(
            lambda: len(graders_of(parent.pid)) == 2 and graders_of(parent.pid),
            120,
            "two busy graders",
        )
        graders = with_servers(graders, parent.pid)
    finally:
        parent.kill()
        parent.wait(timeout=30)
    try:
        wait_until(lambda: not [p for p in graders if alive(p)], 10, "the graders' end")
    finally:
        for pid in [p for p in graders if alive(p)]:
            os.kill(pid, signal.SIGKILL)  # this test's own graders, left by a failure


def test_grading_processes_die_with_a_killed_reward_actor(cluster_2x2, inputs, tmp_path):
    """SIGKILL of the reward actor while its grading processes grade: none outlives it (nor
    their forkserver), and the run fails naming the reward."""
    cfg = demo_config(
        inputs, tmp_path, "orphans", [*ONE_RANK, "runner.timeouts.failure_detection_s=30"]
    )
    handle = run_grpo_two_worker(cfg, component_classes={"reward": HangingReward})
    wait_until(lambda: components_ready(handle), TIMEOUT, "the components")
    victim = row(handle, "reward", 0)
    graders = wait_until(lambda: graders_of(victim["pid"]), TIMEOUT, "the actor's busy graders")
    graders = with_servers(graders, victim["pid"])
    try:
        os.kill(victim["pid"], signal.SIGKILL)
        wait_until(lambda: not [p for p in graders if alive(p)], 10, "the graders' end")
    finally:
        for pid in [p for p in graders if alive(p)]:
            os.kill(pid, signal.SIGKILL)  # this test's own graders, left by a failure
    with pytest.raises(ComponentError) as failed:
        handle.result(timeout=60)
    assert (failed.value.component, failed.value.rank) == ("reward", 0), failed.value


def test_a_stalled_log_write_blocks_neither_status_nor_failure_detection(
    cluster_2x2, inputs, tmp_path
):
    """log/main.log turned into a FIFO nobody reads: the controller's next write to it blocks
    in open() for real, as on a stalled mount. status() still answers at once, a killed
    component still fails the run within failure_detection_s, and the run's record (its lines,
    in order, and failure.json) is written once the storage answers again."""
    run_id = "stalled-log"
    cfg = demo_config(
        inputs,
        tmp_path,
        run_id,
        [
            *ONE_RANK,
            "runner.max_steps=4",
            "runner.save_interval=-1",
            "runner.timeouts.failure_detection_s=30",
        ],
    )
    handle = run_grpo_two_worker(cfg)
    ray.get(handle.step(1), timeout=TIMEOUT)
    controller = handle.status()["controller_pid"]
    main_log = tmp_path / run_id / "log" / "main.log"
    kept = main_log.with_name("main.log.kept")
    os.replace(main_log, kept)
    os.mkfifo(main_log)
    try:
        wait_until(lambda: blocked_on_fifo(controller), TIMEOUT, "a write blocked on main.log")
        status, seconds = timed(handle.status)
        assert seconds < ANSWER_S and status["state"] == "running", (seconds, status)
        victim = row(handle, "reward", 0)
        killed_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        with pytest.raises(ComponentError) as failed:
            handle.result(timeout=30)
        assert time.monotonic() - killed_at < 30
        assert (failed.value.component, failed.value.rank) == ("reward", 0), failed.value
        assert not (tmp_path / run_id / "failure.json").exists()  # held behind the stall
    finally:
        piped = unstall(main_log, kept)
    assert piped.strip()  # the line the stall held, written once it ended
    line = "RUN_FAILED error=ComponentError: component reward rank 0"
    wait_until(lambda: line in main_log.read_text(), 30, "the failure's line after the stall")
    wait_until((tmp_path / run_id / "failure.json").exists, 30, "failure.json")

"""Math reward: +scale when the grader finds the answer equal to a gold solution, else -scale.

The grader is RLinf's (rewards.rlinf_grader, the default) or HF math_verify (reward.grader).

Grading runs in a few worker processes, one answer per worker at a time, for one reason: a hard
per-answer timeout (RLinf's is 10 s). math_verify's own timeouts use signal.alarm, which works
only in a process's main thread, and a Ray actor method (or `asyncio.to_thread`) is not one;
RLinf's grader sets none. A worker that runs past `timeout_s` is killed, its answer scored wrong,
and a fresh worker takes its place, so a pathological expression cannot stall later steps.

The workers are forked from a forkserver of the MathReward's own (rewards/grading_server.py, on
Linux): it imports the grader and grades one trivial answer once (rewards/warm_rlinf.py or
warm_math_verify.py), so each worker, the first ones and each replacement of a killed one,
starts with sympy and the parsers imported instead of importing them afresh (about a CPU-second
each); nor does it run the main module as spawned processes do (a Ray worker's imports ray),
unless the grader or reward_fn is defined there. Each worker dies with the process that holds
the MathReward, even SIGKILLed while it grades (_die_with_parent). Where the forkserver cannot
be used (not Linux, or it failed to start a worker: a warning says so) they are spawned as
fresh interpreters instead.

reward.reward_fn ('package.module:function') replaces the grader with a user's function,
fn(prompt, answer, row) -> float, run in the same processes under the same limit: each process
imports it by name when it starts (so it must be importable on the reward's node; the forkserver
does not import it: a user's module may not import there, or not safely before a fork), an
answer past reward.timeout_s scores 0.0, and its float is the reward as it is (no reward_scale).
Unlike a math grader's exception, which scores the answer wrong, a user function that raises,
returns no finite float, or kills its process fails the step with the traceback: that is a bug
in the function, and scoring it 0 would let it pass as a low reward.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from rlinf_twoworker.config.settings import RewardSettings
from rlinf_twoworker.errors import ConfigError, TwoWorkerError
from rlinf_twoworker.rewards.graders import (
    GRADERS,
    REWARD_FN_KEY,
    RewardFunction,
    resolve_reward_fn,
    reward_fn_syntax_problem,
    reward_value_problem,
)
from rlinf_twoworker.rewards.grading_server import (
    WARM_UP_ANSWER,
    GradingServer,
    die_with_parent_thread,
    forkserver_available,
    forkserver_pid,
    release_alive_pipe,
)
from rlinf_twoworker.rewards.math_verify_grader import grade_math_verify, quiet_timeout_notice
from rlinf_twoworker.rewards.rlinf_grader import environment_problem, grade_rlinf

if TYPE_CHECKING:
    from rlinf_twoworker.messages import Graded, PromptRow

Grader = Callable[[str, Sequence[str]], bool]
_STARTUP_TIMEOUT_S = 120.0
"""A worker must start (and answer 'ready') within this time."""


class RewardError(TwoWorkerError):
    """The reward's grading workers could not be started."""


class RewardFunctionError(TwoWorkerError):
    """reward.reward_fn raised, returned no finite float, or ended its grading process: a bug
    in the user's function, which fails the step (the message holds the traceback)."""


TIMED_OUT_REWARD = 0.0
"""The reward of an answer whose reward.reward_fn call ran past reward.timeout_s."""
_TRACEBACK_CHARS = 6000
"""A reward function's traceback is cut to its last this many characters (deep recursion)."""


grade_one = grade_math_verify
"""The math_verify grader under its former name (reward.grader=math_verify)."""

WARM_UP_MODULES: dict[Grader, str] = {
    grade_rlinf: "rlinf_twoworker.rewards.warm_rlinf",
    grade_math_verify: "rlinf_twoworker.rewards.warm_math_verify",
}
"""The module whose import in the forkserver warms each built-in grader up."""


def _die_with_parent(parent_pid: int | None) -> None:
    """Make this grading process die with the process that holds its MathReward, even killed
    with SIGKILL while it grades (an idle one also ends on its pipe's EOF). On Linux the kernel
    sends SIGKILL when this process's parent thread ends, and a parent that died before prctl
    is seen by the parent pid not being the expected one:

    - forked by the MathReward's forkserver (`parent_pid` None): the parent is the forkserver,
      whose pid it recorded before the fork, and which ends with the holder (its own
      PR_SET_PDEATHSIG on the holder's starting thread, and the EOF of its alive pipe, whose
      copy this process closes: rewards/grading_server.py);
    - spawned (`parent_pid`: the holder's pid): the parent is the holder, and the thread that
      started this process one MathReward keeps for that."""
    expected = parent_pid
    if expected is None:  # the server's pid; without its preload, the parent as found now
        expected = forkserver_pid() or os.getppid()
    die_with_parent_thread("grading process")
    if parent_pid is None:
        release_alive_pipe()
    if os.getppid() != expected:
        os._exit(0)


def _worker_main(
    conn: Connection, grader: Grader, parent_pid: int | None, reward_fn: str | None = None
) -> None:
    """Loop of a grading process: receive (answer, solutions), send (correct, error or None).

    `parent_pid`: the pid of the process holding the MathReward when spawned, None when
    forked by its forkserver (_die_with_parent). With `reward_fn`, resolved here by name (each
    process imports it itself; the forkserver does not): receive (prompt, answer, row), send
    (reward, None) or (None, why there is none); a name that does not resolve here is sent as
    ("failed", why) instead of "ready"."""
    _die_with_parent(parent_pid)
    quiet_timeout_notice()
    judge: RewardFunction | None = None
    if reward_fn is not None:
        try:
            judge = resolve_reward_fn(reward_fn)
        except Exception as exc:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
            return
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if task is None:
            return
        if judge is not None:
            conn.send(_call_reward_fn(judge, *task))
            continue
        try:
            conn.send((bool(grader(*task)), None))
        except Exception as exc:  # a grader bug must not kill the worker
            conn.send((False, f"{type(exc).__name__}: {exc}"))


def _call_reward_fn(
    fn: RewardFunction, prompt: str, answer: str, row: dict[str, Any]
) -> tuple[float | None, str | None]:
    """(the reward, None), or (None, what went wrong: the traceback, or the value refused)."""
    try:
        value = fn(prompt, answer, row)
    except Exception:
        trace = traceback.format_exc()[-_TRACEBACK_CHARS:]
        return None, f"raised on the answer {_preview(answer)}:\n{trace}"
    problem = reward_value_problem(value)
    if problem is not None:
        return None, f"{problem} for the answer {_preview(answer)}"
    return float(value), None


def _preview(text: str, chars: int = 80) -> str:
    """The start of an answer, for an error that must say which one without quoting it all."""
    return repr(text if len(text) <= chars else text[:chars] + "...")


@dataclass
class _Worker:
    process: Any
    conn: Connection
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    task: int | None = None
    """Index of the answer being graded; None when idle."""

    def stop(self, kill: bool) -> None:
        if kill or not self.ready:
            self.process.kill()
        else:
            try:
                self.conn.send(None)
            except OSError:
                self.process.kill()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()


class MathReward:
    """Scores answers against gold solutions under a hard per-answer timeout.

    `grader` judges one answer against its solutions: RLinf's (grade_rlinf, the default) or
    math_verify's (grade_one), or any picklable module-level function (tests make one hang).
    `preload`: the modules the grading processes' forkserver imports once before it forks
    them; by default the built-in grader's warm-up (WARM_UP_MODULES), nothing for another
    grader or reward_fn, whose modules each process imports itself. Name a module here only if
    importing it before a fork is safe (it starts no threads); one that does not import there
    is passed over, one whose import fails otherwise makes the grading processes spawned.
    `reward_fn` ('package.module:function', reward.reward_fn) replaces the grader: score() then
    needs each answer's PromptRow and returns the function's values as they are (reward_scale
    unused), 0.0 for an answer past timeout_s, and raises RewardFunctionError when the function
    raises, returns no finite float, or ends its process.
    `last_stats` describes the latest score() call: correct + wrong is the number of answers; timed_out and errors (grader exceptions, dead workers) are counted among
    the wrong ones; seconds is the call's wall time (under reward_fn: correct counts the
    rewards > 0). Thread-safe: calls are serialised.
    """

    def __init__(
        self,
        reward_scale: float = 5.0,
        timeout_s: float = 10.0,
        num_workers: int | None = None,
        grader: Grader = grade_rlinf,
        reward_fn: str | None = None,
        *,
        preload: Sequence[str] | None = None,
    ) -> None:
        if reward_fn is not None and (problem := reward_fn_syntax_problem(reward_fn)):
            raise ConfigError(REWARD_FN_KEY, reward_fn, problem)
        if timeout_s <= 0:
            raise ValueError(f"reward.timeout_s={timeout_s} must be > 0")
        try:
            pickle.dumps(grader)
        except Exception as exc:
            raise ValueError(
                f"grader {grader!r} must be picklable (a module-level function): {exc}"
            ) from exc
        if reward_fn is None and grader is grade_rlinf and (problem := environment_problem()):
            raise RewardError(f"math reward on {os.uname().nodename}: {problem}")
        self.reward_scale, self.timeout_s, self.grader = reward_scale, timeout_s, grader
        self.reward_fn = reward_fn
        self._missed: Any = False if reward_fn is None else TIMED_OUT_REWARD
        """An answer's result until its process answers (what a timed-out answer keeps)."""
        self.num_workers = num_workers or min(4, os.cpu_count() or 1)
        self.last_stats: dict[str, float] = {}
        self._workers: list[_Worker] = []
        self._ctx = multiprocessing.get_context("spawn")
        # A forkserver of this object's own, not multiprocessing's process-wide one, whose
        # preload list is one per process: several MathRewards of one process (tests) each
        # import their own grader, and nothing else that forks from a forkserver here shares it.
        self._server: GradingServer | None = None
        if forkserver_available():
            if preload is None:
                warm = WARM_UP_MODULES.get(grader) if reward_fn is None else None
                preload = [warm] if warm else []
            modules = ["rlinf_twoworker.rewards.grading_server", __name__]
            self._server = GradingServer([*modules, *preload])
        # A grader or function defined in the main module needs it imported in each process.
        self._import_main = getattr(grader, "__module__", None) == "__main__" or (
            reward_fn is not None and reward_fn.partition(":")[0] == "__main__"
        )
        self._lock = threading.Lock()
        # The grading processes (and their forkserver) die when the thread that started them
        # ends (_die_with_parent): this one lives as long as this object, whichever threads
        # call score() and warm_up().
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="math-grader-start")

    def score(
        self,
        answers: Sequence[str],
        solutions: Sequence[Sequence[str]],
        rows: Sequence[PromptRow] | None = None,
    ) -> list[float]:
        """+reward_scale for each answer that matches one of its solutions, else -reward_scale;
        under reward_fn, the function's value for each answer and its `rows` entry."""
        return self.scored(answers, solutions, rows)[0]

    def scored(
        self,
        answers: Sequence[str],
        solutions: Sequence[Sequence[str]],
        rows: Sequence[PromptRow] | None = None,
    ) -> tuple[list[float], dict[str, float]]:
        """score()'s values and this call's own stats (last_stats may be a later call's by
        the time a caller reads it); `seconds` is the grading's own time, under the lock, so
        the seconds of calls that waited for one another add up to no more than the wall
        clock."""
        if len(answers) != len(solutions):
            raise ValueError(f"{len(answers)} answers but {len(solutions)} solution lists")
        if self.reward_fn is not None:
            return self._score_with_function(answers, rows)
        correct, stats = self._graded(list(zip(answers, solutions, strict=True)), bool)
        return [self.reward_scale if ok else -self.reward_scale for ok in correct], stats

    def _score_with_function(
        self, answers: Sequence[str], rows: Sequence[PromptRow] | None
    ) -> tuple[list[float], dict[str, float]]:
        if rows is None or len(rows) != len(answers):
            raise ValueError(
                f"reward.reward_fn needs each answer's prompt and data row: {len(answers)} "
                f"answers but {'no' if rows is None else len(rows)} rows"
            )
        tasks = [(r.prompt, answer, r.row) for answer, r in zip(answers, rows, strict=True)]
        values, stats = self._graded(tasks, lambda value: value > 0)
        return [float(v) for v in values], stats

    def _graded(
        self, tasks: list[tuple[Any, ...]], counts_correct: Callable[[Any], bool]
    ) -> tuple[list[Any], dict[str, float]]:
        """Grade `tasks` under the lock: their results and this call's stats, which become
        last_stats (`correct`: the results `counts_correct` accepts)."""
        with self._lock:
            start = time.monotonic()
            results, timed_out, errors = self._grade_all(tasks)
            correct = sum(1 for r in results if counts_correct(r))
            stats = {
                "correct": correct,
                "wrong": len(results) - correct,
                "timed_out": timed_out,
                "errors": errors,
                "seconds": time.monotonic() - start,
            }
            self.last_stats = stats
        return results, stats

    async def scored_async(
        self,
        answers: Sequence[str],
        solutions: Sequence[Sequence[str]],
        rows: Sequence[PromptRow] | None = None,
    ) -> tuple[list[float], dict[str, float]]:
        """scored() in a thread, so an async actor's event loop keeps serving other calls."""
        return await asyncio.to_thread(self.scored, answers, solutions, rows)

    def warm_up(self) -> None:
        """Start every grading process and grade one trivial answer in each (the grader's
        imports), so the run's first step does not wait for them. Under the lock throughout:
        a score() meanwhile waits, and its stats are never this warm-up's."""
        with self._lock:
            if self.reward_fn is None:
                # An answer either grader parses as LaTeX and compares through sympy, so that
                # each process has imported all it grades with (forked ones have, from their
                # server's warm-up: this is then a check that each one answers).
                self._grade_all([WARM_UP_ANSWER] * self.num_workers)
            else:  # each imports the function as it starts; calling it on no data means nothing
                self._top_up(self.num_workers)
            counts = {"timed_out": 0, "errors": 0}
            # The ones that got no answer may still be importing: wait for them.
            while any(not w.ready for w in self._workers):
                self._collect([], counts)
                self._reap_overdue(counts)

    def close(self) -> None:
        """Stop the grading processes and their forkserver (score() starts new ones if called
        again)."""
        with self._lock:
            for worker in self._workers:
                worker.stop(kill=worker.task is not None)
            self._workers.clear()
            if self._server is not None:
                self._server.stop()

    def __enter__(self) -> MathReward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the worker pool ------------------------------------------------------------------------

    def _grade_all(self, tasks: Sequence[tuple[Any, ...]]) -> tuple[list[Any], int, int]:
        """Grade every task; returns (correct per task, or the reward under reward_fn;
        timed-out count, error count)."""
        correct: list[Any] = [self._missed] * len(tasks)
        pending = deque(range(len(tasks)))
        counts = {"timed_out": 0, "errors": 0}
        try:
            while pending or any(w.task is not None for w in self._workers):
                self._top_up(len(pending))
                self._dispatch(pending, tasks)
                self._collect(correct, counts)
                self._reap_overdue(counts)
        except BaseException:
            # A busy worker's late result would be credited to the next call's answer.
            for worker in [w for w in self._workers if w.task is not None]:
                self._drop(worker, kill=True)
            raise
        return correct, counts["timed_out"], counts["errors"]

    def _top_up(self, backlog: int) -> None:
        """Start workers (lazily, and to replace killed ones) up to num_workers."""
        wanted = min(self.num_workers, backlog + sum(w.task is not None for w in self._workers))
        while len(self._workers) < wanted:
            self._workers.append(self._start())

    def _start(self) -> _Worker:
        """A grading process, started from the thread kept for that: forked by the
        forkserver, or spawned where there is none or it failed to start this one."""
        if self._server is not None:
            parent, child = self._ctx.Pipe()
            process = self._server.process(
                _worker_main,
                (child, self.grader, None, self.reward_fn),
                "math-grader",
                import_main=self._import_main,
            )
            try:
                self._starter.submit(process.start).result(timeout=_STARTUP_TIMEOUT_S)
                return _Worker(process, parent)
            except Exception as exc:
                # The server exited (an import in its preload raised, it was killed) or hangs
                # in its preload: grade with spawned processes, which report what they meet.
                parent.close()
                server, self._server = self._server, None
                server.stop()  # also ends a start() still waiting for the server's answer
                logging.getLogger(__name__).warning(
                    "math reward on %s: its grading processes' forkserver did not start one "
                    "(%s: %s; the server's own traceback, if any, is in this process's "
                    "stderr; its preload: %s); spawning them instead, each importing the "
                    "grader itself",
                    os.uname().nodename,
                    type(exc).__name__,
                    str(exc) or f"no answer within {_STARTUP_TIMEOUT_S:.0f} s",
                    ", ".join(server.preload),
                )
            finally:
                child.close()
        parent, child = self._ctx.Pipe()
        try:
            process = self._ctx.Process(
                target=_worker_main,
                args=(child, self.grader, os.getpid(), self.reward_fn),
                daemon=True,
                name="math-grader",
            )
            self._starter.submit(process.start).result(timeout=_STARTUP_TIMEOUT_S)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        return _Worker(process, parent)

    def _dispatch(self, pending: deque[int], tasks: Sequence[tuple[Any, ...]]) -> None:
        for worker in list(self._workers):
            if pending and worker.ready and worker.task is None:
                index = pending.popleft()
                if self.reward_fn is not None:
                    task: tuple[Any, ...] = tasks[index]  # (prompt, answer, row)
                else:
                    answer, solutions = tasks[index]
                    task = (answer, list(solutions))
                try:
                    worker.conn.send(task)
                except OSError:
                    # It died idle (killed; forked ones also with their server): not this
                    # answer's doing, which goes to another (the next _top_up replaces it).
                    pending.appendleft(index)
                    self._drop(worker, kill=True)
                    continue
                worker.task, worker.started = index, time.monotonic()

    def _collect(self, correct: list[Any], counts: dict[str, int]) -> None:
        """Wait (at most until the nearest deadline) for results and ready signals."""
        waiting = [w for w in self._workers if w.task is not None or not w.ready]
        if not waiting:
            return
        now = time.monotonic()
        timeout = max(0.0, min(self._deadline(w) for w in waiting) - now)
        by_conn: dict[Any, _Worker] = {w.conn: w for w in waiting}
        for conn in wait(list(by_conn), timeout=timeout):
            worker = by_conn[conn]
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                self._on_dead(worker, counts, len(correct))
                continue
            if message == "ready":
                worker.ready = True
            elif not worker.ready:  # ("failed", why): reward_fn does not resolve there
                self._drop(worker, kill=True)
                raise RewardError(
                    f"a grading process on {os.uname().nodename} cannot use {REWARD_FN_KEY}="
                    f"{self.reward_fn}: {message[1]}"
                )
            elif worker.task is not None:
                ok, error = message
                index, worker.task = worker.task, None
                if error is not None and self.reward_fn is not None:
                    raise RewardFunctionError(self._function_failure(index, len(correct), error))
                correct[index] = ok
                counts["errors"] += error is not None

    def _function_failure(self, index: int, answers: int, error: str) -> str:
        return (
            f"{REWARD_FN_KEY} {self.reward_fn} failed on answer {index} (of {answers} in this "
            f"grading call) on {os.uname().nodename}: it {error.rstrip()}\nA reward function "
            "must return a finite float for every answer; fix the function (a failure stops "
            "the run rather than scoring 0, which would hide the bug as a low reward)"
        )

    def _on_dead(self, worker: _Worker, counts: dict[str, int], answers: int) -> None:
        self._drop(worker, kill=True)
        if self.reward_fn is not None and worker.ready and worker.task is not None:
            raise RewardFunctionError(
                self._function_failure(
                    worker.task,
                    answers,
                    f"ended its grading process (exit code {worker.process.exitcode}) instead of "
                    "returning",
                )
            )
        if self.reward_fn is not None and not worker.ready:
            raise RewardError(
                f"a grading process on {os.uname().nodename} exited while importing "
                f"{REWARD_FN_KEY}={self.reward_fn} (exit code {worker.process.exitcode}); "
                "importing the function's module must not end the process"
            )
        if not worker.ready:
            raise RewardError(
                f"a math grading process exited while starting (exit code "
                f"{worker.process.exitcode}); the grader must be importable by its module's "
                "name in a process started for it, and its packages (sympy, latex2sympy2, "
                "math_verify) installed on this node"
            )
        counts["errors"] += 1  # its answer stays scored wrong

    def _reap_overdue(self, counts: dict[str, int]) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if now < self._deadline(worker) or (worker.ready and worker.task is None):
                continue
            self._drop(worker, kill=True)
            if not worker.ready:
                raise RewardError(
                    f"a math grading process did not start within {_STARTUP_TIMEOUT_S:.0f} s; "
                    "the node may be overloaded"
                )
            counts["timed_out"] += 1

    def _deadline(self, worker: _Worker) -> float:
        limit = self.timeout_s if worker.ready else _STARTUP_TIMEOUT_S
        return worker.started + limit

    def _drop(self, worker: _Worker, kill: bool) -> None:
        self._workers.remove(worker)
        worker.stop(kill=kill)


class RewardWorker:
    """Math grading (or reward.reward_fn) as a component; grading runs off the actor's event
    loop."""

    def __init__(self, settings: RewardSettings, rank: int = 0) -> None:
        self.began = time.time()  # the process started and imported its worker module
        self.settings = settings
        reward = settings.reward
        self.grader = MathReward(
            reward.reward_scale,
            reward.timeout_s,
            grader=GRADERS[reward.grader],
            reward_fn=reward.reward_fn,
        )
        self.rank = rank

    async def warm_up_grader(self) -> dict[str, Any]:
        """Start the grading processes and wait for each to answer: the run's call right after
        the constructor (components.Component.prepare), while the others load their models
        and step 1 generates; a score() meanwhile waits for it (the grader's lock)."""
        start = time.perf_counter()
        await asyncio.to_thread(self.grader.warm_up)
        return {"seconds": {"grader_start": time.perf_counter() - start}, "cache": []}

    async def score(
        self, answers: list[str], solutions: list[list[str]], rows: list[PromptRow] | None = None
    ) -> Graded:
        """`rows` (each answer's prompt and data row) come only with reward.reward_fn."""
        from rlinf_twoworker.messages import Graded

        scores, stats = await self.grader.scored_async(answers, solutions, rows)
        if self.grader.reward_fn is not None and stats["timed_out"]:
            logging.getLogger(__name__).warning(
                "%d of %d answers scored %s: %s=%s ran past reward.timeout_s=%s s on them",
                stats["timed_out"],
                len(answers),
                TIMED_OUT_REWARD,
                REWARD_FN_KEY,
                self.grader.reward_fn,
                self.grader.timeout_s,
            )
        return Graded(scores, stats)

    def startup_report(self) -> dict[str, Any]:
        """The process's start (its grading processes': warm_up_grader); no model."""
        from rlinf_twoworker.workers.process import process_times

        return {**process_times(self.began), "seconds": {}}


# For mypy: RewardWorker is what the run asks of the reward (workers/contract.py).
if TYPE_CHECKING:
    from rlinf_twoworker.workers import contract

    _grader: type[contract.Grader] = RewardWorker

"""The controller's storage calls, off its event loop, in the order they are made.

The run directory lives on shared storage, and a stalled mount blocks a file call for as
long as it stalls. The controller's event loop answers `status()`, `cancel()` and the
futures and runs the watchdog, so it never makes such a call itself: its log lines, resume
scan, data state, TensorBoard writes and failure record all go to one thread of the run's
own, one after the other (a log line before the metrics written after it, the failure's
lines before failure.json). A stalled storage then delays only the calls behind it.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from rlinf_twoworker.errors import RunDirError
from rlinf_twoworker.run.tasks import background
from rlinf_twoworker.storage.rundir import MAIN_LOG, RunLog, write_failure

T = TypeVar("T")
_here = threading.local()  # `on` is True in a StorageIO's thread


class QueuedLog(RunLog):
    """A RunLog whose lines are written by the storage thread, in the order they are logged
    (from any thread); logged in the storage thread itself, a line is written at once, so a
    function run there (`StorageIO.call`) sees its own lines on disk when it returns."""

    def __init__(self, run_dir: Path, pool: ThreadPoolExecutor) -> None:
        super().__init__(run_dir)
        self._pool = pool
        self.failed: OSError | None = None
        """The first queued write that failed (the next StorageIO.call raises it)."""

    def _append(self, relative: str, line: str) -> None:
        if getattr(_here, "on", False):
            super()._append(relative, line)
        else:
            self.later(RunLog._append, self, relative, line)

    def later(self, fn: Callable[..., Any], *args: Any) -> None:
        """fn(*args) in the storage thread after what is queued, not waited for."""
        self._pool.submit(self._kept, fn, *args)

    def _kept(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except OSError as exc:  # nobody waits for it: the controller's next call raises it
            self.failed = self.failed or exc


class StorageIO:
    """One thread for one run's storage calls: `call` them from the event loop, log with
    `log`, or queue a call nobody waits for with `log.later`. The thread lives as long as
    the controller (no call is refused late)."""

    def __init__(self, run_dir: Path, run_id: str) -> None:
        self.run_dir = Path(run_dir)
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix=f"{run_id}:storage", initializer=_mark_storage_thread
        )
        self.log = QueuedLog(self.run_dir, self._pool)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) in the storage thread, after every call queued before; raises
        a queued write's failure first (the run's record is incomplete without it)."""
        result = await asyncio.wrap_future(self._pool.submit(fn, *args, **kwargs))
        if self.log.failed is not None:
            raise RunDirError(
                f"cannot write the run's log or metrics under {self.run_dir}: "
                f"{self.log.failed}; check that the shared storage is mounted, writable and "
                "not full"
            ) from self.log.failed
        return result

    async def record_failure(
        self, exc: BaseException, state: str, step: int | None, timeout: float
    ) -> bool:
        """RUN_<STATE> in the logs, the traceback in main.log, then failure.json; waits at
        most `timeout` s (False: the storage stalls, and the record lands when it answers)."""
        recording = asyncio.wrap_future(self._pool.submit(_record, self.log, exc, state, step))
        try:
            await asyncio.wait_for(asyncio.shield(recording), timeout)
        except asyncio.TimeoutError:
            # Its late failure is retrieved there, not reported as never retrieved.
            background(recording)
            return False
        return True


def _mark_storage_thread() -> None:
    _here.on = True


def _record(log: RunLog, exc: BaseException, state: str, step: int | None) -> None:
    detail = "".join(traceback.format_exception(exc)) if state == "failed" else str(exc)
    summary = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    log.info(f"RUN_{state.upper()} error={type(exc).__name__}: {summary}")
    with open(log.run_dir / MAIN_LOG, "a", encoding="utf-8") as handle:
        handle.write(detail + "\n")
    write_failure(log.run_dir, exc, state, step)

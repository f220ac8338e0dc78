"""Work started now and awaited later, with its failure never lost; calls awaited together,
the first failure raised at once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from rlinf_twoworker.run.liveness import is_death

T = TypeVar("T")


def background(work: Awaitable[T]) -> asyncio.Future[T]:
    """Start `work` now; whoever awaits the returned future later gets its result or its error.
    Should nobody await it (the run failed first, or it was cancelled), its error is retrieved
    here, so asyncio never reports an exception that was never retrieved."""
    future = asyncio.ensure_future(work)
    future.add_done_callback(_retrieve)
    return future


async def in_daemon_thread(call: Callable[[], None], what: str, timeout_s: float) -> bool:
    """Run `call` in a daemon thread and wait for it up to `timeout_s`: False if it has not
    finished by then; raises what it raised. For calls to Ray's GCS that hang once the cluster
    is gone (removing a placement group): in asyncio's executor such a call would also hold the
    process at its exit, which joins the executor's threads, so it outlived its cluster."""
    done, failed = threading.Event(), []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the awaiting task
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name=f"rlinf-{what}", daemon=True).start()
    finished = await asyncio.to_thread(done.wait, timeout_s)
    if failed:
        raise failed[0]
    return finished


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def gather_fail_fast(calls: Sequence[Awaitable[Any]]) -> list[Any]:
    """Await all calls; at the first failure stop waiting on the others and raise it (a death
    first, when several failed together). asyncio.gather would leave the others running."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()  # a no-op for finished ones
    failed = [
        exc for t in tasks if t.done() and not t.cancelled() and (exc := t.exception()) is not None
    ]
    if failed:
        raise min(failed, key=lambda exc: not is_death(exc.__cause__))
    return [t.result() for t in tasks]

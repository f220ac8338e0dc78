"""Work started now and awaited later, with its failure never lost; calls awaited together,
the first failure raised at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
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

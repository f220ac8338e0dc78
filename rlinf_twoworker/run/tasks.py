"""Work started now and awaited later, with its failure never lost."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

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

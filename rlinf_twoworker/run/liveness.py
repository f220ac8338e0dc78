"""Failure detection for a run: which component process or node died, and which failure is
the cause. The controller's watchdog asks `liveness_error` every few seconds, so a death is
noticed even while no call to the dead process is in flight; `root_cause` turns a survivor's
failed collective into the death of the peer that broke it."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import ray

from rlinf_twoworker.errors import ClusterError, ComponentError

Member = Any
"""One component process (run.group.Member: slot, handle, where)."""


class ComponentGroup(Protocol):
    """What the watch needs of a run's component processes (run.group.ComponentGroup, which
    imports this module for Ray's error text)."""

    stopping: bool

    def all(self) -> list[Member]: ...

    def describe(self, member: Member) -> str: ...


def alive_node_ids() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


async def liveness_error(
    watch: Watch | None, bundle_nodes: list[str], run_id: str
) -> BaseException | None:
    """The first death found: a component's process, or a node holding a bundle of the
    run's placement group (`bundle_nodes`, by bundle index); None when all live."""
    try:
        alive: set[str] | None = await asyncio.to_thread(alive_node_ids)
    except Exception:  # the GCS did not answer this round: the pings still watch
        alive = None
    if watch is not None:
        error = watch.check_alive(alive)
        if error is not None:
            return error
    dead = [n for n in bundle_nodes if alive is not None and n not in alive]
    if dead:
        bundle = bundle_nodes.index(dead[0])
        return ClusterError(
            f"node {dead[0][:8]} holding bundle {bundle} of the placement group of run "
            f"{run_id} is dead (removed from the cluster or unreachable); the run "
            "cannot continue: check the node, then start a new run (or resume)"
        )
    return None


async def root_cause(watch: Watch | None, exc: BaseException, budget_s: float) -> BaseException:
    """A call that failed because a peer died (a collective broken by a dead rank) is
    reported as that peer's death: the dead process is the cause, not the survivor.
    Looks for a dead member for at most `budget_s`."""
    if watch is None or not isinstance(exc, ComponentError):
        return exc
    if is_death(exc.__cause__):  # the failed call's own process died: already the cause
        return exc
    dead = await watch.find_dead(budget_s)
    if not dead:
        return exc
    member, died = dead[0]
    error = watch.died(member, died)
    return ComponentError(
        error.component,
        error.rank,
        error.node,
        f"{error.cause} (then {exc.component} rank {exc.rank} failed: {exc.cause})",
    )


class Watch:
    """The liveness watch over one run's component processes: one ping in flight per member,
    and the error that names the first member found dead."""

    def __init__(self, group: ComponentGroup) -> None:
        self.group = group
        self._pings: dict[str, asyncio.Future] = {}
        self.stopped = False

    def died(self, member: Member, exc: BaseException | str) -> ComponentError:
        """The error that reports `member`'s process (or node) as dead."""
        cause = exc if isinstance(exc, str) else death_cause(exc)
        return ComponentError(
            member.slot.component, member.slot.rank, self.group.describe(member), cause
        )

    def check_alive(self, alive_nodes: set[str] | None) -> ComponentError | None:
        """One round of the liveness watch: the error of the first member whose process or
        node is dead, else None.

        One ping is kept in flight per member. On a busy member it waits behind the running
        call, but it fails as soon as the process dies, so a death is seen even while no call
        to that member is in flight."""
        if self.stopped or self.group.stopping:
            return None
        for member in self.group.all():
            node = str(member.where.get("node_id") or "")
            if alive_nodes is not None and node and node not in alive_nodes:
                return self.died(
                    member,
                    f"its node {node[:8]} ({member.where.get('ip', '?')}) is dead (removed from "
                    "the cluster or unreachable). Check the node, then start a new run, "
                    "resuming from the last checkpoint",
                )
            ping = self._pings.get(member.slot.name)
            if ping is not None and ping.done():
                error = None if ping.cancelled() else ping.result()
                if error is not None and is_death(error):
                    return self.died(member, error)
                ping = None  # answered, or only unavailable for now: ask again
            if ping is None:
                self._pings[member.slot.name] = asyncio.ensure_future(_ping(member.handle))
        return None

    async def find_dead(self, timeout: float) -> list[tuple[Member, BaseException]]:
        """Members whose process is dead, each with Ray's error; a member that does not answer
        within `timeout` (busy, or stalled in a collective) is not counted as dead."""

        async def probe(member: Member) -> BaseException | None:
            try:
                error = await asyncio.wait_for(_ping(member.handle), timeout)
            except asyncio.TimeoutError:
                return None
            return error if is_death(error) else None  # unavailable is not (yet) dead

        members = self.group.all()
        errors = await asyncio.gather(*(probe(m) for m in members))
        return [(m, e) for m, e in zip(members, errors) if e is not None]

    def stop(self) -> None:
        self.stopped = True
        for ping in self._pings.values():
            ping.cancel()
        self._pings.clear()


async def _ping(handle: Any) -> BaseException | None:
    """None when the process answered, else Ray's error (returned, so that a ping nobody
    looks at again never logs an unretrieved exception)."""
    try:
        await handle.ping.remote()
    except Exception as exc:
        return exc
    return None


def is_death(exc: BaseException | None) -> bool:
    """Ray says the actor's process is gone for good (max_restarts=0): killed, crashed, its
    node lost, or its constructor failed. An ActorUnavailableError is not (yet) a death."""
    return isinstance(exc, ray.exceptions.ActorDiedError)


def death_cause(exc: BaseException) -> str:
    """One line out of Ray's ActorDiedError (or ActorUnavailableError): how the process died."""
    if not isinstance(exc, ray.exceptions.RayActorError):
        return short_reason(exc)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if isinstance(exc, ray.exceptions.ActorUnavailableError):
        detail = " ".join(lines).split("unavailable: ")[-1].split(". The task may")[0]
        return (
            f"its process became unreachable ({detail}); its node may be lost or cut off. "
            "Check that node, then start a new run, resuming from the last checkpoint"
        )
    if exc.actor_init_failed:
        return f"its constructor failed: {lines[-1] if lines else type(exc).__name__}"
    pid = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("pid:")), "?")
    reason = next((line for line in lines if line.startswith("The actor is dead")), lines[-1])
    reason = reason.split(" Some common causes")[0].rstrip(".")
    return (
        f"its process (pid {pid}) died: {reason}. Look for the reason (OOM killer, a crash) in "
        "that node's Ray worker logs, then start a new run, resuming from the last checkpoint"
    )


def short_reason(exc: BaseException) -> str:
    """One line saying why a call failed (a death in Ray's words made short)."""
    if isinstance(exc, ray.exceptions.RayActorError):
        return death_cause(exc)
    text = str(exc).strip()
    cause = getattr(exc, "cause", None)
    if cause is not None:
        text = f"{type(cause).__name__}: {cause}"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__

"""Start every component as a Ray actor pinned to its bundle and GPU, and call them safely.

Actor names are `<run_id>:<component>:<rank>` in namespace `rlinf_twoworker`, so operators
find them with `ray list actors`. Every call goes through `call`, which applies a timeout and
turns any failure into a ComponentError naming the component, its rank and its node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from rlinf_twoworker.actor import ActorWorker
from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.errors import ComponentError
from rlinf_twoworker.inference import InferenceWorker
from rlinf_twoworker.placement import Placement, Slot, scheduling_options
from rlinf_twoworker.results import Placed
from rlinf_twoworker.reward import MathReward
from rlinf_twoworker.rollout import RolloutWorker

NAMESPACE = "rlinf_twoworker"


class RewardWorker:
    """Math grading as a component; grading runs off the actor's event loop."""

    def __init__(self, cfg: GRPOConfig, rank: int = 0) -> None:
        self.grader = MathReward(cfg.reward.reward_scale, cfg.reward.timeout_s)
        self.rank = rank

    async def score(self, answers: list[str], solutions: list[list[str]]) -> dict[str, Any]:
        scores = await self.grader.score_async(answers, solutions)
        return {"scores": scores, "stats": dict(self.grader.last_stats)}

    def where(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        import os
        import socket

        return {
            "component": "reward",
            "rank": self.rank,
            "host": socket.gethostname(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def ping(self) -> bool:
        return True

    def attach_log(self, path: str) -> None:
        from rlinf_twoworker.worker import attach_log

        attach_log(path, "reward", self.rank)


CLASSES = {
    "rollout": RolloutWorker,
    "reward": RewardWorker,
    "inference": InferenceWorker,
    "actor": ActorWorker,
}


@dataclass
class Member:
    slot: Slot
    handle: Any
    where: dict[str, Any]


class ComponentGroup:
    """Every component process of one run, with where each one lives."""

    def __init__(
        self,
        cfg: GRPOConfig,
        run_id: str,
        placement: Placement,
        pg: Any,
        classes: dict[str, type] | None = None,
        bundle_nodes: list[dict[str, str]] | None = None,
    ) -> None:
        """`bundle_nodes[i]` is {'node_id', 'ip'} of bundle i: where a member is known to be
        before it answers (an error in its constructor still names its node)."""
        self.cfg, self.run_id, self.placement, self.pg = cfg, run_id, placement, pg
        self.bundle_nodes = bundle_nodes or []
        self.classes = {**CLASSES, **(classes or {})}
        self.members: dict[str, list[Member]] = {}
        self.timeouts = cfg.runner.timeouts
        self._pings: dict[str, asyncio.Future] = {}
        self.stopping = False

    def start(self) -> None:
        """Create every actor (model loading starts in parallel); `wait_started` awaits them."""
        env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        for slot in self.placement.slots:
            cls = self.classes[slot.component]
            options = scheduling_options(self.pg, self.placement, slot)
            remote: Any = ray.remote(cls).options(
                name=f"{self.run_id}:{slot.component}:{slot.rank}",
                namespace=NAMESPACE,
                max_concurrency=4 if slot.component == "reward" else 1,
                runtime_env={"env_vars": env},
                max_restarts=0,
                **options,
            )
            handle = remote.remote(self.cfg, slot.rank)
            where = dict(self.bundle_nodes[slot.bundle]) if self.bundle_nodes else {}
            self.members.setdefault(slot.component, []).append(Member(slot, handle, where))

    async def wait_started(self) -> None:
        members = self.all()
        wheres = await self.call_each(
            members, "where", timeout=self.timeouts.actor_start_s, stage="start"
        )
        for member, where in zip(members, wheres):
            member.where = where

    def all(self) -> list[Member]:
        return [m for ms in self.members.values() for m in ms]

    def one(self, component: str) -> Member:
        return self.members[component][0]

    def actors(self) -> list[Member]:
        return self.members["actor"]

    def describe(self, member: Member) -> str:
        w = member.where
        host = f"{w['host']}/" if w.get("host") else ""
        return f"{host}{w.get('ip', '?')} node {str(w.get('node_id', '?'))[:8]}"

    async def call(
        self, member: Member, method: str, *args: Any, timeout: float, stage: str
    ) -> Any:
        """One remote call with a timeout; any failure names component, rank and node."""
        ref = getattr(member.handle, method).remote(*args)
        try:
            return await asyncio.wait_for(ref, timeout)
        except asyncio.TimeoutError:
            raise ComponentError(
                member.slot.component,
                member.slot.rank,
                self.describe(member),
                f"{stage} ({method}) did not finish within {timeout:g} s; "
                "raise runner.timeouts or look at the component's log",
            ) from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise ComponentError(
                member.slot.component,
                member.slot.rank,
                self.describe(member),
                f"{stage} ({method}) failed: {_short(exc)}",
            ) from exc

    async def call_each(
        self,
        members: list[Member],
        method: str,
        *args: Any,
        timeout: float,
        stage: str,
        per_member: list[tuple] | None = None,
    ) -> list[Any]:
        """The same method on several members concurrently (a collective must be entered by
        all); the first failure cancels the wait on the others and is raised at once, so a
        collective stalled by a dead member never holds the run (a death is preferred as the
        error when several members failed together)."""
        argss = per_member or [args] * len(members)
        return await gather_fail_fast(
            [self.call(m, method, *a, timeout=timeout, stage=stage) for m, a in zip(members, argss)]
        )

    def shared_gpus(self) -> tuple[bool, bool]:
        """Whether the weight sync's cross group (actor 0, rollout) and fan-out group (rollout,
        inference) join processes on one GPU, where NCCL cannot run between them."""
        if self.cfg.cluster.accelerator != "cuda":
            return (False, False)
        source = self.actors()[0].slot.resource_rank
        ranks = [self.one(c).slot.resource_rank for c in ("rollout", "inference")]
        return (source == ranks[0], len(set(ranks)) < len(ranks))

    def topology(self) -> list[Placed]:
        rows = []
        for m in self.all():
            rows.append(
                Placed(
                    m.slot.component,
                    m.slot.rank,
                    m.slot.bundle,
                    m.slot.resource_rank,
                    str(m.where.get("node_id", "")),
                    str(m.where.get("ip", "")),
                    list(m.where.get("gpu_ids", [])),
                    int(m.where.get("pid", 0)),
                )
            )
        return rows

    # ---- liveness -----------------------------------------------------------------------
    def died(self, member: Member, exc: BaseException | str) -> ComponentError:
        """The error that reports `member`'s process (or node) as dead."""
        cause = exc if isinstance(exc, str) else death_cause(exc)
        return ComponentError(member.slot.component, member.slot.rank, self.describe(member), cause)

    def check_alive(self, alive_nodes: set[str] | None) -> ComponentError | None:
        """One round of the liveness watch: the error of the first member whose process or
        node is dead, else None.

        One ping is kept in flight per member. On a busy member it waits behind the running
        call, but it fails as soon as the process dies, so a death is seen even while no call
        to that member is in flight."""
        if self.stopping:
            return None
        for member in self.all():
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

        members = self.all()
        errors = await asyncio.gather(*(probe(m) for m in members))
        return [(m, e) for m, e in zip(members, errors) if e is not None]

    def stop_watch(self) -> None:
        self.stopping = True
        for ping in self._pings.values():
            ping.cancel()
        self._pings.clear()

    def kill(self) -> None:
        self.stopping = True  # our own kills are not deaths to report
        for member in self.all():
            try:
                ray.kill(member.handle, no_restart=True)
            except Exception:  # already dead: nothing left to release
                pass


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
        return _short(exc)
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


def _short(exc: BaseException) -> str:
    if isinstance(exc, ray.exceptions.RayActorError):
        return death_cause(exc)
    text = str(exc).strip()
    cause = getattr(exc, "cause", None)
    if cause is not None:
        text = f"{type(cause).__name__}: {cause}"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__

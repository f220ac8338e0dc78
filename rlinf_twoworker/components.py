"""Start every component as a Ray actor pinned to its bundle and GPU, and call them safely.

Actor names are `<run_id>:<component>:<rank>` in namespace `rlinf_twoworker`, so operators
find them with `ray list actors`. Every call goes through `call`, which applies a timeout and
turns any failure into a ComponentError naming the component, its rank and its node.
"""

from __future__ import annotations

import asyncio
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
    ) -> None:
        self.cfg, self.run_id, self.placement, self.pg = cfg, run_id, placement, pg
        self.classes = {**CLASSES, **(classes or {})}
        self.members: dict[str, list[Member]] = {}
        self.timeouts = cfg.runner.timeouts

    def start(self) -> None:
        """Create every actor (model loading starts in parallel); `wait_started` awaits them."""
        env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        for slot in self.placement.slots:
            cls = self.classes[slot.component]
            options = scheduling_options(self.pg, self.placement, slot)
            remote = ray.remote(cls).options(
                name=f"{self.run_id}:{slot.component}:{slot.rank}",
                namespace=NAMESPACE,
                max_concurrency=4 if slot.component == "reward" else 1,
                runtime_env={"env_vars": env},
                max_restarts=0,
                **options,
            )
            handle = remote.remote(self.cfg, slot.rank)
            self.members.setdefault(slot.component, []).append(Member(slot, handle, {}))

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
        return f"{w.get('host', '?')}/{w.get('ip', '?')} node {str(w.get('node_id', '?'))[:8]}"

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
        all); the first failure cancels the wait on the others and is raised."""
        calls = [
            self.call(
                m, method, *(per_member[i] if per_member else args), timeout=timeout, stage=stage
            )
            for i, m in enumerate(members)
        ]
        return list(await asyncio.gather(*calls))

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

    def kill(self) -> None:
        for member in self.all():
            try:
                ray.kill(member.handle, no_restart=True)
            except Exception:  # already dead: nothing left to release
                pass


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    cause = getattr(exc, "cause", None)
    if cause is not None:
        text = f"{type(cause).__name__}: {cause}"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__

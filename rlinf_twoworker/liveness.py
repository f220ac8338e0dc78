"""Failure detection for a run: which component process or node died, and which failure is
the cause. The controller's watchdog asks `liveness_error` every few seconds, so a death is
noticed even while no call to the dead process is in flight; `root_cause` turns a survivor's
failed collective into the death of the peer that broke it."""

from __future__ import annotations

import asyncio

from rlinf_twoworker.components import ComponentGroup, is_death
from rlinf_twoworker.errors import ClusterError, ComponentError


def alive_node_ids() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


async def liveness_error(
    group: ComponentGroup | None, bundle_nodes: list[str], run_id: str
) -> BaseException | None:
    """The first death found: a component's process, or a node holding a bundle of the
    run's placement group (`bundle_nodes`, by bundle index); None when all live."""
    try:
        alive: set[str] | None = await asyncio.to_thread(alive_node_ids)
    except Exception:  # the GCS did not answer this round: the pings still watch
        alive = None
    if group is not None:
        error = group.check_alive(alive)
        if error is not None:
            return error
    dead = [n for n in bundle_nodes if alive is not None and n not in alive]
    if dead:
        bundle = bundle_nodes.index(dead[0])
        return ClusterError(
            f"node {dead[0][:8]} holding bundle {bundle} of placement group "
            f"{run_id}:pg is dead (removed from the cluster or unreachable); the run "
            "cannot continue: check the node, then start a new run (or resume)"
        )
    return None


async def root_cause(
    group: ComponentGroup | None, exc: BaseException, budget_s: float
) -> BaseException:
    """A call that failed because a peer died (a collective broken by a dead rank) is
    reported as that peer's death: the dead process is the cause, not the survivor.
    Looks for a dead member for at most `budget_s`."""
    if group is None or not isinstance(exc, ComponentError):
        return exc
    if is_death(exc.__cause__):  # the failed call's own process died: already the cause
        return exc
    dead = await group.find_dead(budget_s)
    if not dead:
        return exc
    member, died = dead[0]
    error = group.died(member, died)
    return ComponentError(
        error.component,
        error.rank,
        error.node,
        f"{error.cause} (then {exc.component} rank {exc.rank} failed: {exc.cause})",
    )

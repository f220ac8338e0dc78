"""Component processes kept between runs (cluster.keep_processes).

A run that keeps its processes names its placement group `rlinf_twoworker-kept:<signature>:
<run>` and starts its model components (the rows of components.TABLE with `keep`) as
detached Ray actors named after the group (`host_name`). When the run has trained to its end,
each of them drops its worker (`ComponentHost.unload`: the model, the process groups, the
log it was given) and the group stays, idle. The next run of the same Ray job with the same
signature (the cluster's shape, the placement, the workers, the caller's node: `signature`)
claims the group and loads its models into those processes, without starting a process or
importing torch and transformers again. The first kept process of a group (rollout 0) holds
the claim: one run at a time uses a group.

Any run that does not take an idle kept group frees it when it starts (its processes are
killed with the group), so kept processes never hold GPUs another run asks for; so do
`release_kept()` and the end of the Ray job (the group is the job's, and its actors die
with it). A run that fails or is cancelled after its models began to load kills its
processes and removes its group, kept or not; one that fails before (the preflight, its data,
the memory plan) gives its kept processes back as they came, for the next run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PREFIX = "rlinf_twoworker-kept"
CLAIM_S = 30.0
"""How long a kept group's claim may take: its first process answers between calls."""
LOCK = ("rollout", 0)
"""The kept process that holds a group's claim (every run has a rollout rank 0)."""


@dataclass
class KeptGroup:
    """An idle kept placement group this run has claimed, and its kept processes."""

    pg: Any
    name: str
    hosts: dict[tuple[str, int], Any]
    """(component, rank) -> the live process's actor handle."""


def signature(cfg: Any, slots: Sequence[Any], workers: dict[str, Any]) -> str:
    """What a kept group must match to serve a run: the Ray job, the cluster's shape, each
    slot (component, rank, bundle, resource rank), each worker and the node that holds bundle
    0 when it is the caller's (cluster/placement.driver_holds_bundle_0)."""
    import ray

    from rlinf_twoworker.cluster.placement import driver_holds_bundle_0

    context = ray.get_runtime_context()
    cluster = cfg.cluster
    facts = {
        "job": context.get_job_id(),
        "shape": [cluster.num_nodes, cluster.num_gpus_per_node, cluster.cpus_per_bundle],
        "accelerator": cluster.accelerator,
        "slots": [[s.component, s.rank, s.bundle, s.resource_rank] for s in slots],
        "workers": {k: str(v) for k, v in sorted(workers.items())},
        "head": context.get_node_id() if driver_holds_bundle_0(cluster) else None,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]


def group_name(sig: str, run_id: str) -> str:
    return f"{PREFIX}:{sig}:{run_id}"


def host_name(pg: Any, component: str, rank: int) -> str:
    """The name of a kept process of group `pg` (in the library's namespace)."""
    return f"{PREFIX}:{pg.id.hex()[:16]}:{component}:{rank}"


def _kept_groups() -> list[tuple[Any, str]]:
    """Every live kept placement group of the cluster, with its name."""
    from rlinf_twoworker.cluster.placement import live_groups

    return live_groups(lambda name: name.startswith(PREFIX + ":"))


def _host(pg: Any, component: str, rank: int) -> Any | None:
    import ray

    from rlinf_twoworker.cluster.connect import NAMESPACE

    try:
        return ray.get_actor(host_name(pg, component, rank), namespace=NAMESPACE)
    except ValueError:  # not (or no longer) alive
        return None


def _claim(pg: Any, run_id: str) -> bool:
    """Claim group `pg` for `run_id`; False when another run holds it, or when its lock
    process does not exist (yet: the run that made the group is starting its processes). A
    group whose lock process is dead or hung is claimed: it can only be freed."""
    lock = _host(pg, *LOCK)
    if lock is None:
        return False
    try:
        return bool(lock.claim.remote(run_id).future().result(CLAIM_S))
    except Exception:  # dead or hung: nobody can use it
        return True


def take(sig: str | None, run_id: str, slots: Sequence[Any]) -> KeptGroup | None:
    """Claim an idle kept group of signature `sig` for this run (None: take none) and free
    every other idle one, so this run's own group finds the GPUs. Groups that other runs
    hold are left alone."""
    from rlinf_twoworker.cluster.placement import wait_removed

    taken: KeptGroup | None = None
    for pg, name in _kept_groups():
        if not _claim(pg, run_id):
            continue
        if taken is None and sig is not None and name.split(":")[1] == sig:
            hosts = {(s.component, s.rank): _host(pg, s.component, s.rank) for s in slots}
            if hosts.get(LOCK) is not None:
                taken = KeptGroup(pg, name, {k: h for k, h in hosts.items() if h is not None})
                continue
        wait_removed(pg)  # its processes die with it
    return taken


def free_claimed(run_id: str) -> None:
    """Remove the kept groups `run_id` holds (its controller died while it held them)."""
    from rlinf_twoworker.cluster.placement import wait_removed

    for pg, name in _kept_groups():
        lock = _host(pg, *LOCK)
        try:
            holder = (
                name.split(":", 2)[2]
                if lock is None
                else lock.claimed_by.remote().future().result(CLAIM_S)
            )
        except Exception:
            holder = run_id
        if holder == run_id:
            wait_removed(pg)


def release_kept() -> int:
    """Free every idle kept group of the connected cluster (their processes die with them);
    returns how many (0 where this process is not connected to a cluster). Groups that a run
    holds are left to it."""
    import ray

    from rlinf_twoworker.cluster.placement import wait_removed

    if not ray.is_initialized():
        return 0
    freed = 0
    for pg, _ in _kept_groups():
        if _claim(pg, f"release-{id(pg)}"):
            wait_removed(pg)
            freed += 1
    return freed

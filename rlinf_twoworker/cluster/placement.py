"""The STRICT_SPREAD placement group of a run and the options that pin a component process to
its bundle and GPU share (the ranks themselves come from config/placement.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlinf_twoworker.errors import PlacementError

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from rlinf_twoworker.config.placement import Placement, Slot
    from rlinf_twoworker.config.schema import ClusterConfig


def _alive_nodes_summary() -> str:
    import ray

    parts = []
    try:
        available = ray._private.state.available_resources_per_node()
    except Exception:  # the diagnostic must never hide the real error
        available = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        free = available.get(node_id, {})
        parts.append(
            f"node {node_id[:8]} ({node['NodeManagerAddress']}) "
            f"{free.get('GPU', 0):g}/{node['Resources'].get('GPU', 0):g} GPU free, "
            f"{free.get('CPU', 0):g}/{node['Resources'].get('CPU', 0):g} CPU free"
        )
    return "; ".join(parts) or "no alive nodes"


def driver_holds_bundle_0(cluster: ClusterConfig) -> bool:
    """Whether bundle 0 (the Head's components: rollout, reward, inference) goes on the
    caller's node: when that node has cluster.num_gpus_per_node GPUs (the tutorial's Head).
    A caller on a node without them (a CPU-only Head, as KubeRay and hosted Ray make it) lets
    Ray put bundle 0 on a GPU node; the run's controller stays with the caller."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    own = next((n for n in ray.nodes() if n.get("NodeID") == here and n.get("Alive")), None)
    gpus = float((own or {}).get("Resources", {}).get("GPU", 0))
    return gpus >= cluster.num_gpus_per_node


def request_placement_group(cluster: ClusterConfig, name: str) -> PlacementGroup:
    """Ask for one STRICT_SPREAD group (returns at once): bundle 0 on the caller's node when it
    has the GPUs (driver_holds_bundle_0), else wherever Ray finds a node for it."""
    import ray
    from ray.util.placement_group import placement_group

    bundle = {"GPU": float(cluster.num_gpus_per_node), "CPU": float(cluster.cpus_per_bundle)}
    here = ray.get_runtime_context().get_node_id()
    first = {"ray.io/node-id": here} if driver_holds_bundle_0(cluster) else {}
    selectors = [first] + [{} for _ in range(cluster.num_nodes - 1)]
    return placement_group(
        [dict(bundle) for _ in range(cluster.num_nodes)],
        strategy="STRICT_SPREAD",
        name=name,
        bundle_label_selector=selectors,
    )


def placement_timeout_error(cluster: ClusterConfig, name: str, timeout_s: float) -> PlacementError:
    """What was asked and what each alive node offers."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    first = (
        f"bundle 0 on this node ({here[:8]})"
        if driver_holds_bundle_0(cluster)
        else f"bundle 0 on any of them (this node, {here[:8]}, has fewer GPUs)"
    )
    return PlacementError(
        f"placement group '{name}' not scheduled within {timeout_s:g} s: STRICT_SPREAD needs "
        f"{cluster.num_nodes} nodes with {cluster.num_gpus_per_node} free GPU(s) and "
        f"{cluster.cpus_per_bundle} CPU(s) each, {first}; alive: "
        f"{_alive_nodes_summary()}. Add nodes or free GPUs, or lower cluster.num_nodes / "
        "cluster.num_gpus_per_node."
    )


def callers_group_problems(pg: PlacementGroup, cluster: ClusterConfig) -> list[str]:
    """What in a placement group the caller owns differs from what the config asks for (every
    difference, empty when it fits): STRICT_SPREAD, cluster.num_nodes bundles of
    cluster.num_gpus_per_node GPUs each. Its bundle 0 may be on any node: the Head's
    components go where it is (the caller's node need not hold it)."""
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(pg)
    bundles = table.get("bundles") or {}
    problems = []
    if table.get("strategy") != "STRICT_SPREAD":
        problems.append(
            f"strategy is {table.get('strategy')}, not STRICT_SPREAD (one node per bundle)"
        )
    if len(bundles) != cluster.num_nodes:
        problems.append(f"{len(bundles)} bundles, not cluster.num_nodes={cluster.num_nodes}")
    gpus = [float(bundles[i].get("GPU", 0)) for i in sorted(bundles)]
    wrong = [f"bundle {i}: {g:g}" for i, g in enumerate(gpus) if g != cluster.num_gpus_per_node]
    if wrong:
        problems.append(
            f"GPUs per bundle are not cluster.num_gpus_per_node={cluster.num_gpus_per_node} "
            f"({', '.join(wrong)})"
        )
    return problems


def create_placement_group(cluster: ClusterConfig, name: str, timeout_s: float) -> PlacementGroup:
    """Request the group and wait for it; on timeout remove it and raise PlacementError."""
    import ray

    pg = request_placement_group(cluster, name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        error = placement_timeout_error(cluster, name, timeout_s)
        wait_removed(pg)
        raise error
    return pg


def bundle_node_ids(pg: PlacementGroup) -> list[str]:
    """Node id of each bundle, by bundle index."""
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(pg)
    mapping = table["bundles_to_node_id"]
    return [mapping[i] for i in range(len(mapping))]


def scheduling_options(
    pg: PlacementGroup, placement: Placement, slot: Slot, num_cpus: float = 0.0
) -> dict[str, Any]:
    """Ray actor options that pin a component's process to its bundle and GPU share."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=slot.bundle
        ),
        "num_gpus": placement.gpu_fraction(slot),
        "num_cpus": num_cpus,
    }


def live_groups(named: Callable[[str], bool]) -> list[tuple[PlacementGroup, str]]:
    """Every placement group of the cluster not yet removed whose name `named` accepts,
    with its name (whichever job or namespace made it)."""
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table

    return [
        (PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))), info.get("name") or "")
        for pg_id, info in placement_group_table().items()
        if info.get("state") != "REMOVED" and named(info.get("name") or "")
    ]


def wait_removed(pg: PlacementGroup, timeout_s: float = 10.0) -> bool:
    """Remove a placement group and wait until the GCS reports it gone."""
    from ray.util.placement_group import placement_group_table, remove_placement_group

    with contextlib.suppress(Exception):  # already removed
        remove_placement_group(pg)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if placement_group_table(pg).get("state") == "REMOVED":
            return True
        time.sleep(0.1)
    return False

"""Component placement: RLinf's resource-rank syntax, the STRICT_SPREAD placement group, pinning.

Resource ranks are node-major: rank r lives in bundle r // gpus_per_node (one bundle a node) on
local GPU r % gpus_per_node. Components that share a rank share its GPU through fractional GPU
requests (rollout and reward on rank 0 in the default placement).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlinf_twoworker.errors import ConfigError, PlacementError

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from rlinf_twoworker.config import ClusterConfig

COMPONENTS = ("rollout", "reward", "inference", "actor")


def parse_ranks(spec: Any, key: str = "component_placement") -> list[int]:
    """Parse an RLinf placement value: 3, '2-3', '0,1', '0-1,3' or a list of ints."""
    if isinstance(spec, bool):
        raise ConfigError(key, spec, "a placement is a rank, 'a-b', 'a,b' or a list of ranks")
    if isinstance(spec, int):
        ranks = [spec]
    elif isinstance(spec, (list, tuple)) or hasattr(spec, "__iter__") and not isinstance(spec, str):
        ranks = [r for item in spec for r in parse_ranks(item, key)]
    elif isinstance(spec, str) and spec.strip():
        ranks = []
        for part in spec.replace(" ", "").split(","):
            lo, dash, hi = part.partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()):
                raise ConfigError(key, spec, "a placement is a rank, 'a-b', 'a,b' or a list")
            if dash and int(hi) < int(lo):
                raise ConfigError(key, spec, f"range '{part}' runs backwards")
            ranks.extend(range(int(lo), int(hi) + 1) if dash else [int(lo)])
    else:
        raise ConfigError(key, spec, "a placement is a rank, 'a-b', 'a,b' or a list of ranks")
    if len(set(ranks)) != len(ranks):
        raise ConfigError(key, spec, "a rank is listed twice")
    return ranks


@dataclass(frozen=True)
class Slot:
    """Where one process of a component runs."""

    component: str
    rank: int  # rank inside the component (actor rank 0, 1, ...)
    resource_rank: int
    bundle: int
    local_gpu: int

    @property
    def name(self) -> str:
        return f"{self.component}:{self.rank}"


@dataclass(frozen=True)
class Placement:
    """The resolved placement: every component's slots, checked against the cluster shape."""

    num_nodes: int
    gpus_per_node: int
    slots: tuple[Slot, ...]

    def ranks(self, component: str) -> list[int]:
        return [s.resource_rank for s in self.slots if s.component == component]

    def of(self, component: str) -> list[Slot]:
        return [s for s in self.slots if s.component == component]

    def sharers(self, resource_rank: int) -> int:
        """How many component processes share this resource rank's GPU."""
        return sum(1 for s in self.slots if s.resource_rank == resource_rank)

    def gpu_fraction(self, slot: Slot) -> float:
        return 1.0 / self.sharers(slot.resource_rank)

    def as_dict(self) -> dict[str, list[int]]:
        return {c: self.ranks(c) for c in COMPONENTS}


def resolve_placement(cluster: ClusterConfig) -> Placement:
    """Check cluster.component_placement and turn it into slots (raises ConfigError)."""
    placement = dict(cluster.component_placement)
    total = cluster.num_nodes * cluster.num_gpus_per_node
    unknown = sorted(set(placement) - set(COMPONENTS))
    if unknown:
        raise ConfigError(
            f"cluster.component_placement.{unknown[0]}",
            placement[unknown[0]],
            f"unknown component; the components are {', '.join(COMPONENTS)}",
        )
    slots = []
    for component in COMPONENTS:
        key = f"cluster.component_placement.{component}"
        if component not in placement or placement[component] is None:
            raise ConfigError(key, None, "every component must be placed")
        ranks = parse_ranks(placement[component], key)
        bad = [r for r in ranks if not 0 <= r < total]
        if bad:
            raise ConfigError(
                key,
                placement[component],
                f"rank {bad[0]} is outside the cluster's {total} resource ranks "
                f"(num_nodes {cluster.num_nodes} x num_gpus_per_node "
                f"{cluster.num_gpus_per_node})",
            )
        if component == "actor" and ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            raise ConfigError(key, placement[component], "actor ranks must be contiguous")
        if component != "actor" and len(ranks) != 1:
            raise ConfigError(
                key, placement[component], f"{component} runs as one process: give exactly one rank"
            )
        per_node = cluster.num_gpus_per_node
        slots += [Slot(component, i, r, r // per_node, r % per_node) for i, r in enumerate(ranks)]
    return Placement(cluster.num_nodes, cluster.num_gpus_per_node, tuple(slots))


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


def request_placement_group(cluster: ClusterConfig, name: str) -> PlacementGroup:
    """Ask for one STRICT_SPREAD group, bundle 0 on the caller's node (returns at once)."""
    import ray
    from ray.util.placement_group import placement_group

    bundle = {"GPU": float(cluster.num_gpus_per_node), "CPU": float(cluster.cpus_per_bundle)}
    here = ray.get_runtime_context().get_node_id()
    selectors = [{"ray.io/node-id": here}] + [{} for _ in range(cluster.num_nodes - 1)]
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
    return PlacementError(
        f"placement group '{name}' not scheduled within {timeout_s:g} s: STRICT_SPREAD needs "
        f"{cluster.num_nodes} nodes with {cluster.num_gpus_per_node} free GPU(s) and "
        f"{cluster.cpus_per_bundle} CPU(s) each, bundle 0 on this node ({here[:8]}); alive: "
        f"{_alive_nodes_summary()}. Add nodes or free GPUs, or lower cluster.num_nodes / "
        "cluster.num_gpus_per_node."
    )


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

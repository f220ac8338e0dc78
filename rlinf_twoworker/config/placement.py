"""RLinf's placement syntax resolved against the cluster's shape: which resource rank, bundle
and local GPU each component process gets. Pure: the config's validation runs it.

Resource ranks are node-major: rank r lives in bundle r // gpus_per_node (one bundle a node) on
local GPU r % gpus_per_node. Components that share a rank share its GPU through fractional GPU
requests (rollout and reward on rank 0 in the default placement).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rlinf_twoworker import components
from rlinf_twoworker.errors import ConfigError


class ClusterShape(Protocol):
    """What placement reads of the config's `cluster` section."""

    @property
    def num_nodes(self) -> int: ...

    @property
    def num_gpus_per_node(self) -> int: ...

    @property
    def component_placement(self) -> Mapping[str, Any]: ...


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
        names = dict.fromkeys(s.component for s in self.slots)
        return {c: self.ranks(c) for c in names}


def resolve_placement(
    cluster: ClusterShape, table: Sequence[components.Component] | None = None
) -> Placement:
    """Check cluster.component_placement for `table`'s components (default: those every run
    has) and turn it into slots; raises ConfigError naming the component."""
    table = [c for c in components.TABLE if c.needed is None] if table is None else table
    placement = dict(cluster.component_placement)
    unknown = sorted(set(placement) - set(components.NAMES))
    if unknown:
        raise ConfigError(
            f"cluster.component_placement.{unknown[0]}",
            placement[unknown[0]],
            f"unknown component; the components are {', '.join(components.NAMES)}",
        )
    slots = []
    for component in table:
        spec = component_spec(placement, component)
        ranks = _ranks_of(cluster, component, spec)
        per_node = cluster.num_gpus_per_node
        slots += [
            Slot(component.name, i, r, r // per_node, r % per_node) for i, r in enumerate(ranks)
        ]
    return Placement(cluster.num_nodes, cluster.num_gpus_per_node, tuple(slots))


def placement_record(
    cluster: ClusterShape, placement: Placement, table: Sequence[components.Component]
) -> dict[str, dict[str, Any]]:
    """Component -> {"spec": its cluster.component_placement entry, "resource_ranks",
    "nodes"}, for `table`'s components as `placement` (resolve_placement's) placed them: what
    the run records in placement.json and the postflight reports."""
    per_node = cluster.num_gpus_per_node
    record = {}
    for component in table:
        ranks = placement.ranks(component.name)
        record[component.name] = {
            "spec": component_spec(cluster.component_placement, component),
            "resource_ranks": ranks,
            "nodes": sorted({r // per_node for r in ranks}),
        }
    return record


def component_spec(placement: Mapping[str, Any], component: components.Component) -> Any:
    """The component's entry of cluster.component_placement, or else its default component's
    (the reference policy goes where inference goes unless named)."""
    spec = placement.get(component.name)
    if spec is None and component.default_placement is not None:
        spec = placement.get(component.default_placement)
    return spec


def _ranks_of(cluster: ClusterShape, component: components.Component, spec: Any) -> list[int]:
    key = f"cluster.component_placement.{component.name}"
    if spec is None:
        raise ConfigError(key, None, "every component must be placed")
    ranks = parse_ranks(spec, key)
    total = cluster.num_nodes * cluster.num_gpus_per_node
    bad = [r for r in ranks if not 0 <= r < total]
    if bad:
        raise ConfigError(
            key,
            spec,
            f"rank {bad[0]} is outside the cluster's {total} resource ranks "
            f"(num_nodes {cluster.num_nodes} x num_gpus_per_node {cluster.num_gpus_per_node})",
        )
    if component.trains and ranks != list(range(ranks[0], ranks[0] + len(ranks))):
        raise ConfigError(key, spec, f"{component.name} ranks must be contiguous")
    if not component.trains and len(ranks) != 1:
        raise ConfigError(key, spec, f"{component.name} runs as one process: give exactly one rank")
    return ranks

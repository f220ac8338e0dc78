"""Placement: resource-rank parsing, the STRICT_SPREAD group on real Ray nodes, actor pinning."""

from __future__ import annotations

import re
import time

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table
from support import settled_free_gpus

from rlinf_twoworker.cluster.placement import (
    bundle_node_ids,
    create_placement_group,
    live_groups,
    request_placement_group,
    scheduling_options,
    wait_removed,
)
from rlinf_twoworker.config import ClusterConfig
from rlinf_twoworker.config.placement import Placement, Slot, parse_ranks, resolve_placement
from rlinf_twoworker.errors import ConfigError, PlacementError

SHORT_TIMEOUT_S = 3.0


@ray.remote(num_cpus=0)
class Where:
    """Reports where Ray put it: node id and the GPU ids it was given."""

    def where(self) -> tuple[str, list[str]]:
        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]


def start_pinned(pg, placement: Placement) -> dict[str, tuple[str, list[str]]]:
    actors = [
        Where.options(**scheduling_options(pg, placement, s)).remote() for s in placement.slots
    ]
    try:
        found = ray.get([a.where.remote() for a in actors], timeout=60)
    finally:
        for actor in actors:
            ray.kill(actor)
    return {slot.name: where for slot, where in zip(placement.slots, found)}


# --- resolving the placement (no Ray) --------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "ranks"),
    [
        (3, [3]),
        ("2-3", [2, 3]),
        ("0,1", [0, 1]),
        ("0-1,3", [0, 1, 3]),
        ([1, 2], [1, 2]),
        (" 2 - 3 ", [2, 3]),
    ],
)
def test_parse_ranks(spec, ranks: list[int]):
    assert parse_ranks(spec) == ranks


def test_default_placement_resolves_to_node_major_slots():
    placement = resolve_placement(ClusterConfig())
    assert placement.slots == (
        Slot("rollout", 0, 0, 0, 0),
        Slot("reward", 0, 0, 0, 0),
        Slot("inference", 0, 1, 0, 1),
        Slot("actor", 0, 2, 1, 0),
        Slot("actor", 1, 3, 1, 1),
    )
    assert placement.as_dict() == {"rollout": [0], "reward": [0], "inference": [1], "actor": [2, 3]}
    fractions = {s.name: placement.gpu_fraction(s) for s in placement.slots}
    assert fractions == {
        "rollout:0": 0.5,
        "reward:0": 0.5,
        "inference:0": 1.0,
        "actor:0": 1.0,
        "actor:1": 1.0,
    }


def test_placement_outside_the_cluster_is_a_config_error():
    cluster = ClusterConfig(num_nodes=1, num_gpus_per_node=2)
    with pytest.raises(ConfigError, match="rank 2 is outside the cluster's 2 resource ranks"):
        resolve_placement(cluster)


# --- the placement group on the 2x2 cluster --------------------------------------------------


def test_group_is_strict_spread_one_bundle_a_node_bundle_0_here(cluster_2x2):
    cluster = ClusterConfig()
    pg = create_placement_group(cluster, "test-default", timeout_s=30)
    try:
        table = placement_group_table(pg)
        assert table["strategy"] == "STRICT_SPREAD" and table["state"] == "CREATED"
        bundle = {"GPU": 2.0, "CPU": float(cluster.cpus_per_bundle)}
        assert table["bundles"] == {0: bundle, 1: bundle}
        nodes = bundle_node_ids(pg)
        assert len(set(nodes)) == 2
        assert nodes[0] == ray.get_runtime_context().get_node_id()
    finally:
        assert wait_removed(pg)


def test_actors_land_on_their_node_and_gpu(cluster_2x2):
    cluster = ClusterConfig()
    placement = resolve_placement(cluster)
    pg = create_placement_group(cluster, "test-pinning", timeout_s=30)
    try:
        nodes = bundle_node_ids(pg)
        found = start_pinned(pg, placement)
    finally:
        wait_removed(pg)
    for slot in placement.slots:
        node, gpus = found[slot.name]
        assert node == nodes[slot.bundle], slot
        assert len(gpus) == 1, (slot, gpus)
    gpu = {name: gpus[0] for name, (_, gpus) in found.items()}
    assert gpu["rollout:0"] == gpu["reward:0"]  # rank 0's GPU, shared
    assert gpu["inference:0"] != gpu["rollout:0"]
    assert gpu["actor:0"] != gpu["actor:1"]


def test_one_node_one_gpu_topology_places_everything_on_one_gpu(cluster_2x2):
    placement_spec = {"rollout": 0, "inference": 0, "actor": 0, "reward": 0}
    cluster = ClusterConfig(num_nodes=1, num_gpus_per_node=1, component_placement=placement_spec)
    placement = resolve_placement(cluster)
    pg = create_placement_group(cluster, "test-1x1", timeout_s=30)
    try:
        found = start_pinned(pg, placement)
    finally:
        wait_removed(pg)
    here = ray.get_runtime_context().get_node_id()
    assert {node for node, _ in found.values()} == {here}
    assert len({tuple(gpus) for _, gpus in found.values()}) == 1
    assert all(placement.gpu_fraction(s) == 0.25 for s in placement.slots)


def test_infeasible_group_fails_in_time_with_per_node_diagnostic(cluster_2x2):
    before = {pg.id.hex() for pg, _ in live_groups(lambda _: True)}
    free_gpus = settled_free_gpus()
    cluster = ClusterConfig(num_nodes=3)
    start = time.monotonic()
    with pytest.raises(PlacementError) as info:
        create_placement_group(cluster, "test-three-nodes", timeout_s=SHORT_TIMEOUT_S)
    assert time.monotonic() - start < SHORT_TIMEOUT_S + 5
    message = str(info.value)
    assert "test-three-nodes" in message and "3 nodes" in message and "STRICT_SPREAD" in message
    per_node = re.findall(r"node (\w{8}) \(127\.0\.0\.1\) (\d+)/2 GPU free", message)
    alive = {n["NodeID"][:8] for n in ray.nodes() if n["Alive"]}
    assert {node for node, _ in per_node} == alive
    assert sum(int(free) for _, free in per_node) == free_gpus
    assert "lower cluster.num_nodes" in message  # what to do
    assert {pg.id.hex() for pg, _ in live_groups(lambda _: True)} <= before
    assert not live_groups(lambda name: name == "test-three-nodes")


def test_bundle_0_waits_for_the_drivers_node(cluster_2x2):
    """With this node's GPUs taken, a 1-node group must not fall back to the other node."""
    here = ray.get_runtime_context().get_node_id()
    hog = placement_group([{"GPU": 2}], bundle_label_selector=[{"ray.io/node-id": here}])
    ray.get(hog.ready(), timeout=30)
    try:
        cluster = ClusterConfig(
            num_nodes=1, component_placement={"rollout": 0, "inference": 1, "actor": 0, "reward": 1}
        )
        with pytest.raises(PlacementError, match=f"bundle 0 on this node \\({here[:8]}\\)"):
            create_placement_group(cluster, "test-not-here", timeout_s=SHORT_TIMEOUT_S)
    finally:
        assert wait_removed(hog)


def test_request_returns_before_the_group_is_ready(cluster_2x2):
    pg = request_placement_group(ClusterConfig(num_nodes=3), "test-pending")
    try:
        assert placement_group_table(pg)["state"] in ("PENDING", "RESCHEDULING")
    finally:
        assert wait_removed(pg)


# --- three nodes, one GPU a bundle: a third node joins the session's cluster ------------------


def test_three_nodes_one_gpu_each_places(cluster_2x2):
    """num_nodes=3 x num_gpus_per_node=1: three bundles of one GPU, one a node, bundle 0 on the
    driver's node, each component on its bundle's node with one GPU of it. The third node (one
    GPU) joins the session's 2x2 cluster for this test and leaves after it."""
    node = cluster_2x2.add_node(gpus=1)
    try:
        cluster = ClusterConfig(
            num_nodes=3,
            num_gpus_per_node=1,
            component_placement={"rollout": 0, "reward": 0, "inference": 1, "actor": 2},
        )
        placement = resolve_placement(cluster)
        pg = create_placement_group(cluster, "three", timeout_s=30)
        try:
            bundles = bundle_node_ids(pg)
            found = start_pinned(pg, placement)
        finally:
            assert wait_removed(pg)
    finally:
        cluster_2x2.remove_node(node)  # the later tests count the session's nodes
    assert len(set(bundles)) == 3 and bundles[0] == ray.get_runtime_context().get_node_id()
    assert node in bundles
    for slot in placement.slots:
        where, gpus = found[slot.name]
        assert where == bundles[slot.bundle], slot
        assert len(gpus) == 1, slot

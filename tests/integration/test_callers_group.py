"""A run inside a placement group its caller owns: the calling task's own group ("current"),
and groups passed in that do not fit the config (refused by name, nothing written).
A real 2-node cluster, real groups; the run never removes a group it did not create."""

from __future__ import annotations

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from support import ONE_RANK

from rlinf_twoworker import run_grpo_two_worker
from rlinf_twoworker.api.demo import demo_config
from rlinf_twoworker.cluster.placement import bundle_node_ids, wait_removed
from rlinf_twoworker.errors import TwoWorkerError

TIMEOUT = 600


@pytest.fixture(scope="module")
def inputs(demo_inputs):
    return demo_inputs


def _group(
    strategy: str = "STRICT_SPREAD", gpus: float = 2, bundles: int = 2, first: str | None = None
):
    """A group as a caller (a Tune trial, a program that reserved its GPUs) would make it,
    bundle 0 on node `first` (this node when None)."""
    first = first or ray.get_runtime_context().get_node_id()
    pg = placement_group(
        [{"GPU": gpus, "CPU": 1} for _ in range(bundles)],
        strategy=strategy,
        bundle_label_selector=[{"ray.io/node-id": first}] + [{}] * (bundles - 1),
    )
    assert ray.get(pg.ready(), timeout=60) is not None
    return pg


def test_a_run_in_the_group_its_calling_task_runs_in_leaves_the_group_to_the_caller(
    cluster_2x2, inputs, tmp_path
):
    """A Ray task of the caller's, in bundle 1 of the caller's group, starts a run with
    placement_group="current" (what a Tune trial does). Bundle 0 is where the caller put it, on
    the other node than the task's: the Head's components go there, the controller stays with
    the calling task, and the group stays the caller's."""
    here = ray.get_runtime_context().get_node_id()
    other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
    pg = _group(first=other)
    cfg = demo_config(inputs, tmp_path, "callers", ONE_RANK)

    @ray.remote(num_cpus=0)
    def trial(cfg) -> dict:
        handle = run_grpo_two_worker(cfg, placement_group="current")
        report = handle.result(timeout=TIMEOUT)
        return {
            "passed": report.passed,
            "errors": report.errors,
            "group": handle.placement_group.id.hex(),
            "placed": {row["component"]: row["node_id"] for row in handle.topology()},
            "caller": ray.get_runtime_context().get_node_id(),
        }

    try:
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1)
        run = ray.get(trial.options(scheduling_strategy=strategy).remote(cfg), timeout=TIMEOUT)
        assert run["passed"], run["errors"]
        assert run["group"] == pg.id.hex()
        assert bundle_node_ids(pg) == [other, here] and run["caller"] == here
        placed = run["placed"]
        assert placed["rollout"] == placed["reward"] == placed["inference"] == other
        assert placed["actor"] == here
        # Released what it made (its actors), not the caller's group.
        assert placement_group_table(pg)["state"] == "CREATED"
        log = (tmp_path / "callers/log/main.log").read_text()
        assert f"PLACEMENT_GROUP the caller's {pg.id.hex()[:8]} (not removed)" in log
        assert f"PLACEMENT bundle 0 (the Head's components) on node {other[:8]}" in log

        # The caller can use its group again at once: the run gave its GPUs back.
        @ray.remote(num_gpus=2, num_cpus=0)
        def holds_the_gpus() -> list:
            return ray.get_gpu_ids()

        gpus = holds_the_gpus.options(scheduling_strategy=strategy).remote()
        assert len(ray.get(gpus, timeout=60)) == 2
    finally:
        wait_removed(pg)
    with pytest.raises(TwoWorkerError, match="does not run in a placement group"):
        # The Driver runs in none.
        run_grpo_two_worker(demo_config(inputs, tmp_path, "nogroup"), placement_group="current")
    assert not (tmp_path / "nogroup").exists()


@pytest.mark.parametrize(
    ("group", "named"),
    [
        ({"strategy": "SPREAD"}, "strategy is SPREAD, not STRICT_SPREAD"),
        (
            {"gpus": 1},
            r"GPUs per bundle are not cluster.num_gpus_per_node=2 \(bundle 0: 1, bundle 1: 1\)",
        ),
        ({"bundles": 1}, "1 bundles, not cluster.num_nodes=2"),
    ],
)
def test_a_group_that_does_not_fit_is_refused_by_name(cluster_2x2, inputs, tmp_path, group, named):
    pg = _group(**group)
    try:
        with pytest.raises(TwoWorkerError, match=f"does not fit the config: .*{named}"):
            run_grpo_two_worker(demo_config(inputs, tmp_path, "misfit"), placement_group=pg)
        assert not (tmp_path / "misfit").exists()  # refused before anything was written
        assert placement_group_table(pg)["state"] == "CREATED"
    finally:
        wait_removed(pg)

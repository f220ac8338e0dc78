"""Shared fixtures: a real 2-node Ray cluster on loopback, shut down after the tests using it."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("NCCL_IB_DISABLE", "1")

import pytest  # noqa: E402

from rlinf_twoworker.cluster.local import LocalCluster  # noqa: E402


@pytest.fixture(scope="session")
def cluster_2x2():
    """A LocalCluster(2, 2) shared by the session; this process is connected to it."""
    with LocalCluster(num_nodes=2, gpus_per_node=2) as cluster:
        yield cluster


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)

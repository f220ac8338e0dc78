"""Shared fixtures: a real 2-node Ray cluster on loopback, shut down after the tests using it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("NCCL_IB_DISABLE", "1")

import pytest  # noqa: E402
from support import (  # noqa: E402
    NODE_CODE,
    REFERENCE_LOGGERS,
    REFERENCE_SETTINGS,
    FinishedRun,
)

from rlinf_twoworker.cluster.local import LocalCluster  # noqa: E402


@pytest.fixture(scope="session")
def cluster_2x2():
    """A LocalCluster(2, 2) shared by the session; this process is connected to it. Ray's
    metrics are reported every 2 s, not 10 (test_metric_loggers waits for a few reports). Its
    nodes start with NODE_CODE on their PYTHONPATH (this process's environment is restored
    once they have started)."""
    system = {"metrics_report_interval_ms": 2000}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", str(NODE_CODE), prepend=os.pathsep)
        cluster = LocalCluster(num_nodes=2, gpus_per_node=2, system_config=system).start()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module", autouse=True)
def no_kept_processes_left():
    """A module's runs may keep their processes for one another (support.KEPT); none are left
    to the next module: placement groups made outside the library (the callers' groups, Tune's
    trials', the probes' tests) would wait behind their GPUs."""
    yield
    from rlinf_twoworker import release_kept

    release_kept()


@pytest.fixture(scope="session")
def demo_inputs(tmp_path_factory):
    """The demo's inputs (its default task), made once for the session; read-only: a test that
    changes inputs makes its own."""
    from rlinf_twoworker.api.demo import make_inputs

    return make_inputs(tmp_path_factory.mktemp("demo-inputs"))


@pytest.fixture(scope="session")
def finished_inputs(tmp_path_factory):
    """The demo's inputs on the digit task (answers differ in reward from random weights on),
    made once for the session; read-only."""
    from rlinf_twoworker.api.demo import make_inputs

    return make_inputs(tmp_path_factory.mktemp("finished-inputs"), task="digit7")


@pytest.fixture(scope="session")
def reference_run(cluster_2x2, finished_inputs, tmp_path_factory) -> FinishedRun:
    """The demo's 2-step run on the digit task with REFERENCE_SETTINGS, run once for the
    session: test_engine checks it end to end, test_warmup compares a warmed-up run with it,
    test_metric_loggers reads its metrics back from every logger (REFERENCE_LOGGERS) and Ray's
    endpoint, and the tests that read a run back use its directory (they change only copies
    of it)."""
    import ray

    from rlinf_twoworker import run_grpo_two_worker
    from rlinf_twoworker.api.demo import demo_config

    root = tmp_path_factory.mktemp("reference")
    cfg = demo_config(finished_inputs, root, "e2e", [*REFERENCE_SETTINGS, *REFERENCE_LOGGERS])
    with pytest.MonkeyPatch.context() as env:  # forwarded to the controller as the run starts
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        env.delenv("MLFLOW_TRACKING_URI", raising=False)  # MLflow's file store in the run's dir
        handle = run_grpo_two_worker(cfg)
    steps = [ray.get(handle.step(n), timeout=300) for n in (1, 2)]
    checkpoint = ray.get(handle.checkpoint(2), timeout=300)
    report = handle.result(timeout=300)
    return FinishedRun(cfg, handle, steps, checkpoint, report, root / "e2e")


@pytest.fixture(scope="session")
def finished_run(reference_run) -> Path:
    """The reference run's directory, finished and verified; read-only."""
    assert reference_run.report.passed, reference_run.report.errors
    return reference_run.run_dir


def run_in_own_process(script: str, *args: str, timeout: float) -> Any:
    """Run `script` with `args` in a Python process of its own, away from the session's cluster
    (RAY_ADDRESS removed: it starts and connects to a cluster of its own); it must exit 0 and
    print a JSON value on its last line, which is returned."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def own_process():
    """run_in_own_process, for tests whose job needs a Ray cluster of its own."""
    return run_in_own_process


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """GPU tests skip without a GPU. The tests on the session's cluster (cluster_2x2, directly
    or through reference_run and the module fixtures) are one group for pytest-xdist's
    `--dist loadgroup` (pyproject's addopts): one worker runs them in order on that cluster (a
    cluster per worker would not fit this machine, and the finished runs are shared), while the
    other runs the rest beside them: the unit tests, and the integration tests whose clusters
    and processes are their own (examples, preload, compile cache, the CLI's checks)."""
    cluster = pytest.mark.xdist_group("cluster")
    for item in items:
        if "cluster_2x2" in getattr(item, "fixturenames", ()):
            item.add_marker(cluster)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)

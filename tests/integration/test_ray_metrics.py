"""A run's metrics in Ray's metrics system (run/ray_metrics.py), read back from the Prometheus
endpoint of the controller's node, on loopback, as the cluster's Prometheus would scrape it."""

from __future__ import annotations

import logging
import math
import re
import time
import urllib.request
from collections.abc import Callable

import ray
from support import ONE_RANK

from rlinf_twoworker import run_grpo_two_worker
from rlinf_twoworker.api.demo import demo_config, make_inputs
from rlinf_twoworker.run import ray_metrics

TIMEOUT = 600
SAMPLE = re.compile(r"^(\w+)\{(.*)\} (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metrics_url() -> str:
    """The endpoint of this process's node: the controller runs on the Driver's node."""
    here = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == here)
    assert node["NodeManagerAddress"] == "127.0.0.1"
    return f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of the endpoint's text format."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return [
        (m[1], dict(LABEL.findall(m[2])), float(m[3]))
        for m in map(SAMPLE.match, text.splitlines())
        if m
    ]


def wait_for(
    url: str,
    name: str,
    labels: dict[str, str],
    timeout: float,
    until: Callable[[float], bool] = lambda value: True,
) -> float:
    """The value of the series `name` with `labels` once the endpoint shows one that `until`
    accepts; Ray's agent exports what a process recorded once every report interval."""
    deadline = time.monotonic() + timeout
    seen: list[float] = []
    while True:
        seen = [v for n, tags, v in scrape(url) if n == name and labels.items() <= tags.items()]
        if seen and until(seen[0]):
            return seen[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}{labels} not exported within {timeout} s ({seen})")
        time.sleep(1)


def test_a_steps_reward_and_the_runs_state_reach_rays_metrics_endpoint(cluster_2x2, tmp_path):
    run_id = "ray-metrics"
    inputs = make_inputs(tmp_path / "inputs")
    cfg = demo_config(
        inputs, tmp_path, run_id, [*ONE_RANK, "runner.max_steps=1", "runner.save_interval=-1"]
    )
    # The session's cluster reports every 2 s (conftest.py; Ray's default is 10 s): a value
    # shows within two report intervals.
    interval_s = max(ray._config.metrics_report_interval_ms(), 1000) / 1000
    export_s = 3 * interval_s + 10
    handle = run_grpo_two_worker(cfg)
    result = ray.get(handle.step(1), timeout=TIMEOUT)
    recorded_at = time.monotonic()  # the controller records a step before its future resolves
    url = metrics_url()
    metric = "ray_rlinf_twoworker_step_metric"
    expected = result.metrics["rollout/reward_scores"]

    reward = wait_for(url, metric, {"run_id": run_id, "name": "rollout/reward_scores"}, export_s)
    assert math.isclose(reward, expected, rel_tol=1e-9, abs_tol=1e-12)
    step_s = wait_for(url, metric, {"run_id": run_id, "name": "time/step"}, export_s)
    assert math.isclose(step_s, result.timings["time/step"], rel_tol=1e-9)
    assert wait_for(url, "ray_rlinf_twoworker_step", {"run_id": run_id}, export_s) == 1
    assert wait_for(url, "ray_rlinf_twoworker_steps_total", {"run_id": run_id}, export_s) == 1

    report = handle.result(timeout=TIMEOUT)
    assert report.passed, report.errors
    state = "ray_rlinf_twoworker_state"
    succeeded = {"run_id": run_id, "state": "succeeded"}
    assert wait_for(url, state, succeeded, export_s, until=lambda v: v == 1) == 1
    assert wait_for(url, state, {"run_id": run_id, "state": "running"}, export_s) == 0

    # Ray's agent forgets a gauge its process has not recorded for two report intervals (after
    # the one it was exported in); the finished step's values stay while the controller lives.
    time.sleep(max(0.0, recorded_at + 3.5 * interval_s - time.monotonic()))
    reward = wait_for(url, metric, {"run_id": run_id, "name": "rollout/reward_scores"}, 0)
    assert math.isclose(reward, expected, rel_tol=1e-9, abs_tol=1e-12)


def test_a_failed_export_warns_once_and_never_reaches_the_run(monkeypatch, caplog):
    monkeypatch.setattr(ray_metrics, "_warned", False)
    with caplog.at_level(logging.WARNING, logger=ray_metrics.__name__):
        for step in (1, 2):  # a value that is not a number: the export fails, twice
            ray_metrics.export_step("broken", step, {"rollout/reward_scores": "n/a"})  # type: ignore[dict-item]
    warnings = [r for r in caplog.records if r.name == ray_metrics.__name__]
    assert len(warnings) == 1
    assert "the run goes on" in warnings[0].getMessage()

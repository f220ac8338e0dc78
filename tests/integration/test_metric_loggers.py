"""Where a run's metrics go: runner.logger.logger_backends (wandb offline, MLflow's file store,
beside TensorBoard) and Ray's metrics system (run/ray_metrics.py), read back from the Prometheus
endpoint of the controller's node on loopback, as the cluster's Prometheus would scrape it; the
session's reference run (2 x 2, conftest.py), no network."""

from __future__ import annotations

import json
import logging
import math
import re
import struct
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import ray
from support import LOGGED_EXTRAS

from rlinf_twoworker.config import load_config, to_typed
from rlinf_twoworker.errors import ConfigError
from rlinf_twoworker.run import ray_metrics
from rlinf_twoworker.run.metric_loggers import forwarded_env, missing_backends

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


def wandb_history(run_file: Path) -> list[dict]:
    """The history records of an offline wandb run file (LevelDB's log format: 32 KiB blocks of
    records with a 7-byte header, crc32, length, type; after the file's 7-byte W&B header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos = run_file.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", run_file
    records, pending = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            records.append(pending)
            pending = b""
    history = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            )
    return history


def test_every_steps_metrics_reach_each_logger_and_rays_endpoint(reference_run, monkeypatch):
    """The session's reference run logs with every backend (conftest.py, REFERENCE_LOGGERS):
    wandb (offline) and MLflow hold each step's metrics, and Ray's metrics endpoint of the
    controller's node shows the last step's and the run's state, and keeps them while the
    controller lives. wandb and MLflow are optional extras: where one is absent, its part is
    skipped."""
    extras = LOGGED_EXTRAS
    run_id = reference_run.run_dir.name
    # The session's cluster reports every 2 s (conftest.py; Ray's default is 10 s): a value
    # shows within two report intervals.
    interval_s = max(ray._config.metrics_report_interval_ms(), 1000) / 1000
    export_s = 3 * interval_s + 10
    handle, steps = reference_run.handle, reference_run.steps
    last = steps[-1]
    recorded_at = last.finished_at  # the controller records a step before its future resolves

    # Ray's metrics system: the last step's values and the step counters, then the run's state.
    url = metrics_url()
    metric = "ray_rlinf_twoworker_step_metric"
    expected = last.metrics["rollout/reward_scores"]
    reward = {"run_id": run_id, "name": "rollout/reward_scores"}
    close = lambda want: lambda v: math.isclose(v, want, rel_tol=1e-9, abs_tol=1e-12)  # noqa: E731
    wait_for(url, metric, reward, export_s, until=close(expected))
    step_s = {"run_id": run_id, "name": "time/step"}
    wait_for(url, metric, step_s, export_s, until=close(last.timings["time/step"]))
    for gauge in ("ray_rlinf_twoworker_step", "ray_rlinf_twoworker_steps_total"):
        wait_for(url, gauge, {"run_id": run_id}, export_s, until=lambda v: v == 2)
    assert handle.result(timeout=TIMEOUT).passed
    state = "ray_rlinf_twoworker_state"
    succeeded = {"run_id": run_id, "state": "succeeded"}
    assert wait_for(url, state, succeeded, export_s, until=lambda v: v == 1) == 1
    assert wait_for(url, state, {"run_id": run_id, "state": "running"}, export_s) == 0
    # Ray's agent forgets a gauge its process has not recorded for two report intervals (after
    # the one it was exported in); the finished step's values stay while the controller lives.
    time.sleep(max(0.0, recorded_at + 3.5 * interval_s - time.time()))
    assert close(expected)(wait_for(url, metric, reward, 0))

    log_dir = reference_run.run_dir
    if "wandb" in extras:
        [run_file] = (log_dir / "wandb").glob("wandb/offline-run-*/run-*.wandb")
        history = {int(h["_step"]): h for h in wandb_history(run_file)}
        assert sorted(history) == [1, 2]
        for step in steps:
            logged = history[step.step]
            for tag, value in step.scalars().items():
                assert logged[tag] == pytest.approx(value, rel=1e-6, abs=1e-9), tag
    if "mlflow" in extras:
        from mlflow.tracking import MlflowClient

        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient((log_dir / "mlruns").resolve().as_uri())
        experiment = client.get_experiment_by_name("reference")
        [run] = client.search_runs([experiment.experiment_id])
        assert run.info.run_name == run_id and run.info.status == "FINISHED"
        assert run.data.params["runner.logger.project_name"] == "reference"
        for tag in ("rollout/reward_scores", "actor/training/actor/final_loss", "time/step"):
            points = {m.step: m.value for m in client.get_metric_history(run.info.run_id, tag)}
            assert points == {s.step: pytest.approx(s.scalars()[tag]) for s in steps}, tag
        every = set(run.data.metrics)
        assert every == set(last.scalars()), every ^ set(last.scalars())


def test_swanlab_and_unknown_backends_are_refused_by_name():
    with pytest.raises(ConfigError, match="swanlab is not a backend of the library"):
        to_typed(load_config(None, ["runner.logger.logger_backends=[tensorboard,swanlab]"]))
    with pytest.raises(ConfigError, match="the backends are tensorboard, wandb, mlflow"):
        to_typed(load_config(None, ["runner.logger.logger_backends=[neptune]"]))


def test_a_backend_whose_package_is_absent_names_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # Python's own way to make it unimportable
    [problem] = missing_backends(["tensorboard", "mlflow"])
    assert "pip install 'rlinf_twoworker[mlflow]'" in problem


def test_only_a_run_that_logs_to_wandb_or_mlflow_forwards_their_environment(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    assert forwarded_env(["tensorboard"]) == {}
    forwarded = forwarded_env(["tensorboard", "wandb"])
    assert forwarded["WANDB_MODE"] == "offline"
    assert forwarded["MLFLOW_TRACKING_URI"] == "http://tracking:5000"


def test_a_failed_export_warns_once_and_never_reaches_the_run(monkeypatch, caplog):
    monkeypatch.setattr(ray_metrics, "_warned", False)
    with caplog.at_level(logging.WARNING, logger=ray_metrics.__name__):
        for step in (1, 2):  # a value that is not a number: the export fails, twice
            ray_metrics.export_step("broken", step, {"rollout/reward_scores": "n/a"})  # type: ignore[dict-item]
    warnings = [r for r in caplog.records if r.name == ray_metrics.__name__]
    assert len(warnings) == 1
    assert "the run goes on" in warnings[0].getMessage()

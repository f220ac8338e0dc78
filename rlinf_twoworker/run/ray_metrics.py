"""A run's live metrics in Ray's metrics system, for the Ray dashboard and the cluster's
Prometheus/Grafana: the controller records them, its node's metrics agent exports them.

Ray exports a metric named X as `ray_X` (a counter as `ray_X_total`), on the endpoint of the
node the controller runs on (the Driver's):

    rlinf_twoworker_step_metric{run_id, name}  gauge: the last value of each step metric and
                                               stage time; name is its TensorBoard tag
                                               (rollout/reward_scores, time/actor/training, ...)
    rlinf_twoworker_step{run_id}               gauge: the last step done
    rlinf_twoworker_steps{run_id}              counter: the steps this controller ran
    rlinf_twoworker_state{run_id, state}       gauge: 1 for the run's state, 0 for the others

The step metrics' keys hold `/`, which Prometheus names cannot, so they are one metric with the
key as a tag: one series per key and run, a few dozen (the memory keys grow with the ranks).
Exporting is best effort: a failure logs one warning and never reaches the run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from ray.util.metrics import Counter, Gauge

PREFIX = "rlinf_twoworker_"
STATES = ("pending", "running", "succeeded", "failed", "cancelled")
"""The controller's states (RunController.state), each a series of rlinf_twoworker_state."""

_log = logging.getLogger(__name__)


class RayMetrics:
    """The metrics of one controller process and the last value of every gauge series."""

    def __init__(self) -> None:
        self.step_metric = Gauge(
            f"{PREFIX}step_metric",
            "The last value of a step metric or stage time; name is its TensorBoard tag.",
            tag_keys=("run_id", "name"),
        )
        self.step = Gauge(f"{PREFIX}step", "The last step done.", tag_keys=("run_id",))
        self.steps = Counter(f"{PREFIX}steps", "Steps run.", tag_keys=("run_id",))
        self.state = Gauge(
            f"{PREFIX}state",
            "1 for the run's state, 0 for the other states.",
            tag_keys=("run_id", "state"),
        )
        self.last: dict[tuple[Gauge, tuple[tuple[str, str], ...]], float] = {}
        self.lock = threading.Lock()

    def record_step(self, run_id: str, step: int, scalars: Mapping[str, float]) -> None:
        values = {name: float(value) for name, value in scalars.items()}
        for name, value in values.items():
            self._set(self.step_metric, {"run_id": run_id, "name": name}, value)
        self._set(self.step, {"run_id": run_id}, float(step))
        self.steps.inc(1.0, {"run_id": run_id})

    def record_state(self, run_id: str, state: str) -> None:
        for each in dict.fromkeys((*STATES, state)):
            self._set(self.state, {"run_id": run_id, "state": each}, float(each == state))

    def refresh(self) -> None:
        """Record every gauge's last value again: Ray's metrics agent forgets a gauge series
        its process has not recorded for two report intervals (Ray >= 2.60), and a step can
        take longer than that."""
        with self.lock:
            last = list(self.last.items())
        for (gauge, tags), value in last:
            gauge.set(value, dict(tags))

    def _set(self, gauge: Gauge, tags: dict[str, str], value: float) -> None:
        gauge.set(value, tags)
        with self.lock:
            self.last[(gauge, tuple(tags.items()))] = value


_metrics: RayMetrics | None = None
_warned = False


def export_step(run_id: str, step: int, scalars: Mapping[str, float]) -> None:
    """Record step `step`'s metrics and stage times (`scalars`, TensorBoard's tags and values)."""
    _export(lambda metrics: metrics.record_step(run_id, step, scalars))


def export_state(run_id: str, state: str) -> None:
    """Record the run's state (one of STATES)."""
    _export(lambda metrics: metrics.record_state(run_id, state))


def refresh_period_s() -> float:
    """Half of Ray's report interval (metrics_report_interval_ms, at least 1 s as Ray uses it)."""
    import ray

    return max(ray._config.metrics_report_interval_ms(), 1000) / 2000


def _export(record: Callable[[RayMetrics], None]) -> None:
    global _metrics
    try:
        if _metrics is None:
            _metrics = RayMetrics()
            _start_refresher(_metrics, refresh_period_s())
        record(_metrics)
    except Exception as exc:  # the metrics are a view of the run: they never fail it
        _warn_once(exc)


def _start_refresher(metrics: RayMetrics, period_s: float) -> None:
    """A daemon thread that keeps the last values exported while the process lives."""

    def loop() -> None:
        while True:
            time.sleep(period_s)
            try:
                metrics.refresh()
            except Exception as exc:
                _warn_once(exc)

    threading.Thread(target=loop, name="rlinf-ray-metrics", daemon=True).start()


def _warn_once(exc: Exception) -> None:
    global _warned
    if not _warned:
        _warned = True
        _log.warning(
            "exporting the run's metrics to Ray's metrics system failed (%s: %s); the run goes "
            "on, the Ray dashboard and Prometheus may miss its metrics; TensorBoard has them",
            type(exc).__name__,
            exc,
        )

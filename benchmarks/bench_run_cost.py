"""What one CPU run costs the machine: the unit of the test suite's time on a CPU host.

Most of the CI's time is the integration tests' real runs on a 2 x 2 LocalCluster, and on a
host of few cores a run's cost is its CPU-seconds, not its wall time: its processes import
torch and transformers at once and share the cores. This starts one LocalCluster (as the
tests' session does) and runs the demo's 2-step job on it `--runs` times, one after another,
recording for each run:

- cpu_s: the whole host's CPU-seconds from the call to the postflight's report (/proc/stat:
  every process, Ray's own included);
- wall_s and to_first_step (the run's own start-up record);
- for the last run, each process's CPU-seconds over the run, by Ray's process title
  (ray::ActorWorker, ...), sampled with psutil every 0.3 s (a process that ends between two
  samples loses its last 0.3 s).

The first run pays what a cluster's first run pays once (the node probes' pooled workers
import the heavy modules); the later ones are what each further run of a test session costs.

    python -m benchmarks run_cost --runs 3
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("NCCL_IB_DISABLE", "1")

from record import write_result  # noqa: E402


def host_cpu_s() -> float:
    """The host's busy CPU-seconds so far (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class ProcessCpu:
    """Each process's CPU-seconds (its children's included), sampled until stopped."""

    def __init__(self, interval_s: float = 0.3) -> None:
        self.interval_s = interval_s
        self.seen: dict[int, tuple[str, float]] = {}
        self.base: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        import psutil  # Ray ships it and puts it on the path once imported

        for proc in psutil.process_iter(["pid", "cmdline", "name"]):
            try:
                t = proc.cpu_times()
                title = " ".join(proc.info["cmdline"] or []).strip() or proc.info["name"]
                used = t.user + t.system + t.children_user + t.children_system
            except Exception:  # gone between listing and reading
                continue
            self.seen[proc.pid] = (title, used)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> ProcessCpu:
        self._sample()
        self.base = {pid: used for pid, (_, used) in self.seen.items()}
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def by_title(self, top: int = 15) -> dict[str, float]:
        """CPU-seconds over the window by process title (Ray workers' ray::<Class>), largest
        first; this benchmark's own process under 'this process'."""
        totals: collections.Counter[str] = collections.Counter()
        for pid, (title, used) in self.seen.items():
            name = "this process" if pid == os.getpid() else title.split("  ")[0][:40]
            totals[name] += used - self.base.get(pid, 0.0)
        return {k: round(v, 2) for k, v in totals.most_common(top) if v >= 0.05}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="2-step runs, one after another")
    parser.add_argument("--out", help="the result file (default: benchmarks/results/...)")
    parser.add_argument(
        "--preload",
        action="store_true",
        help="start the cluster with LocalCluster(preload=True): its workers import ahead",
    )
    parser.add_argument(
        "--override", action="append", default=[], help="a config override for every run"
    )
    args = parser.parse_args(argv)

    from rlinf_twoworker import run_grpo_two_worker
    from rlinf_twoworker.api.demo import demo_config, make_inputs
    from rlinf_twoworker.cluster.local import LocalCluster

    root = Path(tempfile.mkdtemp(prefix="run-cost-"))
    inputs = make_inputs(root / "inputs", task="digit7")
    runs: list[dict[str, Any]] = []
    all_cpu0, all_wall0 = host_cpu_s(), time.monotonic()
    with LocalCluster(num_nodes=2, gpus_per_node=2, preload=args.preload):
        for i in range(args.runs):
            last = i == args.runs - 1
            sampler = ProcessCpu() if last else None
            if sampler is not None:
                sampler.__enter__()
            cpu0, wall0 = host_cpu_s(), time.monotonic()
            cfg = demo_config(inputs, root / "runs", f"cost-{i}", args.override)
            handle = run_grpo_two_worker(cfg)
            report = handle.result(timeout=900)
            row: dict[str, Any] = {
                "run": i + 1,
                "passed": report.passed,
                "cpu_s": round(host_cpu_s() - cpu0, 2),
                "wall_s": round(time.monotonic() - wall0, 2),
                "to_first_step": handle.startup().get("to_first_step"),
            }
            if sampler is not None:
                sampler.__exit__()
                row["cpu_s_by_process"] = sampler.by_title()
            runs.append(row)
            print(row, flush=True)
        all_cpu, all_wall = host_cpu_s() - all_cpu0, time.monotonic() - all_wall0
    later = runs[1:] or runs
    payload = {
        "cores": os.cpu_count(),
        "preload": args.preload,
        "overrides": args.override,
        "cluster_and_runs_cpu_s": round(all_cpu, 2),
        "cluster_and_runs_wall_s": round(all_wall, 2),
        "runs": runs,
        "later_runs_mean_cpu_s": round(sum(r["cpu_s"] for r in later) / len(later), 2),
        "later_runs_mean_wall_s": round(sum(r["wall_s"] for r in later) / len(later), 2),
    }
    name = f"demo-2step-x{args.runs}" + ("-preload" if args.preload else "")
    path = write_result("run_cost", name, None, payload, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

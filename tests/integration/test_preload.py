"""rlinf_twoworker.preload: Ray's idle workers import the library ahead of a run, on every node,
without touching CUDA, and hand a GPU actor its own GPUs afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from support import ONE_RANK


def test_preload_imports_cleanly_without_touching_cuda():
    code = (
        "import rlinf_twoworker.preload as p, torch, sys; "
        "assert p.cuda_untouched(); "
        "assert 'rlinf_twoworker.workers.actor' in sys.modules; "
        "assert 'transformers.modeling_utils' in sys.modules; print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# The whole tutorial job (demo size) on a cluster shaped as KubeRay and hosted Ray shape it (a
# Head of CPUs only, then 2 GPU nodes) whose workers preload the library, then a GPU actor on
# each GPU node, in the workers Ray started since. In a process of its own: this test session's
# process is connected to its own cluster.
RUN_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import ray
    from rlinf_twoworker.api.demo import demo_config, make_inputs
    from rlinf_twoworker.api.handle import run_grpo_two_worker
    from rlinf_twoworker.cluster.local import LocalCluster

    @ray.remote(num_gpus=1, num_cpus=0)
    class Probe:
        def __init__(self):
            self.constructed = time.time()

        def report(self):
            import rlinf_twoworker.preload as preload
            from rlinf_twoworker.workers.process import process_times

            return {
                "node": ray.get_runtime_context().get_node_id(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_untouched": preload.cuda_untouched(),
                "preloaded_before_work": preload._began < self.constructed,
                "transformers_loaded": "transformers.modeling_utils" in sys.modules,
                "process_times_preloaded": process_times(time.time())["preloaded"],
            }

    root = Path(sys.argv[1])
    inputs = make_inputs(root / "inputs")
    cfg = demo_config(inputs, root / "runs", "preloaded", json.loads(sys.argv[2]))
    with LocalCluster(num_nodes=2, gpus_per_node=2, cpus_per_node=1, preload=True, cpu_head=True):
        here = ray.get_runtime_context().get_node_id()
        [own] = [n for n in ray.nodes() if n["NodeID"] == here]
        handle = run_grpo_two_worker(cfg)
        first = ray.get(handle.step(1), timeout=600)
        ray.get(handle.checkpoint(2), timeout=600)
        report = handle.result(timeout=600)
        placed = {row["component"]: row["node_id"] for row in handle.topology()}
        probes = [
            Probe.options(resources={f"local_node_{i}": 0.01}).remote() for i in range(2)
        ]
        probed = ray.get([p.report.remote() for p in probes], timeout=300)
    print(json.dumps({"passed": report.passed, "errors": report.errors[:3],
                      "startup": first.startup, "probes": probed, "here": here,
                      "driver_gpus": own["Resources"].get("GPU", 0), "placed": placed}))
    """
)


def test_the_tutorial_job_on_a_cpu_head_runs_in_preloaded_workers(tmp_path, own_process):
    """Two properties of one run (one cluster start instead of two):
    - A Head of CPUs only (KubeRay, hosted Ray): the controller runs with the Driver, bundle 0
      (rollout, reward, inference) on the first GPU node Ray finds, named in the log.
    - Preloaded workers: every component and the probes run in workers that imported the
      library ahead (or on their start); the run verifies and main.log names them. Ray's
      workers import it when they start (those it starts ahead of a job, on every node, while
      they idle; when they start is Ray's) before taking any work, and leave CUDA untouched: a
      GPU actor started after the run, on each GPU node, sees only the GPU Ray gave it."""
    # ONE_RANK: the subject is where components run and what their workers imported, not the
    # actor's ranks.
    out = own_process(RUN_SCRIPT, str(tmp_path), json.dumps(ONE_RANK), timeout=1200)
    assert out["passed"], out["errors"]
    log = (tmp_path / "runs" / "preloaded" / "log" / "main.log").read_text()
    # The CPU head.
    assert out["driver_gpus"] == 0
    placed, here = out["placed"], out["here"]
    assert placed["rollout"] == placed["reward"] == placed["inference"] != here
    assert placed["actor"] not in (here, placed["rollout"])
    assert f"on node {placed['rollout'][:8]}" in log and f"controller's node {here[:8]}" in log
    # The preloaded workers.
    [line] = [line for line in log.splitlines() if "STARTUP preloaded workers" in line]
    for who in ("rollout:0", "reward:0", "inference:0", "actor:0"):
        assert who in line, line
    assert "of 4 components" in line
    reports = out["probes"]
    assert len({r["node"] for r in reports}) == 2  # one on each GPU node
    assert here not in {r["node"] for r in reports}
    for report in reports:
        assert report["preloaded_before_work"], report
        assert report["transformers_loaded"] and report["process_times_preloaded"], report
        assert report["cuda_untouched"], report
        assert len(report["gpu_ids"]) == 1, report
        assert report["cuda_visible_devices"] == report["gpu_ids"][0], report  # Ray's GPU

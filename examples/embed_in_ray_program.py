"""A run inside your own Ray program: its futures are Ray ObjectRefs, so they go straight into
your tasks as arguments. Ray starts each task once the step (or checkpoint) it needs is done.

    python examples/embed_in_ray_program.py --local
"""

from __future__ import annotations

import argparse
import sys

import ray
from _setup import add_arguments, cluster_of, config_of

from rlinf_twoworker import run_grpo_two_worker
from rlinf_twoworker.results import STEP_STAGES, CheckpointInfo, StepResult

TIMEOUT_S = 3600.0


@ray.remote(num_cpus=0)
def summarize(step: StepResult) -> dict[str, float]:
    """Runs on the cluster when the step is done; Ray passes the StepResult itself."""
    stages = {k: step.timings[k] for k in STEP_STAGES if k in step.timings}
    slowest = max(stages, key=stages.__getitem__)
    return {
        "step": step.step,
        "reward": step.metrics["rollout/reward_scores"],
        "correct": step.metrics["rollout/correct_fraction"],
        "slowest_stage": slowest,
        "slowest_stage_share": stages[slowest] / step.timings["time/step"],
    }


@ray.remote(num_cpus=0)
def trend(*summaries: dict[str, float]) -> float:
    """Reward change from the first step to the last."""
    return summaries[-1]["reward"] - summaries[0]["reward"]


@ray.remote(num_cpus=0)
def shard_bytes(checkpoint: CheckpointInfo) -> int:
    return sum(checkpoint.shards.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    cfg = config_of(args, "embed")
    with cluster_of(args):
        handle = run_grpo_two_worker(cfg, ray_address=args.address)
        last = cfg.runner.max_steps
        # Scheduled now, run later: each task waits on Ray for the step it takes as argument.
        summaries = [summarize.remote(handle.step(n)) for n in range(1, last + 1)]
        change = trend.remote(*summaries)
        size = shard_bytes.remote(handle.checkpoint(last))
        for summary in ray.get(summaries, timeout=TIMEOUT_S):
            print(f"EMBED_SUMMARY {summary}", flush=True)
        print(f"EMBED_TREND reward_change={ray.get(change, timeout=TIMEOUT_S):+.4f}")
        print(f"EMBED_CHECKPOINT shard_bytes={ray.get(size, timeout=TIMEOUT_S)}")
        report = handle.result(timeout=TIMEOUT_S)
    print(f"postflight: {'passed' if report.passed else report.errors}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())

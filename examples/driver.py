"""A Driver script: GRPO training on the Ray cluster this machine belongs to, in one call.

On the Ray Head of a running cluster (the platform started Ray; this script only connects):

    python examples/driver.py --config my-run.yaml runner.experiment_name=run-7 runner.max_steps=10

To try it anywhere (a 2-node cluster on this machine, the embedded demo inputs, 2 CPU steps):

    python examples/driver.py --local
"""

from __future__ import annotations

import argparse
import sys

import ray
from _setup import add_arguments, cluster_of, config_of

from rlinf_twoworker import TwoWorkerError, run_grpo_two_worker

STEP_TIMEOUT_S = 3600.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    cfg = config_of(args, "driver")
    with cluster_of(args):
        handle = run_grpo_two_worker(cfg, ray_address=args.address)
        print(f"run {handle.run_id} writing to {handle.output_dir}", flush=True)
        try:
            for n in range(1, cfg.runner.max_steps + 1):
                step = ray.get(handle.step(n), timeout=STEP_TIMEOUT_S)
                m, t = step.metrics, step.timings
                print(
                    f"step {n}/{cfg.runner.max_steps}: reward {m['rollout/reward_scores']:+.3f} "
                    f"loss {m['actor/training/actor/final_loss']:.5f} {t['time/step']:.2f}s",
                    flush=True,
                )
            report = handle.result(timeout=STEP_TIMEOUT_S)
        except (TwoWorkerError, ray.exceptions.RayError) as exc:
            print(f"run failed: {exc}", file=sys.stderr)
            return 1
    print(f"checkpoint: {report.checkpoint_dir}")
    print(f"postflight: {'passed' if report.passed else report.errors}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())

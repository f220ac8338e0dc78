"""A Ray Tune sweep of the learning rate: two GRPO runs at once, each in its trial's placement
group, each step's metrics reported to Tune as it completes; prints the best trial by reward.

    pip install -e ".[tune]"
    python examples/tune_sweep.py --local                      # demo, 2-node cluster started here
    python examples/tune_sweep.py --config my.yaml --lrs 1e-6 2e-6   # a real cluster

With --demo/--local each trial is the demo job on 2 nodes x 1 GPU (rollout, reward and
inference on one, the actor on the other), so two trials fit a 2 x 2 cluster side by side.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _setup import add_arguments, cluster_of, config_of

ONE_GPU_A_NODE = [
    "cluster.num_nodes=2",
    "cluster.num_gpus_per_node=1",
    "cluster.component_placement={rollout:0,reward:0,inference:0,actor:1}",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 1e-4])
    args = parser.parse_args()
    if args.demo or args.local:
        args.overrides = [*ONE_GPU_A_NODE, *args.overrides]
    cfg = config_of(args, "sweep")
    with cluster_of(args):
        import ray
        from ray import tune

        from rlinf_twoworker.api.tune import grpo_trainable, trial_resources

        if not ray.is_initialized():
            ray.init(address=args.address or "auto", namespace="rlinf_twoworker")
        tuner = tune.Tuner(
            tune.with_resources(grpo_trainable(cfg), trial_resources(cfg)),
            param_space={"actor.optim.lr": tune.grid_search(args.lrs)},
            tune_config=tune.TuneConfig(
                metric="rollout/reward_scores", mode="max", max_concurrent_trials=len(args.lrs)
            ),
            run_config=tune.RunConfig(
                storage_path=str(Path(cfg.runner.output_dir) / ".tune"),
                name=cfg.runner.experiment_name,
                verbose=0,
            ),
        )
        results = tuner.fit()
        for result in results:
            lr, m = result.config["actor.optim.lr"], result.metrics or {}
            print(
                f"TUNE_TRIAL lr={lr:g} steps={m.get('step')} "
                f"reward={m.get('rollout/reward_scores')} verified={m.get('verification_passed')} "
                f"checkpoint={result.checkpoint.path if result.checkpoint else None} "
                f"error={result.error}",
                flush=True,
            )
        if results.errors:
            return 1
        best = results.get_best_result()
        print(
            f"TUNE_BEST lr={best.config['actor.optim.lr']:g} "
            f"reward={best.metrics['rollout/reward_scores']:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

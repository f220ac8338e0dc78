"""Watch a run's rewards live: every step of a run is a future you can `await`.

In a notebook an event loop is already running, so use top-level await:

    handle = run_grpo_two_worker(cfg)
    rewards = await watch(handle, plot_path="rewards.png")

As a script (a 2-node cluster on this machine, the embedded demo inputs):

    python examples/notebook_live_rewards.py --local --plot rewards.png
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from _setup import add_arguments, cluster_of, config_of

from rlinf_twoworker import RunHandle, run_grpo_two_worker

STEP_TIMEOUT_S = 3600.0


async def watch(handle: RunHandle, plot_path: str | None = None) -> list[float]:
    """Await each step as it finishes; print its reward and redraw the plot."""
    rewards: list[float] = []
    for n in range(1, handle.config.runner.max_steps + 1):
        result = await asyncio.wait_for(handle.step(n), STEP_TIMEOUT_S)
        rewards.append(result.metrics["rollout/reward_scores"])
        print(f"LIVE_REWARD step={n} reward={rewards[-1]:+.4f}", flush=True)
        if plot_path:
            draw(rewards, Path(plot_path))
    return rewards


def draw(rewards: list[float], path: Path) -> None:
    """The reward curve so far (in a notebook: IPython.display.Image(path), or plt.show())."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3))
    axis.plot(range(1, len(rewards) + 1), rewards, marker="o")
    axis.set_xlabel("step")
    axis.set_ylabel("mean reward")
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


async def main(args: argparse.Namespace) -> int:
    handle = run_grpo_two_worker(config_of(args, "live"), ray_address=args.address)
    rewards = await watch(handle, args.plot)
    report = await asyncio.wait_for(handle.result_ref(), STEP_TIMEOUT_S)
    print(f"rewards {rewards}; postflight {'passed' if report.passed else report.errors}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--plot", default=None, help="PNG redrawn after every step")
    arguments = parser.parse_args()
    with cluster_of(arguments):
        sys.exit(asyncio.run(main(arguments)))

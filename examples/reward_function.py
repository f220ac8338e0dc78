"""A reward function in Python instead of the math grader: reward.reward_fn="module:function".

The run calls `fn(prompt, answer, row) -> float` for every answer, in the reward's grading
processes (one answer at a time, each call cut at reward.timeout_s): `prompt` is the data's
prompt text, `answer` the decoded answer, `row` the prompt's whole JSONL record (every key,
so a task can carry its own reference fields). The float is the reward as it is
(reward.reward_scale does not apply). A function that raises, or returns no finite float,
stops the run with its traceback: a bug must not pass as a low reward.

The function is imported by name on the Driver (the request check) and in each grading
process, so its module must be importable there: installed, or its directory on PYTHONPATH in
the environment Ray starts with on every node. Run as a script, this file's directory is on
the path of the Driver and of Ray's workers, so:

    # the demo (a tiny model, 2 CPU steps), rewarded for palindromic answers instead:
    python examples/reward_function.py --local

    # any run, the function named as a config override:
    rlinf-twoworker run ... reward.reward_fn=reward_function:palindrome
    PYTHONPATH=examples rlinf-twoworker demo reward.reward_fn=reward_function:palindrome
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"\d+")


def palindrome(prompt: str, answer: str, row: dict[str, Any]) -> float:
    """1.0 when the answer's final value (its last \\boxed{}, else its last number) is a
    palindrome of two or more characters ("121", "7337"), 0.0 for a single character, -1.0
    for another value or none. A task that is no math on math prompts: the reward ignores the
    question and the row's gold solutions (row["solutions"] is there to read, as any key)."""
    found = _BOXED.findall(answer) or _NUMBER.findall(answer)
    if not found:
        return -1.0
    value = found[-1].strip()
    if len(value) >= 2 and value == value[::-1]:
        return 1.0
    return 0.0 if len(value) == 1 else -1.0


def even_length(prompt: str, answer: str, row: dict[str, Any]) -> float:
    """1.0 for an answer of an even number of characters, else 0.0: the simplest reward that
    differs between answers, for trying the mechanism."""
    return 1.0 if len(answer) % 2 == 0 else 0.0


REWARD_FN = f"{Path(__file__).stem}:palindrome"
"""What reward.reward_fn names when this file runs as a script (its directory is on the path)."""


def main() -> int:
    import ray
    from _setup import add_arguments, cluster_of, config_of

    from rlinf_twoworker import TwoWorkerError, run_grpo_two_worker
    from rlinf_twoworker.api.request import reward_fn_error

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    args.overrides = [f"reward.reward_fn={REWARD_FN}", *args.overrides]
    cfg = config_of(args, "reward-fn")
    from rlinf_twoworker.config import to_typed

    error = reward_fn_error(to_typed(cfg))  # the check `rlinf-twoworker run` makes
    if error is not None:
        print(f"ConfigError: {error}", file=sys.stderr)
        return 2
    with cluster_of(args):
        handle = run_grpo_two_worker(cfg, ray_address=args.address)
        print(f"run {handle.run_id} writing to {handle.output_dir}", flush=True)
        try:
            for n in range(1, cfg.runner.max_steps + 1):
                m = ray.get(handle.step(n), timeout=3600).metrics
                print(
                    f"step {n}/{cfg.runner.max_steps}: {cfg.reward.reward_fn} mean reward "
                    f"{m['rollout/reward_scores']:+.3f}, share > 0 "
                    f"{m['rollout/correct_fraction']:.2f}",
                    flush=True,
                )
            report = handle.result(timeout=3600)
        except (TwoWorkerError, ray.exceptions.RayError) as exc:
            print(f"run failed: {exc}", file=sys.stderr)
            return 1
    print(f"postflight: {'passed' if report.passed else report.errors}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())

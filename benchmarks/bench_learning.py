"""Learning benchmark: GRPO must raise the reward of the demo's 24M model on the "digit" task.

    python -m benchmarks learning                          # one GPU, 200 steps, lr 1e-5
    python -m benchmarks learning --seeds 1234,777,42      # three seeds at once, and the spread
    python -m benchmarks learning --no-reader --seed 777   # the model without the reader head
    python -m benchmarks learning --smoke                  # CPU, tiny model, 8 steps
    (the same: python benchmarks/bench_learning.py [...])

The model is `make_inputs(size="small", reader=True)`: a random Qwen2 (8 layers, hidden 512)
whose answer prior makes it reply with one digit 0..8 then EOS, so a random policy is right
about one time in nine on "Write the digit d." (d uniform over 0..8: no answer pays more than
another unless the policy reads the prompt; `--task add-hard` and the other demo tasks work
too). Its reader head (api/demo.py `_add_digit_reader`) carries the prompt's digit to the
answer's position; nothing maps it to an answer, so the prior stays uniform (answer entropy
2.17 nats of ln 9 = 2.20, right 0.112 of the time) and GRPO has the read-out to learn. Without
the head (--no-reader) the digit reaches that position through random attention alone: the
last hidden state varies with the digit by 0.5% of its norm (12% with the head), GRPO has to
grow that attention first, and meanwhile groups whose answers are all wrong give no advantage,
so the answer distribution drifts onto a few digits and, for some seeds, every group ties:
whether it learns within 200 steps is up to the seed (benchmarks/RESULTS.md).

The run goes through the public API only (`run_grpo_two_worker` on a one-node, one-GPU
`LocalCluster`, every component on resource rank 0), with the library's defaults except the
batch (32 prompts x 8 answers), the run's length, the learning rate and the speed settings of
docs/performance.md. --seed sets data.seed and actor.seed. --seeds runs one process per seed,
all at once on the one GPU, each writing its own files, then learning-<tag>-seeds-<hardware>.json
with every seed's summary and the spread; it exits 1 unless every seed passed.

Per step it records the reward, the correct fraction, the loss, the grad norm, the share of
groups whose answers disagree (the groups with non-zero advantages), every metric about ratios,
clipping, KL or entropy, and the step's seconds, appending each step's row to
<out-dir>/learning-<tag>.steps.jsonl as it comes. It writes learning-<tag>-<hardware>.json and
.png (reward against step) under --out-dir (benchmarks/results), prints steps/s and the
first-10 and last-10 mean rewards, and exits 1 when the reward did not rise (last-10 mean <=
first-10 mean), when a step had an all-zero gradient without every answer right (every group
tied: nothing to learn from), or when the postflight failed; with --smoke only the last two
count (8 steps of 64 answers are noise). Extra arguments are config overrides (a.b=c), applied
last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import ray
import record as result_record  # benchmarks/ is the script's path
import torch

from rlinf_twoworker import RunHandle, run_grpo_two_worker
from rlinf_twoworker.api.demo import demo_config, make_inputs
from rlinf_twoworker.cluster.local import LocalCluster
from rlinf_twoworker.results import StepResult
from rlinf_twoworker.workers.reward import RewardWorker

RESULTS = Path(__file__).resolve().parent / "results"
WINDOW = 10
"""Steps averaged at each end of the run to decide whether the reward rose."""
STEP_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Scale:
    accelerator: str
    size: str
    """A key of rlinf_twoworker.api.demo.MODEL_SIZES."""
    steps: int
    prompts: int
    group_size: int
    lr: float | None
    """actor.optim.lr; None keeps the library's default."""


GPU = Scale("cuda", "small", steps=200, prompts=32, group_size=8, lr=1e-5)
# The CPU check: every stage and output of the GPU run, at a size 2 cores finish in minutes;
# the 83k-parameter model needs a large learning rate to move at all in 8 steps.
SMOKE = Scale("cpu", "tiny", steps=8, prompts=8, group_size=8, lr=1e-3)


class GroupSpreadReward(RewardWorker):
    """The library's reward component that also appends, per step, the share of groups whose
    rewards differ to `log_path`: only those groups get non-zero GRPO advantages, and no metric
    reports it. `group_size`: the run's answers per prompt (a reward's settings do not hold
    it)."""

    log_path = ""
    group_size = 0

    async def score(self, answers: list[str], solutions: list[list[str]]) -> dict[str, Any]:
        graded = await super().score(answers, solutions)
        groups = torch.tensor(graded.scores).view(-1, self.group_size)
        spread = (groups.amax(-1) > groups.amin(-1)).float().mean().item()
        with open(self.log_path, "a", encoding="utf-8") as log:
            log.write(f"{spread}\n")
        return graded


def overrides(scale: Scale, steps: int, lr: float | None) -> list[str]:
    """Settings on top of demo_config: one node, one GPU, the batch and the run's length."""
    return [
        f"cluster.accelerator={scale.accelerator}",
        "cluster.num_nodes=1",
        "cluster.num_gpus_per_node=1",
        'cluster.component_placement={rollout:0,inference:0,actor:"0",reward:0}',
        f"runner.max_steps={steps}",
        f"runner.save_interval={steps}",  # one checkpoint, at the end
        f"data.rollout_batch_size={scale.prompts}",
        f"algorithm.group_size={scale.group_size}",
        *([f"actor.optim.lr={lr}"] if lr is not None else []),
        # docs/performance.md: the same update, in fewer and larger micro-batches.
        "runner.enable_dynamic_batch_size=true",
        "runner.max_tokens_per_mbs=4096",
        f"algorithm.logprob_forward_micro_batch_size={scale.prompts * scale.group_size}",
    ]


def train(handle: RunHandle, steps: int, progress: Path | None = None) -> list[StepResult]:
    """Every step's result, in order, printed as it comes (and its row appended to
    `progress`, so a run cut short keeps its curve)."""
    results = []
    for n in range(1, steps + 1):
        results.append(ray.get(handle.step(n), timeout=STEP_TIMEOUT_S))
        print(_progress(results[-1]), flush=True)
        if progress is not None:
            with open(progress, "a", encoding="utf-8") as f:
                f.write(json.dumps(record(results[-1], float("nan"))) + "\n")
    return results


def _progress(result: StepResult) -> str:
    m = result.metrics
    return (
        f"step {result.step:4d}  reward {m['rollout/reward_scores']:+.3f}  "
        f"correct {m['rollout/correct_fraction']:.3f}  "
        f"loss {m['actor/training/actor/final_loss']:+.4f}  "
        f"grad_norm {m['actor/training/actor/grad_norm']:.4f}  "
        f"step_s {result.timings['time/step']:.2f}"
    )


def record(result: StepResult, spread: float) -> dict[str, float]:
    """One step's row of the JSON: the named metrics, every ratio/clip/KL/entropy metric, the
    step's seconds."""
    m = result.metrics
    row = {
        "step": result.step,
        "reward": m["rollout/reward_scores"],
        "correct_fraction": m["rollout/correct_fraction"],
        "loss": m["actor/training/actor/final_loss"],
        "grad_norm": m["actor/training/actor/grad_norm"],
        "groups_with_spread": spread,
        "response_length": m["rollout/response_length"],
        "step_s": result.timings["time/step"],
    }
    watched = ("ratio", "clip", "kl", "entropy", "logprob")
    row.update({k: v for k, v in m.items() if any(w in k for w in watched)})
    return row


def summarise(rows: list[dict[str, float]], wall_s: float) -> dict[str, Any]:
    rewards = [r["reward"] for r in rows]
    window = min(WINDOW, len(rows) // 2) or 1
    first, last = statistics.fmean(rewards[:window]), statistics.fmean(rewards[-window:])
    return {
        "steps": len(rows),
        "window": window,
        "first_mean_reward": first,
        "last_mean_reward": last,
        "reward_rose": last > first,
        # A step whose answers were all right has nothing left to learn; any other step
        # with a zero gradient had every group tied, so GRPO learned nothing from it.
        "zero_grad_steps": [
            r["step"] for r in rows if r["grad_norm"] == 0.0 and r["correct_fraction"] < 1.0
        ],
        "steps_per_s": len(rows) / sum(r["step_s"] for r in rows),
        "wall_s": wall_s,
    }


def plot(rows: list[dict[str, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.5))
    axis.plot([r["step"] for r in rows], [r["reward"] for r in rows], marker=".")
    axis.set_xlabel("GRPO step")
    axis.set_ylabel("mean reward (+5 right, -5 wrong)")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tag",
        default=None,
        help="the configuration in the result files' names (default: TASK-lrLR, -smoke added)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few steps")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: scale's)")
    parser.add_argument("--lr", type=float, default=None, help="actor.optim.lr")
    parser.add_argument("--task", default="digit", help="a demo task (default: digit)")
    parser.add_argument("--size", default=None, help="demo model size (default: scale's)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts a step")
    parser.add_argument("--cpu", action="store_true", help="the GPU scale, on the CPU")
    parser.add_argument("--seed", type=int, default=None, help="data.seed and actor.seed")
    parser.add_argument(
        "--seeds",
        default=None,
        help="comma list: one run per seed, all at once, and the spread (module docstring)",
    )
    parser.add_argument(
        "--reader",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the model with the reader head (default; api/demo.py)",
    )
    parser.add_argument("--work-dir", default=None, help="inputs and run (default: a temp dir)")
    parser.add_argument("--out-dir", default=str(RESULTS), help="where the JSON and PNG go")
    parser.add_argument("overrides", nargs="*", help="more config overrides (a.b=c), last")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.seeds:
        return run_seeds(args, argv if argv is not None else sys.argv[1:])
    scale = SMOKE if args.smoke else GPU
    scale = replace(
        scale,
        accelerator="cpu" if args.cpu else scale.accelerator,
        size=args.size or scale.size,
        prompts=args.prompts or scale.prompts,
    )
    steps, lr = args.steps or scale.steps, args.lr or scale.lr
    if args.tag is None:
        args.tag = default_tag(args, lr)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-learning-")).resolve()
    # One epoch of distinct records for the whole run (runner.max_epochs is 1).
    samples = scale.prompts * steps
    inputs = make_inputs(
        work / "inputs", task=args.task, num_samples=samples, size=scale.size, reader=args.reader
    )
    seeded = [] if args.seed is None else [f"data.seed={args.seed}", f"actor.seed={args.seed}"]
    extra = [*overrides(scale, steps, lr), *seeded, *args.overrides]
    cfg = demo_config(inputs, work / "runs", f"learning-{args.tag}", extra)
    spread_log = work / "group-spread.txt"
    spread_log.unlink(missing_ok=True)
    group = {"log_path": str(spread_log), "group_size": cfg.algorithm.group_size}
    reward = type("Reward", (GroupSpreadReward,), group)
    meta = {
        "scale": asdict(scale),
        "steps": steps,
        "lr": cfg.actor.optim.lr,
        "overrides": args.overrides,
        "task": args.task,
        "seed": args.seed,
        "reader": args.reader,
    }
    meta |= {"torch": torch.__version__, "device": _device_name(scale), "work_dir": str(work)}
    start = time.perf_counter()
    with LocalCluster(num_nodes=1, gpus_per_node=1):
        handle = run_grpo_two_worker(cfg, component_classes={"reward": reward})
        progress = Path(args.out_dir) / f"learning-{args.tag}.steps.jsonl"
        progress.unlink(missing_ok=True)
        results = train(handle, steps, progress)
        spreads = [float(x) for x in spread_log.read_text().split()]
        rows = [record(r, spread) for r, spread in zip(results, spreads)]
        summary = summarise(rows, time.perf_counter() - start)
        write(Path(args.out_dir), args.tag, {"meta": meta, "summary": summary, "steps": rows})
        report = handle.result(timeout=STEP_TIMEOUT_S)  # the postflight, after the data is safe
    summary |= {"postflight_passed": report.passed, "postflight_errors": report.errors}
    write(Path(args.out_dir), args.tag, {"meta": meta, "summary": summary, "steps": rows})
    print(
        f"steps/s {summary['steps_per_s']:.3f}  mean reward first {summary['window']} steps "
        f"{summary['first_mean_reward']:+.3f}, last {summary['window']} "
        f"{summary['last_mean_reward']:+.3f}  postflight {'passed' if report.passed else 'FAILED'}"
    )
    return _verdict(summary, require_rise=not args.smoke)


def default_tag(args: argparse.Namespace, lr: float) -> str:
    tag = f"{args.task}-lr{lr:g}" + ("-reader" if args.reader else "")
    tag += "" if args.seed is None else f"-seed{args.seed}"
    return tag + ("-smoke" if args.smoke else "")


def run_seeds(args: argparse.Namespace, argv: list[str]) -> int:
    """One process per seed of --seeds, all at once; then every seed's summary and the spread
    in learning-<tag>-seeds-<hardware>.json. Exit 1 unless every seed passed."""
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    base = [a for i, a in enumerate(argv) if a != "--seeds" and argv[i - 1 : i] != ["--seeds"]]
    base = [a for a in base if not a.startswith("--seeds=")]
    if args.tag is not None:  # each seed gets its own tag
        base = [a for i, a in enumerate(base) if a != "--tag" and base[i - 1 : i] != ["--tag"]]
    scale = SMOKE if args.smoke else GPU
    tag = args.tag or default_tag(args, args.lr or scale.lr)
    procs = {}
    with contextlib.ExitStack() as logs:
        for seed in seeds:
            cmd = [sys.executable, str(Path(__file__).resolve()), *base, "--seed", str(seed)]
            cmd += ["--tag", f"{tag}-seed{seed}"]
            log_path = Path(args.out_dir) / f"learning-{tag}-seed{seed}.log"
            log = logs.enter_context(open(log_path, "w", encoding="utf-8"))
            procs[seed] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            print(f"seed {seed}: {' '.join(cmd)}", flush=True)
        codes = {seed: proc.wait() for seed, proc in procs.items()}
    device = "cpu" if args.smoke or args.cpu else torch.cuda.get_device_name()
    hardware = "cpu" if device == "cpu" else result_record.hardware_tag([device])
    per_seed = {}
    for seed in seeds:
        name = result_record.result_name("learning", f"{tag}-seed{seed}", hardware)
        try:
            saved = json.loads((Path(args.out_dir) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            per_seed[seed] = {"exit_code": codes[seed], "error": f"{type(exc).__name__}: {exc}"}
            continue
        summary, rows = saved["summary"], saved["steps"]
        per_seed[seed] = {
            "exit_code": codes[seed],
            **{k: summary.get(k) for k in ("first_mean_reward", "last_mean_reward")},
            **{k: summary.get(k) for k in ("zero_grad_steps", "postflight_passed")},
            "correct_first": rows[0]["correct_fraction"] if rows else None,
            "correct_last10": statistics.fmean(r["correct_fraction"] for r in rows[-WINDOW:])
            if rows
            else None,
            "first_step_correct_at_least_half": next(
                (r["step"] for r in rows if r["correct_fraction"] >= 0.5), None
            ),
        }
    finals = [p["correct_last10"] for p in per_seed.values() if p.get("correct_last10") is not None]
    spread = {
        "correct_last10_min": min(finals) if finals else None,
        "correct_last10_max": max(finals) if finals else None,
        "correct_last10_mean": statistics.fmean(finals) if finals else None,
        "correct_last10_stdev": statistics.stdev(finals) if len(finals) > 1 else None,
    }
    payload = {"seeds": seeds, "per_seed": per_seed, "spread": spread, "argv": argv}
    result_record.write_result(
        "learning",
        f"{tag}-seeds",
        hardware,
        payload,
        Path(args.out_dir) / result_record.result_name("learning", f"{tag}-seeds", hardware),
    )
    print(json.dumps(payload, indent=1, default=str))
    return 0 if all(code == 0 for code in codes.values()) else 1


def write(out: Path, tag: str, payload: dict[str, Any]) -> None:
    """learning-<tag>-<hardware>.json (record.py: commit, command, versions added) and .png."""
    meta = payload["meta"]
    hardware = "cpu" if meta["device"] == "cpu" else result_record.hardware_tag([meta["device"]])
    name = result_record.result_name("learning", tag, hardware)
    path = result_record.write_result("learning", tag, hardware, payload, out / name)
    title = f"{meta['scale']['size']} model, task {meta['task']}, {tag}"
    plot(payload["steps"], path.with_suffix(".png"), title)


def _device_name(scale: Scale) -> str:
    return torch.cuda.get_device_name() if scale.accelerator == "cuda" else "cpu"


def _verdict(summary: dict[str, Any], require_rise: bool) -> int:
    failures = []
    if not summary["reward_rose"] and require_rise:
        failures.append("the reward did not rise")
    elif not summary["reward_rose"]:  # --smoke: a few steps of 64 answers are mostly noise
        print("the reward did not rise (not required with --smoke)")
    if summary["zero_grad_steps"]:
        failures.append(f"all-zero gradients at steps {summary['zero_grad_steps']}")
    if not summary["postflight_passed"]:
        failures.append(f"the postflight failed: {summary['postflight_errors']}")
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

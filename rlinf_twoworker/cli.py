"""The `rlinf-twoworker` command: demo, run (the Driver command), verify.

Each subcommand prints the tutorial's status lines, appends them to the run's driver.log, and
ends with `STARTUP_EXIT_CODE=<code>`; the process exits with that code.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rlinf_twoworker.errors import TwoWorkerError

TUTORIAL_SUBDIR = Path("runs") / "two-worker-grpo-pipeline"


def _emit_final(run_dir: Path | None, code: int) -> int:
    line = f"STARTUP_EXIT_CODE={code}"
    print(line, flush=True)
    if run_dir is not None and (run_dir / "driver.log").exists():
        with open(run_dir / "driver.log", "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
    return code


def drive(cfg, overrides: Sequence[str] = (), ray_address: str | None = None) -> int:
    """Start the run, stream its log, wait for the postflight; returns the exit code."""
    from rlinf_twoworker.handle import run_grpo_two_worker

    run_dir = None
    try:
        handle = run_grpo_two_worker(cfg, ray_address=ray_address, overrides=overrides)
        run_dir = handle.output_dir
        print(f"RUN_DIR={run_dir}", flush=True)
        handle.follow(lambda line: print(line, flush=True))
        report = handle.result()
        code = 0 if report.passed else 1
    except TwoWorkerError as exc:
        print(f"RLINF_ERROR={type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 2 if run_dir is None else 1
    except KeyboardInterrupt:
        print("RLINF_ERROR=interrupted: cancelling the run", file=sys.stderr, flush=True)
        try:
            handle.cancel()
        except Exception:
            pass
        code = 130
    return _emit_final(run_dir, code)


def cmd_demo(args: argparse.Namespace) -> int:
    from rlinf_twoworker.demo import demo_config, make_inputs
    from rlinf_twoworker.local import LocalCluster

    output_root = Path(args.output_root).resolve()
    run_id = args.run_id or time.strftime("demo-%Y%m%d-%H%M%S")
    overrides = [f"runner.max_steps={args.steps}", *args.overrides]
    try:
        inputs = make_inputs(output_root / f".inputs-{run_id}")
        cfg = demo_config(inputs, output_root, run_id, overrides)
    except TwoWorkerError as exc:
        print(f"RLINF_ERROR={type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return _emit_final(None, 2)
    with LocalCluster(num_nodes=cfg.cluster.num_nodes, gpus_per_node=cfg.cluster.num_gpus_per_node):
        return drive(cfg, overrides)


def cmd_run(args: argparse.Namespace) -> int:
    from rlinf_twoworker.config import load_config

    overrides = list(args.overrides)
    env = os.environ
    if "RUN_ID" in env:
        overrides.append(f"runner.experiment_name={env['RUN_ID']}")
    if env.get("WORK_ROOT"):
        overrides.append(f"runner.output_dir={Path(env['WORK_ROOT']) / TUTORIAL_SUBDIR}")
    if env.get("TARGET_STEPS"):
        overrides.append(f"runner.max_steps={env['TARGET_STEPS']}")
    try:
        if "RUN_ID" in env and not env["RUN_ID"]:
            raise TwoWorkerError("RUN_ID is set but empty: give the run a name")
        cfg = load_config(args.config, overrides)
    except TwoWorkerError as exc:
        print(f"RLINF_ERROR={type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return _emit_final(None, 2)
    return drive(cfg, overrides, ray_address=args.address)


def cmd_verify(args: argparse.Namespace) -> int:
    from rlinf_twoworker.verify import verify_run

    report = verify_run(args.output_dir, args.target_steps, args.expected_nodes)
    return 0 if report.passed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlinf-twoworker", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the whole scenario on a local 2x2 cluster, no downloads")
    demo.add_argument("--output-root", default="demo-runs", help="parent of the run directory")
    demo.add_argument("--run-id", default=None, help="run name (default: demo-<time>)")
    demo.add_argument("--steps", type=int, default=2, help="GRPO steps (default 2)")
    demo.add_argument("overrides", nargs="*", help="config overrides, Hydra syntax (a.b=c)")
    demo.set_defaults(func=cmd_demo)
    run = sub.add_parser("run", help="the Driver command: run on the existing Ray cluster")
    run.add_argument("--config", default=None, help="a YAML config in RLinf's layout")
    run.add_argument("--address", default=None, help="Ray address (default: auto)")
    run.add_argument("overrides", nargs="*", help="config overrides, Hydra syntax (a.b=c)")
    run.set_defaults(func=cmd_run)
    verify = sub.add_parser("verify", help="the postflight of a finished run directory")
    verify.add_argument("--output-dir", required=True, help="the run directory")
    verify.add_argument("--target-steps", type=int, required=True)
    verify.add_argument("--expected-nodes", type=int, required=True)
    verify.set_defaults(func=cmd_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

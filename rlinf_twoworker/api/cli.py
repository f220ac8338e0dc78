"""The `rlinf-twoworker` command: run, demo, preflight, verify, readback, export-hf,
export-rlinf, report.

Exit codes: 0 success; 1 the run or a check failed; 2 the request is invalid (nothing was created
or changed); 3 no Ray cluster is reachable, or it is not the cluster the config asks for; 130
interrupted (the run is cancelled). `run`, `demo` and `preflight` end with STARTUP_EXIT_CODE=<code>.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlinf_twoworker.api.report import DriverConsole as Console
from rlinf_twoworker.api.request import RequestError, resolve_request
from rlinf_twoworker.config import run_id_problem, to_typed
from rlinf_twoworker.errors import (
    ClusterError,
    ConfigError,
    PlacementError,
    RunDirError,
    TwoWorkerError,
)

if TYPE_CHECKING:
    from rlinf_twoworker.storage.verify import Expected

OK, FAILED, INVALID, NO_CLUSTER, INTERRUPTED = 0, 1, 2, 3, 130


def _code_of(exc: BaseException, started: bool) -> int:
    if isinstance(exc, (ClusterError, PlacementError)):
        return NO_CLUSTER
    if isinstance(exc, (RequestError, ConfigError, RunDirError)) or not started:
        return INVALID
    return FAILED


def drive(
    cfg: Any, overrides: Sequence[str], console: Console, timeout_s: float | None = None
) -> int:
    """Start the run on the connected cluster, show its log (and progress on a terminal), wait
    for its postflight; returns the exit code."""
    from rlinf_twoworker.api.handle import run_grpo_two_worker

    handle = None
    try:
        handle = run_grpo_two_worker(cfg, overrides=overrides)
        console.attach(handle.output_dir)
        console.line(f"RUN_DIR={handle.output_dir}")
        report = console.watch(handle, timeout_s or _run_timeout(handle))
        code = OK if report.passed else FAILED
    except KeyboardInterrupt:
        console.error("interrupted: cancelling the run")
        if handle is not None:
            _cancel(handle, console)
        code = INTERRUPTED
    except Exception as exc:  # every failure ends with a reason and an exit code
        console.error(f"{type(exc).__name__}: {exc}")
        code = _code_of(exc, handle is not None)
    if handle is not None and code != OK:
        console.training_exit_code(code)
    return console.final(code)


def _cancel(handle: Any, console: Console) -> None:
    try:
        handle.cancel(timeout=60)
    except Exception as exc:  # the run may already be gone; say so and go on exiting
        console.error(f"cancel did not complete: {exc}")


def _run_timeout(handle: Any) -> float:
    """An upper bound on the whole run from its own stage timeouts."""
    from rlinf_twoworker.storage.checkpoints import scheduled_steps

    typed = to_typed(handle.config)
    t = typed.runner.timeouts
    steps = typed.runner.max_steps * t.step_s + len(scheduled_steps(typed)) * t.checkpoint_s
    return t.placement_s + t.preflight_s + t.actor_start_s + 2 * t.collective_s + steps + 600


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def cmd_run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        cfg, overrides = resolve_request(args.config, args.overrides, os.environ)
        signal.signal(signal.SIGTERM, _interrupt)  # the platform stopping the Driver cancels
        from rlinf_twoworker.cluster.connect import connect

        connect(args.address, to_typed(cfg))
    except Exception as exc:
        console.error(f"{type(exc).__name__}: {exc}")
        return console.final(_code_of(exc, False))
    return drive(cfg, overrides, console, args.timeout)


def cmd_demo(args: argparse.Namespace) -> int:
    """The run's own request check first (a typo or a reused RUN_ID fails in a second and
    writes nothing), then the demo inputs, then a LocalCluster and the run."""
    from rlinf_twoworker.api.demo import DATA_NAME, DemoInputs, demo_config, make_inputs
    from rlinf_twoworker.api.request import input_problems, run_dir_problems
    from rlinf_twoworker.cluster.local import LocalCluster

    console = Console()
    output_root = Path(args.output_root).resolve()
    run_id = args.run_id or time.strftime("demo-%Y%m%d-%H%M%S")
    if (problem := run_id_problem(run_id)) is not None:
        console.error(f"RequestError: --run-id {run_id!r} is invalid: it {problem}")
        return console.final(INVALID)
    overrides = [f"runner.max_steps={args.steps}", *args.overrides]
    root = output_root / f".inputs-{run_id}"
    planned = DemoInputs(root, root / "model", root / "data" / DATA_NAME)
    try:
        cfg = demo_config(planned, output_root, run_id, overrides)  # nothing written yet
        typed = to_typed(cfg)
        # The demo's own inputs do not exist yet; any other input (an override) must.
        others = [p for p in input_problems(typed) if str(root) not in p]
        problems = run_dir_problems(typed) + others
        if problems:
            raise RequestError(problems)
        inputs = make_inputs(root)
        cfg = demo_config(inputs, output_root, run_id, overrides)
        problems = input_problems(to_typed(cfg))
        if problems:
            raise RequestError(problems)
    except (TwoWorkerError, ValueError) as exc:
        console.error(f"{type(exc).__name__}: {exc}")
        return console.final(INVALID)
    with LocalCluster(num_nodes=cfg.cluster.num_nodes, gpus_per_node=cfg.cluster.num_gpus_per_node):
        return drive(cfg, overrides, console)


def cmd_preflight(args: argparse.Namespace) -> int:
    """Placement and the per-node preflight only, on the connected cluster; no run directory."""
    from rlinf_twoworker.errors import PreflightError

    console = Console()
    pg = None
    try:
        cfg, _ = resolve_request(args.config, args.overrides, os.environ, for_run=False)
        typed = to_typed(cfg)
        from rlinf_twoworker.cluster.connect import connect

        connect(args.address, typed)
        from rlinf_twoworker.cluster.placement import create_placement_group
        from rlinf_twoworker.cluster.preflight import run_preflight

        name = f"preflight-{os.getpid()}:pg"
        pg = create_placement_group(typed.cluster, name, typed.runner.timeouts.placement_s)
        run_preflight(typed, pg, output_dir=None, log=console.line)
        code = OK
    except PreflightError:
        code = FAILED  # run_preflight printed RLINF_PREFLIGHT_STATUS=failed with the reason
    except Exception as exc:
        console.error(f"{type(exc).__name__}: {exc}")
        code = _code_of(exc, pg is not None)
    finally:
        if pg is not None:
            from rlinf_twoworker.cluster.placement import wait_removed

            wait_removed(pg)
    return console.final(code)


def cmd_verify(args: argparse.Namespace) -> int:
    """The postflight of RUN_DIR, against its own record unless the flags say otherwise."""
    from rlinf_twoworker.storage.verify import verify_run

    try:
        run_dir = _verify_run_dir(args)
        placement = _verify_placement(args.expected_placement)
        expected = _verify_expected(run_dir, args, placement)
    except TwoWorkerError as exc:
        _status_failed("RLINF_VERIFICATION_STATUS", exc)
        return INVALID
    own = _record_expected(run_dir)
    what_if = own is None or expected != own
    if what_if:  # the run's record stays the run's: a question about other values only prints
        print(
            "RLINF_VERIFICATION_NOTE checked against values other than the run's own record "
            "(flags given, or no readable record): verification.json left unchanged",
            flush=True,
        )
    report = verify_run(run_dir, expected=expected, write=not what_if)
    return OK if report.passed else FAILED


def _record_expected(run_dir: Path) -> Expected | None:
    """What the run's own record asks for, or None without a readable record."""
    from rlinf_twoworker.storage.verify import expected_from_record

    try:
        return expected_from_record(run_dir, None, None, None)
    except TwoWorkerError:
        return None


def _verify_run_dir(args: argparse.Namespace) -> Path:
    given = [d for d in (args.run_dir, args.output_dir) if d is not None]
    if not given or (len(given) == 2 and Path(given[0]).resolve() != Path(given[1]).resolve()):
        raise TwoWorkerError(
            "give the run directory once: rlinf-twoworker verify RUN_DIR "
            f"(got {'none' if not given else ' and '.join(given)})"
        )
    if args.output_dir is not None:
        print(
            "note: --output-dir is deprecated; pass the run directory as RUN_DIR", file=sys.stderr
        )
    return Path(given[0])


def _verify_placement(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    from rlinf_twoworker.config.overrides import parse_override

    _, _, placement = parse_override(f"placement={text}")
    if not isinstance(placement, dict):
        raise TwoWorkerError(
            f"--expected-placement {text!r} is not a map like "
            '{rollout:0,inference:1,actor:"2-3",reward:0}'
        )
    return placement


def _verify_expected(
    run_dir: Path, args: argparse.Namespace, placement: dict[str, Any] | None
) -> Expected:
    """From the run's record, each flag given replacing its value; without a readable record,
    from the flags alone (--target-steps and --expected-nodes are then needed)."""
    from rlinf_twoworker.storage.verify import expected_at, expected_from_record

    try:
        return expected_from_record(run_dir, args.target_steps, args.expected_nodes, placement)
    except TwoWorkerError:
        if args.target_steps is None or args.expected_nodes is None:
            raise
    return expected_at(run_dir, args.target_steps, args.expected_nodes, placement)


def _command_steps(name: str) -> Any:
    """An argparse type for a command's step count: api.request.MIN_STEPS, as TARGET_STEPS."""

    def parse(text: str) -> int:
        from rlinf_twoworker.api.request import steps_problem

        problem = steps_problem(name, text)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return int(text)

    parse.__name__ = name  # argparse names the type in its message
    return parse


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not >= 1")
    return value


def cmd_readback(args: argparse.Namespace) -> int:
    from rlinf_twoworker.storage.readback import readback

    try:
        print("\n".join(readback(args.run_dir, args.step).lines()))
    except TwoWorkerError as exc:
        return _failed("READBACK", exc)
    print("READBACK_STATUS=passed", flush=True)
    return OK


def cmd_export(args: argparse.Namespace) -> int:
    from rlinf_twoworker.storage.export import export_hf

    try:
        print("\n".join(export_hf(args.run_dir, args.out, args.step, args.dtype).lines()))
    except TwoWorkerError as exc:
        return _failed("EXPORT", exc)
    print("EXPORT_STATUS=passed", flush=True)
    return OK


def cmd_export_rlinf(args: argparse.Namespace) -> int:
    from rlinf_twoworker.storage.export_rlinf import export_rlinf

    try:
        result = export_rlinf(args.run_dir, args.out, args.step, args.fsdp_version)
    except TwoWorkerError as exc:
        return _failed("EXPORT", exc)
    print("\n".join(result.lines()))
    print("EXPORT_STATUS=passed", flush=True)
    return OK


def cmd_report(args: argparse.Namespace) -> int:
    from rlinf_twoworker.api.report import load_scalars, plot, table

    run_dir = Path(args.run_dir).resolve()
    try:
        scalars = load_scalars(run_dir)
        print(table(scalars))
        if not args.no_plot:
            out = plot(scalars, args.out or run_dir / "report.png", title=run_dir.name)
            print(f"REPORT_PLOT={out}", flush=True)
    except TwoWorkerError as exc:
        return _failed("REPORT", exc)
    return OK


def _failed(command: str, exc: BaseException) -> int:
    _status_failed(f"{command}_STATUS", exc)
    return FAILED


def _status_failed(status: str, exc: BaseException) -> None:
    """A command's failure: its status line on stdout (`<STATUS>=failed error=...`, one line,
    for scripts) and the error on stderr (`RLINF_ERROR=<type>: ...`), as `run` reports it."""
    print(f"{status}=failed error={' '.join(str(exc).split())}", flush=True)
    print(f"RLINF_ERROR={type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def _cluster_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        help="a YAML config in RLinf's layout (default: none, the library's embedded defaults, "
        "which are the tutorial's settings)",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="the Ray cluster's address (default: RAY_ADDRESS, else the cluster running on "
        "this node)",
    )
    parser.add_argument(
        "overrides", nargs="*", help="config overrides, key=value as on Hydra's command line"
    )


def _step_arg(parser: argparse.ArgumentParser, default: str) -> None:
    """--step, the checkpoint a command reads, the same way for every such command."""
    parser.add_argument(
        "--step",
        type=_positive_int,
        default=None,
        help=f"the checkpoint's step (default: {default})",
    )


def _run_dir_arg(parser: argparse.ArgumentParser, optional: bool = False) -> None:
    """RUN_DIR, the same way for every command that reads a run."""
    parser.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        nargs="?" if optional else None,
        default=None,
        help="the run directory (runner.output_dir/<run id>, printed as RUN_DIR= by run and demo)",
    )


def build_parser() -> argparse.ArgumentParser:
    summary, _, rest = (__doc__ or "").partition("\n\n")
    parser = argparse.ArgumentParser(
        prog="rlinf-twoworker",
        description=summary.strip(),
        epilog=rest.strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keep the docstring's lines
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="the Driver command: a run on the existing Ray cluster (env RUN_ID, WORK_ROOT, "
        "TARGET_STEPS)",
        description="The Driver command: one GRPO run on the Ray cluster this node belongs "
        "to (it connects; it never starts Ray), from the request check to the postflight. "
        "Environment: RUN_ID names the run (runner.experiment_name; letters, digits, '.', '_', "
        "'-'; a new one each run), WORK_ROOT the shared storage the runs go under (runs in WORK_ROOT/runs/two-worker-grpo-pipeline/RUN_ID), TARGET_STEPS the steps to "
        "train (runner.max_steps and the checkpoint step, >= 2). Each is optional where the "
        "config or an override gives the key.",
    )
    _cluster_args(run)
    run.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds for the whole run (default: the sum of the config's runner.timeouts)",
    )
    run.set_defaults(func=cmd_run)
    demo = sub.add_parser(
        "demo",
        help="the whole scenario on a local 2x2 cluster, no downloads",
        description="The main job at toy size on this machine: a local 2-node x 2-GPU Ray "
        "cluster on loopback, a tiny Qwen2 model and an addition data set made on the spot, "
        "the run, a checkpoint, the postflight (docs/local.md).",
    )
    demo.add_argument(
        "--output-root",
        default="demo-runs",
        help="the parent of the run directory (default: demo-runs)",
    )
    demo.add_argument("--run-id", default=None, help="the run's name (default: demo-<date>-<time>)")
    demo.add_argument(
        "--steps", type=_command_steps("--steps"), default=2, help="GRPO steps, >= 2 (default: 2)"
    )
    demo.add_argument(
        "overrides", nargs="*", help="config overrides, key=value as on Hydra's command line"
    )
    demo.set_defaults(func=cmd_demo)
    preflight = sub.add_parser(
        "preflight",
        help="placement and per-node preflight only",
        description="The placement group and the per-node preflight of a run of this config, "
        "on the connected cluster, then nothing: no run directory, no components.",
    )
    _cluster_args(preflight)
    preflight.set_defaults(func=cmd_preflight)
    verify = sub.add_parser(
        "verify",
        help="the postflight of a finished run directory, against its own record",
        description="The postflight of RUN_DIR. What the run must show (steps, nodes, placement, "
        "run id, output root, checkpoint, validation) comes from its record "
        "hydra/.hydra/config.yaml; each flag replaces the record's value.",
    )
    _run_dir_arg(verify, optional=True)
    verify.add_argument(
        "--output-dir",
        default=None,
        help="deprecated: the run directory (give RUN_DIR instead; default: none)",
    )
    verify.add_argument(
        "--target-steps",
        type=_command_steps("--target-steps"),
        default=None,
        help="the step the run must end at (default: runner.max_steps; give it for a run that "
        "runner.max_epochs ended earlier)",
    )
    verify.add_argument(
        "--expected-nodes",
        type=_positive_int,
        default=None,
        help="the nodes the run must show (default: the record's cluster.num_nodes)",
    )
    verify.add_argument(
        "--expected-placement",
        default=None,
        help="the placement the run must show, Hydra map syntax (default: the record's, or "
        'without one the tutorial\'s {rollout:0,inference:1,actor:"2-3",reward:0})',
    )
    verify.set_defaults(func=cmd_verify)
    readback = sub.add_parser(
        "readback",
        help="load a finished run's checkpoint (no Ray, no GPU)",
        description="Load a verified run's DCP checkpoint in this process (no Ray, no GPU) and "
        "print its shards and parameter count: the check that the files on storage are whole.",
    )
    _run_dir_arg(readback)
    _step_arg(readback, "the one the postflight verified")
    readback.set_defaults(func=cmd_readback)
    export = sub.add_parser(
        "export-hf",
        help="a checkpoint as a Hugging Face model directory",
        description="Write a checkpoint's weights as a Hugging Face model directory "
        "(model.safetensors, config and tokenizer files, a SHA256SUMS) that "
        "AutoModelForCausalLM.from_pretrained loads; no Ray, no GPU.",
    )
    _run_dir_arg(export)
    _step_arg(export, "the newest complete one")
    export.add_argument("--out", required=True, help="the new model directory (must not exist)")
    export.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="the weights' dtype (default: the checkpoint's, the float32 master weights)",
    )
    export.set_defaults(func=cmd_export)
    rlinf = sub.add_parser(
        "export-rlinf",
        help="a checkpoint in the form RLinf's FSDP actor resumes from (no Ray, no GPU)",
        description="Write OUT/global_step_<N>/actor/dcp_checkpoint from RUN_DIR's checkpoint: "
        "the shards copied, fsdp_version, lr_schedulers and rng written as RLinf's loader "
        "asserts. RLinf resumes from it with runner.resume_dir=OUT/global_step_<N>.",
    )
    _run_dir_arg(rlinf)
    _step_arg(rlinf, "the newest complete one")
    rlinf.add_argument(
        "--out",
        default=None,
        help="the directory to hold global_step_<N>, e.g. RLinf's "
        "<output_dir>/<experiment_name>/checkpoints (default: RUN_DIR/rlinf/checkpoints)",
    )
    rlinf.add_argument(
        "--fsdp-version",
        default=None,
        choices=("fsdp", "fsdp2"),
        help="RLinf's actor.fsdp_config.strategy that will load it (default: the run's, "
        "from its hydra/.hydra/config.yaml; RLinf's own default is fsdp)",
    )
    rlinf.set_defaults(func=cmd_export_rlinf)
    report = sub.add_parser(
        "report",
        help="a run's metrics: a table and a PNG plot",
        description="A run's TensorBoard metrics as a table (reward, loss, grad norm, seconds "
        "a step) and a PNG plot; works on a finished run and on one still writing.",
    )
    _run_dir_arg(report)
    report.add_argument("--out", default=None, help="the PNG's path (default: RUN_DIR/report.png)")
    report.add_argument(
        "--no-plot", action="store_true", help="print the table only (default: table and plot)"
    )
    report.set_defaults(func=cmd_report)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlinf_twoworker")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return "(not installed)"


def _plain_ray_output() -> None:
    """The commands' output is read as a log (driver.log, a platform's job log): Ray's colour
    codes only on a terminal, and no deduplication of the components' lines, whose summary Ray
    prints when it disconnects, after STARTUP_EXIT_CODE, the last line. The user's own
    RAY_COLOR_PREFIX and RAY_DEDUP_LOGS win; read when Ray is first imported, which is later."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _plain_ray_output()
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

"""The postflight's checks, one function per part of a run directory (logs, resolved config,
location, TensorBoard metrics, checkpoint, preflight record): each reads files only, fills its
part of the report and returns its errors."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlinf_twoworker.config.placement import parse_ranks
from rlinf_twoworker.errors import TwoWorkerError
from rlinf_twoworker.results import VerificationReport
from rlinf_twoworker.storage.checkpoints import dcp_problems
from rlinf_twoworker.storage.expected import Expected
from rlinf_twoworker.storage.metrics import event_files, read_scalars, tensorboard_dir
from rlinf_twoworker.storage.rundir import (
    CONFIG_YAML,
    DRIVER_LOG,
    FAILURE_JSON,
    MAIN_LOG,
    PLACEMENT_JSON,
    PREFLIGHT_JSON,
    checkpoint_dir,
)

FATAL_MARKERS = (
    "Traceback (most recent call last)",
    "Error executing job",
    "RayTaskError(",
    "ActorDiedError",
    "ActorUnavailableError",
    "CUDA out of memory",
    "RLINF_PREFLIGHT_STATUS=failed",
)
EXIT_CODE = re.compile(r"RLINF_PYTHON_EXIT_CODE=(\S*)")
PREFLIGHT_PASSED = re.compile(r"^RLINF_PREFLIGHT_STATUS=passed(\s|$)")


def _read_lines(path: Path, errors: list[str]) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        errors.append(f"{path} cannot be read ({exc}); the run did not write its log there")
        return []


def check_logs(run_dir: Path, target_steps: int) -> list[str]:
    errors: list[str] = []
    driver = _read_lines(run_dir / DRIVER_LOG, errors)
    main = _read_lines(run_dir / MAIN_LOG, errors)
    for name, lines in ((DRIVER_LOG, driver), (MAIN_LOG, main)):
        for number, line in enumerate(lines, start=1):
            marker = next((m for m in FATAL_MARKERS if m in line), None)
            if marker is not None:
                errors.append(
                    f"{run_dir / name} line {number} shows a failure ({marker!r}): "
                    f"{line.strip()[:200]!r}; read the log around that line for the cause"
                )
    codes = [m.group(1) for line in driver if (m := EXIT_CODE.search(line))]
    if codes[-1:] != ["0"]:
        seen = f"the last one says {codes[-1]!r}" if codes else "there is none"
        errors.append(
            f"{run_dir / DRIVER_LOG} must end the training with RLINF_PYTHON_EXIT_CODE=0 but "
            f"{seen}; {_why_it_ended(run_dir)}"
        )
    limit = f"Step limit given by max_steps={target_steps} reached. Stopping run"
    if not any(limit in line for line in driver + main):
        errors.append(
            f"neither {run_dir / DRIVER_LOG} nor {run_dir / MAIN_LOG} has the line {limit!r}; "
            f"the run stopped before step {target_steps} or ran a different max_steps"
        )
    if not any(PREFLIGHT_PASSED.match(line.strip()) for line in driver):
        errors.append(
            f"{run_dir / DRIVER_LOG} has no line RLINF_PREFLIGHT_STATUS=passed; a run whose "
            "preflight did not pass (or never ran) does not count: read the log's start and "
            "preflight.json"
        )
    return errors


def _why_it_ended(run_dir: Path) -> str:
    """What failure.json says, or, without one, that the run was killed before it could say."""
    try:
        record = json.loads((run_dir / FAILURE_JSON).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return (
            f"there is no {FAILURE_JSON} either, so the Driver or the run controller was "
            "killed before it could record why (the log's last STEP line is the last step "
            f"done); to continue, start a new run with runner.resume_dir={run_dir}"
        )
    except (OSError, ValueError) as exc:
        return f"{run_dir / FAILURE_JSON} cannot be read ({exc}); see the log's end"
    what = f"{record.get('type', 'error')}: {record.get('error', '?')}"
    return f"{run_dir / FAILURE_JSON} records the run {record.get('state', 'failed')}: {what}"


def _same(actual: Any, expected: Any) -> bool:
    """Equal values of equal types (0 is not '0', '2-3' is not [2, 3])."""
    if isinstance(expected, dict):
        return (
            isinstance(actual, dict)
            and actual.keys() == expected.keys()
            and all(_same(actual[k], expected[k]) for k in expected)
        )
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(expected)
            and all(_same(a, e) for a, e in zip(actual, expected, strict=True))
        )
    return type(actual) is type(expected) and actual == expected


def check_config(run_dir: Path, report: VerificationReport, expected: Expected) -> list[str]:
    path = run_dir / CONFIG_YAML
    try:
        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as exc:  # a missing or broken file is a finding, not a crash
        return [f"{path} cannot be loaded ({exc}); the run did not save its resolved config"]
    if not isinstance(cfg, dict):
        return [f"{path} is not a mapping of config keys; the resolved config is damaged"]
    cluster, runner = cfg.get("cluster") or {}, cfg.get("runner") or {}
    actual_placement = cluster.get("component_placement")
    errors = []
    checks = (
        ("cluster.num_nodes", cluster.get("num_nodes"), expected.expected_nodes),
        ("cluster.component_placement", actual_placement, expected.placement),
        ("runner.max_steps", runner.get("max_steps"), expected.recorded_max_steps),
        ("runner.experiment_name", runner.get("experiment_name"), expected.run_id),
    )
    for key, actual, wanted in checks:
        if not _same(actual, wanted):
            hint = " (types matter: a rank is an int, a range the string 'a-b')" * (
                key == "cluster.component_placement"
            )
            errors.append(
                f"{path}: {key} is {actual!r} but the run must have {wanted!r}{hint}; the "
                "run used a different config: rerun with the intended overrides"
            )
    output_dir = runner.get("output_dir")
    if not output_dir or Path(output_dir).resolve() != expected.output_root.resolve():
        errors.append(
            f"{path}: runner.output_dir is {output_dir!r} but the run must have been written "
            f"under {expected.output_root}; the run wrote elsewhere or this is a copied directory"
        )
    return errors


def check_location(run_dir: Path, expected: Expected) -> list[str]:
    if run_dir == expected.run_dir:
        return []
    return [
        f"run directory {run_dir} is not {expected.run_dir} (the expected output root "
        f"{expected.output_root} / run id {expected.run_id!r}); verify the directory the run "
        "wrote, or give the run id and output root it was asked for"
    ]


def check_placement(run_dir: Path, report: VerificationReport) -> list[str]:
    """placement.json (storage/rundir.write_placement): each component's placement as the run
    resolved it, reported; every process it lists must have run inside its component's
    resource ranks."""
    path = run_dir / PLACEMENT_JSON
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        placed, processes = record["components"], record["processes"]
        if not isinstance(placed, dict) or not all(isinstance(p, dict) for p in processes):
            raise TypeError("'components' must map names to placements, 'processes' be objects")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [
            f"{path} cannot be read ({type(exc).__name__}: {exc}); the run records where it "
            "placed its components once they have started, so it never got that far or the "
            "file was damaged"
        ]
    report.placement = placed
    errors = []
    for process in processes:
        name, rank = process.get("component"), process.get("resource_rank")
        if rank not in (placed.get(name) or {}).get("resource_ranks", []):
            errors.append(
                f"{path}: process {name}:{process.get('rank')} ran on resource rank {rank}, "
                f"outside its component's placement {placed.get(name)}; damaged or not this run's"
            )
    return errors


def _memory_estimates(run_dir: Path) -> dict[str, float]:
    """The memory plan's estimate of each process, keyed as its measured peaks are."""
    try:
        plan = json.loads((run_dir / "memory_plan.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # a run from before the plan, or an unreadable file
        return {}
    return {
        f"memory/{p['component']}/{p['rank']}/plan_estimate_gib": p["estimate_gib"]
        for gpu in plan.get("gpus", [])
        for p in gpu.get("processes", [])
    }


def check_metrics(run_dir: Path, report: VerificationReport, expected: Expected) -> list[str]:
    directory = tensorboard_dir(run_dir)
    files = event_files(run_dir)
    if not files:
        return [
            f"{directory} holds no events.out.tfevents.* file; the run logged no metrics "
            "(RLinf logs nothing for the final step, so a run needs >= 2 steps)"
        ]
    scalars = read_scalars(files)
    report.memory_peaks = {
        tag: max(series.values())
        for tag, series in sorted(scalars.items())
        if tag.startswith("memory/") and series
    }
    report.memory_estimates = _memory_estimates(run_dir)
    errors = []
    for tag in expected.required_tags:
        if not scalars.get(tag):
            errors.append(
                f"TensorBoard files under {directory} have no scalar {tag!r}; the training step "
                "that logs it did not run: check log/main.log"
            )
            continue
        steps = sorted(scalars[tag])
        values = [scalars[tag][s] for s in steps]
        report.metrics[tag] = {"step": steps[-1], "value": values[-1], "steps": steps}
        where = f"TensorBoard scalar {tag!r} under {directory}"
        errors += _check_series(where, tag, steps, values, expected.target_steps)
    return errors


def _check_series(
    where: str, tag: str, steps: list[int], values: list[float], target_steps: int
) -> list[str]:
    errors = []
    if steps[-1] != target_steps:
        errors.append(
            f"{where} was last logged at step {steps[-1]}, not at the target step "
            f"{target_steps}; the metric stopped early (or the run ran other steps): check "
            "log/main.log around that step"
        )
    bad = [(s, v) for s, v in zip(steps, values, strict=True) if not math.isfinite(v)]
    if bad:
        errors.append(
            f"{where} is not finite at step {bad[0][0]} ({bad[0][1]}); the training diverged: "
            "lower actor.optim.lr or check the rewards"
        )
    if tag.endswith("/lr") and any(not v > 0 for v in values):
        errors.append(
            f"{where} is not > 0 (values {values}); the optimiser did not train: check "
            "actor.optim.lr and actor.lr_sched"
        )
    return errors


def check_checkpoint(run_dir: Path, report: VerificationReport, expected: Expected) -> list[str]:
    step = expected.checkpoint_step
    if step is None:
        report.notes.append(
            "no checkpoint expected (as with runner.save_interval=-1, which never saves): "
            "no checkpoint was checked"
        )
        return []
    ckpt = checkpoint_dir(run_dir, step)
    if not ckpt.is_dir():
        return [
            f"checkpoint directory {ckpt} is missing; the run did not save at step "
            f"{step}: check runner.save_interval and log/main.log"
        ]
    report.checkpoint_dir = str(ckpt)
    report.checkpoint_files = {
        str(p.relative_to(ckpt)): p.stat().st_size for p in sorted(ckpt.rglob("*")) if p.is_file()
    }
    dcp_dir = ckpt / "actor" / "dcp_checkpoint"
    metadata, data = dcp_dir / ".metadata", ckpt / "data" / "data.pt"
    shards = sorted(dcp_dir.glob("*.distcp"))
    # A rank's shard is its files __<rank>_<i>.distcp (runner.checkpoint_write_threads of
    # them); the count is of ranks that wrote one, non-empty.
    report.actor_fsdp_shards = len(
        {p.name.split("_")[2] for p in shards if p.stat().st_size > 0 and p.name.count("_") >= 3}
    )
    # One shard per FSDP actor rank: two in the tutorial's placement ("2-3").
    min_shards = _actor_ranks(expected.placement)
    errors = []
    metadata_written = metadata.is_file() and metadata.stat().st_size > 0
    if not metadata_written:
        errors.append(
            f"{metadata} is missing or empty; the sharded actor checkpoint is incomplete and "
            "cannot be loaded: the save did not finish"
        )
    shard_problems = []
    if report.actor_fsdp_shards < min_shards:
        shard_problems.append(
            f"{dcp_dir} has non-empty *.distcp shard files of {report.actor_fsdp_shards} "
            f"rank(s) (files: {[p.name for p in shards]}); a run with {min_shards} FSDP actor "
            f"ranks writes a shard for each: a rank did not save"
        )
    if metadata_written:
        # Every file the .metadata names, present and long enough (a shard spans files).
        shard_problems += dcp_problems(dcp_dir)
    if shard_problems:
        errors.append("; ".join(shard_problems))
    if not data.is_file() or data.stat().st_size == 0:
        errors.append(
            f"{data} is missing or empty; the data loader's state was not saved, so the run "
            "cannot resume from this checkpoint"
        )
    return errors


def _actor_ranks(placement: dict[str, Any]) -> int:
    try:
        return len(parse_ranks(placement.get("actor"), "cluster.component_placement.actor"))
    except TwoWorkerError:  # a malformed expected placement fails the config check instead
        return 1


def check_preflight(run_dir: Path, report: VerificationReport) -> list[str]:
    path = run_dir / PREFLIGHT_JSON
    if not path.is_file():
        return [
            f"{path} is missing; the preflight never wrote its report, so nothing shows the "
            "nodes were checked before training: a run without it does not count"
        ]
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [f"{path} cannot be read as JSON ({exc}); the preflight's report is damaged"]
    nodes = data if isinstance(data, list) else data.get("nodes") or data.get("workers") or []
    report.workers = [n for n in nodes if isinstance(n, dict)]
    if isinstance(data, dict) and data.get("passed") is False:
        return [f"{path} says the preflight failed ({data.get('errors')}); fix it and rerun"]
    return []

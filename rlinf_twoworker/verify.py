"""The postflight (SCENARIO.md step 5): read a finished run directory and decide if it succeeded.

A run whose logs show a failure never counts as a success, whatever the platform reported. Only
files are read (logs, resolved config, TensorBoard events, checkpoint), so the check runs on any
machine that mounts the shared storage: no Ray, no GPU.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlinf_twoworker.errors import VerificationError
from rlinf_twoworker.metrics import event_files, read_scalars
from rlinf_twoworker.placement import COMPONENTS, parse_ranks
from rlinf_twoworker.rundir import (
    CONFIG_YAML,
    DRIVER_LOG,
    FAILURE_JSON,
    MAIN_LOG,
    PREFLIGHT_JSON,
    TENSORBOARD_DIR,
    VERIFICATION_JSON,
    atomic_write_text,
    checkpoint_dir,
)

TUTORIAL_PLACEMENT: dict[str, Any] = {"rollout": 0, "inference": 1, "actor": "2-3", "reward": 0}
REQUIRED_SCALARS = (
    "rollout/reward_scores",
    "actor/training/actor/final_loss",
    "actor/training/actor/grad_norm",
    "actor/training/actor/lr",
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


@dataclass
class VerificationReport:
    passed: bool
    run_dir: str
    target_steps: int
    expected_nodes: int
    errors: list[str] = field(default_factory=list)
    checkpoint_dir: str | None = None
    checkpoint_files: dict[str, int] = field(default_factory=dict)
    """Path relative to checkpoint_dir -> size in bytes."""
    metrics: dict[str, dict] = field(default_factory=dict)
    """Tag -> {"step": last step, "value": last value, "steps": every logged step}."""
    workers: list[dict] = field(default_factory=list)
    """preflight.json's per-node entries (empty when the file is absent)."""
    placement: dict = field(default_factory=dict)
    """Component -> {"spec", "resource_ranks", "nodes"} from the resolved config."""
    actor_fsdp_shards: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: non-finite metric values become the strings 'nan', 'inf', '-inf'."""
        data = asdict(self)
        for entry in data["metrics"].values():
            if not math.isfinite(entry["value"]):
                entry["value"] = str(entry["value"])
        return data


def verify_run(
    output_dir: str | Path,
    target_steps: int,
    expected_nodes: int,
    log: Callable[[str], None] = print,
    write: bool = True,
    expected_placement: dict[str, Any] | None = None,
) -> VerificationReport:
    """Check the run directory `output_dir` (<output_root>/<RUN_ID>); never raises on a bad run.

    Logs GRPO_METRIC, ACTOR_FSDP_SHARDS, CHECKPOINT_DIR and RLINF_VERIFICATION_STATUS lines,
    writes verification.json when `write`, and returns the report (see `require_passed`).
    """
    run_dir = Path(output_dir).resolve()
    report = VerificationReport(False, str(run_dir), target_steps, expected_nodes)
    if not run_dir.is_dir():
        report.errors.append(
            f"run directory {run_dir} does not exist; check the RUN_ID and that the shared "
            "storage is mounted on this machine"
        )
        _log_result(report, log)
        return report
    placement = TUTORIAL_PLACEMENT if expected_placement is None else expected_placement
    report.errors += _check_logs(run_dir, target_steps)
    report.errors += _check_config(run_dir, report, placement)
    report.errors += _check_metrics(run_dir, report)
    # One shard per FSDP actor rank: two in the tutorial's placement ("2-3").
    min_shards = len(
        parse_ranks(placement.get("actor", "2-3"), "cluster.component_placement.actor")
    )
    report.errors += _check_checkpoint(run_dir, report, min_shards)
    report.errors += _read_workers(run_dir, report)
    report.passed = not report.errors
    _log_result(report, log)
    if write:
        text = json.dumps(report.to_dict(), indent=2, sort_keys=True)
        atomic_write_text(run_dir / VERIFICATION_JSON, text + "\n")
    return report


def require_passed(report: VerificationReport) -> None:
    """Raise VerificationError listing every error of a failed report."""
    if not report.passed:
        listed = "\n".join(f"  - {e}" for e in report.errors)
        raise VerificationError(
            f"postflight of {report.run_dir} failed with {len(report.errors)} error(s):\n{listed}"
        )


def _log_result(report: VerificationReport, log: Callable[[str], None]) -> None:
    for tag, entry in report.metrics.items():
        log(f"GRPO_METRIC={tag} step={entry['step']} value={entry['value']}")
    log(f"ACTOR_FSDP_SHARDS={report.actor_fsdp_shards}")
    log(f"CHECKPOINT_DIR={report.checkpoint_dir}")
    for error in report.errors:
        log(f"RLINF_VERIFICATION_ERROR={error}")
    if report.passed:
        log("RLINF_VERIFICATION_STATUS=passed")
    else:
        first = " ".join(report.errors[0].split()) if report.errors else "unknown"
        log(f"RLINF_VERIFICATION_STATUS=failed error={first}")


def _read_lines(path: Path, errors: list[str]) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        errors.append(f"{path} cannot be read ({exc}); the run did not write its log there")
        return []


def _check_logs(run_dir: Path, target_steps: int) -> list[str]:
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


def _check_config(run_dir: Path, report: VerificationReport, placement: dict) -> list[str]:
    path = run_dir / CONFIG_YAML
    try:
        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as exc:  # a missing or broken file is a finding, not a crash
        return [f"{path} cannot be loaded ({exc}); the run did not save its resolved config"]
    if not isinstance(cfg, dict):
        return [f"{path} is not a mapping of config keys; the resolved config is damaged"]
    cluster, runner = cfg.get("cluster") or {}, cfg.get("runner") or {}
    actual_placement = cluster.get("component_placement")
    report.placement = _resolved_placement(actual_placement, cluster.get("num_gpus_per_node"))
    errors = []
    checks = (
        ("cluster.num_nodes", cluster.get("num_nodes"), report.expected_nodes),
        ("cluster.component_placement", actual_placement, placement),
        ("runner.max_steps", runner.get("max_steps"), report.target_steps),
        ("runner.experiment_name", runner.get("experiment_name"), run_dir.name),
    )
    for key, actual, expected in checks:
        if not _same(actual, expected):
            hint = " (types matter: a rank is an int, a range the string 'a-b')" * (
                key == "cluster.component_placement"
            )
            errors.append(
                f"{path}: {key} is {actual!r} but the run must have {expected!r}{hint}; the "
                "run used a different config: rerun with the intended overrides"
            )
    output_dir = runner.get("output_dir")
    if not output_dir or Path(output_dir).resolve() != run_dir.parent:
        errors.append(
            f"{path}: runner.output_dir is {output_dir!r} but the run directory's parent is "
            f"{run_dir.parent}; the run wrote elsewhere or this is a copied directory"
        )
    return errors


def _resolved_placement(spec: Any, gpus_per_node: Any) -> dict:
    if not isinstance(spec, dict) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        return {}
    resolved = {}
    for component in COMPONENTS:
        try:
            ranks = parse_ranks(spec.get(component), f"cluster.component_placement.{component}")
        except ValueError:
            ranks = []
        nodes = sorted({r // gpus_per_node for r in ranks})
        resolved[component] = {"spec": spec.get(component), "resource_ranks": ranks, "nodes": nodes}
    return resolved


def _check_metrics(run_dir: Path, report: VerificationReport) -> list[str]:
    directory = run_dir / TENSORBOARD_DIR
    files = event_files(run_dir)
    if not files:
        return [
            f"{directory} holds no events.out.tfevents.* file; the run logged no metrics "
            "(RLinf logs nothing for the final step, so a run needs >= 2 steps)"
        ]
    scalars = read_scalars(files)
    errors = []
    for tag in REQUIRED_SCALARS:
        if not scalars.get(tag):
            errors.append(
                f"TensorBoard files under {directory} have no scalar {tag!r}; the training step "
                "that logs it did not run: check log/main.log"
            )
            continue
        steps = sorted(scalars[tag])
        values = [scalars[tag][s] for s in steps]
        report.metrics[tag] = {"step": steps[-1], "value": values[-1], "steps": steps}
        bad = [(s, v) for s, v in zip(steps, values, strict=True) if not math.isfinite(v)]
        if bad:
            errors.append(
                f"TensorBoard scalar {tag!r} under {directory} is not finite at step "
                f"{bad[0][0]} ({bad[0][1]}); the training diverged: lower actor.optim.lr or "
                "check the rewards"
            )
        if tag.endswith("/lr") and any(not v > 0 for v in values):
            errors.append(
                f"TensorBoard scalar {tag!r} under {directory} is not > 0 (values {values}); "
                "the optimiser did not train: check actor.optim.lr and actor.lr_sched"
            )
    return errors


def _check_checkpoint(run_dir: Path, report: VerificationReport, min_shards: int = 2) -> list[str]:
    ckpt = checkpoint_dir(run_dir, report.target_steps)
    if not ckpt.is_dir():
        return [
            f"checkpoint directory {ckpt} is missing; the run did not save at step "
            f"{report.target_steps}: check runner.save_interval and log/main.log"
        ]
    report.checkpoint_dir = str(ckpt)
    report.checkpoint_files = {
        str(p.relative_to(ckpt)): p.stat().st_size for p in sorted(ckpt.rglob("*")) if p.is_file()
    }
    dcp_dir = ckpt / "actor" / "dcp_checkpoint"
    metadata, data = dcp_dir / ".metadata", ckpt / "data" / "data.pt"
    shards = sorted(dcp_dir.glob("*.distcp"))
    report.actor_fsdp_shards = sum(1 for p in shards if p.stat().st_size > 0)
    errors = []
    if not metadata.is_file() or metadata.stat().st_size == 0:
        errors.append(
            f"{metadata} is missing or empty; the sharded actor checkpoint is incomplete and "
            "cannot be loaded: the save did not finish"
        )
    if report.actor_fsdp_shards < min_shards:
        errors.append(
            f"{dcp_dir} has {report.actor_fsdp_shards} non-empty *.distcp shard(s) (files: "
            f"{[p.name for p in shards]}); a run with {min_shards} FSDP actor ranks writes at "
            f"least {min_shards}: a rank did not save"
        )
    if not data.is_file() or data.stat().st_size == 0:
        errors.append(
            f"{data} is missing or empty; the data loader's state was not saved, so the run "
            "cannot resume from this checkpoint"
        )
    return errors


def _read_workers(run_dir: Path, report: VerificationReport) -> list[str]:
    path = run_dir / PREFLIGHT_JSON
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [f"{path} cannot be read as JSON ({exc}); the preflight's report is damaged"]
    nodes = data if isinstance(data, list) else data.get("nodes") or data.get("workers") or []
    report.workers = [n for n in nodes if isinstance(n, dict)]
    if isinstance(data, dict) and data.get("passed") is False:
        return [f"{path} says the preflight failed ({data.get('errors')}); fix it and rerun"]
    return []

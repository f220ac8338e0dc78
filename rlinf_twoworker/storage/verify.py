"""The postflight (SCENARIO.md step 5): read a finished run directory and decide if it succeeded.

A run whose logs show a failure never counts as a success, whatever the platform reported. What
the run must show comes as one `Expected`: inside a run from the request (`expected_from_config`),
never from the run's own record, so a run that recorded other values fails; after the fact,
`rlinf-twoworker verify RUN_DIR` takes it from the record (`expected_from_record`). Only files
are read (logs, resolved config, TensorBoard events, checkpoint), so the check runs on any
machine that mounts the shared storage: no Ray, no GPU. What is expected is built in
expected.py, each check is in checks.py; this module runs them and records the verdict.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlinf_twoworker.errors import VerificationError
from rlinf_twoworker.results import VerificationReport
from rlinf_twoworker.storage import checks
from rlinf_twoworker.storage.expected import (
    REQUIRED_SCALARS,
    TUTORIAL_PLACEMENT,
    VALIDATION_SCALARS,
    Expected,
    expected_at,
    expected_from_config,
    expected_from_record,
)
from rlinf_twoworker.storage.rundir import (
    VERIFICATION_JSON,
    atomic_write_text,
)

__all__ = [
    "REQUIRED_SCALARS",
    "TUTORIAL_PLACEMENT",
    "VALIDATION_SCALARS",
    "Expected",
    "VerificationReport",
    "expected_at",
    "expected_from_config",
    "expected_from_record",
    "require_passed",
    "verify_run",
]


def verify_run(
    output_dir: str | Path,
    target_steps: int | None = None,
    expected_nodes: int | None = None,
    log: Callable[[str], None] = print,
    write: bool = True,
    expected_placement: dict[str, Any] | None = None,
    *,
    expected: Expected | None = None,
) -> VerificationReport:
    """Check the run directory `output_dir` (<output_root>/<RUN_ID>) against `expected` (what
    the request asked for: `expected_from_config`), or, for callers that know only these,
    against `expected_at(output_dir, target_steps, expected_nodes, expected_placement)`.
    Never raises on a bad run.

    Logs GRPO_METRIC, ACTOR_FSDP_SHARDS, CHECKPOINT_DIR, RLINF_VERIFICATION_NOTE and
    RLINF_VERIFICATION_STATUS lines, writes verification.json when `write`, and returns the
    report (see `require_passed`).
    """
    if expected is None:
        if target_steps is None or expected_nodes is None:
            raise TypeError("verify_run needs expected=, or target_steps and expected_nodes")
        expected = expected_at(output_dir, target_steps, expected_nodes, expected_placement)
    elif (target_steps, expected_nodes, expected_placement) != (None, None, None):
        raise TypeError("verify_run takes expected= or target_steps/expected_nodes, not both")
    path = Path(output_dir).resolve()
    report = _new_report(path, expected)
    if not path.is_dir():
        report.errors.append(
            f"run directory {path} does not exist; check the RUN_ID and that the shared "
            "storage is mounted on this machine"
        )
    else:
        report.errors += _run_checks(path, report, expected)
    report.passed = not report.errors
    _log_result(report, log)
    if write and path.is_dir():
        text = json.dumps(report.to_dict(), indent=2, sort_keys=True)
        atomic_write_text(path / VERIFICATION_JSON, text + "\n")
    return report


def _run_checks(run_dir: Path, report: VerificationReport, expected: Expected) -> list[str]:
    return [
        *checks.check_logs(run_dir, expected.target_steps),
        *checks.check_config(run_dir, report, expected),
        *checks.check_placement(run_dir, report),
        *checks.check_location(run_dir, expected),
        *checks.check_metrics(run_dir, report, expected),
        *checks.check_checkpoint(run_dir, report, expected),
        *checks.check_preflight(run_dir, report),
    ]


def _new_report(run_dir: Path, expected: Expected) -> VerificationReport:
    return VerificationReport(
        passed=False,
        run_dir=str(run_dir),
        target_steps=expected.target_steps,
        expected_nodes=expected.expected_nodes,
        run_id=expected.run_id,
        output_root=str(expected.output_root),
        checkpoint_step=expected.checkpoint_step,
        required_tags=list(expected.required_tags),
    )


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
    for note in report.notes:
        log(f"RLINF_VERIFICATION_NOTE={note}")
    for error in report.errors:
        log(f"RLINF_VERIFICATION_ERROR={error}")
    if report.passed:
        log("RLINF_VERIFICATION_STATUS=passed")
    else:
        first = " ".join(report.errors[0].split()) if report.errors else "unknown"
        log(f"RLINF_VERIFICATION_STATUS=failed error={first}")

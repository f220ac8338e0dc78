"""The postflight (SCENARIO.md step 5): read a finished run directory and decide if it succeeded.

A run whose logs show a failure never counts as a success, whatever the platform reported. What
the run must show comes as one `Expected`: inside a run from the request (`expected_from_config`),
never from the run's own record, so a run that recorded other values fails; after the fact,
`rlinf-twoworker verify RUN_DIR` takes it from the record (`expected_from_record`). Only files
are read (logs, resolved config, TensorBoard events, checkpoint), so the check runs on any
machine that mounts the shared storage: no Ray, no GPU.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from omegaconf import OmegaConf

from rlinf_twoworker import components
from rlinf_twoworker.config import GRPOConfig, load_config, to_typed
from rlinf_twoworker.config.placement import parse_ranks
from rlinf_twoworker.errors import TwoWorkerError, VerificationError
from rlinf_twoworker.storage.metrics import event_files, read_scalars, tensorboard_dir
from rlinf_twoworker.storage.rundir import (
    CONFIG_YAML,
    DRIVER_LOG,
    FAILURE_JSON,
    MAIN_LOG,
    PREFLIGHT_JSON,
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
VALIDATION_SCALARS = ("val/reward_scores", "val/correct_fraction")
"""Also required when the run validates (data.val_data_paths and runner.val_check_interval > 0)."""
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


@dataclass(frozen=True, kw_only=True)
class Expected:
    """What a run directory must show. Inside a run these are the request's values (the config
    the caller asked for), never the run's own record."""

    run_id: str
    """runner.experiment_name, and the run directory's name."""
    output_root: Path
    """runner.output_dir: the parent the run directory must have been written under."""
    target_steps: int
    """The run's last step: the step-limit line's, and the one every required scalar ends at."""
    expected_nodes: int
    """cluster.num_nodes."""
    checkpoint_step: int | None
    """The step whose checkpoint must be complete; None: the run saves no checkpoint (RLinf's
    runner.save_interval=-1 never saves), so the checkpoint is not checked."""
    max_steps: int | None = None
    """runner.max_steps in the resolved config; None: target_steps (they differ only when
    runner.max_epochs ends the run first)."""
    placement: dict[str, Any] = field(default_factory=lambda: dict(TUTORIAL_PLACEMENT))
    """cluster.component_placement, types included (a rank is an int, a range the string 'a-b')."""
    required_tags: tuple[str, ...] = REQUIRED_SCALARS
    """TensorBoard scalars that must be logged, finite, with their last value at target_steps."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_root", Path(self.output_root))
        object.__setattr__(self, "required_tags", tuple(self.required_tags))
        _rule(bool(self.run_id) and "/" not in self.run_id, "run_id", self.run_id, "not a run name")
        _rule(self.target_steps >= 1, "target_steps", self.target_steps, "must be >= 1")
        _rule(self.expected_nodes >= 1, "expected_nodes", self.expected_nodes, "must be >= 1")
        step = self.checkpoint_step
        _rule(
            step is None or 1 <= step <= self.target_steps,
            "checkpoint_step",
            step,
            f"must be None (no checkpoint) or a step in 1..target_steps ({self.target_steps})",
        )

    @property
    def recorded_max_steps(self) -> int:
        return self.target_steps if self.max_steps is None else self.max_steps

    @property
    def run_dir(self) -> Path:
        """Where the run must be: output_root/run_id."""
        return self.output_root.resolve() / self.run_id


def _rule(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"Expected.{name} = {value!r}: {rule}")


def expected_from_config(
    cfg: GRPOConfig, placement: dict[str, Any] | None = None, last_step: int | None = None
) -> Expected:
    """What a run of the request `cfg` must show. `placement` is cluster.component_placement as
    the request gave it (default: cfg's); `last_step` is the step the run ends at (default
    runner.max_steps; lower when runner.max_epochs ends it first). The checkpoint is the last
    scheduled one, none when runner.save_interval < 0; validation adds its scalars when the run
    validates (data.val_data_paths and runner.val_check_interval > 0)."""
    last = cfg.runner.max_steps if last_step is None else last_step
    validates = bool(getattr(cfg.data, "val_data_paths", None) or []) and (
        (getattr(cfg.runner, "val_check_interval", 0) or 0) > 0
    )
    return Expected(
        run_id=cfg.runner.experiment_name,
        output_root=Path(cfg.runner.output_dir).resolve(),
        target_steps=last,
        expected_nodes=cfg.cluster.num_nodes,
        checkpoint_step=_last_checkpoint_step(cfg, last),
        max_steps=cfg.runner.max_steps,
        placement=dict(cfg.cluster.component_placement if placement is None else placement),
        required_tags=REQUIRED_SCALARS + (VALIDATION_SCALARS if validates else ()),
    )


def _last_checkpoint_step(cfg: GRPOConfig, last: int) -> int | None:
    if cfg.runner.save_interval < 0:
        return None
    from rlinf_twoworker.storage.checkpoints import (
        scheduled_steps,  # imports torch: only when needed
    )

    steps = scheduled_steps(cfg, last)
    return steps[-1] if steps else None


def expected_from_record(
    run_dir: str | Path,
    target_steps: int | None = None,
    expected_nodes: int | None = None,
    placement: dict[str, Any] | None = None,
) -> Expected:
    """What `run_dir` must show by its own record (hydra/.hydra/config.yaml), each value given
    replacing the record's (target_steps: the last step, as `expected_from_config`'s
    last_step). Raises VerificationError when the record cannot be read."""
    path = Path(run_dir) / CONFIG_YAML
    if not Path(run_dir).is_dir():
        raise VerificationError(
            f"run directory {run_dir} does not exist; check the RUN_ID and that the shared "
            "storage is mounted on this machine"
        )
    try:
        if not path.is_file():
            raise FileNotFoundError("the file does not exist")
        cfg = load_config(path)
        recorded = cast(dict[str, Any], OmegaConf.to_container(cfg.cluster.component_placement))
        expected = expected_from_config(to_typed(cfg), recorded, target_steps)
    except (TwoWorkerError, OSError, ValueError) as exc:
        raise VerificationError(
            f"the run's record {path} cannot be read ({exc}); give the expected values "
            "instead: the verify command's --target-steps and --expected-nodes (and "
            "--expected-placement for a placement other than the tutorial's)"
        ) from exc
    if expected_nodes is not None:
        expected = replace(expected, expected_nodes=expected_nodes)
    if placement is not None:
        expected = replace(expected, placement=dict(placement))
    return expected


def expected_at(
    run_dir: str | Path,
    target_steps: int,
    expected_nodes: int,
    placement: dict[str, Any] | None = None,
) -> Expected:
    """What `run_dir` must show when only steps, nodes and placement are known: its name is the
    run id, its parent the output root, the checkpoint is at target_steps, the tutorial's
    scalars are required and its placement is the default."""
    path = Path(run_dir).resolve()
    return Expected(
        run_id=path.name,
        output_root=path.parent,
        target_steps=target_steps,
        expected_nodes=expected_nodes,
        checkpoint_step=target_steps,
        max_steps=target_steps,
        placement=dict(TUTORIAL_PLACEMENT if placement is None else placement),
    )


@dataclass
class VerificationReport:
    passed: bool
    run_dir: str
    target_steps: int
    expected_nodes: int
    errors: list[str] = field(default_factory=list)
    run_id: str = ""
    output_root: str = ""
    """The expected run id and output root (the run directory must be output_root/run_id)."""
    checkpoint_step: int | None = None
    """The step whose checkpoint was checked; None when the run was expected to save none."""
    required_tags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What was not checked, and why (a checkpoint the run was not expected to save)."""
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
    memory_peaks: dict[str, float] = field(default_factory=dict)
    """memory/<component>/<rank>/<what> -> the largest value of any step (GiB)."""
    memory_estimates: dict[str, float] = field(default_factory=dict)
    """memory/<component>/<rank>/plan_estimate_gib -> the memory plan's estimate for that
    process (memory_plan.json; CUDA context included), beside the measured peaks."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: non-finite metric values become the strings 'nan', 'inf', '-inf'."""
        data = asdict(self)
        for entry in data["metrics"].values():
            if not math.isfinite(entry["value"]):
                entry["value"] = str(entry["value"])
        return data


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
        *_check_logs(run_dir, expected.target_steps),
        *_check_config(run_dir, report, expected),
        *_check_location(run_dir, expected),
        *_check_metrics(run_dir, report, expected),
        *_check_checkpoint(run_dir, report, expected),
        *_check_preflight(run_dir, report),
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


def _check_config(run_dir: Path, report: VerificationReport, expected: Expected) -> list[str]:
    path = run_dir / CONFIG_YAML
    try:
        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as exc:  # a missing or broken file is a finding, not a crash
        return [f"{path} cannot be loaded ({exc}); the run did not save its resolved config"]
    if not isinstance(cfg, dict):
        return [f"{path} is not a mapping of config keys; the resolved config is damaged"]
    cluster, runner = cfg.get("cluster") or {}, cfg.get("runner") or {}
    actual_placement = cluster.get("component_placement")
    report.placement = _resolved_placement(actual_placement, cluster.get("num_gpus_per_node"), cfg)
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


def _check_location(run_dir: Path, expected: Expected) -> list[str]:
    if run_dir == expected.run_dir:
        return []
    return [
        f"run directory {run_dir} is not {expected.run_dir} (the expected output root "
        f"{expected.output_root} / run id {expected.run_id!r}); verify the directory the run "
        "wrote, or give the run id and output root it was asked for"
    ]


def _resolved_placement(spec: Any, gpus_per_node: Any, record: dict) -> dict:
    """Component -> its placement spec, resource ranks and nodes, for the components the
    recorded config runs (the table's; the reference only with a KL term), each placed as
    the run placed it (the reference on its default component's ranks when unnamed)."""
    if not isinstance(spec, dict) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        return {}
    resolved = {}
    try:
        in_run = components.in_run(OmegaConf.create(record))
    except Exception:  # a damaged record (no algorithm section): the components every run has
        in_run = [c for c in components.TABLE if c.needed is None]
    for component in in_run:
        given = spec.get(component.name)
        if given is None and component.default_placement is not None:
            given = spec.get(component.default_placement)
        try:
            ranks = parse_ranks(given, f"cluster.component_placement.{component.name}")
        except ValueError:
            ranks = []
        nodes = sorted({r // gpus_per_node for r in ranks})
        resolved[component.name] = {"spec": given, "resource_ranks": ranks, "nodes": nodes}
    return resolved


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


def _check_metrics(run_dir: Path, report: VerificationReport, expected: Expected) -> list[str]:
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


def _check_checkpoint(run_dir: Path, report: VerificationReport, expected: Expected) -> list[str]:
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
    report.actor_fsdp_shards = sum(1 for p in shards if p.stat().st_size > 0)
    # One shard per FSDP actor rank: two in the tutorial's placement ("2-3").
    min_shards = _actor_ranks(expected.placement)
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


def _actor_ranks(placement: dict[str, Any]) -> int:
    try:
        return len(parse_ranks(placement.get("actor"), "cluster.component_placement.actor"))
    except TwoWorkerError:  # a malformed expected placement fails the config check instead
        return 1


def _check_preflight(run_dir: Path, report: VerificationReport) -> list[str]:
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

"""Ray Tune: one GRPO run per trial, inside the placement group Tune reserves for the trial.

    from ray import tune
    from rlinf_twoworker.api.tune import grpo_trainable, trial_resources

    trainable = tune.with_resources(grpo_trainable(cfg), trial_resources(cfg))
    tuner = tune.Tuner(
        trainable,
        param_space={"actor.optim.lr": tune.grid_search([1e-5, 2e-5])},
        tune_config=tune.TuneConfig(metric="rollout/reward_scores", mode="max"),
        run_config=tune.RunConfig(failure_config=tune.FailureConfig(max_failures=2)),
    )
    best = tuner.fit().get_best_result()

`trial_resources` asks Tune for the run's own shape (cluster.num_nodes bundles of
cluster.num_gpus_per_node GPUs, STRICT_SPREAD) plus an empty head bundle, so the trainable
itself holds nothing and sits on bundle 0's node, as a run's caller must. Each trial runs
`run_grpo_two_worker(cfg, placement_group="current")` with the trial's parameters applied as
config overrides (checked like any override: a key that does not exist is refused by name), in
its own run directory `<runner.output_dir>/<experiment_name>-<trial id>`. Every step's metrics
and stage times go to Tune as the step's future resolves, with the step's checkpoint once it is
complete on storage; the last report waits for the postflight (`verification_passed`), and a
run that fails or does not pass fails its trial. Needs `pip install -e ".[tune]"`.

Checkpoints go to Tune by reference: the step's `tune.Checkpoint` is a directory holding only
`rlinf_checkpoint.json` (POINTER_JSON: the absolute path of the run's own
`checkpoints/global_step_<N>`, its run directory, run id, step and trial), because Tune copies
what it is given into its storage and a 1.5B model's checkpoint with Adam state is about 18 GB.
A trial that Tune starts again with a checkpoint (a retry under `FailureConfig(max_failures=N)`,
`Tuner.restore`, a PBT exploit handing it another trial's checkpoint) reads it with
`tune.get_checkpoint()`, checks the checkpoint it names is complete, and runs a new run
directory `<experiment_name>-<trial id>-r<k>` (k counts the trial's attempts; run directories
are never reused) with `runner.resume_dir` at that checkpoint. The new run's `resumed_from.json`
names the checkpoint and the run it came from, and every attempt's `tune_trial.json`
(TRIAL_JSON) names its trial, attempt and parent. Reports go on at the checkpoint's step + 1:
Tune rolls the trial back to the checkpoint's report (its training_iteration too), so each step
is reported once per timeline, in order. The referenced files stay where the run wrote them, so
they must outlive the trials that may restore them: `runner.keep_last_checkpoints` prunes them,
Tune's `CheckpointConfig(num_to_keep)` deletes only pointers.
"""

from __future__ import annotations

import copy
import json
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ray
from omegaconf import DictConfig

from rlinf_twoworker.api.handle import RunHandle, run_grpo_two_worker
from rlinf_twoworker.config import GRPOConfig, config_notes, to_typed
from rlinf_twoworker.config.overrides import apply_override
from rlinf_twoworker.errors import TwoWorkerError, VerificationError
from rlinf_twoworker.storage import checkpoints as ckpt
from rlinf_twoworker.storage.rundir import atomic_write_text, run_dir_of

POINTER_JSON = "rlinf_checkpoint.json"
"""The one file of a checkpoint handed to Tune: where the run's checkpoint is."""
TRIAL_JSON = "tune_trial.json"
"""In every trial's run directory: its trial, attempt, and the checkpoint it resumed from."""
POINTER_KEYS = ("checkpoint", "run_dir", "run_id", "step")


def _tune() -> Any:
    try:
        from ray import tune
    except ImportError as exc:
        raise TwoWorkerError(
            f"Ray Tune is not installed ({exc}); install the extra: pip install -e '.[tune]' "
            "(or pip install 'ray[tune]')"
        ) from exc
    return tune


def trial_resources(cfg: DictConfig) -> Any:
    """Tune's PlacementGroupFactory for one run of `cfg`: an empty head bundle for the
    trainable, then the run's bundles. Idle kept processes of earlier runs on the connected
    cluster (cluster.keep_processes) are released here: the trials' groups are Tune's, not
    library runs, and would wait behind their GPUs."""
    from rlinf_twoworker.run.kept import release_kept

    release_kept()
    cluster = to_typed(cfg).cluster
    bundle = {"CPU": cluster.cpus_per_bundle, "GPU": cluster.num_gpus_per_node}
    bundles: list[dict[str, float]] = [{}] + [dict(bundle) for _ in range(cluster.num_nodes)]
    return _tune().PlacementGroupFactory(bundles, strategy="STRICT_SPREAD")


def trial_config(cfg: DictConfig, params: Mapping[str, Any], trial_id: str) -> DictConfig:
    """`cfg` with the trial's parameters ('section.key' -> value) and its own run id."""
    run = copy.deepcopy(cfg)
    for key, value in params.items():
        apply_override(run, f"{key}={json.dumps(value)}")
    name = f"{run.runner.experiment_name}-{trial_id}"
    apply_override(run, f"runner.experiment_name={json.dumps(name)}")
    config_notes(run, to_typed(run))  # every rule again, on the trial's values
    return run


def attempt_config(cfg: DictConfig, pointer: Mapping[str, Any] | None) -> tuple[DictConfig, int]:
    """The trial config `cfg` for this attempt, and the attempt's number k: the first attempt
    keeps the trial's run id, attempt k >= 1 (its run directory exists) runs as `<id>-r<k>`;
    with a Tune checkpoint's `pointer` the run resumes from the checkpoint it names."""
    run = copy.deepcopy(cfg)
    root, name = Path(run.runner.output_dir).resolve(), run.runner.experiment_name
    attempt = 0
    while run_dir_of(root, name if attempt == 0 else f"{name}-r{attempt}").exists():
        attempt += 1
    if attempt:
        apply_override(run, f"runner.experiment_name={json.dumps(f'{name}-r{attempt}')}")
    if pointer is not None:
        problems = ckpt.checkpoint_problems(Path(pointer["checkpoint"]))
        if problems:
            raise TwoWorkerError(
                f"run {name}: Tune restarted the trial from run {pointer['run_id']}'s "
                f"checkpoint of step {pointer['step']}, which cannot be resumed from: "
                f"{problems[0]}; keep the checkpoints a trial may restore (runner."
                "keep_last_checkpoints=0 keeps all), or start the trial afresh"
            )
        apply_override(run, f"runner.resume_dir={json.dumps(str(pointer['checkpoint']))}")
    return run, attempt


def read_pointer(checkpoint: Any) -> dict[str, Any] | None:
    """The POINTER_JSON of a Tune checkpoint (None for None): the run checkpoint it names."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        path = Path(directory) / POINTER_JSON
        if not path.is_file():
            raise TwoWorkerError(
                f"Tune's checkpoint {checkpoint.path} has no {POINTER_JSON}: grpo_trainable did "
                "not report it; restore the trial from a checkpoint this trainable reported"
            )
        pointer = json.loads(path.read_text(encoding="utf-8"))
    missing = [key for key in POINTER_KEYS if key not in pointer]
    if missing:
        raise TwoWorkerError(
            f"{POINTER_JSON} of Tune's checkpoint {checkpoint.path} lacks {missing}: it was "
            "written by another version of grpo_trainable; start the trial afresh"
        )
    return dict(pointer)


def grpo_trainable(
    cfg: DictConfig, component_classes: dict[str, type] | None = None
) -> Callable[[dict[str, Any]], None]:
    """A Tune function trainable that runs one GRPO run of `cfg` per trial (module docstring).
    `component_classes` goes to `run_grpo_two_worker` (tests inject failing components)."""
    base, classes = copy.deepcopy(cfg), dict(component_classes or {})

    def grpo_trial(params: dict[str, Any]) -> None:
        tune = _tune()
        trial_id = tune.get_context().get_trial_id()
        pointer = read_pointer(tune.get_checkpoint())
        run_cfg, attempt = attempt_config(trial_config(base, params, trial_id), pointer)
        handle = run_grpo_two_worker(
            run_cfg, placement_group="current", component_classes=classes or None
        )
        try:
            _write_trial_record(handle, trial_id, attempt, pointer)
            first = 1 if pointer is None else ckpt.step_of(Path(pointer["checkpoint"])) + 1
            _report_steps(tune, handle, to_typed(run_cfg), first, trial_id)
        except BaseException:
            handle.cancel()  # frees what the run made; the trial's group stays Tune's
            raise

    return grpo_trial


def _write_trial_record(
    handle: RunHandle, trial: str, attempt: int, pointer: dict[str, Any] | None
) -> None:
    """TRIAL_JSON: which trial and attempt the run is, and the pointer it resumed from."""
    record = {"trial_id": trial, "attempt": attempt, "parent": pointer, "time": time.time()}
    atomic_write_text(handle.output_dir / TRIAL_JSON, json.dumps(record, indent=2) + "\n")


def _report_steps(tune: Any, handle: RunHandle, typed: GRPOConfig, first: int, trial: str) -> None:
    """Report steps `first`.. (the earlier ones were reported before Tune restarted the trial;
    the resumed run's futures for them hold no metrics)."""
    t = typed.runner.timeouts
    timeout = t.step_s + t.checkpoint_s
    start_up = t.placement_s + t.preflight_s + t.actor_start_s + t.collective_s + t.checkpoint_s
    steps, step = typed.runner.max_steps, first
    saved: set[int] = set()
    while step <= steps:
        wait = timeout + (start_up if step == first else 0.0)
        result = ray.get(handle.step(step), timeout=wait)
        if step == first:  # runner.max_epochs may end the run before max_steps
            steps = int(handle.status().get("total_steps") or steps)
            saved = set(ckpt.scheduled_steps(typed, steps))
        info = ray.get(handle.checkpoint(step), timeout=timeout) if step in saved else None
        metrics: dict[str, Any] = {**result.scalars(), "step": step}
        if step == steps:
            metrics["verification_passed"] = _verified(handle, timeout, typed)
        if info is None:
            tune.report(metrics)
        else:
            _report_with_pointer(tune, metrics, handle, info.directory, trial)
        step += 1


def _report_with_pointer(
    tune: Any, metrics: dict[str, Any], handle: RunHandle, directory: str, trial: str
) -> None:
    """tune.report with a Tune checkpoint naming the run's checkpoint `directory`; Tune copies
    the pointer into its storage before report returns, so the temporary one goes after."""
    checkpoint = Path(directory).resolve()
    pointer = {
        "checkpoint": str(checkpoint),
        "run_dir": str(Path(handle.output_dir).resolve()),
        "run_id": handle.run_id,
        "step": ckpt.step_of(checkpoint),
        "trial_id": trial,
    }
    with tempfile.TemporaryDirectory(prefix="rlinf-tune-pointer-") as tmp:
        (Path(tmp) / POINTER_JSON).write_text(json.dumps(pointer, indent=2) + "\n")
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))


def _verified(handle: RunHandle, timeout: float, typed: GRPOConfig) -> bool:
    report = handle.result(timeout=timeout)
    if not report.passed:
        raise VerificationError(
            f"run {typed.runner.experiment_name}: the postflight failed: "
            + "; ".join(report.errors[:5])
        )
    return True


__all__ = [
    "POINTER_JSON",
    "TRIAL_JSON",
    "attempt_config",
    "grpo_trainable",
    "read_pointer",
    "trial_config",
    "trial_resources",
]

"""Ray Tune: one GRPO run per trial, inside the placement group Tune reserves for the trial.

    from ray import tune
    from rlinf_twoworker.api.tune import grpo_trainable, trial_resources

    trainable = tune.with_resources(grpo_trainable(cfg), trial_resources(cfg))
    tuner = tune.Tuner(
        trainable,
        param_space={"actor.optim.lr": tune.grid_search([1e-5, 2e-5])},
        tune_config=tune.TuneConfig(metric="rollout/reward_scores", mode="max"),
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
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from typing import Any

import ray
from omegaconf import DictConfig

from rlinf_twoworker.api.handle import run_grpo_two_worker
from rlinf_twoworker.config import config_notes, to_typed
from rlinf_twoworker.config.overrides import apply_override
from rlinf_twoworker.errors import TwoWorkerError, VerificationError
from rlinf_twoworker.storage import checkpoints as ckpt


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
    trainable, then the run's bundles."""
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


def grpo_trainable(cfg: DictConfig) -> Callable[[dict[str, Any]], None]:
    """A Tune function trainable that runs one GRPO run of `cfg` per trial (module docstring)."""
    base = copy.deepcopy(cfg)

    def grpo_trial(params: dict[str, Any]) -> None:
        tune = _tune()
        run_cfg = trial_config(base, params, tune.get_context().get_trial_id())
        _run_trial(tune, run_cfg)

    return grpo_trial


def _run_trial(tune: Any, cfg: DictConfig) -> None:
    typed = to_typed(cfg)
    t = typed.runner.timeouts
    timeout = t.step_s + t.checkpoint_s
    start_up = t.placement_s + t.preflight_s + t.actor_start_s + t.collective_s
    handle = run_grpo_two_worker(cfg, placement_group="current")
    try:
        steps = typed.runner.max_steps
        step = 1
        while step <= steps:
            wait = timeout + (start_up if step == 1 else 0.0)
            result = ray.get(handle.step(step), timeout=wait)
            if step == 1:  # runner.max_epochs may end the run before max_steps
                steps = int(handle.status().get("total_steps") or steps)
                saved = set(ckpt.scheduled_steps(typed, steps))
            checkpoint = None
            if step in saved:
                info = ray.get(handle.checkpoint(step), timeout=timeout)
                checkpoint = tune.Checkpoint.from_directory(info.directory)
            metrics: dict[str, Any] = {**result.metrics, **result.timings, "step": step}
            if step == steps:
                metrics["verification_passed"] = _verified(handle, timeout, typed)
            tune.report(metrics, checkpoint=checkpoint)
            step += 1
    except BaseException:
        handle.cancel()  # frees what the run made; the trial's group stays Tune's
        raise


def _verified(handle: Any, timeout: float, typed: Any) -> bool:
    report = handle.result(timeout=timeout)
    if not report.passed:
        raise VerificationError(
            f"run {typed.runner.experiment_name}: the postflight failed: "
            + "; ".join(report.errors[:5])
        )
    return True


__all__ = ["grpo_trainable", "trial_config", "trial_resources"]

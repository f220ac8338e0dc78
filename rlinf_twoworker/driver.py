"""The Driver's request, checked before Ray is touched: environment, config, run directory, inputs.

A bad request (RUN_ID, WORK_ROOT, TARGET_STEPS, a config error, an existing run directory, a
missing input) fails here in well under a second, with its reason, and creates nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlinf_twoworker.config import to_typed
from rlinf_twoworker.errors import TwoWorkerError

TUTORIAL_SUBDIR = Path("runs") / "two-worker-grpo-pipeline"


class RequestError(TwoWorkerError):
    """The Driver's request (environment, arguments, config) is invalid."""


def env_overrides(env: Mapping[str, str], overrides: Sequence[str], need_run_id: bool) -> list[str]:
    """RUN_ID, WORK_ROOT, TARGET_STEPS as config overrides (command-line overrides come after)."""
    from rlinf_twoworker.config import RUN_ID_PATTERN

    out = []
    run_id = env.get("RUN_ID")
    named = any(o.startswith("runner.experiment_name=") for o in overrides)
    if run_id is None and need_run_id and not named:
        raise RequestError("RUN_ID is not set: export RUN_ID=<a new run name>")
    if run_id is not None:
        if not RUN_ID_PATTERN.match(run_id):
            raise RequestError(
                f"RUN_ID={run_id!r} is invalid: it must match {RUN_ID_PATTERN.pattern} "
                "(letters, digits, '.', '_', '-'; not empty, no '/')"
            )
        out.append(f"runner.experiment_name={json.dumps(run_id)}")
    work_root = env.get("WORK_ROOT")
    if work_root is not None:
        root = Path(work_root)
        if not work_root or not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
            raise RequestError(
                f"WORK_ROOT={work_root!r} is not a writable directory: mount the shared "
                "storage there (every node must see it at the same path)"
            )
        out.append(f"runner.output_dir={json.dumps(str(root.resolve() / TUTORIAL_SUBDIR))}")
    steps = env.get("TARGET_STEPS")
    if steps is not None:
        if not steps.strip().isdigit() or int(steps) < 2:
            raise RequestError(
                f"TARGET_STEPS={steps!r} is invalid: it must be an integer >= 2 (the tutorial's "
                "postflight needs the metrics of at least two steps)"
            )
        out.append(f"runner.max_steps={int(steps)}")
    return out


def resolve_request(
    config: str | None, overrides: Sequence[str], env: Mapping[str, str], for_run: bool = True
) -> tuple[Any, list[str]]:
    """Everything checked before Ray is touched: returns (config, the overrides applied)."""
    from rlinf_twoworker.config import load_config
    from rlinf_twoworker.rundir import refuse_existing, run_dir_of

    applied = [*env_overrides(env, overrides, for_run), *overrides]
    cfg = load_config(config, applied)
    typed = to_typed(cfg)
    check_inputs(typed)
    if not for_run:
        return cfg, applied
    run_dir = run_dir_of(Path(typed.runner.output_dir).resolve(), typed.runner.experiment_name)
    refuse_existing(run_dir)
    existing = next(p for p in [run_dir, *run_dir.parents] if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RequestError(
            f"{existing} is not writable: the run directory {run_dir} cannot be made"
        )
    if typed.runner.resume_dir:
        from rlinf_twoworker.checkpoint import resume_source, step_of

        source = resume_source(typed, run_dir)
        if source is not None and step_of(source) >= typed.runner.max_steps:
            raise RequestError(
                f"the resume checkpoint {source} is at step {step_of(source)}, but the run "
                f"stops at runner.max_steps={typed.runner.max_steps}: ask for more steps"
            )
    return cfg, applied


def check_inputs(typed: Any) -> None:
    """Cheap checks of the inputs on this node (the preflight checks digests on every node)."""
    models = {typed.actor.model.model_path, typed.rollout.model.model_path}
    models |= {typed.inference.model.model_path}
    for model in sorted(models):
        if not (Path(model) / "config.json").is_file():
            raise RequestError(
                f"model directory {model} has no config.json: check actor/rollout/inference "
                ".model.model_path and that the storage is mounted"
            )
    for data in typed.data.train_data_paths:
        path = Path(data)
        if not path.is_file() or path.stat().st_size == 0 or not os.access(path, os.R_OK):
            raise RequestError(
                f"data file {data} is missing, empty or unreadable: check data.train_data_paths"
            )

"""The Driver's request, checked before Ray is touched: environment, config, run directory, inputs.

A bad request fails here in well under a second and creates nothing. A config error (ConfigError,
naming the key) is raised as it is; every other problem of the request (RUN_ID, TARGET_STEPS,
WORK_ROOT, the run directory, the inputs) is collected, and one RequestError lists them all, in
the tutorial's order, so that one attempt shows everything to fix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlinf_twoworker import components
from rlinf_twoworker.config import run_id_problem, to_typed
from rlinf_twoworker.errors import ConfigError, RunDirExistsError, TwoWorkerError

TUTORIAL_SUBDIR = Path("runs") / "two-worker-grpo-pipeline"
MIN_STEPS = 2
"""The fewest steps a run of the commands (run's TARGET_STEPS, demo's --steps, verify's
--target-steps) may have: RLinf never logs the final step's metrics, so the tutorial's
postflight needs at least two steps. (A run through the Python API may train one.)"""
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


class RequestError(TwoWorkerError):
    """The Driver's request (environment, arguments, config) is invalid; lists every problem."""

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            super().__init__(self.problems[0])
            return
        listed = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"the request has {len(self.problems)} problems:\n{listed}")

    def __reduce__(self) -> tuple:  # errors cross process boundaries through Ray
        return (type(self), (self.problems,))


@dataclass
class EnvRequest:
    """RUN_ID, WORK_ROOT and TARGET_STEPS as config overrides, and what is wrong with them."""

    overrides: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    run_dir_known: bool = True
    """False when RUN_ID or WORK_ROOT is bad: the run directory cannot be named then."""
    steps_known: bool = True


def env_overrides(env: Mapping[str, str], overrides: Sequence[str], need_run_id: bool) -> list[str]:
    """RUN_ID, WORK_ROOT, TARGET_STEPS as config overrides (command-line overrides come after);
    raises one RequestError listing every problem of the three."""
    request = read_env(env, overrides, need_run_id)
    if request.problems:
        raise RequestError(request.problems)
    return request.overrides


def read_env(env: Mapping[str, str], overrides: Sequence[str], need_run_id: bool) -> EnvRequest:
    """The environment's part of the request, with its problems in the tutorial's order."""
    request = EnvRequest()
    _read_run_id(request, env.get("RUN_ID"), overrides, need_run_id)
    _read_target_steps(request, env.get("TARGET_STEPS"))
    _read_work_root(request, env.get("WORK_ROOT"))
    return request


def _read_run_id(
    request: EnvRequest, run_id: str | None, overrides: Sequence[str], need_run_id: bool
) -> None:
    named = any(o.startswith("runner.experiment_name=") for o in overrides)
    if run_id is None:
        if need_run_id and not named:
            request.problems.append("RUN_ID is not set: export RUN_ID=<a new run name>")
            request.run_dir_known = False
    elif (problem := run_id_problem(run_id)) is not None:
        request.problems.append(f"RUN_ID={run_id!r} is invalid: it {problem}")
        request.run_dir_known = False
    else:
        request.overrides.append(f"runner.experiment_name={json.dumps(run_id)}")


def steps_problem(name: str, text: str) -> str | None:
    """What is wrong with `text` as the step count `name` of a command (MIN_STEPS), or None."""
    if text.strip().isdigit() and int(text) >= MIN_STEPS:
        return None
    return (
        f"{name}={text!r} is invalid: it must be an integer >= {MIN_STEPS} (RLinf never logs "
        f"the final step's metrics, so the postflight needs at least {MIN_STEPS} steps)"
    )


def _read_target_steps(request: EnvRequest, steps: str | None) -> None:
    if steps is None:
        return
    problem = steps_problem("TARGET_STEPS", steps)
    if problem:
        request.problems.append(problem)
        request.steps_known = False
    else:
        request.overrides.append(f"runner.max_steps={int(steps)}")


def _read_work_root(request: EnvRequest, work_root: str | None) -> None:
    if work_root is None:
        return
    root = Path(work_root)
    if not work_root or not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
        request.problems.append(
            f"WORK_ROOT={work_root!r} is not a writable directory: mount the shared "
            "storage there (every node must see it at the same path)"
        )
        request.run_dir_known = False
    else:
        output_root = root.resolve() / TUTORIAL_SUBDIR
        request.overrides.append(f"runner.output_dir={json.dumps(str(output_root))}")


def resolve_request(
    config: str | None, overrides: Sequence[str], env: Mapping[str, str], for_run: bool = True
) -> tuple[Any, list[str]]:
    """Everything checked before Ray is touched: returns (config, the overrides applied).

    Raises ConfigError for a config error, else one RequestError listing every problem."""
    from rlinf_twoworker.config import load_config

    request = read_env(env, overrides, for_run)
    applied = [*request.overrides, *overrides]
    cfg = load_config(config, applied)
    typed = to_typed(cfg)
    if (error := reward_fn_error(typed)) is not None:
        raise error  # a config error: raised as it is, naming the key
    problems = list(request.problems)
    if for_run and request.run_dir_known:
        problems += run_dir_problems(typed)
    problems += input_problems(typed)
    if for_run and request.run_dir_known and request.steps_known:
        problems += resume_problems(typed)
    if problems:
        raise RequestError(problems)
    return cfg, applied


def run_dir_problems(typed: Any) -> list[str]:
    """The run directory must be new, and makeable; the paths the config names
    (hydra.run.dir, hydra.output_subdir, runner.logger.log_path) must lie inside it."""
    from rlinf_twoworker.storage.rundir import escaping_paths, refuse_existing, run_dir_of

    run_dir = run_dir_of(Path(typed.runner.output_dir).resolve(), typed.runner.experiment_name)
    problems = [str(error) for error in escaping_paths(typed)]
    try:
        refuse_existing(run_dir)
    except RunDirExistsError as exc:
        return [*problems, str(exc)]
    existing = next(p for p in [run_dir, *run_dir.parents] if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        problems.append(f"{existing} is not writable: the run directory {run_dir} cannot be made")
    return problems


def resume_problems(typed: Any) -> list[str]:
    """A resume source must be complete and behind runner.max_steps."""
    if not typed.runner.resume_dir:
        return []
    from rlinf_twoworker.storage.checkpoints import resume_limit_problem, resume_source
    from rlinf_twoworker.storage.rundir import run_dir_of

    run_dir = run_dir_of(Path(typed.runner.output_dir).resolve(), typed.runner.experiment_name)
    try:
        source = resume_source(typed, run_dir)
    except TwoWorkerError as exc:
        return [str(exc)]
    problem = None if source is None else resume_limit_problem(source, typed.runner.max_steps)
    return [problem] if problem else []


def reward_fn_error(typed: Any) -> ConfigError | None:
    """reward.reward_fn's function cannot be imported here (ConfigError naming the key, the
    value and what to do), or None. Imports the user's module on this node: the load itself
    checks only the name's form, since a config is also loaded where the user's code is not
    (readback, report); the reward's grading processes import it again on theirs."""
    spec = getattr(typed.reward, "reward_fn", None)
    if spec is None:
        return None
    from rlinf_twoworker.rewards.graders import resolve_reward_fn

    try:
        resolve_reward_fn(spec)
    except ConfigError as exc:
        return exc
    return None


def check_inputs(typed: Any) -> None:
    """Raise one RequestError listing every problem of `input_problems`."""
    problems = input_problems(typed)
    if problems:
        raise RequestError(problems)


def input_problems(typed: Any) -> list[str]:
    """Checks of the inputs on this node, in seconds (the preflight checks digests on every
    node): reward.reward_fn's function, the metric loggers' packages, model directories,
    tokenizer directories, data files (every line parsed as the run parses it), each input's
    SHA256SUMS (present, well formed, listing a data file); one problem per path."""
    from rlinf_twoworker.run.metric_loggers import missing_backends

    problems: list[str | None] = []
    if (error := reward_fn_error(typed)) is not None:  # resolve_request raised it already
        problems.append(str(error))
    problems += missing_backends(typed.runner.logger.logger_backends or [])
    unusable: set[Path] = set()
    for path, keys in _paths_by_key(_model_keys(typed)).items():
        problem = _directory_problem(path, keys, "model")
        if problem:
            unusable.add(path)
        problems.append(problem or _config_json_problem(path, keys) or _manifest_problem(path))
    for path, keys in _paths_by_key(_tokenizer_keys(typed)).items():
        if path not in unusable:  # a model directory that is not usable was named already
            problem = _directory_problem(path, keys, "tokenizer")
            problems.append(problem or _tokenizer_problem(path, keys))
    for path, keys in _paths_by_key(_data_keys(typed)).items():
        problem = _data_problem(path, keys)
        problems.append(problem or _manifest_problem(path) or _data_lines_problem(typed, path))
    return [p for p in problems if p]


def _model_keys(typed: Any) -> list[tuple[str, str]]:
    return components.model_paths(typed)


def _tokenizer_keys(typed: Any) -> list[tuple[str, str]]:
    """Each tokenizer directory; actor's unset one is its model directory (what is loaded)."""
    actor = typed.actor.tokenizer.tokenizer_model
    keys = [
        ("actor.tokenizer.tokenizer_model", actor)
        if actor
        else (
            "actor.model.model_path (actor.tokenizer.tokenizer_model unset)",
            typed.tokenizer_path,
        )
    ]
    inference = getattr(getattr(typed.inference, "tokenizer", None), "tokenizer_model", None)
    if inference:
        keys.append(("inference.tokenizer.tokenizer_model", inference))
    return keys


def _data_keys(typed: Any) -> list[tuple[str, str]]:
    val = getattr(typed.data, "val_data_paths", None) or []
    return [("data.train_data_paths", p) for p in typed.data.train_data_paths] + [
        ("data.val_data_paths", p) for p in val
    ]


def _paths_by_key(pairs: list[tuple[str, str]]) -> dict[Path, str]:
    """Path -> the keys naming it, in first-seen order: one problem per directory."""
    named: dict[Path, list[str]] = {}
    for key, value in pairs:
        named.setdefault(Path(value), []).append(key)
    return {path: ", ".join(keys) for path, keys in named.items()}


def _directory_problem(path: Path, keys: str, what: str) -> str | None:
    if not path.exists():
        return (
            f"{keys} = {str(path)!r}: the {what} directory does not exist; check the path and "
            "that the shared storage is mounted on this node"
        )
    if not path.is_dir():
        return (
            f"{keys} = {str(path)!r} is a file, not a directory: give the {what} directory "
            "(the folder that holds its files)"
        )
    if not os.access(path, os.R_OK | os.X_OK):
        return f"{keys} = {str(path)!r}: the {what} directory is not readable; fix its permissions"
    return None


def _config_json_problem(path: Path, keys: str) -> str | None:
    if os.access(path / "config.json", os.R_OK):
        return None
    return (
        f"{keys} = {str(path)!r}: the model directory has no readable config.json; give a "
        "Hugging Face model directory (config.json, *.safetensors)"
    )


def _tokenizer_problem(path: Path, keys: str) -> str | None:
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    return (
        f"{keys} = {str(path)!r}: the directory holds no tokenizer (neither "
        f"{' nor '.join(TOKENIZER_FILES)}); give the model's directory or its tokenizer's"
    )


def _manifest_problem(path: Path) -> str | None:
    """The input's SHA256SUMS is missing, unreadable, malformed or (a data file) does not list
    it: what the preflight would say on every node, said once, without hashing anything."""
    from rlinf_twoworker.errors import PreflightError
    from rlinf_twoworker.storage.manifest import covering_manifest

    try:
        covering_manifest(path)
    except PreflightError as exc:
        return str(exc)
    return None


def _data_lines_problem(typed: Any, path: Path) -> str | None:
    """A malformed line (file, line and column), unless data.skip_malformed_lines skips them."""
    data = typed.data
    if getattr(data, "skip_malformed_lines", False):
        return None
    from rlinf_twoworker.storage.data import data_file_problem

    return data_file_problem(path, data.prompt_key, data.answer_key)


def _data_problem(path: Path, keys: str) -> str | None:
    if not path.exists():
        return f"{keys}: data file {path} does not exist; check the path and the mount"
    if not path.is_file():
        return f"{keys}: {path} is not a file; give the JSONL file itself"
    if path.stat().st_size == 0:
        return f"{keys}: data file {path} is empty; give the JSONL file with the prompts"
    if not os.access(path, os.R_OK):
        return f"{keys}: data file {path} is not readable; fix its permissions"
    return None

"""The metric loggers a user may add to TensorBoard (runner.logger.logger_backends): wandb and
MLflow, each an observer of the run loop (run/observers.py) and an optional extra
(`pip install 'rlinf_twoworker[wandb]'`, `[mlflow]`).

Each logs every step's scalars (the library's TensorBoard tags, x = the GRPO step; RLinf's
per-minibatch layout stays in TensorBoard) and the run's resolved config, from the controller
on the run's storage thread (a slow network never holds the event loop). They read their usual
environment (WANDB_MODE, WANDB_API_KEY, MLFLOW_TRACKING_URI, ...), which the run forwards from
the Driver to its controller (`forwarded_env`).

    wandb   project runner.logger.project_name, name runner.logger.experiment_name (the run id
            when unset), entity runner.logger.wandb_entity, https proxy
            runner.logger.wandb_proxy, files under <log_path>/wandb/ (RLinf's layout)
    mlflow  experiment runner.logger.project_name, run name as wandb's; tracking URI
            $MLFLOW_TRACKING_URI, else a file store under <log_path>/mlruns/
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

from rlinf_twoworker.results import StepResult
from rlinf_twoworker.run.observers import RunObserver
from rlinf_twoworker.run.storage_io import StorageIO

OPTIONAL = ("wandb", "mlflow")
"""The backends that are optional extras; each one's module and extra share its name."""

ENV_PREFIXES = ("WANDB_", "MLFLOW_")


def missing_backends(backends: list[str]) -> list[str]:
    """The listed optional backends whose package this process cannot import, each as a line
    saying what to install."""
    return [
        f"runner.logger.logger_backends lists {name}, whose package is not installed here: "
        f"pip install 'rlinf_twoworker[{name}]' (or drop {name} from the list)"
        for name in backends
        if name in OPTIONAL and not _importable(name)
    ]


def _importable(module: str) -> bool:
    if module in sys.modules:  # imported, or blocked (None: importing it raises)
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def forwarded_env(backends: list[str]) -> dict[str, str]:
    """The Driver's WANDB_* and MLFLOW_* variables, for the controller's process (started by
    Ray with the node's environment, not the Driver's) when the run logs to wandb or MLflow."""
    if not any(name in OPTIONAL for name in backends):
        return {}
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}


def run_name(cfg: Any) -> str:
    return cfg.runner.logger.experiment_name or cfg.runner.experiment_name


class WandbLogger(RunObserver):
    """Every step's scalars to a wandb run (offline too: WANDB_MODE=offline)."""

    def __init__(self, io: StorageIO, cfg: Any, config: dict[str, Any]) -> None:
        self.io, self.cfg, self.config = io, cfg, config
        self.run: Any = None

    async def training_begins(self) -> None:
        self.run = await self.io.call(self._start)

    def _start(self) -> Any:
        wandb = importlib.import_module("wandb")
        logger = self.cfg.runner.logger
        directory = Path(self.cfg.log_dir) / "wandb"
        directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(https_proxy=logger.wandb_proxy) if logger.wandb_proxy else None
        return wandb.init(
            project=logger.project_name,
            name=run_name(self.cfg),
            entity=logger.wandb_entity,
            config=self.config,
            dir=str(directory),
            settings=settings,
        )

    async def step_done(self, step: int, result: StepResult) -> None:
        await self.io.call(self.run.log, result.scalars(), step=step)

    async def training_ends(self) -> None:
        if self.run is not None:  # queued: a cancel never waits on the network
            self.io.log.later(self.run.finish)


class MlflowLogger(RunObserver):
    """Every step's scalars to an MLflow run, its config as the run's parameters."""

    def __init__(self, io: StorageIO, cfg: Any, config: dict[str, Any]) -> None:
        self.io, self.cfg, self.config = io, cfg, config
        self.client: Any = None
        self.run_id = ""

    async def training_begins(self) -> None:
        await self.io.call(self._start)

    def _start(self) -> None:
        tracking = importlib.import_module("mlflow.tracking")
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # MLflow 3 keeps its file store behind this switch
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (Path(self.cfg.log_dir) / "mlruns").resolve().as_uri()
        self.client = tracking.MlflowClient(uri)
        name = self.cfg.runner.logger.project_name
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(name)
        )
        run = self.client.create_run(experiment_id, run_name=run_name(self.cfg))
        self.run_id = run.info.run_id
        entities = importlib.import_module("mlflow.entities")
        params = [entities.Param(k, str(v)[:6000]) for k, v in _flat(self.config).items()]
        for start in range(0, len(params), 100):  # MLflow takes 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    async def step_done(self, step: int, result: StepResult) -> None:
        await self.io.call(self._log, step, result.scalars())

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        entities = importlib.import_module("mlflow.entities")
        stamp = int(time.time() * 1000)
        metrics = [entities.Metric(k, float(v), stamp, step) for k, v in scalars.items()]
        for start in range(0, len(metrics), 1000):  # MLflow takes 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    async def training_ends(self) -> None:
        if self.client is not None:
            self.io.log.later(self.client.set_terminated, self.run_id)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (runner.logger.project_name -> value)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}

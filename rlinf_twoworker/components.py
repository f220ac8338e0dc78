"""The component table: every process role of a run, once. Placement, the process-group
layout, the weight-sync membership, the preflight's inputs and the postflight's placement
record all read it; adding a component is a row here, its worker, and its stage in run/step.py.

No heavy imports: the config's validation reads the table too. Worker classes are named by
import path and loaded where a run starts them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PRELOAD_MODULE = "rlinf_twoworker.preload"
"""What Ray's idle workers import ahead of a run (RAY_preload_python_modules): every worker
module of this table, among others; a component finds it imported in its process."""

GRPOConfig = Any
"""The run's config (rlinf_twoworker.config.GRPOConfig): the config imports this table, so
the table names it only in words."""

MEMORY = "rlinf_twoworker.cluster.memory_parts"
SETTINGS = "rlinf_twoworker.config.settings"


@dataclass(frozen=True)
class Component:
    name: str
    """The key in cluster.component_placement and in actor names (<run>:<name>:<rank>)."""
    worker: str
    """'module:Class' of its worker; the class takes (settings, rank: int)."""
    settings: str
    """'module:function' making its worker's settings from the run's config: what its process
    reads of it, and nothing else (config/settings.py)."""
    memory: str
    """'module:function' of its GPU memory estimate before any model loads, by part:
    (cfg, model shapes by section, its ranks, recompute) -> {part: bytes}; the memory plan
    (cluster/memory_plan.py) adds up the processes of each GPU. Required: a component without
    an estimate would pass the plan unchecked (cluster/memory_parts.no_gpu_memory says so)."""
    receives_weights: bool = False
    """A copy of the policy that the actor's weights are synced to after every update."""
    trains: bool = False
    """The FSDP actor: as many ranks as its placement lists; the others run one process."""
    concurrency: int = 1
    """Ray max_concurrency of its actor (the reward grades several answers at once)."""
    asynchronous: bool = False
    """Its worker has async methods (the reward's): its process runs its calls on an event
    loop (run/group.py makes its process without importing the worker, so says it here)."""
    model_section: str | None = None
    """The config section whose model.model_path it loads (the preflight checks those)."""
    prepare: str = "prepare_compiler"
    """Its method the run calls right after its constructor, without waiting, while the others
    still load (the compiler's imports and cache; the reward's grading processes); awaited
    after the first step, whose calls it precedes."""
    logprobs: bool = False
    """It computes log-probs of the step's answers (compute_logprobs): the compile warm-up
    (run/warmup.py) hands it a made-up batch of a step's shape."""
    needed: Callable[[GRPOConfig], bool] | None = None
    """None: every run has it; else whether this config needs it."""
    default_placement: str | None = None
    """Where it goes when cluster.component_placement does not name it: that component's ranks."""
    keep: bool = True
    """Its process may serve the next run (cluster.keep_processes: run/kept.py)."""

    def in_run(self, cfg: GRPOConfig) -> bool:
        return self.needed is None or self.needed(cfg)

    def worker_class(self) -> type:
        return named(self.worker)

    def memory_estimate(self) -> Callable[..., dict[str, int]]:
        return named(self.memory)

    def settings_for(self, cfg: GRPOConfig) -> Any:
        """Its worker's settings under `cfg`."""
        return named(self.settings)(cfg)


def named(path: str) -> Any:
    """The class or function named 'module:name' (its module imported)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _kl_in_loss(cfg: Any) -> bool:
    return cfg.algorithm.kl_beta > 0


TABLE: tuple[Component, ...] = (
    # The rollout is first among the policy copies: it is the weight sync's relay.
    Component(
        "rollout",
        "rlinf_twoworker.workers.rollout:RolloutWorker",
        f"{SETTINGS}:rollout_settings",
        f"{MEMORY}:rollout_memory",
        receives_weights=True,
        model_section="rollout",
    ),
    Component(
        "reward",
        "rlinf_twoworker.workers.reward:RewardWorker",
        f"{SETTINGS}:reward_settings",
        f"{MEMORY}:no_gpu_memory",
        concurrency=4,
        asynchronous=True,
        prepare="warm_up_grader",
        keep=False,  # its grading processes are forked for the run's grader: one run each
    ),
    Component(
        "inference",
        "rlinf_twoworker.workers.inference:InferenceWorker",
        f"{SETTINGS}:inference_settings",
        f"{MEMORY}:inference_memory",
        receives_weights=True,
        model_section="inference",
        logprobs=True,
    ),
    Component(
        "actor",
        "rlinf_twoworker.workers.actor:ActorWorker",
        f"{SETTINGS}:actor_settings",
        f"{MEMORY}:actor_memory",
        trains=True,
        model_section="actor",
    ),
    Component(
        "reference",
        "rlinf_twoworker.workers.reference:ReferenceWorker",
        f"{SETTINGS}:reference_settings",
        f"{MEMORY}:reference_memory",
        model_section="actor",  # the actor's initial weights, frozen
        logprobs=True,
        needed=_kl_in_loss,
        default_placement="inference",
    ),
)
NAMES = tuple(c.name for c in TABLE)


def by_name(name: str) -> Component:
    return next(c for c in TABLE if c.name == name)


def in_run(cfg: GRPOConfig) -> list[Component]:
    """The components this config runs, in table order."""
    return [c for c in TABLE if c.in_run(cfg)]


def model_paths(cfg: GRPOConfig) -> list[tuple[str, str]]:
    """(config key, model directory) of every model the run's components load, each key once
    (the preflight and the request check read these)."""
    paths: dict[str, str] = {}
    for component in in_run(cfg):
        if component.model_section is not None:
            section = getattr(cfg, component.model_section)
            paths[f"{component.model_section}.model.model_path"] = section.model.model_path
    return list(paths.items())

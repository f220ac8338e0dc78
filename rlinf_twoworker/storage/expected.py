"""What a finished run directory must show (the postflight's `Expected`) and where that comes
from: the request inside a run (`expected_from_config`), the run's own record after the fact
(`expected_from_record`, `expected_at`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from omegaconf import OmegaConf

from rlinf_twoworker.config import GRPOConfig, load_config, to_typed
from rlinf_twoworker.errors import TwoWorkerError, VerificationError
from rlinf_twoworker.storage.rundir import (
    CONFIG_YAML,
)

TUTORIAL_PLACEMENT: dict[str, Any] = {"rollout": 0, "inference": 1, "actor": "2-3", "reward": 0}
REQUIRED_SCALARS = (
    "rollout/reward_scores",
    "actor/training/actor/final_loss",
    "actor/training/actor/grad_norm",
    "actor/training/actor/lr",
)
VALIDATION_SCALARS = ("val/reward_scores", "val/correct_fraction")
"""Also required when the run validates (GRPOConfig.validates)."""


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
    validates (runner.validate not false, data.val_data_paths, runner.val_check_interval > 0)."""
    last = cfg.runner.max_steps if last_step is None else last_step
    return Expected(
        run_id=cfg.runner.experiment_name,
        output_root=Path(cfg.runner.output_dir).resolve(),
        target_steps=last,
        expected_nodes=cfg.cluster.num_nodes,
        checkpoint_step=_last_checkpoint_step(cfg, last),
        max_steps=cfg.runner.max_steps,
        placement=dict(cfg.cluster.component_placement if placement is None else placement),
        required_tags=REQUIRED_SCALARS + (VALIDATION_SCALARS if cfg.validates else ()),
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

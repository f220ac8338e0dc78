"""RLinf's TensorBoard layout of a run: the step's quantities under RLinf's tags at RLinf's x.

RLinf's reasoning runner (`rlinf/runners/reasoning_runner.py`, `run`, at the pinned commit) logs
once a step is done, except the last step (it returns at `is_train_end` before logging): the
step's `time/...` and `rollout/...` scalars at x = (step - 1) x algorithm.n_minibatches, and
the actor's scalars of minibatch i (0-based) at x + i. The library's own scalars (one value a
step at x = step, the last step included) stay where they are, under their own names, in
`<log_path>/tensorboard/`; these go to a TensorBoard run of their own beside them
(`rlinf_dir`), since several tags share a name but not an x.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlinf_twoworker.storage.rundir import TENSORBOARD_DIR

ROLLOUT_TAGS: dict[str, str] = {
    "rollout/prompt_length": "rollout/prompt_length",
    "rollout/response_length": "rollout/response_length",
    "rollout/average_response_length": "rollout/response_length",
    "rollout/variance_of_response_length": "rollout/response_length_variance",
    "rollout/max_of_response_length": "rollout/response_length_max",
    "rollout/min_of_response_length": "rollout/response_length_min",
    "rollout/total_length": "rollout/total_length",
    "rollout/reward_scores": "rollout/reward_scores",
    "rollout/fraction_of_samples_properly_ended": "rollout/ended_fraction",
    "rollout/advantages_mean": "rollout/advantages_mean",
    "rollout/advantages_max": "rollout/advantages_max",
    "rollout/advantages_min": "rollout/advantages_min",
}
"""RLinf's rollout tag -> the library's (its compute_rollout_metrics, prefixed `rollout/`).
`rollout/total_num_sequence` is the step's answer count (`rlinf_scalars`)."""

TIME_TAGS: dict[str, str] = {
    "time/step": "time/step",
    "time/sync_weights": "time/sync_weights",
    "time/rollout": "time/rollout",
    "time/reward": "time/reward",
    "time/actor/inference": "time/inference",
    "time/actor/training": "time/actor/training",
}
"""RLinf's time tag -> the library's. RLinf's `time/prepare_data` (putting the batch on its
channel) has no counterpart: the prompts travel with the rollout call."""

ACTOR = "actor/training/actor/"
ACTOR_TAGS: dict[str, str] = {
    "final_loss": "final_loss",
    "policy_loss": "policy_loss",
    "policy_loss_abs": "policy_loss_abs",
    "ratio": "ratio_mean",
    "ratio_abs": "ratio_abs",
    "clipped_ratio": "clipped_ratio",
    "dual_cliped_ratio": "dual_clipped_ratio",
    "approx_kl": "approx_kl",
    "clip_fraction": "clip_fraction",
    "entropy_loss": "entropy_loss",
    "kl_loss": "kl_loss",
    "grad_norm": "grad_norm",
    "lr": "lr",
}
"""RLinf's actor metric -> the library's, both under `actor/training/actor/` (its FSDP actor's
training_step: the policy loss's metrics, final/entropy/kl loss, grad norm, lr)."""

ZERO_WHEN_ABSENT = ("entropy_loss", "kl_loss")
"""RLinf logs these as 0 when they are not computed (no entropy, kl_beta = 0)."""


def rlinf_x(step: int, n_minibatches: int, minibatch: int = 0) -> int:
    """RLinf's x of a step's scalars (minibatch 0, and the time and rollout scalars) and of
    its minibatch `minibatch`: (step - 1) x n_minibatches + minibatch."""
    return (step - 1) * n_minibatches + minibatch


def rlinf_logs(step: int, last_step: int) -> bool:
    """Whether RLinf logs `step`: every step but the run's last."""
    return step < last_step


def rlinf_scalars(
    step: int,
    n_minibatches: int,
    answers: int,
    scalars: dict[str, float],
    minibatches: list[dict[str, float]],
) -> dict[int, dict[str, float]]:
    """x -> RLinf's tag -> value for one step, from the library's step scalars (`scalars`, its
    tags) and its actor's per-minibatch metrics (`minibatches`, its tags, in training order).
    A quantity the step lacks is left out (`time/reward` of a step the reward did not time,
    say); `answers`: the step's answer count."""
    x = rlinf_x(step, n_minibatches)
    first = {"rollout/total_num_sequence": float(answers)}
    for tags in (TIME_TAGS, ROLLOUT_TAGS):
        first.update({rlinf: scalars[ours] for rlinf, ours in tags.items() if ours in scalars})
    out: dict[int, dict[str, float]] = {x: first}
    for i, metrics in enumerate(minibatches):
        row = {f"{ACTOR}{name}": 0.0 for name in ZERO_WHEN_ABSENT}
        row.update(
            {
                f"{ACTOR}{rlinf}": metrics[ACTOR + ours]
                for rlinf, ours in ACTOR_TAGS.items()
                if ACTOR + ours in metrics
            }
        )
        out.setdefault(x + i, {}).update(row)
    return out


def rlinf_dir(log_dir: Path, per_worker_log: bool) -> Path:
    """Where RLinf's layout is written: `tensorboard/all/` with runner.per_worker_log (where
    RLinf's runner writes its scalars then), else `tensorboard/rlinf/` (RLinf writes them to
    `tensorboard/` itself, which holds the library's scalars: same tags, other x)."""
    return Path(log_dir) / TENSORBOARD_DIR / ("all" if per_worker_log else "rlinf")


@dataclass(frozen=True)
class RlinfLayout:
    """What RLinf's layout of one run needs: where, the x-axis, the answer count, the last step."""

    directory: Path
    n_minibatches: int
    answers: int
    last_step: int

    @classmethod
    def of(cls, cfg: Any, last_step: int) -> RlinfLayout:
        """For a run of `cfg` (a GRPOConfig) that ends at `last_step`."""
        return cls(
            rlinf_dir(cfg.log_dir, cfg.runner.per_worker_log),
            cfg.algorithm.n_minibatches,
            cfg.data.rollout_batch_size * cfg.algorithm.group_size,
            last_step,
        )

    def scalars(
        self, step: int, scalars: dict[str, float], minibatches: list[dict[str, float]]
    ) -> dict[int, dict[str, float]]:
        """What RLinf logs for `step`: nothing for the last."""
        if not rlinf_logs(step, self.last_step):
            return {}
        return rlinf_scalars(step, self.n_minibatches, self.answers, scalars, minibatches)

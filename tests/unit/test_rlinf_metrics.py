"""RLinf's TensorBoard layout (its tags at its x-axis) and the metrics it logs that the library
added, against RLinf's rules at the pinned commit; validation as the library's own addition.

The expected values are written from RLinf's rules, not from its code:
- `runners/reasoning_runner.py` (`run`): after each step but the last, time and rollout scalars
  at x = (step - 1) x n_minibatches; the actor's scalars of minibatch i at x + i; every tag
  prefixed `time/`, `rollout/` or `actor/training/`.
- `algorithms/losses.py` (`compute_ppo_actor_loss`): per micro-batch, token-means of the ratio,
  |ratio - 1|, the clipped ratio and the ratio where the dual clip binds (0 elsewhere), and the
  aggregated |loss|.
- `utils/distributed.py` (`compute_rollout_metrics`): prompt, response and total lengths, the
  unbiased variance, min and max of the response lengths, the share of answers that ended.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from support import RLINF_REF
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlinf_twoworker.algorithm import PolicyLoss, loss_weights, ppo_loss
from rlinf_twoworker.config import load_config, to_typed
from rlinf_twoworker.config.load import config_notes, to_yaml
from rlinf_twoworker.errors import ConfigError
from rlinf_twoworker.run.step import _length_metrics
from rlinf_twoworker.storage.expected import VALIDATION_SCALARS, expected_from_config
from rlinf_twoworker.storage.metrics import MetricsWriter, event_files, read_scalars
from rlinf_twoworker.storage.rlinf_scalars import (
    RlinfLayout,
    rlinf_dir,
    rlinf_logs,
    rlinf_scalars,
    rlinf_x,
)

# RLinf's tags, as its runner names them.
RLINF_TIME = {
    "time/step",
    "time/sync_weights",
    "time/rollout",
    "time/reward",
    "time/actor/inference",
    "time/actor/training",
}
RLINF_ROLLOUT = {
    f"rollout/{name}"
    for name in (
        "total_num_sequence",
        "prompt_length",
        "response_length",
        "average_response_length",
        "variance_of_response_length",
        "max_of_response_length",
        "min_of_response_length",
        "total_length",
        "reward_scores",
        "fraction_of_samples_properly_ended",
        "advantages_mean",
        "advantages_max",
        "advantages_min",
    )
}
RLINF_ACTOR = {
    f"actor/training/actor/{name}"
    for name in (
        "final_loss",
        "policy_loss",
        "policy_loss_abs",
        "ratio",
        "ratio_abs",
        "clipped_ratio",
        "dual_cliped_ratio",
        "approx_kl",
        "clip_fraction",
        "entropy_loss",
        "kl_loss",
        "grad_norm",
        "lr",
    )
}

A = "actor/training/actor/"


def library_step(step: int) -> tuple[dict[str, float], list[dict[str, float]]]:
    """A step's scalars under the library's tags, and 4 minibatches' actor metrics."""
    scalars = {
        "time/step": 10.0 + step,
        "time/sync_weights": 0.5,
        "time/rollout": 4.0,
        "time/reward": 1.0,
        "time/inference": 2.0,
        "time/actor/training": 3.0,
        "rollout/prompt_length": 100.0,
        "rollout/response_length": 50.0,
        "rollout/response_length_variance": 9.0,
        "rollout/response_length_max": 70.0,
        "rollout/response_length_min": 20.0,
        "rollout/total_length": 150.0,
        "rollout/reward_scores": 0.25,
        "rollout/correct_fraction": 0.5,
        "rollout/ended_fraction": 0.75,
        "rollout/advantages_mean": 0.0,
        "rollout/advantages_max": 1.0,
        "rollout/advantages_min": -1.0,
        "val/reward_scores": 1.0,
        "memory/actor/0/host_rss_gib": 1.0,
        A + "ratio_mean": 1.0,
        A + "dual_clip_fraction": 0.1,
    }
    minibatches = [
        {
            A + name: float(i) + offset
            for offset, name in enumerate(
                (
                    "final_loss",
                    "policy_loss",
                    "policy_loss_abs",
                    "ratio_mean",
                    "ratio_abs",
                    "clipped_ratio",
                    "dual_clipped_ratio",
                    "approx_kl",
                    "clip_fraction",
                    "grad_norm",
                    "lr",
                    "ratio_max",
                    "dual_clip_fraction",
                )
            )
        }
        for i in range(4)
    ]
    return scalars, minibatches


def test_rlinfs_x_axis_is_step_minus_one_times_minibatches_plus_the_minibatch():
    assert [rlinf_x(1, 4, i) for i in range(4)] == [0, 1, 2, 3]
    assert [rlinf_x(3, 4, i) for i in range(4)] == [8, 9, 10, 11]
    assert rlinf_x(5, 1) == 4  # one minibatch: x = step - 1
    # every step but the run's last
    assert [s for s in range(1, 6) if rlinf_logs(s, 5)] == [1, 2, 3, 4]


def test_rlinf_layout_of_a_step_has_rlinfs_tags_at_rlinfs_x():
    scalars, minibatches = library_step(3)
    out = rlinf_scalars(3, 4, 16, scalars, minibatches)
    assert sorted(out) == [8, 9, 10, 11]
    assert set(out[8]) == RLINF_TIME | RLINF_ROLLOUT | RLINF_ACTOR
    for x in (9, 10, 11):
        assert set(out[x]) == RLINF_ACTOR
    first = out[8]
    # renamed: the library's name -> RLinf's
    assert first["time/actor/inference"] == scalars["time/inference"]
    assert first["rollout/max_of_response_length"] == scalars["rollout/response_length_max"]
    assert first["rollout/average_response_length"] == scalars["rollout/response_length"]
    assert first["rollout/fraction_of_samples_properly_ended"] == 0.75
    assert first["rollout/variance_of_response_length"] == 9.0
    assert first["rollout/total_num_sequence"] == 16.0
    for i, x in enumerate(range(8, 12)):
        assert out[x][A + "ratio"] == minibatches[i][A + "ratio_mean"]
        assert out[x][A + "dual_cliped_ratio"] == minibatches[i][A + "dual_clipped_ratio"]
        assert out[x][A + "grad_norm"] == minibatches[i][A + "grad_norm"]
        # RLinf logs these as 0 when they are not computed
        assert out[x][A + "entropy_loss"] == 0.0 and out[x][A + "kl_loss"] == 0.0
    # nothing of the library's own (ratio_max, correct_fraction, val/, memory/) leaks in
    every = {tag for row in out.values() for tag in row}
    assert every == RLINF_TIME | RLINF_ROLLOUT | RLINF_ACTOR
    # the last step is not logged
    layout = RlinfLayout(Path("/x"), 4, 16, last_step=3)
    assert layout.scalars(3, scalars, minibatches) == {}
    assert sorted(layout.scalars(2, scalars, minibatches)) == [4, 5, 6, 7]


def test_rlinf_layout_goes_to_tensorboard_all_with_per_worker_log(tmp_path: Path):
    assert rlinf_dir(tmp_path, True) == tmp_path / "tensorboard" / "all"
    assert rlinf_dir(tmp_path, False) == tmp_path / "tensorboard" / "rlinf"
    cfg = to_typed(load_config(overrides=["+runner.per_worker_log=true"]))
    layout = RlinfLayout.of(cfg, 5)
    assert layout.directory == cfg.log_dir / "tensorboard" / "all"
    assert (layout.n_minibatches, layout.last_step) == (cfg.algorithm.n_minibatches, 5)
    assert layout.answers == cfg.data.rollout_batch_size * cfg.algorithm.group_size


def test_the_writer_keeps_the_library_scalars_apart_from_rlinfs(tmp_path: Path):
    layout = RlinfLayout(rlinf_dir(tmp_path, True), 4, 16, last_step=2)
    writer = MetricsWriter(tmp_path, layout)
    for step in (1, 2):
        writer.write(step, *library_step(step))
    writer.close()
    # the library's: x = step, both steps, read by the postflight (tensorboard/ itself only)
    ours = read_scalars(event_files(tmp_path))
    assert ours["rollout/reward_scores"] == {1: 0.25, 2: 0.25}
    assert "rollout/max_of_response_length" not in ours
    # RLinf's: step 1 only, at RLinf's x
    theirs = EventAccumulator(str(layout.directory), size_guidance={"scalars": 0})
    theirs.Reload()
    assert set(theirs.Tags()["scalars"]) == RLINF_TIME | RLINF_ROLLOUT | RLINF_ACTOR
    assert [e.step for e in theirs.Scalars("rollout/reward_scores")] == [0]
    assert [e.step for e in theirs.Scalars(A + "ratio")] == [0, 1, 2, 3]
    assert [e.value for e in theirs.Scalars(A + "lr")] == [10.0, 11.0, 12.0, 13.0]


def test_rlinfs_new_actor_metrics_on_hand_made_tokens():
    """One row, three valid tokens and one pad; ratios 0.5, 1.1, 5.0; advantages -1, +1, -1;
    clip 0.2, dual clip 3. Per token (RLinf): loss max(-A r, -A clip(r)) = 0.8, -1.1, 5.0, the
    last bound by the dual clip to 3.0."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    old = torch.zeros(1, 4)
    logprobs = torch.log(torch.tensor([[0.5, 1.1, 5.0, 1.0]]))
    adv = torch.tensor([[-1.0, 1.0, -1.0, 0.0]])
    weights = loss_weights(mask, [[slice(0, 1)]], "token-mean")
    settings = PolicyLoss(clip_low=0.2, clip_high=0.2, clip_c=3.0)
    _, m = ppo_loss(logprobs, old, adv, weights, weights, settings)
    got = {k: float(v) for k, v in m.items()}
    assert got["policy_loss"] == pytest.approx((0.8 - 1.1 + 3.0) / 3)
    assert got["policy_loss_abs"] == pytest.approx((0.8 + 1.1 + 3.0) / 3)
    assert got["ratio_mean"] == pytest.approx((0.5 + 1.1 + 5.0) / 3)
    assert got["ratio_abs"] == pytest.approx((0.5 + 0.1 + 4.0) / 3)
    assert got["clipped_ratio"] == pytest.approx((0.8 + 1.1 + 1.2) / 3)
    assert got["dual_clipped_ratio"] == pytest.approx(5.0 / 3)  # RLinf: the ratio, not a share
    assert got["dual_clip_fraction"] == pytest.approx(1 / 3)
    assert got["clip_fraction"] == pytest.approx(1 / 3)
    # without a dual clip nothing is dual-clipped
    _, plain = ppo_loss(logprobs, old, adv, weights, weights, PolicyLoss())
    assert float(plain["dual_clipped_ratio"]) == 0.0
    assert float(plain["policy_loss_abs"]) == pytest.approx((0.8 + 1.1 + 5.0) / 3)


def test_rlinfs_length_metrics_on_hand_made_masks():
    """Two chunks of different widths; answers of 3, 4 and 1 tokens under a limit of 4 (the one
    of 4 tokens did not end: RLinf's is_end is false at the limit); prompts of 5, 6, 7."""
    masks = [torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), torch.tensor([[1, 0]])]
    got = _length_metrics(torch.tensor([5, 6, 7]), masks, max_new_tokens=4)
    assert got["rollout/prompt_length"] == pytest.approx(6.0)
    assert got["rollout/total_length"] == pytest.approx((8 + 10 + 8) / 3)
    assert got["rollout/response_length_min"] == 1.0
    assert got["rollout/response_length_variance"] == pytest.approx(7 / 3)  # unbiased
    assert got["rollout/ended_fraction"] == pytest.approx(2 / 3)


# ---- validation: the library's own ------------------------------------------------------------

RLINF_LIKE = """\
defaults:
  - hybrid_engines/fsdp@actor.fsdp_config
runner:
  val_check_interval: 1
data:
  val_data_paths: ["/data/val.jsonl"]
"""


def test_an_rlinf_config_file_does_not_validate_unless_asked(tmp_path: Path):
    path = tmp_path / "rlinf.yaml"
    path.write_text(RLINF_LIKE)
    cfg = load_config(path)
    typed = to_typed(cfg)
    assert typed.runner.validate is False and not typed.validates
    assert any(n.startswith("runner.validate=False") for n in config_notes(cfg))
    assert not set(VALIDATION_SCALARS) & set(expected_from_config(typed).required_tags)
    # the run's record keeps the choice (it has a defaults list too)
    record = tmp_path / "config.yaml"
    record.write_text(to_yaml(cfg))
    assert to_typed(load_config(record)).runner.validate is False
    # asked for
    assert to_typed(load_config(path, ["runner.validate=true"])).validates
    # the library's own configs: a file without Hydra's defaults, or overrides only
    plain = tmp_path / "plain.yaml"
    plain.write_text(
        RLINF_LIKE.replace("defaults:\n  - hybrid_engines/fsdp@actor.fsdp_config\n", "")
    )
    assert to_typed(load_config(plain)).validates
    assert to_typed(load_config(overrides=["data.val_data_paths=[/data/val.jsonl]"])).validates
    # RLinf's assertion on the two intervals holds whether the run validates or not
    with pytest.raises(ConfigError, match="runner.save_interval"):
        load_config(path, ["runner.val_check_interval=2", "runner.save_interval=3"])


def test_rlinfs_yaml_as_shipped_does_not_validate():
    shipped = RLINF_REF
    path = shipped / "qwen2.5-1.5b-grpo-pipeline-fsdp-sgl.yaml"
    if not path.is_file():
        pytest.skip(f"RLinf's reference YAML is not here ({path}): ../shared is absent")
    typed = to_typed(load_config(path, ["cluster.num_gpus_per_node=4"]))
    assert typed.data.val_data_paths and typed.runner.val_check_interval == 1
    assert not typed.validates


def test_variance_of_one_answer_is_not_nan():
    got = _length_metrics(torch.tensor([5]), [torch.tensor([[1, 1]])], max_new_tokens=4)
    assert not math.isnan(got["rollout/response_length_variance"])

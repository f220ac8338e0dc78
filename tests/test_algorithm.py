"""GRPO maths against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlinf_twoworker.algorithm import (
    agg_loss,
    group_advantages,
    kl_penalty,
    lr_at,
    masked_mean,
    masked_sum,
    ppo_clip_loss,
    token_logprobs,
)

SQRT_HALF = 1 / (math.sqrt(2) + 1e-6)


def test_advantages_of_equal_rewards_are_zero():
    adv = group_advantages(torch.tensor([5.0, 5.0, -5.0, -5.0]), group_size=2)
    assert torch.equal(adv, torch.zeros(4))


def test_advantages_use_unbiased_group_std():
    # mean 0, unbiased std sqrt(2): (+-1) / sqrt(2)
    adv = group_advantages(torch.tensor([1.0, -1.0, 5.0, 5.0]), group_size=2)
    assert torch.allclose(adv, torch.tensor([SQRT_HALF, -SQRT_HALF, 0.0, 0.0]))
    # mean 2, unbiased std 1
    adv3 = group_advantages(torch.tensor([1.0, 2.0, 3.0]), group_size=3)
    assert torch.allclose(adv3, torch.tensor([-1.0, 0.0, 1.0]) / (1 + 1e-6))


def test_advantages_are_per_contiguous_group():
    adv = group_advantages(torch.tensor([5.0, -5.0, -5.0, 5.0]), group_size=2)
    assert adv[0] > 0 and adv[1] < 0 and adv[2] < 0 and adv[3] > 0


def test_advantages_edge_cases():
    assert torch.equal(group_advantages(torch.tensor([3.0, -1.0]), 1), torch.zeros(2))
    assert group_advantages(torch.tensor([1, -1]), 2).dtype == torch.float32
    with pytest.raises(ValueError, match="group_size=2"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), 2)


def test_masked_mean_and_sum():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1, 0], [1, 1]])
    assert masked_sum(x, mask).item() == 8.0
    assert masked_mean(x, mask).item() == pytest.approx(8 / 3)
    assert torch.equal(masked_mean(x, mask, dim=-1), torch.tensor([1.0, 3.5]))
    assert masked_mean(x, torch.zeros(2, 2)).item() == 0.0  # all padding: 0, not NaN


def test_token_mean_vs_seq_mean_token_mean():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    # sequence means 2 and 4; the empty third sequence does not count
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="loss_agg_func"):
        agg_loss(loss, mask, "sum")


@pytest.mark.parametrize("fused", [False, True])
def test_token_logprobs_matches_naive_gather_with_uneven_chunks(fused):
    """Chunked, and with fused=True the compiled kernel (its backward too), equal the
    vocabulary-wide log-softmax."""
    torch.manual_seed(0)
    logits = torch.randn(5, 4, 11, requires_grad=True)
    labels = torch.randint(0, 11, (5, 4))
    naive = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    chunked = token_logprobs(logits, labels, chunk_size=2, fused=fused)
    assert chunked.shape == (5, 4)
    assert torch.allclose(chunked, naive, atol=1e-6)
    (g_naive,) = torch.autograd.grad(naive.sum(), logits)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    assert torch.allclose(g_chunked, g_naive, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_token_logprobs_computes_low_precision_logits_in_float32(fused):
    torch.manual_seed(1)
    logits = (torch.randn(3, 2, 7) * 5).bfloat16()
    labels = torch.randint(0, 7, (3, 2))
    out = token_logprobs(logits, labels, chunk_size=8, fused=fused)
    expected = torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert out.dtype == torch.float32
    assert torch.allclose(out, expected, atol=1e-6)


def _one_token_each(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logprobs = torch.log(torch.tensor(ratios)).unsqueeze(-1)
    return logprobs, torch.zeros_like(logprobs), torch.ones_like(logprobs)


def test_clipped_loss_at_known_ratios():
    logprobs, old, mask = _one_token_each([1.5, 0.5, 1.5, 0.5])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    # per token: clipped at 1.2 -> -1.2; clipped at 0.8 -> +0.8; unclipped 1.5; unclipped -0.5
    loss, m = ppo_clip_loss(logprobs, old, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 1.5 - 0.5) / 4)
    assert m["pg_loss"].item() == pytest.approx(loss.item())
    assert m["clip_fraction"].item() == pytest.approx(0.5)
    assert m["ratio_mean"].item() == pytest.approx(1.0)
    k2 = 0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 2
    assert m["approx_kl"].item() == pytest.approx(k2)


def test_single_clipped_tokens():
    for ratio, adv, expected in ((1.5, 2.0, -1.2 * 2.0), (0.5, -3.0, 0.8 * 3.0)):
        logprobs, old, mask = _one_token_each([ratio])
        loss, m = ppo_clip_loss(logprobs, old, torch.tensor([adv]), mask, clip_eps=0.2)
        assert loss.item() == pytest.approx(expected)
        assert m["clip_fraction"].item() == 1.0


def test_loss_masks_padding_and_broadcasts_advantages():
    logprobs = torch.log(torch.tensor([[1.1, 1.0, 7.0], [0.9, 7.0, 7.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, m = ppo_clip_loss(logprobs, torch.zeros(2, 3), torch.tensor([1.0, 2.0]), mask, 0.2)
    assert loss.item() == pytest.approx((-1.1 - 1.0 - 1.8) / 3)
    assert m["clip_fraction"].item() == 0.0  # the ratio-7 tokens are padding
    seq, _ = ppo_clip_loss(
        logprobs, torch.zeros(2, 3), torch.tensor([1.0, 2.0]), mask, 0.2, "seq-mean-token-mean"
    )
    assert seq.item() == pytest.approx(((-1.1 - 1.0) / 2 - 1.8) / 2)


@pytest.mark.parametrize("adv, direction", [(1.0, +1), (-1.0, -1)])
def test_descending_the_loss_moves_logprob_with_the_advantage(adv, direction):
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = logprobs.detach().clone()
    optimiser = torch.optim.SGD([logprobs], lr=0.1)
    loss, _ = ppo_clip_loss(logprobs, old, torch.tensor([adv]), torch.ones(1, 2), 0.2)
    loss.backward()
    optimiser.step()
    assert torch.all((logprobs.detach() - old) * direction > 0)


def test_clipped_branch_has_no_gradient():
    logprobs = torch.log(torch.tensor([[1.5]])).requires_grad_()
    loss, _ = ppo_clip_loss(logprobs, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), 0.2)
    loss.backward()
    assert logprobs.grad is not None and logprobs.grad.item() == 0.0


def test_kl_kinds_at_known_values():
    logp, ref = torch.tensor([0.5, -0.5]), torch.zeros(2)
    assert torch.allclose(kl_penalty(logp, ref, "kl"), torch.tensor([0.5, -0.5]))
    assert torch.allclose(kl_penalty(logp, ref, "abs"), torch.tensor([0.5, 0.5]))
    assert torch.allclose(kl_penalty(logp, ref, "mse"), torch.tensor([0.125, 0.125]))
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1]
    assert torch.allclose(kl_penalty(logp, ref, "low_var_kl"), torch.tensor(k3))
    assert kl_penalty(torch.tensor([-30.0]), torch.zeros(1), "low_var_kl").item() == 10.0
    with pytest.raises(ValueError, match="kl_penalty_type"):
        kl_penalty(logp, ref, "js")


def test_kl_term_is_added_with_its_weight():
    logprobs = torch.tensor([[0.5, -0.5]])
    ref = torch.zeros(1, 2)
    loss, m = ppo_clip_loss(
        logprobs,
        logprobs,
        torch.zeros(1),
        torch.ones(1, 2),
        0.2,
        kl_beta=0.1,
        ref_logprobs=ref,
        kl_penalty_type="mse",
    )
    assert loss.item() == pytest.approx(0.1 * 0.125)
    assert m["kl_loss"].item() == pytest.approx(0.125)
    with pytest.raises(ValueError, match="ref_logprobs"):
        ppo_clip_loss(logprobs, logprobs, torch.zeros(1), torch.ones(1, 2), 0.2, kl_beta=0.1)


def test_lr_constant_with_warmup():
    kw = dict(base_lr=1e-3, style="constant", warmup_iters=4, warmup_init=0.0, min_lr=0.0)
    assert lr_at(0, total_steps=8, **kw) == 0.0
    assert lr_at(2, total_steps=8, **kw) == pytest.approx(5e-4)
    assert lr_at(4, total_steps=8, **kw) == pytest.approx(1e-3)
    assert lr_at(100, total_steps=8, **kw) == pytest.approx(1e-3)
    assert lr_at(0, 2e-5, "constant", 0, 0.0, 0.0, 8) == 2e-5


def test_lr_linear_and_cosine_decay():
    assert lr_at(5, 1.0, "linear", 0, 0.0, 0.0, 10) == pytest.approx(0.5)
    assert lr_at(7, 1.0, "linear", 2, 0.0, 0.0, 12) == pytest.approx(0.5)
    assert lr_at(20, 1.0, "linear", 0, 0.0, 0.0, 10) == pytest.approx(0.0)
    assert lr_at(0, 1.0, "cosine", 0, 0.0, 0.0, 10) == pytest.approx(1.0)
    assert lr_at(5, 1.0, "cosine", 0, 0.0, 0.1, 10) == pytest.approx(0.55)
    assert lr_at(10, 1.0, "cosine", 0, 0.0, 0.1, 10) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="lr_decay_style"):
        lr_at(0, 1.0, "step", 0, 0.0, 0.0, 10)

"""GRPO maths against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlinf_twoworker.algorithm import (
    PolicyLoss,
    group_advantages,
    kl_penalty,
    loss_weights,
    masked_mean,
    masked_sum,
    normalize_advantages,
    ppo_loss,
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


@pytest.mark.parametrize("fused", [False, True])
def test_token_logprobs_matches_naive_gather_with_uneven_chunks(fused):
    """Chunked, and with fused=True the compiled kernel (its backward too), equal the
    vocabulary-wide log-softmax."""
    torch.manual_seed(0)
    logits = torch.randn(5, 4, 11, requires_grad=True)
    labels = torch.randint(0, 11, (5, 4))
    naive = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    chunked = token_logprobs(logits, labels, chunk_tokens=3, fused=fused)
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
    out = token_logprobs(logits, labels, chunk_tokens=8, fused=fused)
    expected = torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert out.dtype == torch.float32
    assert torch.allclose(out, expected, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_token_logprobs_divide_by_the_temperature_and_give_the_entropy(fused):
    """RLinf computes log-probs and entropy from logits / temperature, in the actor and in
    inference alike."""
    torch.manual_seed(2)
    logits = torch.randn(3, 4, 9, requires_grad=True)
    labels = torch.randint(0, 9, (3, 4))
    logprobs, entropy = token_logprobs(
        logits, labels, chunk_tokens=3, fused=fused, temperature=0.7, with_entropy=True
    )
    scaled = torch.log_softmax(logits / 0.7, dim=-1)
    expected = scaled.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(logprobs, expected, atol=1e-6)
    assert torch.allclose(entropy, -(scaled.exp() * scaled).sum(-1), atol=1e-5)
    plain = token_logprobs(logits, labels, fused=fused)
    assert not torch.allclose(plain, expected, atol=1e-3)  # the temperature matters
    (grad,) = torch.autograd.grad(entropy.sum(), logits)
    (naive,) = torch.autograd.grad(-(scaled.exp() * scaled).sum(), logits)
    assert torch.allclose(grad, naive, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("grads", ["logprobs", "entropy", "both"])
@pytest.mark.parametrize("chunk_tokens", [3, 8, 4096])
def test_token_logprobs_backward_equals_autograd_in_float64(fused, grads, chunk_tokens):
    """The hand-written backward (from logsumexp and the softmax-weighted mean) against
    autograd through the plain arithmetic in float64, with upstream gradients on the log-probs,
    the entropy or both, a temperature, bf16 logits taken as a strided view (the masked path
    slices them) and chunks of pieces of rows (3), of whole rows (8) and of everything."""
    torch.manual_seed(3)
    full = (torch.randn(3, 6, 17) * 3).bfloat16().requires_grad_(True)
    logits = full[:, 1:-1]  # [3, 4, 17], not contiguous
    labels = torch.randint(0, 17, (3, 4))
    up_lp, up_ent = torch.randn(3, 4), torch.randn(3, 4)
    logprobs, entropy = token_logprobs(
        logits,
        labels,
        chunk_tokens=chunk_tokens,
        fused=fused,
        temperature=0.7,
        with_entropy=True,
    )
    ref_x = (logits.detach().double() / 0.7).requires_grad_(True)
    ref_log = torch.log_softmax(ref_x, -1)
    ref_lp = ref_log.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(ref_log.exp() * ref_log).sum(-1)
    assert torch.allclose(logprobs.double(), ref_lp, atol=1e-5)
    assert torch.allclose(entropy.double(), ref_ent, atol=1e-5)
    ours = {"logprobs": (logprobs * up_lp).sum(), "entropy": (entropy * up_ent).sum()}
    theirs = {"logprobs": (ref_lp * up_lp).sum(), "entropy": (ref_ent * up_ent).sum()}
    keys = ["logprobs", "entropy"] if grads == "both" else [grads]
    (grad,) = torch.autograd.grad(sum(ours[k] for k in keys), full)
    (ref,) = torch.autograd.grad(sum(theirs[k] for k in keys), ref_x)
    assert grad.dtype == torch.bfloat16
    assert torch.all(grad[:, [0, -1]] == 0)
    # d/dlogits = d/dx / T; bf16 keeps about 3 significant digits
    expected = ref / 0.7
    assert torch.allclose(grad[:, 1:-1].double(), expected, atol=2e-2 * expected.abs().max())


def test_token_logprobs_backward_allocates_nothing_larger_than_the_logits():
    """The eager backward's largest allocation is the logits' gradient in their dtype, not a
    float32 tensor the size of the logits (autograd through the plain arithmetic makes
    several): the memory plan counts the logits and their gradient, 4 bytes a (token,
    vocabulary entry) in bf16."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(4)
    logits = torch.randn(4, 256, 2000).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 2000, (4, 256))
    logprobs, entropy = token_logprobs(
        logits, labels, chunk_tokens=64, temperature=0.7, with_entropy=True
    )
    loss = logprobs.sum() + 0.1 * entropy.sum()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest == logits.numel() * logits.element_size()


def test_token_logprobs_without_gradients_give_the_same_values():
    """Under no_grad (inference's recompute) the values are the same arithmetic's."""
    torch.manual_seed(5)
    logits = torch.randn(2, 5, 13).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 13, (2, 5))
    with_grad = token_logprobs(logits, labels, temperature=0.9, with_entropy=True)
    with torch.no_grad():
        without = token_logprobs(logits, labels, temperature=0.9, with_entropy=True)
    assert torch.equal(with_grad[0], without[0]) and torch.equal(with_grad[1], without[1])
    assert without[0].grad_fn is None


# --- loss weights: RLinf's aggregation, token by token ----------------------------------------

MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
ONE_ROW = [[slice(0, 1), slice(1, 2)], [slice(2, 3), slice(3, 4)]]  # 2 ranks x 2 micro-batches
TWO_ROWS = [[slice(0, 2)], [slice(2, 4)]]  # 2 ranks x 1 micro-batch of 2 rows


def _per_row(weights: torch.Tensor) -> list[float]:
    """The weight of each row's valid tokens (all equal within a row here)."""
    return [float(weights[i][MASK[i].bool()][0]) for i in range(4)]


@pytest.mark.parametrize(
    "agg, layout, expected",
    [
        # each micro-batch: 1/valid tokens; each rank has 2 micro-batches, 2 ranks: x 1/4
        ("token-mean", ONE_ROW, [1 / 12, 1 / 4, 1 / 8, 1 / 16]),
        # rank 0's micro-batch has 4 valid tokens, rank 1's has 6; 1 micro-batch, 2 ranks
        ("token-mean", TWO_ROWS, [1 / 8, 1 / 8, 1 / 12, 1 / 12]),
        # 1/row tokens / 2 rows / (1 micro-batch x 2 ranks)
        ("seq-mean-token-mean", TWO_ROWS, [1 / 12, 1 / 4, 1 / 8, 1 / 16]),
        ("seq-mean-token-sum", TWO_ROWS, [1 / 4, 1 / 4, 1 / 4, 1 / 4]),
        ("global-token-mean", TWO_ROWS, [1 / 10] * 4),
    ],
)
def test_loss_weights_at_hand_computed_values(agg, layout, expected):
    weights = loss_weights(MASK, layout, agg)
    assert _per_row(weights) == pytest.approx(expected)
    assert torch.all(weights[~MASK.bool()] == 0)


def _rlinf_loss(per_token: torch.Tensor, mask: torch.Tensor, layout, agg: str) -> torch.Tensor:
    """RLinf's FSDP actor, written out: each micro-batch aggregated on its own
    (rlinf/utils/utils.py), divided by the rank's micro-batch count (gradient accumulation),
    then averaged over ranks (FSDP's gradient reduction)."""
    m = mask.float()
    total = torch.zeros(())
    for parts in layout:
        for rows in parts:
            v, k = per_token[rows], m[rows]
            if agg == "token-mean":
                value = (v * k).sum() / k.sum()
            elif agg == "seq-mean-token-mean":
                value = ((v * k).sum(-1) / k.sum(-1)).mean()
            else:
                value = (v * k).sum(-1).mean()
            total = total + value / len(parts) / len(layout)
    return total


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("layout", [ONE_ROW, TWO_ROWS])
def test_weighted_sum_is_rlinfs_loss_and_gradient(agg, layout):
    torch.manual_seed(3)
    per_token = torch.randn(4, 4, requires_grad=True)
    ours = (loss_weights(MASK, layout, agg) * per_token).sum()
    theirs = _rlinf_loss(per_token, MASK, layout, agg)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    (g_ours,) = torch.autograd.grad(ours, per_token)
    (g_theirs,) = torch.autograd.grad(theirs, per_token)
    assert torch.allclose(g_ours, g_theirs, atol=1e-7)


def test_loss_weights_refuse_an_unknown_aggregation():
    with pytest.raises(ValueError, match="loss_agg_func"):
        loss_weights(MASK, TWO_ROWS, "sum")


# --- the PPO loss ---------------------------------------------------------------------------


def _tokens(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row at the given ratios, one micro-batch: token-mean weights 1/rows."""
    logprobs = torch.log(torch.tensor(ratios)).unsqueeze(-1)
    mask = torch.ones_like(logprobs)
    return (
        logprobs,
        torch.zeros_like(logprobs),
        loss_weights(mask, [[slice(0, len(ratios))]], "token-mean"),
    )


def _loss(ratios, adv, settings=PolicyLoss(), **kw):
    logprobs, old, w = _tokens(ratios)
    return ppo_loss(logprobs, old, torch.tensor(adv), w, w, settings, **kw)


def test_clipped_loss_at_known_ratios():
    # per token: clipped at 1.2 -> -1.2; clipped at 0.8 -> +0.8; unclipped 1.5; unclipped -0.5
    loss, m = _loss([1.5, 0.5, 1.5, 0.5], [1.0, -1.0, -1.0, 1.0])
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 1.5 - 0.5) / 4)
    assert m["policy_loss"].item() == pytest.approx(loss.item())
    assert m["clip_fraction"].item() == pytest.approx(0.5)
    assert m["ratio_mean"].item() == pytest.approx(1.0)
    assert m["ratio_max"].item() == pytest.approx(1.5)
    # RLinf's approx_kl: the token-mean of old - new (k1), here -mean(log ratio)
    k1 = -(2 * math.log(1.5) + 2 * math.log(0.5)) / 4
    assert m["approx_kl"].item() == pytest.approx(k1)


def test_ratio_max_is_over_the_valid_tokens_and_zero_without_any():
    """The largest ratio among the tokens that count (a masked token's ratio is not seen,
    however large), and 0 where none counts; computed without asking the device whether any
    counts (no host sync a micro-batch)."""
    logprobs, old, w = _tokens([1.5, 3.0, 0.5])
    w[1, 0] = 0.0  # the 3.0 is masked out (one token a row)
    _, m = ppo_loss(logprobs, old, torch.tensor([1.0, 1.0, 1.0]), w, w, PolicyLoss())
    assert m["ratio_max"].item() == pytest.approx(1.5)
    none = torch.zeros_like(w)
    _, m = ppo_loss(logprobs, old, torch.tensor([1.0, 1.0, 1.0]), none, none, PolicyLoss())
    assert m["ratio_max"].item() == 0.0


def test_asymmetric_clip_uses_low_and_high():
    settings = PolicyLoss(clip_low=0.2, clip_high=0.28)
    loss, m = _loss([1.3, 0.7], [1.0, -1.0], settings)
    assert loss.item() == pytest.approx((-1.28 + 0.8) / 2)
    assert m["clip_fraction"].item() == 1.0


def test_dual_clip_bounds_negative_advantage_tokens():
    # A = -1, ratio 5: max(5, 1.2) = 5, dual clip at 3 x |A| = 3; A = -1, ratio 2: 2 < 3 stays
    settings = PolicyLoss(clip_c=3.0)
    logprobs, old, w = _tokens([5.0, 2.0])
    logprobs.requires_grad_()
    loss, m = ppo_loss(logprobs, old, torch.tensor([-1.0, -1.0]), w, w, settings)
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2)
    assert m["dual_clip_fraction"].item() == pytest.approx(0.5)
    loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad[0].item() == 0.0 and logprobs.grad[1].item() != 0.0
    without, _ = _loss([5.0, 2.0], [-1.0, -1.0])
    assert without.item() == pytest.approx((5.0 + 2.0) / 2)


def test_log_ratio_clamps_apply_before_exp():
    settings = PolicyLoss(log_ratio_max=0.1, clip_low=10.0, clip_high=10.0)
    loss, m = _loss([2.0], [-1.0], settings)
    assert loss.item() == pytest.approx(math.exp(0.1))
    assert m["approx_kl"].item() == pytest.approx(-0.1)


def test_entropy_bonus_is_subtracted_with_the_loss_weights():
    logprobs, old, w = _tokens([1.0, 1.0])
    entropy = torch.tensor([[2.0], [4.0]])
    base, _ = ppo_loss(logprobs, old, torch.tensor([1.0, -1.0]), w, w, PolicyLoss(), entropy)
    loss, m = ppo_loss(
        logprobs, old, torch.tensor([1.0, -1.0]), w, w, PolicyLoss(entropy_bonus=0.01), entropy
    )
    assert m["entropy_loss"].item() == pytest.approx(3.0)
    assert loss.item() == pytest.approx(base.item() - 0.01 * 3.0)


def test_loss_masks_padding_and_broadcasts_advantages():
    logprobs = torch.log(torch.tensor([[1.1, 1.0, 7.0], [0.9, 7.0, 7.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    w = loss_weights(mask, [[slice(0, 2)]], "token-mean")
    loss, m = ppo_loss(logprobs, torch.zeros(2, 3), torch.tensor([1.0, 2.0]), w, w, PolicyLoss())
    assert loss.item() == pytest.approx((-1.1 - 1.0 - 1.8) / 3)
    assert m["clip_fraction"].item() == 0.0  # the ratio-7 tokens are padding
    assert m["ratio_max"].item() == pytest.approx(1.1)


@pytest.mark.parametrize("adv, direction", [(1.0, +1), (-1.0, -1)])
def test_descending_the_loss_moves_logprob_with_the_advantage(adv, direction):
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = logprobs.detach().clone()
    w = loss_weights(torch.ones(1, 2), [[slice(0, 1)]], "token-mean")
    optimiser = torch.optim.SGD([logprobs], lr=0.1)
    loss, _ = ppo_loss(logprobs, old, torch.tensor([adv]), w, w, PolicyLoss())
    loss.backward()
    optimiser.step()
    assert torch.all((logprobs.detach() - old) * direction > 0)


def test_clipped_branch_has_no_gradient():
    logprobs, old, w = _tokens([1.5])
    logprobs.requires_grad_()
    loss, _ = ppo_loss(logprobs, old, torch.tensor([1.0]), w, w, PolicyLoss())
    loss.backward()
    assert logprobs.grad is not None and logprobs.grad.item() == 0.0


def test_kl_kinds_at_rlinfs_values():
    logp, ref = torch.tensor([0.5, -0.5]), torch.zeros(2)
    for kind in ("kl", "k1"):
        assert torch.allclose(kl_penalty(logp, ref, kind), torch.tensor([0.5, -0.5]))
    assert torch.allclose(kl_penalty(logp, ref, "abs"), torch.tensor([0.5, 0.5]))
    for kind in ("mse", "k2"):
        assert torch.allclose(kl_penalty(logp, ref, kind), torch.tensor([0.125, 0.125]))
    # k3 with d = ref - logp: exp(d) - d - 1
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1]
    for kind in ("low_var_kl", "k3"):
        assert torch.allclose(kl_penalty(logp, ref, kind), torch.tensor(k3))
    assert kl_penalty(torch.tensor([-30.0]), torch.zeros(1), "k3").item() == 10.0  # clamped
    with pytest.raises(ValueError, match="kl_penalty_type"):
        kl_penalty(logp, ref, "full")


def test_kl_term_is_added_with_its_weight():
    logprobs = torch.tensor([[0.5, -0.5]])
    w = loss_weights(torch.ones(1, 2), [[slice(0, 1)]], "token-mean")
    settings = PolicyLoss(kl_beta=0.1, kl_type="mse")
    loss, m = ppo_loss(
        logprobs, logprobs, torch.zeros(1), w, w, settings, ref_logprobs=torch.zeros(1, 2)
    )
    assert loss.item() == pytest.approx(0.1 * 0.125)
    assert m["kl_loss"].item() == pytest.approx(0.125)
    with pytest.raises(ValueError, match="ref_logprobs"):
        ppo_loss(logprobs, logprobs, torch.zeros(1), w, w, settings)


def test_normalize_advantages_whitens_valid_tokens_only():
    adv = torch.tensor([[1.0, 1.0, 9.0], [-1.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    (out,) = normalize_advantages([adv], [mask])
    # valid values 1, 1, -1: mean 1/3, biased std sqrt(8/9)
    std = math.sqrt(8 / 9)
    expected = torch.tensor(
        [[(2 / 3) / (std + 1e-5), (2 / 3) / (std + 1e-5), 0.0], [(-4 / 3) / (std + 1e-5), 0, 0]]
    )
    assert torch.allclose(out, expected, atol=1e-6)


def test_the_kl_term_takes_rlinfs_fsdp_argument_order():
    """RLinf's FSDP actor adds kl_beta * agg(kl_penalty(ref_logprobs, logprobs)): for k3 that
    is exp(d) - d - 1 with d = logp - ref. Tokens at logp - ref = +0.5 and -0.5, one
    micro-batch: the token-mean of the two."""
    logprobs = torch.tensor([[0.5, -0.5]], requires_grad=True)
    ref = torch.zeros(1, 2)
    w = loss_weights(torch.ones(1, 2), [[slice(0, 1)]], "token-mean")
    settings = PolicyLoss(kl_beta=0.2, kl_type="low_var_kl")
    loss, m = ppo_loss(logprobs, logprobs.detach(), torch.zeros(1), w, w, settings, None, ref)
    k3 = [math.exp(0.5) - 0.5 - 1, math.exp(-0.5) + 0.5 - 1]
    assert m["kl_loss"].item() == pytest.approx(sum(k3) / 2)
    assert loss.item() == pytest.approx(0.2 * sum(k3) / 2)
    loss.backward()
    # d/dlogp of (exp(d) - d - 1) / 2 * 0.2 = 0.1 * (exp(d) - 1): pulls logp toward ref
    expected = [0.1 * (math.exp(0.5) - 1), 0.1 * (math.exp(-0.5) - 1)]
    assert logprobs.grad is not None
    assert logprobs.grad[0].tolist() == pytest.approx(expected)

"""The split-KV decode attention kernel (engines/decode_attention.py) on a real GPU: equal to the
grouped matrix product up to rounding for every slot's own end and left padding, and the static
sampler's greedy answers with it equal to transformers' generate, refills included."""

from __future__ import annotations

import math

import pytest
import torch
from support import tiny_lm

from rlinf_twoworker.engines.decode_attention import (
    grouped_matmul,
    kernel_available,
    split_kv,
    splits_for,
)
from rlinf_twoworker.engines.static import SamplingSettings, StaticSampler
from rlinf_twoworker.engines.static_kernels import masked_softmax
from rlinf_twoworker.workers.rollout import left_pad

pytestmark = pytest.mark.gpu


def _case(slots, heads, kv_heads, dim, length, width, dtype, seed=0):
    """Random q and caches; slot b attends to columns [pad_b, end_b), end_b <= width."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    keys = torch.randn(slots, kv_heads, length, dim, device="cuda", generator=g).to(dtype)
    values = torch.randn(slots, kv_heads, length, dim, device="cuda", generator=g).to(dtype)
    q = torch.randn(slots, heads, 1, dim, device="cuda", generator=g).to(dtype)
    end = torch.randint(1, width + 1, (slots,), device="cuda", generator=g)
    end[0] = width  # one slot filled to the read width
    pad = (torch.rand(slots, device="cuda", generator=g) * (end - 1)).long()
    cols = torch.arange(length, device="cuda")
    valid = (cols[None, :] >= pad[:, None]) & (cols[None, :] < end[:, None])
    # Columns past each slot's end hold stale keys (valid stays false there, end excludes them).
    return q, keys, values, valid, end


@pytest.mark.skipif(not kernel_available(torch.device("cuda")), reason="needs CUDA and Triton")
@pytest.mark.parametrize(
    "slots,heads,kv_heads,dim,width,dtype",
    [
        (5, 4, 2, 16, 130, torch.float32),
        (7, 12, 2, 128, 300, torch.bfloat16),
        (3, 8, 8, 64, 64, torch.bfloat16),  # no grouping
        (256, 12, 2, 128, 1024, torch.bfloat16),
    ],
)
def test_split_kv_equals_the_grouped_product(slots, heads, kv_heads, dim, width, dtype):
    q, keys, values, valid, end = _case(slots, heads, kv_heads, dim, width + 77, width, dtype)
    scale = dim**-0.5
    bias = torch.zeros(slots, width, device="cuda").masked_fill(~valid[:, :width], -math.inf)
    reference = grouped_matmul(
        q.double(), keys.double(), values.double(), bias[:, None, None, :], scale, masked_softmax
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for splits in sorted({1, 3, splits_for(slots, kv_heads, width + 77, torch.device("cuda"))}):
        out = split_kv(q, keys, values, valid, end, width, scale, splits)
        assert out.dtype == dtype and out.shape == (slots, 1, heads * dim)
        error = (out.double() - reference).abs().max().item()
        assert error < tolerance, (splits, error)


@pytest.mark.skipif(not kernel_available(torch.device("cuda")), reason="needs CUDA and Triton")
def test_split_kv_reads_the_shared_prompt_from_the_source_slot():
    """Slots in groups of three share their first slot's prompt columns (`source`, `shared`
    100: not a whole number of column blocks): the kernel's output equals the grouped
    product's over caches where every slot holds the prompt itself, though the other slots'
    prompt columns hold noise."""
    slots, width, shared = 12, 300, 100
    q, keys, values, valid, end = _case(slots, 12, 2, 128, 400, width, torch.bfloat16, seed=2)
    source = torch.arange(slots, device="cuda") // 3 * 3
    for cache in (keys, values):
        cache[:, :, :shared] = cache[source][:, :, :shared]
    # Live slots, as in the sampler: past the prompt, each with its group's padding.
    end.clamp_(min=shared + 1)
    prompt = valid[source][:, :shared]
    valid = torch.arange(400, device="cuda")[None, :] < end[:, None]
    valid[:, :shared] = prompt
    bias = torch.zeros(slots, width, device="cuda").masked_fill(~valid[:, :width], -math.inf)
    reference = grouped_matmul(
        q.double(),
        keys.double(),
        values.double(),
        bias[:, None, None, :],
        128**-0.5,
        masked_softmax,
    )
    others = source != torch.arange(slots, device="cuda")
    for cache in (keys, values):
        cache[others, :, :shared] = 10 * torch.randn_like(cache[others, :, :shared])
    prefix = torch.tensor([shared], device="cuda")
    for splits in (1, 4):
        out = split_kv(
            q, keys, values, valid, end, width, 128**-0.5, splits, source=source, shared=prefix
        )
        error = (out.double() - reference).abs().max().item()
        assert error < 2e-2, (splits, error)
    # Without `source` each slot reads its own (noisy) prompt columns: the test can tell.
    own = split_kv(q, keys, values, valid, end, width, 128**-0.5, 1)
    assert (own.double() - reference).abs().max().item() > 0.1


def _tiny_cuda_lm(arch):
    """head_dim 16: the smallest the kernel takes."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tiny_lm(arch, vocab=61, hidden=64, seed=None, max_position_embeddings=128)
        with torch.no_grad():
            model.lm_head.weight.mul_(4.0)
    return model.cuda()


def _grpo_rows():
    """4 prompts of 1-8 tokens x 3 answers each, left-padded to 8 (pad id 0)."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 61, (1 + 2 * i,), generator=generator).tolist() for i in range(4)]
    ids, mask = left_pad(prompts, pad_id=0, width=8)
    return ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)


@pytest.mark.skipif(not kernel_available(torch.device("cuda")), reason="needs CUDA and Triton")
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_sampler_with_split_kv_gives_generate_greedy_answers(arch):
    """GRPO rows (4 prompts x 3 answers) in 4 slots (refills into slots with stale caches,
    a group's prompt read from its first slot), greedy, head_dim 16: the kernel's answers
    equal the grouped product's and generate's."""
    model = _tiny_cuda_lm(arch)
    ids, mask = _grpo_rows()
    greedy = SamplingSettings(do_sample=False)
    kernel = StaticSampler(model, 4, 8 + 40, attention="split_kv")
    assert kernel.attention == "split_kv" and kernel.compiled
    answers = kernel.generate(ids, mask, 40, [-1], 0, greedy)
    assert kernel.stats.refilled_rows == 8
    grouped = StaticSampler(model, 4, 8 + 40, attention="grouped")
    assert torch.equal(answers, grouped.generate(ids, mask, 40, [-1], 0, greedy))
    reference = model.generate(
        input_ids=ids.cuda(),
        attention_mask=mask.cuda(),
        do_sample=False,
        max_new_tokens=40,
        eos_token_id=None,
        pad_token_id=0,
    )[:, 8:].cpu()
    assert torch.equal(answers, reference)


@pytest.mark.skipif(not kernel_available(torch.device("cuda")), reason="needs CUDA and Triton")
def test_sampled_answers_with_split_kv_equal_the_grouped_products():
    """Sampled GRPO rows ending at varied lengths in 5 slots, so a group's first slot takes
    another prompt while the group's other answers still read it: with one seed, the kernel
    draws the same answers as the grouped product (both sample from softmax(logits))."""
    model = _tiny_cuda_lm("qwen2")
    ids, mask = _grpo_rows()
    sampled = SamplingSettings(do_sample=True)
    answers = {}
    for attention in ("split_kv", "grouped"):
        sampler = StaticSampler(model, 5, 8 + 40, attention=attention)
        torch.manual_seed(0)
        answers[attention] = sampler.generate(ids, mask, 40, [3, 4, 5], 0, sampled)
        assert sampler.stats.refilled_rows == 7
    assert torch.equal(answers["split_kv"], answers["grouped"])
    ends = [[i for i, t in enumerate(row) if t in (3, 4, 5)] for row in answers["grouped"].tolist()]
    assert len({e[0] if e else 40 for e in ends}) >= 3

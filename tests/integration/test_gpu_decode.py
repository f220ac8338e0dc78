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
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_sampler_with_split_kv_gives_generate_greedy_answers(arch):
    """12 prompts of 1-8 tokens in 4 slots (refills into slots with stale caches), greedy,
    head_dim 16: the kernel's answers equal the grouped product's and generate's."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tiny_lm(arch, vocab=61, hidden=64, seed=None, max_position_embeddings=128)
        with torch.no_grad():
            model.lm_head.weight.mul_(4.0)
    model = model.cuda()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 61, (1 + i % 8,), generator=generator).tolist() for i in range(12)]
    ids, mask = left_pad(prompts, pad_id=0, width=8)
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

"""The split-KV decode attention kernel (engines/decode_attention.py): equal to the grouped
matrix product up to rounding for every slot's own end and left padding, a GRPO group's prompt
read from the group's first slot, and the static sampler's answers with it equal to
transformers' generate (greedy) and to the grouped product's (sampled), refills included.

The same Triton program runs on a GPU and, on CPU tensors, under Triton's interpreter
(TRITON_INTERPRET=1): the CPU cases check the kernel's logic wherever Triton is installed (the
test extra installs it), the GPU cases its compiled, tuned form. Triton reads TRITON_INTERPRET
when it is first imported, so the CPU cases run in a process of their own, started by
test_the_interpreted_cases_in_a_process_of_their_own with the variable set."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import generate_greedy, tiny_lm

from rlinf_twoworker.engines import decode_attention
from rlinf_twoworker.engines.decode_attention import (
    grouped_matmul,
    kernel_available,
    split_kv,
    splits_for,
)
from rlinf_twoworker.engines.static import SamplingSettings, StaticSampler
from rlinf_twoworker.engines.static_kernels import masked_softmax
from rlinf_twoworker.workers.rollout import left_pad

try:
    import triton  # noqa: F401
except ImportError:
    pytest.skip(
        "Triton is not installed: pip install -e '.[test]' installs it", allow_module_level=True
    )


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CPU_CASES = 8


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cpu" and not INTERPRETED:
        pytest.skip("runs in test_the_interpreted_cases_in_a_process_of_their_own's own process")
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert kernel_available(torch.device(request.param))
    return request.param


@pytest.mark.skipif(INTERPRETED, reason="this process is the one it starts")
def test_the_interpreted_cases_in_a_process_of_their_own():
    """This file's CPU cases, in a pytest of their own under TRITON_INTERPRET=1: every one of
    them runs and passes (none skipped)."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            "-k",
            "cpu and not bf16",
        ]
        + [str(Path(__file__).relative_to(root))],
        cwd=root,
        # Not this worker's pytest variables (an xdist worker's would reach the inner run).
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        | {"TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = done.stdout + done.stderr
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, out[-4000:]
    assert re.search(rf"\b{CPU_CASES} passed", summary) and "skipped" not in summary, summary


def _case(device, slots, heads, kv_heads, dim, length, width, dtype, seed=0):
    """Random q and caches; slot b attends to columns [pad_b, end_b), end_b <= width."""
    g = torch.Generator(device=device).manual_seed(seed)
    keys = torch.randn(slots, kv_heads, length, dim, device=device, generator=g).to(dtype)
    values = torch.randn(slots, kv_heads, length, dim, device=device, generator=g).to(dtype)
    q = torch.randn(slots, heads, 1, dim, device=device, generator=g).to(dtype)
    end = torch.randint(1, width + 1, (slots,), device=device, generator=g)
    end[0] = width  # one slot filled to the read width
    pad = (torch.rand(slots, device=device, generator=g) * (end - 1)).long()
    cols = torch.arange(length, device=device)
    valid = (cols[None, :] >= pad[:, None]) & (cols[None, :] < end[:, None])
    # Columns past each slot's end hold stale keys (valid stays false there, end excludes them).
    return q, keys, values, valid, end


def _reference(q, keys, values, valid, width, scale):
    bias = torch.zeros(valid.shape[0], width, device=q.device)
    bias = bias.masked_fill(~valid[:, :width], -math.inf)
    return grouped_matmul(
        q.double(), keys.double(), values.double(), bias[:, None, None, :], scale, masked_softmax
    )


@pytest.mark.parametrize(
    "slots,heads,kv_heads,dim,width,dtype",
    [
        (5, 4, 2, 16, 130, torch.float32),
        (3, 8, 8, 64, 64, torch.float32),  # no grouping
        # bf16 on the GPU only: the interpreter computes through NumPy, which has no bf16.
        pytest.param(7, 12, 2, 128, 300, torch.bfloat16, marks=pytest.mark.gpu, id="bf16"),
    ],
)
def test_split_kv_equals_the_grouped_product(device, slots, heads, kv_heads, dim, width, dtype):
    if dtype == torch.bfloat16 and device != "cuda":
        pytest.skip("bf16 runs on the GPU only")
    length = width + 77
    q, keys, values, valid, end = _case(device, slots, heads, kv_heads, dim, length, width, dtype)
    reference = _reference(q, keys, values, valid, width, dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for splits in sorted({1, 3, splits_for(slots, kv_heads, length, torch.device(device))}):
        out = split_kv(q, keys, values, valid, end, width, dim**-0.5, splits)
        assert out.dtype == dtype and out.shape == (slots, 1, heads * dim)
        error = (out.double() - reference).abs().max().item()
        assert error < tolerance, (splits, error)


def test_split_kv_reads_the_shared_prompt_from_the_source_slot(device):
    """Slots in groups of three share their first slot's prompt columns (`source`, `shared`
    100: not a whole number of column blocks): the kernel's output equals the grouped
    product's over caches where every slot holds the prompt itself, though the other slots'
    prompt columns hold noise."""
    slots, width, shared, dim = 12, 300, 100, 64
    q, keys, values, valid, end = _case(device, slots, 8, 2, dim, 400, width, torch.float32, seed=2)
    source = torch.arange(slots, device=device) // 3 * 3
    for cache in (keys, values):
        cache[:, :, :shared] = cache[source][:, :, :shared]
    # Live slots, as in the sampler: past the prompt, each with its group's padding.
    end.clamp_(min=shared + 1)
    prompt = valid[source][:, :shared]
    valid = torch.arange(400, device=device)[None, :] < end[:, None]
    valid[:, :shared] = prompt
    reference = _reference(q, keys, values, valid, width, dim**-0.5)
    others = source != torch.arange(slots, device=device)
    for cache in (keys, values):
        cache[others, :, :shared] = 10 * torch.randn_like(cache[others, :, :shared])
    prefix = torch.tensor([shared], device=device)
    for splits in (1, 4):
        out = split_kv(
            q, keys, values, valid, end, width, dim**-0.5, splits, source=source, shared=prefix
        )
        error = (out.double() - reference).abs().max().item()
        assert error < 1e-5, (splits, error)
    # Without `source` each slot reads its own (noisy) prompt columns: the test can tell.
    own = split_kv(q, keys, values, valid, end, width, dim**-0.5, 1)
    assert (own.double() - reference).abs().max().item() > 0.1


def _tiny_lm(arch, device):
    """head_dim 16: the smallest the kernel takes."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tiny_lm(arch, vocab=61, hidden=64, seed=None, max_position_embeddings=128)
        with torch.no_grad():
            model.lm_head.weight.mul_(4.0)
    return model.to(device)


def _grpo_rows():
    """4 prompts of 1-7 tokens x 3 answers each, left-padded to 8 (pad id 0)."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 61, (1 + 2 * i,), generator=generator).tolist() for i in range(4)]
    ids, mask = left_pad(prompts, pad_id=0, width=8)
    return ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_sampler_with_split_kv_gives_generate_greedy_answers(device, arch):
    """GRPO rows (4 prompts x 3 answers) in 4 slots (refills into slots with stale caches,
    a group's prompt read from its first slot), greedy, head_dim 16: the kernel's answers
    equal the grouped product's and generate's."""
    model = _tiny_lm(arch, device)
    ids, mask = _grpo_rows()
    greedy = SamplingSettings(do_sample=False)
    new = 40 if device == "cuda" else 16  # the interpreter runs each program in Python
    kernel = StaticSampler(model, 4, 8 + new, attention="split_kv")
    answers = kernel.generate(ids, mask, new, [-1], 0, greedy)
    assert kernel.stats.refilled_rows == 8
    grouped = StaticSampler(model, 4, 8 + new, attention="grouped")
    assert torch.equal(answers, grouped.generate(ids, mask, new, [-1], 0, greedy))
    assert torch.equal(answers, generate_greedy(model, ids, mask, new))


def test_sampled_answers_with_split_kv_equal_the_grouped_products(device):
    """Sampled GRPO rows ending at varied lengths in 5 slots, so a group's first slot takes
    another prompt while the group's other answers still read it: with one seed, the kernel
    draws the same answers as the grouped product (both sample from softmax(logits))."""
    model = _tiny_lm("qwen2", device)
    ids, mask = _grpo_rows()
    sampled = SamplingSettings(do_sample=True)
    new = 40 if device == "cuda" else 24
    answers = {}
    for attention in ("split_kv", "grouped"):
        sampler = StaticSampler(model, 5, 8 + new, attention=attention)
        torch.manual_seed(0)
        answers[attention] = sampler.generate(ids, mask, new, [3, 4, 5], 0, sampled)
        assert sampler.stats.refilled_rows == 7
    assert torch.equal(answers["split_kv"], answers["grouped"])
    ends = [[i for i, t in enumerate(row) if t in (3, 4, 5)] for row in answers["grouped"].tolist()]
    assert len({e[0] if e else new for e in ends}) >= 3


def test_a_failing_kernel_falls_back_to_the_grouped_product(device, monkeypatch):
    """Triton failing in the kernel (here its launch raising Triton's own out-of-resources
    error, as a GPU with less shared memory than the tuned blocks need would) costs a warning
    and the kernel, not the rollout: the sampler decodes with the grouped product from then on,
    and its answers are the product's."""
    from triton.runtime.errors import OutOfResources

    model = _tiny_lm("qwen2", device)
    ids, mask = _grpo_rows()
    greedy = SamplingSettings(do_sample=False)
    expected = StaticSampler(model, 4, 8 + 12, attention="grouped").generate(
        ids, mask, 12, [-1], 0, greedy
    )

    def launcher(grid):
        raise OutOfResources(262144, 232448, "shared memory")

    monkeypatch.setattr(decode_attention, "_launcher", launcher)
    sampler = StaticSampler(model, 4, 8 + 12, attention="split_kv")
    with pytest.warns(UserWarning, match=r"split-KV decode attention kernel failed \(OutOfRes"):
        answers = sampler.generate(ids, mask, 12, [-1], 0, greedy)
    assert sampler.attention == "grouped"
    assert torch.equal(answers, expected)


@pytest.mark.skipif(INTERPRETED, reason="needs no kernel: runs once, in the main process")
def test_the_split_count_is_the_sampler_pick_unless_the_environment_names_one(monkeypatch):
    """RLINF_DECODE_SPLITS replaces splits_for's pick (the benchmarks' A/B of the range count);
    a value that is not a positive integer is refused by the variable's name."""
    cpu = torch.device("cpu")
    monkeypatch.delenv(decode_attention.SPLITS_ENV, raising=False)
    picked = splits_for(256, 2, 2048, cpu)
    assert picked == max(1, math.ceil(4 * 4 / (256 * 2)))  # the interpreter's 4 "SMs"
    assert splits_for(2, 2, 2048, cpu) == 4  # few slots: more ranges
    monkeypatch.setenv(decode_attention.SPLITS_ENV, "3")
    assert splits_for(256, 2, 2048, cpu) == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(decode_attention.SPLITS_ENV, bad)
        with pytest.raises(ValueError, match="RLINF_DECODE_SPLITS"):
            splits_for(256, 2, 2048, cpu)


@pytest.mark.skipif(INTERPRETED, reason="needs no kernel: runs once, in the main process")
def test_the_kernel_pays_with_many_slots_or_long_ranges(monkeypatch):
    """kernel_pays, on an H100's 132 streaming multiprocessors: split-KV where the (slot, KV
    head) pairs fill two programs a multiprocessor, or where each of the sampler's own ranges
    is at least LONG_RANGE_COLUMNS long; the grouped product for few slots on short caches,
    whatever RLINF_DECODE_SPLITS says."""
    monkeypatch.setattr(decode_attention, "_sms", lambda device: 132)
    monkeypatch.delenv(decode_attention.SPLITS_ENV, raising=False)
    gpu = torch.device("cuda")
    pays = decode_attention.kernel_pays
    assert pays(256, 2, gpu, 2304)  # 32x8@2048's rollout: 512 pairs
    assert pays(132, 2, gpu, 0)  # the pairs alone, whatever the cache
    assert not pays(16, 2, gpu, 1024)  # the tutorial's sampler: 8 ranges of 128 columns
    assert not pays(64, 2, gpu, 2304)  # 5 ranges of 461 columns
    assert splits_for(64, 2, 8192, gpu) == 5
    assert pays(64, 2, gpu, 8192)  # 8x8@8192's sampler: 64 slots x 8192 columns, 5 ranges
    assert not pays(64, 2, gpu, 5 * decode_attention.LONG_RANGE_COLUMNS - 1)
    assert pays(64, 2, gpu, 5 * decode_attention.LONG_RANGE_COLUMNS)
    # RLINF_DECODE_SPLITS sets the ranges the kernel runs with, not which attention runs:
    # one forced range of 2304 columns leaves 64 slots x 2304 with the grouped product, and a
    # value it refuses is refused by the kernel only
    for forced in ("1", "two"):
        monkeypatch.setenv(decode_attention.SPLITS_ENV, forced)
        assert not pays(64, 2, gpu, 2304)

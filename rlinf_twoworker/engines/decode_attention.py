"""Decode attention of the static sampler: one query token per slot against that slot's KV cache,
reading only the columns the slot has filled.

Two implementations of a decode step's attention:

- `grouped_matmul` (every device): the query heads of each KV head grouped into one matrix
  product with the cache's first `width` columns, a masked float32 softmax, a second product.
  It reads `width` columns of every slot, `width` being the longest live answer's bound.
- `split_kv` (CUDA, with Triton; on CPU tensors under Triton's interpreter, TRITON_INTERPRET=1,
  which the tests use): a flash-decoding kernel. Each (slot, KV head) is cut into
  `splits` column ranges, one program each; a program reads its range only up to the slot's
  own end (`end[b]`, the column after its newest key), keeps an online softmax in float32 and
  writes a partial output with its log-sum-exp; a small reduction combines the ranges (with
  one range a slot's program writes the output itself, in q's dtype, and no reduction runs). A slot
  half way through its answer thus reads half the columns of one near its end, and no scores
  or probabilities go through memory. A GRPO group's slots read their common prompt columns
  from one slot (`source`), adjacent programs, so the group's prompt comes from memory about
  once and from cache after. Its results equal the grouped product's up to rounding (float32
  scores instead of the bf16 product's): tests/unit/test_decode_attention.py.

`end` and `valid` together say which columns a slot attends to: [0, end[b]) holds the prompt
(its left padding marked invalid in `valid`) and the answer so far; nothing at or past
`end[b]` is read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch

BLOCK_N = 128
"""A range's length is a multiple of this: the largest of the column blocks the kernel is
tuned over (64 or 128 columns an iteration)."""
GROUP_PAD = 16
"""Query heads per KV head the kernel computes at once (the matrix unit's smallest row count):
models with more query heads per KV head use the grouped product."""


def grouped_matmul(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    softmax: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
) -> torch.Tensor:
    """q [B, H, 1, D], keys/values [B, KV, >= W, D], `bias` [B, 1, 1, W] (additive: 0 or -inf)
    -> [B, 1, H * D]. Reads the first W cache columns of every slot."""
    b, heads, _, dim = q.shape
    kv_heads, width = keys.shape[1], bias.shape[-1]
    keys, values = keys[:, :, :width], values[:, :, :width]
    # One query per row: group the query heads of each KV head, so the cache is read where it
    # lies instead of being repeated per query head.
    q = q.reshape(b, kv_heads, heads // kv_heads, dim)
    probs = softmax(q @ keys.transpose(-1, -2), bias, scale)
    return (probs @ values).reshape(b, 1, -1)


def kernel_supports(q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether split_kv handles these shapes: at most GROUP_PAD query heads per KV head and a
    power-of-two head_dim from 16 (the matrix unit's tile) to 128 (the largest measured; a
    program holds a GROUP_PAD x head_dim float32 accumulator)."""
    group = q_heads // kv_heads
    return group <= GROUP_PAD and 16 <= head_dim <= 128 and head_dim & (head_dim - 1) == 0


INTERPRETED_BLOCK_N = 64
"""The column block under Triton's interpreter, which has no GPU to tune on."""


def interpreting() -> bool:
    """Whether Triton's interpreter runs its programs (TRITON_INTERPRET=1): on CPU tensors,
    slowly, for tests."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_available(device: torch.device) -> bool:
    """Whether split_kv can run on `device`: an importable Triton and a CUDA device, or a CPU
    one under Triton's interpreter."""
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_refusal(device: torch.device, q_heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why split_kv cannot run for this device and these shapes (kernel_available,
    kernel_supports), or None when it can."""
    if not kernel_available(device):
        return (
            "runs on CUDA with Triton (on CPU only under Triton's interpreter, "
            f"TRITON_INTERPRET=1), and this model is on {device}"
        )
    if not kernel_supports(q_heads, kv_heads, head_dim):
        return (
            f"takes at most {GROUP_PAD} query heads a KV head and a power-of-two head_dim from "
            f"16 to 128, and this model has (heads, KV heads, head_dim) "
            f"{(q_heads, kv_heads, head_dim)}"
        )
    return None


def _sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 for the interpreter's CPU (a few ranges,
    so its runs take the reduction's path too)."""
    if device.type != "cuda":
        return 4
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


SPLITS_ENV = "RLINF_DECODE_SPLITS"
"""A positive integer in the rollout process's environment: the column ranges per (slot, KV
head) instead of splits_for's pick (for A/B measurements; the pick is the default)."""


def picked_splits(slots: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """The sampler's own pick of column ranges per (slot, KV head): enough programs for four
    per streaming multiprocessor, each range at least BLOCK_N columns."""
    wanted = max(1, math.ceil(4 * _sms(device) / (slots * kv_heads)))
    return max(1, min(wanted, math.ceil(max_len / BLOCK_N)))


def splits_for(slots: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Column ranges per (slot, KV head) the kernel runs with: picked_splits, unless
    RLINF_DECODE_SPLITS overrides it. One range needs no reduction: the program writes the
    output itself."""
    forced = os.environ.get(SPLITS_ENV, "")
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(
                f"decode attention: {SPLITS_ENV}={forced!r} in the rollout process's "
                "environment is not a positive integer (column ranges per slot and KV head); "
                "unset it to let the sampler pick"
            )
        return int(forced)
    return picked_splits(slots, kv_heads, max_len, device)


LONG_RANGE_COLUMNS = 1024
"""Columns a split-KV range must cover for the kernel to pay with few slots: ranges that long
amortise their partial outputs and the reduction that combines them."""


def kernel_pays(slots: int, kv_heads: int, device: torch.device, max_len: int) -> bool:
    """Whether the split-KV kernel beats the grouped product for this sampler: when the
    (slot, KV head) pairs alone give two programs per streaming multiprocessor, or when the
    cache is long enough that each of picked_splits' ranges covers LONG_RANGE_COLUMNS columns
    (the sampler's own pick: RLINF_DECODE_SPLITS, an A/B of the range count, does not change
    which attention runs). Measured on an H100, 1.5B shape: at 256 slots (2 ranges each) the
    sampler generated 24% more tokens/s with the kernel on GRPO groups of 8 (11% on distinct
    prompts); at 16 slots (17 ranges each) 4% fewer, the ranges' partial outputs and their
    reduction costing more than the few columns they save
    (benchmarks/results/decode-split_kv-h100.json); at 64 slots x 8192 columns (5 ranges of
    over 1,600 columns) the rollout of 8 x 8 answers took 17% less time
    (benchmarks/results/scale-8x8@8192-split_kv-h100.json against -grouped-h100.json)."""
    if slots * kv_heads >= 2 * _sms(device):
        return True
    return max_len >= picked_splits(slots, kv_heads, max_len, device) * LONG_RANGE_COLUMNS


def _launcher(grid: tuple[int, int]) -> Any:
    """The Triton program launched over `grid` (engines/decode_kernel.py imports Triton only
    when the kernel first runs): tuned on a GPU, one fixed column block when interpreted."""
    from rlinf_twoworker.engines.decode_kernel import split_kv_partial

    if not interpreting():
        return split_kv_partial[grid]
    return lambda *args, **kwargs: split_kv_partial.fn[grid](
        *args, BLOCK_N=INTERPRETED_BLOCK_N, **kwargs
    )


def combine(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Column ranges' outputs [B, KV, S, G, D] and log-sum-exps [B, KV, S, G] -> the softmax
    over all of them, [B, KV, G, D] (a range with lse -inf weighs nothing)."""
    top = lse.amax(2, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weight = torch.exp(lse - top)
    return (partial * weight.unsqueeze(-1)).sum(2) / weight.sum(2).clamp_min(1e-30).unsqueeze(-1)


def split_kv(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    end: torch.Tensor,
    width: int,
    scale: float,
    splits: int,
    reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = combine,
    source: torch.Tensor | None = None,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, 1, D], keys/values [B, KV, L, D] (last dim contiguous), valid [B, L] bool,
    end [B] int64 (slot b reads columns [0, end[b]); the caller bounds it by `width`, the
    columns any slot may read) -> [B, 1, H * D] in q's dtype. `source` [B] int64 and `shared`
    [1] int64: slot b reads its columns [0, shared) from slot source[b], which holds the same
    keys and values there (a GRPO group's prompt); None: every slot its own. Graph-safe: no
    host sync; the launch depends on `width` and `splits` only."""
    b, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    # Fixed `splits` (the buffers' shapes never change with the width; a range past every
    # slot's end writes an lse of -inf), each range a whole number of BLOCK_N columns.
    chunk = math.ceil(math.ceil(width / splits) / BLOCK_N) * BLOCK_N
    if source is None or shared is None:
        source = torch.arange(b, device=q.device)
        shared = torch.zeros(1, dtype=torch.long, device=q.device)
    q3 = q.reshape(b, heads, dim)
    direct = splits == 1
    if direct:  # the program's output is the attention's: written once, in q's dtype
        partial = torch.empty(b, heads, dim, dtype=q.dtype, device=q.device)
        lse = partial  # not written
    else:
        partial = torch.empty(b, kv_heads, splits, GROUP_PAD, dim, device=q.device)
        lse = torch.empty(b, kv_heads, splits, GROUP_PAD, device=q.device)
    _launcher((b * kv_heads, splits))(
        q3,
        keys,
        values,
        valid,
        end,
        source,
        shared,
        partial,
        lse,
        q3.stride(0),
        q3.stride(1),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        valid.stride(0),
        scale,
        chunk,
        KV=kv_heads,
        SPLITS=splits,
        GROUP=group,
        GROUP_PAD=GROUP_PAD,
        D=dim,
        # float32 caches (tests' models) multiply in full float32, not TF32.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DIRECT=direct,
    )
    if direct:
        return partial.reshape(b, 1, heads * dim)
    out = reduce(partial[:, :, :, :group], lse[:, :, :, :group])
    return out.to(q.dtype).reshape(b, 1, heads * dim)

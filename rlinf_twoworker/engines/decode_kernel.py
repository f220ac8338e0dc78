"""The split-KV decode attention's Triton program (engines/decode_attention.py says what it
computes). Imported only where Triton is: a CUDA machine with PyTorch's Triton."""

import triton
import triton.language as tl

CONFIGS = [
    triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st)
    for n in (64, 128)
    for w in (4, 8)
    for st in (2, 3)
]


@triton.jit
def attend(
    q,
    m,
    total,
    acc,
    k_base,
    v_base,
    valid_row,
    begin,
    stop,
    stride_kn,
    stride_vn,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    scale,
):
    """The online softmax over columns [begin, stop) of one KV head's cache at k_base,
    v_base, their validity at valid_row."""
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    for col in range(begin, stop, BLOCK_N):
        cols = col + n
        inside = cols < stop
        ok = tl.load(valid_row + cols, mask=inside, other=0) != 0
        k = tl.load(k_base + cols[:, None] * stride_kn + d[None, :], mask=inside[:, None])
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vn + d[None, :], mask=inside[:, None])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return m, total, acc


# Tuned once per head shape and range count, on the first call (a sampler's warm-up step,
# outside any graph capture): the tuner's trial runs write only the partial outputs.
@triton.autotune(configs=CONFIGS, key=["KV", "SPLITS", "GROUP", "D"])
@triton.jit
def split_kv_partial(
    Q,
    K,
    V,
    VALID,
    END,
    SOURCE,
    SHARED,
    OUT,
    LSE,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_valid,
    scale,
    chunk,
    KV: tl.constexpr,
    SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,
):
    slot_head = tl.program_id(0)
    split = tl.program_id(1)
    b = (slot_head // KV).to(tl.int64)  # int64 offsets: a layer's cache may pass 2**31
    h = slot_head % KV
    end = tl.load(END + b)
    source = tl.load(SOURCE + b).to(tl.int64)
    shared = tl.load(SHARED)
    start = split * chunk
    stop = tl.minimum(start + chunk, end)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    q = tl.load(
        Q + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
        mask=g[:, None] < GROUP,
        other=0.0,
    )
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    valid_row = VALID + b * stride_valid
    # The shared prompt columns from the slot that holds them for the whole group (its
    # slots, adjacent programs, then read them once from memory and again from cache),
    # the rest from the slot's own cache.
    m, total, acc = attend(
        q,
        m,
        total,
        acc,
        K + source * stride_kb + h * stride_kh,
        V + source * stride_vb + h * stride_vh,
        valid_row,
        start,
        tl.minimum(stop, shared),
        stride_kn,
        stride_vn,
        D,
        BLOCK_N,
        PRECISION,
        scale,
    )
    m, total, acc = attend(
        q,
        m,
        total,
        acc,
        K + b * stride_kb + h * stride_kh,
        V + b * stride_vb + h * stride_vh,
        valid_row,
        tl.maximum(start, shared),
        stop,
        stride_kn,
        stride_vn,
        D,
        BLOCK_N,
        PRECISION,
        scale,
    )
    # A range with no valid column (past the slot's end, or all padding) weighs nothing.
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    if DIRECT:
        # One range per (slot, KV head): its output is the attention's, written in OUT's
        # dtype where the o projection reads it ([B, H, D]); no log-sum-exp, no reduction.
        heads = (b * KV + h) * GROUP + g
        tl.store(
            OUT + heads[:, None] * D + d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=g[:, None] < GROUP,
        )
    else:
        lse = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        row = (slot_head * SPLITS + split) * GROUP_PAD
        tl.store(OUT + (row + g)[:, None] * D + d[None, :], out)
        tl.store(LSE + row + g, lse)

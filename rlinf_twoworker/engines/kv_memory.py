"""How many decode slots of the static engine fit in memory: pure arithmetic on a model config.

A decode slot holds one answer at a time: its KV cache (prompt + answer columns in every layer)
and its share of the decode step's buffers, which a captured CUDA graph keeps allocated. The
slots share one margin kept free for the prefill's activations. `slots_that_fit` takes the
free bytes as an argument (the engine reads them from the GPU), so the arithmetic is tested on
hand-computed sizes without a GPU.

The margin: a prefill forward runs on at most PREFILL_TOKENS tokens (the engine cuts larger
fills into chunks of rows), so its activations are bounded whatever the number of slots. It is
estimated as the largest tensors one decoder layer holds at once for those tokens (the residual
stream and its norm, q/k/v, the attention output, gate/up and the SwiGLU output), the attention
scores should SDPA fall back to its math kernel (flash and memory-efficient kernels do not
materialise them), the last position's logits, and HEADROOM for what no formula sees (allocator
fragmentation, cuBLAS workspaces, the compiled kernels).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlinf_twoworker.errors import TwoWorkerError

if TYPE_CHECKING:  # dtypes only: the run's controller plans memory without importing torch
    import torch

PREFILL_TOKENS = 16384
"""Most prompt tokens in one prefill forward: large enough for efficient GEMMs, small enough
that the prefill's activations stay a small fixed margin next to the KV cache."""
HEADROOM = 2**30
"""Bytes kept free beyond the prefill's estimated activations (see the module docstring)."""
LOGIT_WORK_BYTES = 64
"""Bytes per vocabulary entry per slot for the decode step's working copies of the logits:
float32 copies made by the repetition penalty, temperature, top-k/top-p masks and the
sampling noise, and top-p's int64 sort order (about a dozen tensors of 4 or 8 bytes)."""


def _dims(cfg: Any) -> tuple[int, int, int, int]:
    """(layers, heads, KV heads, head_dim) of a Qwen2/Qwen3/Llama/Mistral config."""
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, heads, kv_heads, head_dim


def kv_bytes_per_slot(cfg: Any, max_len: int, dtype: torch.dtype) -> int:
    """Keys and values of one slot: 2 x layers x KV heads x max_len x head_dim x dtype size."""
    layers, _, kv_heads, head_dim = _dims(cfg)
    return 2 * layers * kv_heads * max_len * head_dim * dtype.itemsize


def decode_bytes_per_slot(cfg: Any, max_len: int, dtype: torch.dtype) -> int:
    """One slot's share of the decode step besides its KV cache: the valid mask (bool) and the
    answer buffer (int64) per cache column; float32 attention scores, probabilities and their
    cast per head and column; the logits, their working copies and the repetition penalty's
    `seen` row per vocabulary entry; 64 bytes of per-row scalars. The layers' activations for
    one token are a few hidden sizes, negligible next to these."""
    _, heads, _, _ = _dims(cfg)
    columns = max_len * (1 + 8) + heads * max_len * 12
    vocab = cfg.vocab_size * (dtype.itemsize + LOGIT_WORK_BYTES + 1)
    return columns + vocab + 64


def slot_bytes(cfg: Any, max_len: int, dtype: torch.dtype) -> int:
    return kv_bytes_per_slot(cfg, max_len, dtype) + decode_bytes_per_slot(cfg, max_len, dtype)


def prefill_rows(width: int) -> int:
    """Rows of `width` prompt tokens per prefill forward (at least one)."""
    return max(1, PREFILL_TOKENS // width)


def prefill_margin_bytes(cfg: Any, width: int, dtype: torch.dtype) -> int:
    """Bytes kept free for one prefill forward of prompts `width` tokens wide (module
    docstring: what it counts and why)."""
    _, heads, kv_heads, head_dim = _dims(cfg)
    rows = prefill_rows(width)
    tokens = rows * width
    per_token = 4 * cfg.hidden_size + (heads + 2 * kv_heads) * head_dim + 3 * cfg.intermediate_size
    scores = rows * heads * width * width * 4
    logits = rows * cfg.vocab_size * (dtype.itemsize + 4)
    return tokens * per_token * dtype.itemsize + scores + logits + HEADROOM


def slots_that_fit(
    cfg: Any,
    max_len: int,
    width: int,
    dtype: torch.dtype,
    wanted: int,
    free_bytes: int | None,
    budget_bytes: int | None = None,
    where: str = "rollout component",
    device: str = "the GPU",
) -> int:
    """Decode slots for `wanted` rows: at most `wanted`, their slot_bytes within `free_bytes`
    less the prefill margin (None: no memory query, a CPU) and within `budget_bytes` (None: no
    budget). Raises TwoWorkerError when not even one slot fits."""
    per_slot = slot_bytes(cfg, max_len, dtype)
    limits = [wanted]
    margin = prefill_margin_bytes(cfg, width, dtype)
    if free_bytes is not None:
        limits.append(max(0, free_bytes - margin) // per_slot)
    if budget_bytes is not None:
        limits.append(budget_bytes // per_slot)
    slots = min(limits)
    if slots >= 1:
        return slots
    raise _no_slot_error(cfg, max_len, dtype, free_bytes, margin, budget_bytes, where, device)


def _size(n: int) -> str:
    return f"{n / 2**30:.3f} GiB ({n} bytes)"


def _no_slot_error(
    cfg: Any,
    max_len: int,
    dtype: torch.dtype,
    free_bytes: int | None,
    margin: int,
    budget_bytes: int | None,
    where: str,
    device: str,
) -> TwoWorkerError:
    """What does not fit (one slot's bytes), where (the component, the GPU), what to do."""
    per_slot = slot_bytes(cfg, max_len, dtype)
    limits_said = []
    if free_bytes is not None:
        limits_said.append(
            f"{device} has {_size(free_bytes)} free, {_size(margin)} of it "
            "kept for the prefill's activations"
        )
    if budget_bytes is not None:
        limits_said.append(f"the memory budget is {_size(budget_bytes)}")
    return TwoWorkerError(
        f"static rollout engine ({where}): one decode slot needs {_size(per_slot)} "
        f"(KV cache for {max_len} prompt + answer tokens: "
        f"{kv_bytes_per_slot(cfg, max_len, dtype)} bytes, decode buffers "
        f"{decode_bytes_per_slot(cfg, max_len, dtype)} bytes) but "
        f"{' and '.join(limits_said)}: not even "
        "one slot fits. Lower runner.seq_length (or data.max_prompt_length), free memory on "
        "that GPU (components or other processes placed on it), or raise the memory budget"
    )

"""The `static` rollout engine: a static-KV-cache sampler for Qwen2/Qwen3/Llama-family models,
with continuous batching and CUDA-graph decode on GPUs.

`transformers`' `generate` is bound by Python and kernel-launch overhead at RL batch sizes. This
sampler reuses the loaded model's own weights and rotary embedding but runs its own loop over a
fixed set of decode slots. Each slot holds one answer at a time, with its own KV cache of
prompt + answer columns, preallocated, and its own cache column and position, so every decode
step has the same shapes; on CUDA one decode step (token bookkeeping included) is captured once
as a CUDA graph and replayed. A step writes each slot's new key at that slot's column with a
scatter (no host sync), and reads and writes only persistent buffers.

Continuous batching: generate() takes every row of a rollout. It prefills the first rows into
the slots and decodes; every CHECK_EVERY steps it takes the answers that ended (EOS, or
max_new tokens), and prefills the next waiting rows into their slots: an eager forward of those
rows alone, outside the graph, writing their prompt's keys into cache columns 0..P-1 of those
slots and resetting their rows of the decode state. A long answer thus never idles the other
slots, and rows beyond the slots decode in waves. The number of slots (StaticEngine) is
min(rows, rollout.max_batch_size, what fits in free GPU memory; engines/kv_memory.py). P is the
prompts' width less the leading columns that are padding in every row of the call: those are
dropped before the first prefill, so a batch of short prompts padded to
data.max_prompt_length neither prefills nor reads them.

A decode step is small-batch and bound by reading the weights and the cache, so it is built from
few kernels (engines/static_kernels.py): the q/k/v and gate/up projections run as one GEMM each,
decode attention reads the grouped KV cache in place (no per-head copies) and on GPUs the
elementwise pieces (residual + RMSNorm, rotary, masked softmax, SwiGLU) are fused by
`torch.compile`; a prefill, whose row count changes from one refill to the next, runs them
eagerly. With many slots on a GPU, decode attention is a split-KV Triton kernel instead
(engines/decode_attention.py): each slot reads only its own filled columns, and a GRPO group's
slots read their prompt's columns from the group's first slot. Sampling (temperature, top-k,
top-p, and HF's repetition penalty) stays on the GPU. Exactness: greedy decoding gives the
same tokens as `generate`, with or without a repetition penalty, and the same answers whatever
the number of slots; sampling draws from
softmax(logits / T) at every step (all tested). Qwen3's per-head RMSNorm of q and k runs before
the rotary embedding, and its head_dim need not be hidden_size / heads. Attention is full
attention: a model whose config slides a window shorter than the sequence is refused
(`unsupported_reason`).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from rlinf_twoworker.engines.config_rules import unsupported_reason_of
from rlinf_twoworker.engines.decode_attention import (
    combine,
    grouped_matmul,
    kernel_pays,
    kernel_refusal,
    split_kv,
    splits_for,
)
from rlinf_twoworker.engines.kv_memory import prefill_rows, slots_that_fit
from rlinf_twoworker.engines.models import causal_self_mask, run_or_eager
from rlinf_twoworker.engines.sampling import SamplingSettings, race_compiled
from rlinf_twoworker.engines.static_kernels import (
    EAGER,
    Kernels,
    compiled_kernels,
    fuse_projections,
    penalize_repeats,
    pick_tokens,
)
from rlinf_twoworker.errors import TwoWorkerError

logger = logging.getLogger(__name__)


def unsupported_reason(model: Any, max_len: int) -> str | None:
    """Why the static sampler cannot run `model` over `max_len` tokens (prompt + answer), or
    None when it can (config_rules.unsupported_reason_of)."""
    return unsupported_reason_of(type(model).__name__, model.config, max_len)


def supports(model: Any, max_len: int) -> bool:
    return unsupported_reason(model, max_len) is None


CHECK_EVERY = 16
"""Decode steps between looks at which answers ended (one host sync each): a finished row
holds its slot at most this many steps before the next waiting row takes it."""
READ_STEP = 256
"""Decode attention reads the cache columns [0, W) only, W the filled length of the longest
live answer so far rounded up to a multiple of this (one captured graph per W): a step early
in the answers reads a fraction of the cache instead of all max_len columns."""


ATTENTIONS = ("split_kv", "grouped")
"""Decode attention implementations (engines/decode_attention.py): the split-KV kernel reads
each slot's own filled columns (CUDA); the grouped matrix product reads the longest live
answer's, on any device."""


class DecodeMask(NamedTuple):
    """Which cache columns a decode step attends to: at most the first `width` of any slot;
    as an additive `bias` [B, 1, 1, width] (the grouped product) or, for the split-KV kernel,
    each slot's `end` [B] (it reads columns [0, end) and skips the invalid ones)."""

    width: int
    bias: torch.Tensor | None = None
    end: torch.Tensor | None = None


@dataclass
class RunStats:
    """What a sampler's last generate() did (for tests and benchmarks)."""

    rows: int
    slots: int
    max_len: int = 1
    """Cache columns a slot holds (prompt + answer)."""
    prompt_columns: int = 0
    """Cache columns the prompts take: their padded width less the leading columns that are
    padding in every row, which are dropped before the prefill (no row attends to them)."""
    prefills: int = 0
    """Prefill forwards: the first fill and every refill, each cut into PREFILL_TOKENS chunks."""
    prefill_rows: int = 0
    """Prompts forwarded: each distinct prompt of a fill once (a GRPO group's answers share
    their prompt's prefill, its keys and values copied into each answer's slot)."""
    refilled_rows: int = 0
    """Rows prefilled into a slot that another row's finished answer had left."""
    decode_steps: int = 0
    read_columns: int = 0
    """The decode steps' read widths summed: the cache columns the grouped product reads per
    slot (the split-KV kernel reads at most that, each slot only its own filled columns)."""

    @property
    def mean_read_fraction(self) -> float:
        """Columns read per decode step as a share of the cache's length (1.0: all of it)."""
        return self.read_columns / max(1, self.decode_steps * self.max_len)


@dataclass
class _Slots:
    """The host's view of the slots: the row each decodes (-1: none) and its decode steps so
    far, both known without a sync; and the next row waiting for a slot."""

    owner: torch.Tensor
    age: torch.Tensor
    next_row: int = 0


def first_prompt_column(mask: torch.Tensor) -> int:
    """The first column of left-padded prompts' `mask` [R, P] that some row's prompt uses:
    the columns before it are padding in every row. The last column when every column is
    padding in every row (one column is kept: the prefill needs a token to forward)."""
    used = torch.nonzero(mask.bool().any(0)).flatten()
    return int(used[0]) if len(used) else max(0, mask.shape[1] - 1)


def answer_width(answers: torch.Tensor, eos_ids: list[int]) -> int:
    """Columns up to the end of the longest answer (its first EOS, else all of them)."""
    if answers.shape[0] == 0:
        return 0
    is_eos = torch.isin(answers, torch.tensor(eos_ids, dtype=answers.dtype))
    length = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, answers.shape[1])
    return int(length.max())


class StaticSampler:
    """Generation over `batch` decode slots, each with a preallocated cache of `max_len`
    prompt + answer tokens; any number of rows per generate() (continuous batching)."""

    def __init__(
        self,
        model: Any,
        batch: int,
        max_len: int,
        compiled: bool | None = None,
        backend: str | Callable = "inductor",
        read_step: int = READ_STEP,
        attention: str | None = None,
    ) -> None:
        """`model`: a loaded transformers causal LM of a supported architecture. `compiled`:
        fuse the decode step's elementwise kernels with torch.compile(backend=`backend`); None:
        on GPUs, unless RLINF_SAMPLER_COMPILE=0. `read_step`: decode attention's read width is
        rounded up to a multiple of it (READ_STEP; max_len: always the whole cache).
        `attention`: one of ATTENTIONS; None: RLINF_DECODE_ATTENTION if set, else the split-KV
        kernel where it runs (a CUDA device with Triton, shapes it supports) and pays (enough
        slots or a cache long enough, decode_attention.kernel_pays), else the grouped product."""
        reason = unsupported_reason(model, max_len)
        if reason is not None:
            raise TwoWorkerError(f"static sampler: {reason}; use rollout.engine=hf")
        self.model: Any = model
        self.batch, self.max_len, self.read_step = batch, max_len, read_step
        cfg = model.config
        self.layers = model.model.layers
        self.fused = fuse_projections(model)
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scale = self.head_dim**-0.5
        p = next(model.parameters())
        shape = (len(self.layers), batch, self.kv_heads, max_len, self.head_dim)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self._make_state(p.device)
        self.stats = RunStats(rows=0, slots=batch, max_len=max_len)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        """One captured decode step per read width, for the sampling settings and EOS set of
        `graph_key`; they share one memory pool (they never run at once)."""
        self.graph_key: tuple | None = None
        self.graph_pool: Any = None
        # A decode step is hundreds of tiny kernels; on GPUs the elementwise pieces are compiled
        # into fused kernels, which the CUDA graph then replays.
        if compiled is None:
            compiled = p.device.type == "cuda" and os.environ.get("RLINF_SAMPLER_COMPILE") != "0"
        self.backend = backend
        self.attention = attention or self._default_attention(p.device)
        if self.attention not in ATTENTIONS:
            raise ValueError(f"decode attention {self.attention!r} is not one of {ATTENTIONS}")
        if self.attention == "split_kv":
            refusal = kernel_refusal(p.device, self.heads, self.kv_heads, self.head_dim)
            if refusal is not None:
                raise TwoWorkerError(
                    f"static sampler: the split_kv decode attention {refusal}; use "
                    "attention='grouped'"
                )
            self.splits = splits_for(batch, self.kv_heads, max_len, p.device)
        self._set_kernels(compiled)

    def _default_attention(self, device: torch.device) -> str:
        """The split-KV kernel where it runs and pays (kernel_pays: enough slots, or a cache
        long enough), unless RLINF_DECODE_ATTENTION names the other; the grouped product
        otherwise."""
        wanted = os.environ.get("RLINF_DECODE_ATTENTION")
        if wanted in ATTENTIONS:
            return wanted
        runs = (
            device.type == "cuda"  # never the interpreter unasked
            and kernel_refusal(device, self.heads, self.kv_heads, self.head_dim) is None
        )
        return (
            "split_kv"
            if runs and kernel_pays(self.batch, self.kv_heads, device, self.max_len)
            else "grouped"
        )

    def _make_state(self, dev: torch.device) -> None:
        """Persistent decode state, one row per slot: a captured graph reads and writes exactly
        these buffers, and a refill writes the rows of the slots it fills."""
        b = self.batch

        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=dev)

        self.valid = torch.zeros(b, self.max_len, dtype=torch.bool, device=dev)
        self.tok, self.pos = longs(b, 1), longs(b, 1)
        self.col = longs(b, 1)  # the cache column of the slot's next key
        self.rows = torch.arange(b, device=dev)  # each slot's row of the cache
        # The slot whose cache holds this slot's prompt columns [0, shared): a GRPO group's
        # first slot for all its answers (the split-KV kernel reads them there), or itself.
        self.source = torch.arange(b, device=dev)
        self.shared = longs(1)
        self.step = longs(b, 1)  # the answer position the slot emits next
        self.done = torch.ones(b, dtype=torch.bool, device=dev)
        self.out = longs(b, self.max_len)
        self.pad, self.eos = longs(), longs(0)
        self.limit = longs()  # max_new: an answer's last position + 1
        self.eos_ids: tuple[int, ...] = ()
        # Tokens already in each row, for the repetition penalty: made on its first use, so the
        # default (no penalty) neither stores nor updates it.
        self.seen: torch.Tensor | None = None

    def _state(self) -> tuple[torch.Tensor, ...]:
        state = (self.tok, self.pos, self.col, self.step, self.done, self.out, self.valid)
        return state if self.seen is None else (*state, self.seen)

    def _set_kernels(self, compiled: bool) -> None:
        self.compiled = compiled
        kernels = compiled_kernels(self.backend) if compiled else EAGER
        if not race_compiled(self.batch, self.model.lm_head.weight.shape[0]):
            kernels = kernels._replace(race=EAGER.race)  # sampling.RACE_COMPILED_FROM
        self.kernels = kernels
        # The split-KV ranges' reduction: fixed shapes, one fused kernel when compiled.
        self.combine = torch.compile(combine, backend=self.backend) if compiled else combine

    def _residual_norm(
        self, kern: Kernels, x: torch.Tensor, delta: torch.Tensor | None, norm: torch.nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is None:
            return x, kern.norm(x, norm.weight, norm.variance_epsilon)
        return kern.add_norm(x, delta, norm.weight, norm.variance_epsilon)

    def _qkv(
        self, kern: Kernels, index: int, h: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [B, H, T, D], k and v [B, KV, T, D] of hidden states h [B, T, hidden]."""
        qkv, dims, norms = self._projection(index, h)
        if norms is None:
            return kern.split_rope(qkv, *rotary, *dims)
        return kern.split_norm_rope(qkv, *rotary, *dims, *norms)  # Qwen3

    def _q_stored(
        self, kern: Kernels, index: int, h: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """A decode step's rotated q [B, H, 1, D]; its k and v written to each slot's cache
        column (self.col) in the same kernel."""
        qkv, dims, norms = self._projection(index, h)
        cache = (self.k[index], self.v[index], self.rows, self.col.view(-1))
        return kern.rope_store(*cache, qkv, *rotary, *dims, *(norms or ()))  # norms: Qwen3

    def _projection(
        self, index: int, h: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[int, int, int], tuple[Any, ...] | None]:
        """The fused q/k/v projection of h, the head counts, and Qwen3's q/k norms (None:
        the family has none)."""
        fused = self.fused[index]
        qkv = F.linear(h, fused.qkv_weight, fused.qkv_bias)
        attn = self.layers[index].self_attn
        dims = (self.heads, self.kv_heads, self.head_dim)
        if getattr(attn, "q_norm", None) is None:
            return qkv, dims, None
        return qkv, dims, (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon)

    def _attention(
        self,
        kern: Kernels,
        index: int,
        h: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        mask: Any,
        slots: torch.Tensor | None,
    ) -> torch.Tensor:
        """A prefill's attention (`slots`: the slots it fills, `mask`: boolean [n, 1, P, P]), or
        a decode step's over every slot (`slots` None, `mask`: its DecodeMask)."""
        b, t, _ = h.shape
        keys, values = self.k[index], self.v[index]
        if slots is not None:
            q, k, v = self._qkv(kern, index, h, rotary)
            # A new prompt attends to itself only: the slot's later columns belong to the
            # answer that left it, and are masked until this row writes them.
            keys[slots, :, :t] = k
            values[slots, :, :t] = v
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads
            )
            out = out.transpose(1, 2).reshape(b, t, -1)
        else:
            # Each slot's key goes to its own column, graph-safe (no host sync).
            q = self._q_stored(kern, index, h, rotary)
            if mask.end is not None:
                args = (self.valid, mask.end, mask.width, self.scale, self.splits, self.combine)
                out = split_kv(q, keys, values, *args, self.source, self.shared)
            else:
                out = grouped_matmul(q, keys, values, mask.bias, self.scale, kern.softmax)
        return self.layers[index].self_attn.o_proj(out)

    def _mlp(self, kern: Kernels, index: int, h: torch.Tensor) -> torch.Tensor:
        mlp, gate_up = self.layers[index].mlp, self.fused[index].gate_up_weight
        if gate_up is None:
            return mlp(h)
        return mlp.down_proj(kern.swiglu(F.linear(h, gate_up)))

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, mask: Any, slots: torch.Tensor | None
    ) -> torch.Tensor:
        """Logits of the last position: a prefill of `slots` (eager kernels: its row count
        changes from one refill to the next) or, `slots` None, a decode step."""
        kern = EAGER if slots is not None else self.kernels
        x = self.model.model.embed_tokens(ids)
        cos, sin = self.model.model.rotary_emb(x, pos)  # once per step, shared by all layers
        rotary = (cos.unsqueeze(1), sin.unsqueeze(1))
        delta = None
        for index, layer in enumerate(self.layers):
            x, h = self._residual_norm(kern, x, delta, layer.input_layernorm)
            delta = self._attention(kern, index, h, rotary, mask, slots)
            x, h = self._residual_norm(kern, x, delta, layer.post_attention_layernorm)
            delta = self._mlp(kern, index, h)
        # The last position as [B, 1, hidden], the layers' rank: a [B, hidden] input would
        # compile the residual norm a second time.
        last = None if delta is None else delta[:, -1:]
        _, h = self._residual_norm(kern, x[:, -1:], last, self.model.model.norm)
        return self.model.lm_head(h[:, 0])

    def generate(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new: int,
        eos_ids: list[int],
        pad_id: int,
        s: SamplingSettings,
    ) -> torch.Tensor:
        """Left-padded prompts [R, P], any number of rows -> answers [R, <= max_new] in the
        same order, padded with pad_id after EOS. The leading columns that are padding in every
        row are dropped first (stats.prompt_columns: the width left), so a short batch padded
        to data.max_prompt_length neither prefills nor reads them; a row's own left padding,
        within that width, stays and is masked out. A failure of Triton in the split-KV kernel
        switches decode attention to the grouped product, a torch.compile failure the kernels
        to eager, each with a warning, and generates again; every other error (out of memory,
        the model's own) propagates."""

        def with_this_attention() -> torch.Tensor:
            return run_or_eager(
                lambda: self._generate(ids, mask, max_new, eos_ids, pad_id, s),
                self.attention == "split_kv",
                self._use_grouped,
                "the split-KV decode attention kernel",
                "decoding with the grouped matrix product",
                failed=_triton_failed,
            )

        return run_or_eager(
            with_this_attention,
            self.compiled,
            self._go_eager,
            "compiled sampler kernels",
            "running them eagerly",
        )

    def _go_eager(self) -> None:
        self._set_kernels(False)
        self.drop_graphs()  # they replay the compiled kernels

    def _use_grouped(self) -> None:
        self.attention = "grouped"
        self.drop_graphs()  # they replay the kernel

    def drop_graphs(self) -> None:
        """Forget every captured decode step: the next step captures again, in a new memory
        pool. The old pool goes with its graphs; PyTorch refuses a capture into a pool whose
        graphs are all gone (an internal assert), so it is never reused."""
        self.graphs, self.graph_key, self.graph_pool = {}, None, None

    @torch.no_grad()
    def _generate(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new: int,
        eos_ids: list[int],
        pad_id: int,
        s: SamplingSettings,
    ) -> torch.Tensor:
        # Prompts arrive left-padded to one width (data.max_prompt_length for a rollout), often
        # far wider than the batch's longest prompt. A column that is padding in every row
        # would still be prefilled and kept in the cache, and every decode step would read it
        # (decode attention reads each slot's columns from 0). No row attends to it and
        # positions count real tokens only, so dropping those columns changes no answer. Only
        # the batch's common padding goes: p stays one width for every wave of this call.
        start = first_prompt_column(mask)
        ids, mask = ids[:, start:], mask[:, start:]
        rows, p = ids.shape
        if p + max_new > self.max_len:
            raise ValueError(
                f"sampler built for {self.max_len} tokens a slot, asked for {p} + {max_new}"
            )
        dev = self.k.device
        ids, mask = ids.to(dev), mask.to(dev).bool()
        self._reset(max_new, eos_ids, pad_id)
        self.stats = RunStats(rows=rows, slots=self.batch, max_len=self.max_len, prompt_columns=p)
        answers = torch.full((rows, max_new), pad_id, dtype=torch.long)
        slots = _Slots(torch.full((self.batch,), -1), torch.zeros(self.batch, dtype=torch.long))
        self._fill(torch.arange(self.batch), slots, ids, mask, s)
        while bool((slots.owner >= 0).any()):
            busy = slots.owner >= 0
            # Look again when the next answer may end: at CHECK_EVERY steps, or sooner when a
            # slot's answer reaches max_new tokens.
            burst = min(CHECK_EVERY, int((max_new - slots.age[busy]).min()))
            # A live slot writes column p + age + k at its k-th step of the burst: every key
            # any live slot reads or writes in it lies below `width`.
            width = self.read_width(p + int(slots.age[busy].max()) + burst)
            for _ in range(burst):
                self._step(s, width)
            slots.age += burst
            self.stats.decode_steps += burst
            self.stats.read_columns += burst * width
            finished = torch.nonzero(busy & self.done.cpu()).flatten()
            answers[slots.owner[finished]] = self.out[finished.to(dev), :max_new].cpu()
            slots.owner[finished] = -1
            self._fill(finished, slots, ids, mask, s)
        return answers[:, : answer_width(answers, eos_ids)]

    def read_width(self, needed: int) -> int:
        """Cache columns a decode step reads when live keys lie below `needed`: rounded up to
        `read_step` (few distinct widths, so few graphs), at most the cache's length."""
        return min(self.max_len, -(-needed // self.read_step) * self.read_step)

    def _reset(self, max_new: int, eos_ids: list[int], pad_id: int) -> None:
        """Every slot idle (done) until a prefill fills it; the run's constants in buffers."""
        self.done.fill_(True)
        self.step.fill_(max_new)  # an idle slot writes its pads to the spare column max_new
        self.col.zero_()
        self.pos.zero_()
        self.valid.zero_()
        self.pad.fill_(pad_id)
        self.limit.fill_(max_new)
        self.source.copy_(self.rows)
        if self.eos_ids != tuple(eos_ids):  # a new tensor: a captured graph must be redone
            self.eos_ids = tuple(eos_ids)
            self.eos = torch.tensor(eos_ids, dtype=torch.long, device=self.k.device)

    def _fill(
        self,
        free: torch.Tensor,
        slots: _Slots,
        ids: torch.Tensor,
        mask: torch.Tensor,
        s: SamplingSettings,
    ) -> None:
        """The next waiting rows into the `free` slots; slots left without a row stay idle.
        Each distinct prompt among those rows is forwarded once (in prefills of at most
        PREFILL_TOKENS tokens) and its keys and values copied into the slots of the rows that
        repeat it: a GRPO group's answers share one prefill."""
        first = slots.next_row
        take = free[: ids.shape[0] - first]
        if len(take):
            rows = slice(first, first + len(take))
            self._prefill(take.to(self.k.device), ids[rows], mask[rows], s)
        slots.owner[take] = torch.arange(first, first + len(take))
        slots.age[take] = 0
        slots.next_row += len(take)
        if first > 0:
            self.stats.refilled_rows += len(take)

    def _prefill(
        self, slots: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, s: SamplingSettings
    ) -> None:
        """Prompts [n, P] into the decode slots `slots` [n]: their keys and values at cache
        columns 0..P-1 and their first answer token; every per-slot buffer reset in place
        (outside any graph, into the buffers the captured step reads)."""
        p = ids.shape[1]
        # Rows equal in tokens and mask share one forward: `first[u]` is the first row of
        # distinct prompt u, `inverse[i]` the distinct prompt of row i.
        _, inverse = torch.unique(torch.cat([ids, mask.long()], 1), dim=0, return_inverse=True)
        seen_at: dict[int, int] = {}
        for row, u in enumerate(inverse.tolist()):
            seen_at.setdefault(u, row)
        first = torch.tensor(sorted(seen_at.values()), device=ids.device)
        source = torch.tensor([seen_at[u] for u in inverse.tolist()], device=ids.device)
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = torch.empty(0)
        chunk = prefill_rows(p)
        for begin in range(0, len(first), chunk):
            part = first[begin : begin + chunk]
            out = self._prompt_forward(slots[part], ids[part], mask[part], pos[part])
            logits = out if begin == 0 else torch.cat([logits, out])
        # Row i's logits are those of its prompt's first row; its keys and values a copy.
        row_of_first = torch.full((len(ids),), -1, dtype=torch.long, device=ids.device)
        row_of_first[first] = torch.arange(len(first), device=ids.device)
        logit_row = row_of_first[source]
        copies = source != torch.arange(len(ids), device=ids.device)
        if bool(copies.any()):
            into, frm = slots[copies], slots[source[copies]]
            for cache in (self.k, self.v):
                for layer in cache:  # one layer at a time: no cache-sized temporary
                    layer[into, :, :p] = layer[frm, :, :p]
        # Every slot also holds its own copy, so a slot whose source is refilled now reads its
        # own columns again; the filled slots read their prompt's first slot.
        orphans = torch.isin(self.source, slots)
        self.source[orphans] = self.rows[orphans]
        self.source[slots] = slots[source]
        self.shared.fill_(p)
        if s.repetition_penalty != 1.0:
            self._seed_seen(slots, ids, mask)
        for begin in range(0, len(ids), chunk):  # the picks' working copies: a chunk's rows
            cut = slice(begin, begin + chunk)
            picked = self._pick(logits[logit_row[cut]], s, slots[cut])
            self.tok[slots[cut]] = picked.unsqueeze(1)
        self.valid[slots] = False
        self.valid[slots, :p] = mask
        self.pos[slots] = pos[:, -1:] + 1
        self.col[slots] = p
        self.step[slots] = 0
        self.done[slots] = False
        self.out[slots] = self.pad
        self.stats.prefill_rows += len(first)

    def _prompt_forward(
        self, slots: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        """One prefill forward of prompts [n, P] (positions `pos`, padding excluded) into
        `slots`: their keys and values written, the last position's logits returned."""
        # Rows that are all padding in their first columns still need one visible key.
        attn_mask = causal_self_mask(mask)
        self.stats.prefills += 1
        return self._forward(ids, pos, attn_mask, slots)

    def _seed_seen(self, slots: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """The repetition penalty's presence rows of `slots`, from their real (unpadded)
        prompt tokens."""
        if self.seen is None:  # made once: a captured graph holds its address
            vocab = self.model.lm_head.weight.shape[0]
            self.seen = torch.zeros(self.batch, vocab, dtype=torch.bool, device=ids.device)
        self.seen[slots] = False
        rows = slots.unsqueeze(1).expand_as(ids)
        self.seen[rows[mask], ids[mask]] = True

    def _pick(
        self, logits: torch.Tensor, s: SamplingSettings, slots: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The next token of each slot (`slots` None: all of them); under a repetition
        penalty, the penalty first and the picked tokens marked seen (graph-safe for all
        slots: fixed shapes, no host sync). A decode step samples with the step's kernels (one
        fused pass over the logits when compiled), a prefill eagerly (its row count varies)."""
        race = (EAGER if slots is not None else self.kernels).race
        if s.repetition_penalty == 1.0:
            return pick_tokens(logits, s, race)
        assert self.seen is not None, "_seed_seen runs before the first pick"
        seen = self.seen if slots is None else self.seen[slots]
        tokens = pick_tokens(penalize_repeats(logits, seen, s.repetition_penalty), s, race)
        if slots is None:
            self.seen.scatter_(1, tokens.unsqueeze(1), True)
        else:
            self.seen[slots, tokens] = True
        return tokens

    def _step_eager(self, s: SamplingSettings, width: int) -> None:
        tok = torch.where(self.done.unsqueeze(1), self.pad, self.tok)
        self.out.scatter_(1, self.step, tok)
        # An answer ends at EOS or with its max_new-th token. A comparison with every EOS id,
        # not torch.isin: isin sorts (a host sync) when there are many ids.
        self.done |= (tok == self.eos).any(-1) | (self.step[:, 0] + 1 >= self.limit)
        self.valid.scatter_(1, self.col, True)
        if self.attention == "split_kv":
            # A slot reads up to its newest key (the host's width bounds every live one).
            mask = DecodeMask(width, end=(self.col.view(-1) + 1).clamp(max=width))
        else:
            valid = self.valid[:, :width]
            bias = torch.zeros(valid.shape, device=valid.device).masked_fill(~valid, -math.inf)
            mask = DecodeMask(width, bias=bias[:, None, None, :])
        logits = self._forward(tok, self.pos, mask, None)
        self.tok.copy_(self._pick(logits, s).unsqueeze(1))
        # A finished slot steps on until it is refilled, rewriting its last column (so it
        # never passes the read width the host bounds by the live slots), its position at most
        # the last cache column, its answer position at the spare column max_new: all in
        # bounds, and nothing a live row reads.
        self.pos.add_(1).clamp_(max=self.max_len - 1)
        self.col.add_((~self.done).long().unsqueeze(1)).clamp_(max=self.max_len - 1)
        torch.minimum(self.step + 1, self.limit, out=self.step)

    def _step(self, s: SamplingSettings, width: int) -> None:
        if self.k.device.type != "cuda":
            self._step_eager(s, width)
            return
        key = (s, self.eos_ids)
        if self.graph_key != key:  # new settings or EOS set: every graph captured again
            self.graphs, self.graph_key = {}, key
            self.graph_pool = torch.cuda.graph_pool_handle()
        graph = self.graphs.get(width)
        if graph is None:
            self._capture(s, width)
            return  # the capture ran this step
        graph.replay()

    def _capture(self, s: SamplingSettings, width: int) -> None:
        # Warm up on a side stream (allocator and kernels), then capture one step. The step
        # reads and writes only persistent buffers, so replays advance the state, and every
        # tensor it makes inside the graph is dead at its end: the graphs can share one pool.
        snapshot = [buf.clone() for buf in self._state()]
        stream = _side_stream(self.k.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._step_eager(s, width)
        torch.cuda.current_stream().wait_stream(stream)
        for buf, saved in zip(self._state(), snapshot):
            buf.copy_(saved)
        graph = self.graphs[width] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            self._step_eager(s, width)
        for buf, saved in zip(self._state(), snapshot):
            buf.copy_(saved)
        graph.replay()


def _triton_failed(exc: BaseException) -> bool:
    """Whether `exc` is Triton's own (compiling or launching a program: the split-KV kernel's
    errors), not torch.compile's, which wraps what it meets."""
    return (type(exc).__module__ or "").startswith("triton")


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every capture warms up on: cuBLAS keeps a workspace per stream it ran
    on, so a new stream per capture (each step, when the memory is given back between steps)
    would leave 32 MiB more behind each time."""
    return torch.cuda.Stream(device)


class StaticEngine:
    """The `static` engine of the rollout engine interface. It takes every row of a rollout
    (continuous batching) and decodes them in min(rows, `max_batch_size`, what fits) slots;
    one StaticSampler per (slots wanted, length), built on first use (its KV cache and CUDA
    graph are kept for the next step)."""

    name = "static"
    fixed_prompt_width = True  # one prompt width: the samplers' shapes (and graphs) repeat
    continuous = True

    def __init__(
        self,
        model: Any,
        max_batch_size: int | None = None,
        memory_budget_bytes: int | None = None,
        where: str = "rollout component",
    ) -> None:
        """`max_batch_size`: most decode slots (rollout.max_batch_size; None: one per row).
        `memory_budget_bytes`: most bytes for the slots' KV caches and decode buffers (None:
        the free memory alone bounds them on a GPU). `where` names the component in errors."""
        self.model = model
        self.max_batch_size = max_batch_size
        self.memory_budget_bytes = memory_budget_bytes
        self.where = where
        self.samplers: dict[tuple[int, int], StaticSampler] = {}
        self.last: StaticSampler | None = None

    def generate(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new: int,
        eos_ids: list[int],
        pad_id: int,
        settings: SamplingSettings,
    ) -> torch.Tensor:
        rows, width = ids.shape
        self.last = self.sampler_for(rows, width, width + max_new)
        return self.last.generate(ids, mask, max_new, eos_ids, pad_id, settings)

    @property
    def last_run(self) -> RunStats | None:
        """What the last generate() did: rows, slots, prompt columns, prefills, refills, decode
        steps."""
        return None if self.last is None else self.last.stats

    def sampler_for(self, rows: int, width: int, max_len: int) -> StaticSampler:
        wanted = min(rows, self.max_batch_size or rows)
        key = (wanted, max_len)
        if key not in self.samplers:
            slots = self.slots_for(wanted, width, max_len)
            sampler = self.samplers[key] = StaticSampler(self.model, slots, max_len)
            ranges = f", {sampler.splits} ranges a slot" if sampler.attention == "split_kv" else ""
            logger.info(
                f"{self.where}: a sampler of {slots} slots x {max_len} cache columns, decode "
                f"attention {sampler.attention}{ranges}"
            )
        return self.samplers[key]

    def slots_for(self, wanted: int, width: int, max_len: int) -> int:
        """min(`wanted`, what fits): on a GPU its free memory counts, with the blocks PyTorch's
        allocator holds free (this process reuses them); the memory budget anywhere."""
        param = next(self.model.parameters())
        free, device = None, str(param.device)
        if param.device.type == "cuda":
            idle = torch.cuda.memory_reserved(param.device) - torch.cuda.memory_allocated(
                param.device
            )
            free = torch.cuda.mem_get_info(param.device)[0] + idle
            device = f"GPU {param.device} ({torch.cuda.get_device_name(param.device)})"
        cfg, dtype, budget = self.model.config, param.dtype, self.memory_budget_bytes
        return slots_that_fit(cfg, max_len, width, dtype, wanted, free, budget, self.where, device)

    def weights_loaded(self) -> None:
        """The sync writes into the parameters, which the fused projections alias; re-fuse
        should anything have rebound them (idempotent when nothing did)."""
        fuse_projections(self.model)

    def release_memory(self) -> None:
        """Drop every sampler (their KV caches, decode state and captured graphs): the next
        generate() builds its sampler again, sized to the memory free then, and captures its
        graph again (the compiled kernels are kept)."""
        self.samplers.clear()
        self.last = None

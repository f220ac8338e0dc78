"""The `static` rollout engine: a static-KV-cache sampler for Qwen2/Qwen3/Llama-family models,
with CUDA-graph decode on GPUs.

`transformers`' `generate` is bound by Python and kernel-launch overhead at RL batch sizes. This
sampler reuses the loaded model's own weights and rotary embedding but runs its own loop: the KV
cache is preallocated for prompt + answer, every decode step has the same shapes, and on CUDA one
decode step (token bookkeeping included) is captured once as a CUDA graph and replayed. A decode
step is small-batch and bound by reading the weights, so it is built from few kernels: the q/k/v
and gate/up projections run as one GEMM each (`fuse_projections`), decode attention reads the
grouped KV cache in place (no per-head copies) and on GPUs the elementwise pieces (residual +
RMSNorm, rotary, masked softmax, SwiGLU) are fused by `torch.compile`. Sampling (temperature,
top-k, top-p, and HF's repetition penalty) stays on the GPU. Exactness: greedy decoding gives
the same tokens as `generate`, with or without a repetition penalty, and sampling draws from
softmax(logits / T) at every step (both tested). Qwen3's per-head RMSNorm of q and k runs
before the rotary embedding, and its head_dim need not be hidden_size / heads. Attention is full
attention: a model whose config slides a window shorter than the sequence is refused
(`unsupported_reason`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rlinf_twoworker.engines.models import run_or_eager
from rlinf_twoworker.engines.sampling import SamplingSettings
from rlinf_twoworker.errors import TwoWorkerError

SUPPORTED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")
QWEN_WINDOWS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
"""Architectures that slide a window only with use_sliding_window, from max_window_layers on."""


def sliding_window(model: Any) -> int | None:
    """The attention window the model's own forward applies in some layer (None: none). Mistral
    slides in every layer when `sliding_window` is set; Qwen2 and Qwen3 only with
    `use_sliding_window`, in the layers from `max_window_layers` on (or as their `layer_types`
    list says)."""
    cfg = model.config
    window: int | None = getattr(cfg, "sliding_window", None)
    if window is None or type(model).__name__ not in QWEN_WINDOWS:
        return window
    if not getattr(cfg, "use_sliding_window", False):
        return None
    layer_types = getattr(cfg, "layer_types", None) or [
        "sliding_attention" if i >= cfg.max_window_layers else "full_attention"
        for i in range(cfg.num_hidden_layers)
    ]
    return window if "sliding_attention" in layer_types else None


def unsupported_reason(model: Any, max_len: int) -> str | None:
    """Why the static sampler cannot run `model` over `max_len` tokens (prompt + answer), or
    None when it can."""
    name = type(model).__name__
    if name not in SUPPORTED:
        return f"{name} is not one of the static sampler's architectures {SUPPORTED}"
    window = sliding_window(model)
    if window is not None and window < max_len:
        # The sampler attends over the whole cache; the model would not, past the window.
        return (
            f"{name} attends through a sliding window of {window} tokens (config sliding_window), "
            f"shorter than the {max_len} prompt + answer tokens, and the static sampler "
            "implements full attention only"
        )
    return None


def supports(model: Any, max_len: int) -> bool:
    return unsupported_reason(model, max_len) is None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The arithmetic of the Qwen2/Llama RMSNorm modules, as one function (fusable)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: (x + delta, norm(x + delta)), one fused kernel when compiled."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def split_rope(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused q/k/v projection output [B, T, (H + 2 KV) D] -> rotated q [B, H, T, D], k, v."""
    b, t, _ = qkv.shape
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = q.view(b, t, heads, dim).transpose(1, 2)
    k = k.view(b, t, kv_heads, dim).transpose(1, 2)
    v = v.view(b, t, kv_heads, dim).transpose(1, 2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def split_norm_rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    dim: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """split_rope with Qwen3's per-head RMSNorm of q and k (over head_dim) before the rotary."""
    b, t, _ = qkv.shape
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = rms_norm(q.view(b, t, heads, dim), q_weight, eps).transpose(1, 2)
    k = rms_norm(k.view(b, t, kv_heads, dim), k_weight, eps).transpose(1, 2)
    v = v.view(b, t, kv_heads, dim).transpose(1, 2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def masked_softmax(scores: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention probabilities in float32 (as transformers' eager attention), cast back."""
    return (scores.float() * scale + bias).softmax(-1).to(scores.dtype)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _fuse(parts: list[torch.Tensor]) -> torch.Tensor:
    """One tensor holding the parameters back to back, the parameters rebound as views of it:
    in-place updates of a parameter (weight sync, load_state_dict) write straight into the
    fused tensor, and no weight is stored twice."""
    fused = torch.cat([p.detach() for p in parts])
    offset = 0
    for part in parts:
        part.data = fused[offset : offset + part.shape[0]]
        offset += part.shape[0]
    return fused


@dataclass
class FusedLayer:
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor | None  # None: not a gate/up SiLU MLP, call the module


def fuse_projections(model: Any) -> list[FusedLayer]:
    """Fused q/k/v (and gate/up) projection weights of every decoder layer of a transformers
    Qwen2/Llama/Mistral model; idempotent."""
    done: list[FusedLayer] | None = getattr(model, "_rlinf_fused_projections", None)
    if done is not None and all(
        f.qkv_weight.data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
        for f, layer in zip(done, model.model.layers)
    ):
        return done
    silu = getattr(model.config, "hidden_act", "silu") == "silu"
    fused = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        biases = [lin.bias for lin in qkv]
        gate_up = None
        if silu and getattr(mlp.gate_proj, "bias", None) is None:
            gate_up = _fuse([mlp.gate_proj.weight, mlp.up_proj.weight])
        fused.append(
            FusedLayer(
                _fuse([lin.weight for lin in qkv]),
                None if any(b is None for b in biases) else _fuse(biases),
                gate_up,
            )
        )
    model._rlinf_fused_projections = fused
    return fused


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor on [B, V] logits, in float32 as HF computes it;
    `seen`: [B, V] bool, the tokens already in each row."""
    logits = logits.float()
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def pick_tokens(logits: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    """Next token per row from [B, V] logits (greedy, or sampled after top-k / top-p)."""
    if not s.do_sample:
        return logits.argmax(-1)
    logits = logits.float() / s.temperature
    if s.top_k is not None:
        kth = logits.topk(s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1 - s.top_p
        drop_sorted[:, -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    # Exponential race (Gumbel-max in another form): argmax(p / E) = argmax(log p - log E) ~
    # Categorical(p), and log p differs from the logits by a per-row constant, so no softmax
    # over the vocabulary is needed. Graph-safe, unlike torch.multinomial's host-side checks.
    noise = torch.empty_like(logits).exponential_(1).log_()
    return (logits - noise).argmax(-1)


class StaticSampler:
    """Batched generation with a preallocated cache; one instance per (batch, length) shape."""

    def __init__(
        self,
        model: Any,
        batch: int,
        max_len: int,
        compiled: bool | None = None,
        backend: str | Callable = "inductor",
    ) -> None:
        """`model`: a loaded transformers causal LM of a supported architecture. `compiled`:
        fuse the elementwise kernels with torch.compile(backend=`backend`); None: on GPUs,
        unless RLINF_SAMPLER_COMPILE=0."""
        reason = unsupported_reason(model, max_len)
        if reason is not None:
            raise TwoWorkerError(f"static sampler: {reason}; use rollout.engine=hf")
        self.model: Any = model
        self.batch, self.max_len = batch, max_len
        cfg = model.config
        self.layers = model.model.layers
        self.fused = fuse_projections(model)
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scale = self.head_dim**-0.5
        p = next(model.parameters())
        dev = p.device
        shape = (len(self.layers), batch, self.kv_heads, max_len, self.head_dim)
        self.k = torch.zeros(shape, dtype=p.dtype, device=dev)
        self.v = torch.zeros(shape, dtype=p.dtype, device=dev)
        # Persistent decode state: a captured graph reads and writes exactly these buffers.
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=dev)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.col = torch.zeros(1, dtype=torch.long, device=dev)
        self.step = torch.zeros(1, dtype=torch.long, device=dev)
        self.done = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.out = torch.zeros(batch, max_len, dtype=torch.long, device=dev)
        self.pad = torch.zeros((), dtype=torch.long, device=dev)
        self.eos = torch.zeros(0, dtype=torch.long, device=dev)
        self.eos_ids: tuple[int, ...] = ()
        # Tokens already in each row, for the repetition penalty: made on its first use, so the
        # default (no penalty) neither stores nor updates it.
        self.seen: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_key: tuple | None = None
        # A decode step is hundreds of tiny kernels; on GPUs the elementwise pieces are compiled
        # into fused kernels, which the CUDA graph then replays.
        if compiled is None:
            compiled = dev.type == "cuda" and os.environ.get("RLINF_SAMPLER_COMPILE") != "0"
        self.backend = backend
        self._set_kernels(compiled)

    def _state(self) -> tuple[torch.Tensor, ...]:
        state = (self.tok, self.pos, self.col, self.step, self.done, self.out, self.valid)
        return state if self.seen is None else (*state, self.seen)

    def _set_kernels(self, compiled: bool) -> None:
        self.compiled = compiled
        kernels: tuple[Callable, ...] = (
            rms_norm,
            add_rms_norm,
            split_rope,
            split_norm_rope,
            masked_softmax,
            swiglu,
        )
        if compiled:
            kernels = tuple(torch.compile(k, dynamic=False, backend=self.backend) for k in kernels)
        self.norm, self.add_norm, self.split_rope, self.split_norm_rope = kernels[:4]
        self.softmax, self.swiglu = kernels[4:]

    def _residual_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, norm: torch.nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is None:
            return x, self.norm(x, norm.weight, norm.variance_epsilon)
        return self.add_norm(x, delta, norm.weight, norm.variance_epsilon)

    def _attention(
        self,
        index: int,
        h: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        cols: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of tokens at cache columns `cols` ([T]). `mask`: a prefill's boolean
        [B,1,T,S] mask, or a decode step's additive [B,1,1,S] bias (0 or -inf per key)."""
        fused = self.fused[index]
        b, t, _ = h.shape
        qkv = F.linear(h, fused.qkv_weight, fused.qkv_bias)
        attn = self.layers[index].self_attn
        if getattr(attn, "q_norm", None) is not None:  # Qwen3
            q, k, v = self.split_norm_rope(
                qkv,
                *rotary,
                self.heads,
                self.kv_heads,
                self.head_dim,
                attn.q_norm.weight,
                attn.k_norm.weight,
                attn.q_norm.variance_epsilon,
            )
        else:
            q, k, v = self.split_rope(qkv, *rotary, self.heads, self.kv_heads, self.head_dim)
        keys, values = self.k[index], self.v[index]
        keys.index_copy_(2, cols, k)
        values.index_copy_(2, cols, v)
        if mask.dtype == torch.bool:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, enable_gqa=self.kv_heads != self.heads
            )
            out = out.transpose(1, 2).reshape(b, t, -1)
        else:
            # One query per row: group the query heads of each KV head, so the cache is read
            # where it lies instead of being repeated per query head.
            q = q.reshape(b, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
            probs = self.softmax(q @ keys.transpose(-1, -2), mask, self.scale)
            out = (probs @ values).reshape(b, 1, -1)
        return self.layers[index].self_attn.o_proj(out)

    def _mlp(self, index: int, h: torch.Tensor) -> torch.Tensor:
        mlp, gate_up = self.layers[index].mlp, self.fused[index].gate_up_weight
        if gate_up is None:
            return mlp(h)
        return mlp.down_proj(self.swiglu(F.linear(h, gate_up)))

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        x = self.model.model.embed_tokens(ids)
        cos, sin = self.model.model.rotary_emb(x, pos)  # once per step, shared by all layers
        rotary = (cos.unsqueeze(1), sin.unsqueeze(1))
        delta = None
        for index, layer in enumerate(self.layers):
            x, h = self._residual_norm(x, delta, layer.input_layernorm)
            delta = self._attention(index, h, rotary, cols, mask)
            x, h = self._residual_norm(x, delta, layer.post_attention_layernorm)
            delta = self._mlp(index, h)
        last = None if delta is None else delta[:, -1]
        _, h = self._residual_norm(x[:, -1], last, self.model.model.norm)
        return self.model.lm_head(h)

    def generate(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new: int,
        eos_ids: list[int],
        pad_id: int,
        s: SamplingSettings,
    ) -> torch.Tensor:
        """Left-padded prompts [B, P] -> answers [B, <= max_new], padded with pad_id after EOS.
        A torch.compile failure switches the kernels to eager with a warning and generates
        again; every other error (out of memory, the model's own) propagates."""
        return run_or_eager(
            lambda: self._generate(ids, mask, max_new, eos_ids, pad_id, s),
            self.compiled,
            self._go_eager,
            "compiled sampler kernels",
            "running them eagerly",
        )

    def _go_eager(self) -> None:
        self._set_kernels(False)
        self.graph = None  # it replays the compiled kernels

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
        b, p = ids.shape
        if b != self.batch or p + max_new > self.max_len:
            raise ValueError(
                f"sampler built for batch {self.batch} and {self.max_len} tokens, "
                f"asked for batch {b} with {p} + {max_new} tokens"
            )
        dev = self.k.device
        ids, mask = ids.to(dev), mask.to(dev).bool()
        self.valid.zero_()
        self.valid[:, :p] = mask
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(p, self.max_len, dtype=torch.bool, device=dev).tril()
        prefill_mask = (causal.unsqueeze(0) & self.valid.unsqueeze(1)).unsqueeze(1)
        # Rows that are all padding in their first columns still need one visible key.
        prefill_mask[..., :p] |= torch.eye(p, self.max_len, dtype=torch.bool, device=dev)[:, :p]
        if s.repetition_penalty != 1.0:
            self._seed_seen(ids, mask)
        logits = self._forward(ids, pos, torch.arange(p, device=dev), prefill_mask)
        self.tok.copy_(self._pick(logits, s).unsqueeze(1))
        self.pos.copy_(pos[:, -1:] + 1)
        self.col.fill_(p)
        self.step.zero_()
        self.done.zero_()
        self.pad.fill_(pad_id)
        if self.eos_ids != tuple(eos_ids):  # a new tensor: a captured graph must be redone
            self.eos_ids = tuple(eos_ids)
            self.eos = torch.tensor(eos_ids, dtype=torch.long, device=dev)
        steps = max_new
        for step in range(max_new):
            # Emits the current token (pad once a row is done) and decodes the next; the last
            # decode fills cache column p + max_new - 1, inside the cache.
            self._step(s)
            if step % 16 == 15 and step < max_new - 1 and bool(self.done.all()):
                steps = step + 1
                break
        return self.out[:, :steps].cpu()

    def _seed_seen(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """The repetition penalty's [B, V] presence mask, from the real (unpadded) prompt tokens."""
        if self.seen is None:  # made once: a captured graph holds its address
            vocab = self.model.lm_head.weight.shape[0]
            self.seen = torch.zeros(self.batch, vocab, dtype=torch.bool, device=ids.device)
        self.seen.zero_()
        rows = torch.arange(self.batch, device=ids.device).unsqueeze(1).expand_as(ids)
        self.seen[rows[mask], ids[mask]] = True

    def _pick(self, logits: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
        """The next token per row; under a repetition penalty, the penalty first and the
        picked tokens marked seen (graph-safe: fixed shapes, no host sync)."""
        if s.repetition_penalty == 1.0:
            return pick_tokens(logits, s)
        assert self.seen is not None, "_seed_seen runs before the first pick"
        tokens = pick_tokens(penalize_repeats(logits, self.seen, s.repetition_penalty), s)
        self.seen.scatter_(1, tokens.unsqueeze(1), True)
        return tokens

    def _step_eager(self, s: SamplingSettings) -> None:
        tok = torch.where(self.done.unsqueeze(1), self.pad, self.tok)
        self.out.index_copy_(1, self.step, tok)
        self.done |= torch.isin(tok[:, 0], self.eos)
        self.valid.index_fill_(1, self.col, True)
        bias = torch.zeros(self.valid.shape, device=self.valid.device).masked_fill(
            ~self.valid, float("-inf")
        )
        logits = self._forward(tok, self.pos, self.col, bias[:, None, None, :])
        self.tok.copy_(self._pick(logits, s).unsqueeze(1))
        self.pos.add_(1)
        self.col.add_(1)
        self.step.add_(1)

    def _step(self, s: SamplingSettings) -> None:
        if self.k.device.type != "cuda":
            self._step_eager(s)
            return
        key = (s, self.eos_ids)
        if self.graph is None or self.graph_key != key:
            self._capture(s, key)
            return  # the capture ran this step
        self.graph.replay()

    def _capture(self, s: SamplingSettings, key: tuple) -> None:
        # Warm up on a side stream (allocator and kernels), then capture one step. The step
        # reads and writes only persistent buffers, so replays advance the state.
        snapshot = [buf.clone() for buf in self._state()]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._step_eager(s)
        torch.cuda.current_stream().wait_stream(stream)
        for buf, saved in zip(self._state(), snapshot):
            buf.copy_(saved)
        self.graph, self.graph_key = torch.cuda.CUDAGraph(), key
        with torch.cuda.graph(self.graph):
            self._step_eager(s)
        for buf, saved in zip(self._state(), snapshot):
            buf.copy_(saved)
        self.graph.replay()


class StaticEngine:
    """The `static` engine of the rollout engine interface: one StaticSampler per (batch,
    length) shape, built on first use (its KV cache and CUDA graph are kept for the next step)."""

    name = "static"
    fixed_prompt_width = True  # one prompt width: the samplers' shapes (and graphs) repeat

    def __init__(self, model: Any) -> None:
        self.model = model
        self.samplers: dict[tuple[int, int], StaticSampler] = {}

    def generate(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new: int,
        eos_ids: list[int],
        pad_id: int,
        settings: SamplingSettings,
    ) -> torch.Tensor:
        shape = (ids.shape[0], ids.shape[1] + max_new)
        if shape not in self.samplers:
            self.samplers[shape] = StaticSampler(self.model, *shape)
        return self.samplers[shape].generate(ids, mask, max_new, eos_ids, pad_id, settings)

    def weights_loaded(self) -> None:
        """The sync writes into the parameters, which the fused projections alias; re-fuse
        should anything have rebound them (idempotent when nothing did)."""
        fuse_projections(self.model)

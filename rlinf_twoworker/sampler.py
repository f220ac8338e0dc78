"""A static-KV-cache sampler for Qwen2/Llama-family models, with CUDA-graph decode on GPUs.

`transformers`' `generate` is bound by Python and kernel-launch overhead at RL batch sizes. This
sampler reuses the loaded model's own modules (projections, norms, MLPs, rotary embedding) but
runs its own loop: the KV cache is preallocated for prompt + answer, every decode step has the
same shapes, and on CUDA one decode step is captured once as a CUDA graph and replayed. Sampling
(temperature, top-k, top-p) stays on the GPU. Exactness: greedy decoding gives the same tokens
as `generate` (tested), sampling draws from the same filtered distribution.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED = ("Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")


def supports(model: torch.nn.Module) -> bool:
    return type(model).__name__ in SUPPORTED


@dataclass
class SamplingSettings:
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The arithmetic of the Qwen2/Llama RMSNorm modules, as one function (fusable)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


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
    probs = logits.softmax(-1)
    # Exponential race (Gumbel-max in another form): argmax(p / E) ~ Categorical(p); it is
    # graph-safe, unlike torch.multinomial's host-side checks.
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(-1)


class StaticSampler:
    """Batched generation with a preallocated cache; one instance per (batch, length) shape."""

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int) -> None:
        self.model, self.batch, self.max_len = model, batch, max_len
        cfg = model.config
        self.layers = model.model.layers
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        p = next(model.parameters())
        shape = (len(self.layers), batch, self.kv_heads, max_len, self.head_dim)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=p.device)
        # Persistent decode state: a captured graph reads and writes exactly these buffers.
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=p.device)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=p.device)
        self.col = torch.zeros(1, dtype=torch.long, device=p.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_settings: SamplingSettings | None = None
        self.silu_mlp = getattr(cfg, "hidden_act", "silu") == "silu"
        # A decode step is a thousand tiny kernels; on GPUs the elementwise pieces (norms,
        # rotary, SwiGLU) are compiled into fused kernels, which the CUDA graph then replays.
        self.compiled = p.device.type == "cuda" and os.environ.get("RLINF_SAMPLER_COMPILE") != "0"
        self._set_kernels(self.compiled)

    def _set_kernels(self, compiled: bool) -> None:
        self.compiled = compiled
        wrap = (lambda f: torch.compile(f, dynamic=False)) if compiled else (lambda f: f)
        self.norm, self.rope, self.swiglu = wrap(rms_norm), wrap(rope), wrap(swiglu)

    def _attend(
        self,
        layer: torch.nn.Module,
        index: int,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        cols: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """One attention block for tokens at cache columns `cols` ([T]); mask [B,1,T,S]."""
        attn = layer.self_attn
        b, t, _ = x.shape
        norm = layer.input_layernorm
        h = self.norm(x, norm.weight, norm.variance_epsilon)
        q = attn.q_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, k, *rotary)
        self.k[index].index_copy_(2, cols, k)
        self.v[index].index_copy_(2, cols, v)
        out = F.scaled_dot_product_attention(
            q, self.k[index], self.v[index], attn_mask=mask, enable_gqa=self.kv_heads != self.heads
        )
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        norm = layer.post_attention_layernorm
        h = self.norm(x, norm.weight, norm.variance_epsilon)
        mlp = layer.mlp
        if not self.silu_mlp:
            return x + mlp(h)
        return x + mlp.down_proj(self.swiglu(mlp.gate_proj(h), mlp.up_proj(h)))

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        x = self.model.model.embed_tokens(ids)
        cos, sin = self.model.model.rotary_emb(x, pos)  # once per step, shared by all layers
        rotary = (cos.unsqueeze(1), sin.unsqueeze(1))
        for index, layer in enumerate(self.layers):
            x = self._attend(layer, index, x, rotary, cols, mask)
        return self.model.lm_head(self.model.model.norm(x[:, -1]))

    def generate(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new: int,
        eos_ids: list[int],
        pad_id: int,
        s: SamplingSettings,
    ) -> torch.Tensor:
        """Left-padded prompts [B, P] -> answers [B, <= max_new], padded with pad_id after EOS."""
        try:
            return self._generate(ids, mask, max_new, eos_ids, pad_id, s)
        except Exception as exc:  # a compiler problem must not stop training: go eager
            if not self.compiled or isinstance(exc, ValueError):
                raise
            warnings.warn(
                f"compiled sampler kernels failed ({type(exc).__name__}: {exc}); "
                "running them eagerly",
                stacklevel=2,
            )
            self._set_kernels(False)
            self.graph = None
            return self._generate(ids, mask, max_new, eos_ids, pad_id, s)

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
        """Left-padded prompts [B, P] -> answers [B, <= max_new], padded with pad_id after EOS."""
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
        logits = self._forward(ids, pos, torch.arange(p, device=dev), prefill_mask)
        self.tok.copy_(pick_tokens(logits, s).unsqueeze(1))
        self.pos.copy_(pos[:, -1:] + 1)
        self.col.fill_(p)
        eos = torch.tensor(eos_ids, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        out = torch.full((b, max_new), pad_id, dtype=torch.long, device=dev)
        steps = 0
        for step in range(max_new):
            tok = torch.where(done.unsqueeze(1), torch.full_like(self.tok, pad_id), self.tok)
            out[:, step] = tok[:, 0]
            done |= torch.isin(tok[:, 0], eos)
            steps = step + 1
            if step == max_new - 1 or (step % 16 == 15 and bool(done.all())):
                break
            self.tok.copy_(tok)
            self._decode(s)
        return out[:, :steps].cpu()

    def _decode_eager(self, s: SamplingSettings) -> None:
        self.valid.index_fill_(1, self.col, True)
        mask = self.valid[:, None, None, :]
        logits = self._forward(self.tok, self.pos, self.col, mask)
        self.tok.copy_(pick_tokens(logits, s).unsqueeze(1))
        self.pos.add_(1)
        self.col.add_(1)

    def _decode(self, s: SamplingSettings) -> None:
        if self.k.device.type != "cuda":
            self._decode_eager(s)
            return
        if self.graph is None or self.graph_settings != s:
            self._capture(s)
            return  # the capture ran this step
        self.graph.replay()

    def _capture(self, s: SamplingSettings) -> None:
        # Warm up on a side stream (allocator and kernels), then capture one decode step. The
        # step reads and writes only persistent buffers, so replays advance the state.
        snapshot = (self.tok.clone(), self.pos.clone(), self.col.clone(), self.valid.clone())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._decode_eager(s)
        torch.cuda.current_stream().wait_stream(stream)
        for buf, saved in zip((self.tok, self.pos, self.col, self.valid), snapshot):
            buf.copy_(saved)
        self.graph, self.graph_settings = torch.cuda.CUDAGraph(), s
        with torch.cuda.graph(self.graph):
            self._decode_eager(s)
        for buf, saved in zip((self.tok, self.pos, self.col, self.valid), snapshot):
            buf.copy_(saved)
        self.graph.replay()

"""The static engine's arithmetic, as plain functions of tensors: the decoder's elementwise
pieces (fusable by `torch.compile`), the fused q/k/v and gate/up projections, HF's repetition
penalty and the choice of the next token. engines/static.py runs them in its forward passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from rlinf_twoworker.engines.sampling import SamplingSettings


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


def rope_store(
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    col: torch.Tensor,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    dim: int,
    *norms: Any,
) -> torch.Tensor:
    """A decode step's split_rope (split_norm_rope where Qwen3's per-head `norms` are given:
    q weight, k weight, eps), returning q; its keys and values [B, KV, 1, D] go into the
    caches [B, KV, L, D], row b's at its column col[b]: an index_put, which the compiler does
    in place and fuses with the rotary (one kernel instead of the rotary and two scatters)."""
    if norms:
        q, k, v = split_norm_rope(qkv, cos, sin, heads, kv_heads, dim, *norms)
    else:
        q, k, v = split_rope(qkv, cos, sin, heads, kv_heads, dim)
    keys[rows, :, col] = k[:, :, 0]
    values[rows, :, col] = v[:, :, 0]
    return q


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


def exponential_race(logits: torch.Tensor, noise: torch.Tensor, temperature: float) -> torch.Tensor:
    """The sampled token per row of [B, V] logits, given Exponential(1) `noise` of the same
    shape in float32: argmax(p / E) = argmax(logits / T - log E) ~ Categorical(softmax(logits /
    T)), since log p differs from logits / T by a per-row constant (Gumbel-max in another form),
    so no softmax over the vocabulary is needed. Compiled, it is one pass over the logits and
    the noise (drawn_race: the noise drawn in that pass); eagerly, several float32 copies."""
    return (logits.float() / temperature - noise.log()).argmax(-1)


EXPONENTIAL_FLOOR = torch.finfo(torch.float32).eps / 2
"""The least Exponential(1) draw: PyTorch's own exponential_ maps a uniform of 1 to this
rather than to 0, whose log would make its token win outright."""


def drawn_race(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """exponential_race with its Exponential(1) noise drawn here, -log(1 - U) for U uniform in
    [0, 1) (floored at EXPONENTIAL_FLOOR, as exponential_ floors its draws). Compiled, the
    draw is made inside the pass over the logits (the compiler's own counter-based random
    numbers, which a CUDA graph replay advances like any other draw): no float32 noise is
    written and read back. Eagerly, a uniform tensor first."""
    u = torch.rand(logits.shape, dtype=torch.float32, device=logits.device)
    noise = (-torch.log1p(-u)).clamp_min(EXPONENTIAL_FLOOR)
    return exponential_race(logits, noise, temperature)


def exponential_noise(logits: torch.Tensor) -> torch.Tensor:
    """Exponential(1) noise in float32 for `logits`, from PyTorch's exponential_."""
    return torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(1)


def eager_race(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """exponential_race with PyTorch's exponential_ noise: the race of the eager kernels and of
    a sampler whose logits are too few to compile it (engines/sampling.race_compiled)."""
    return exponential_race(logits, exponential_noise(logits), temperature)


def pick_tokens(
    logits: torch.Tensor, s: SamplingSettings, race: Callable = eager_race
) -> torch.Tensor:
    """Next token per row from [B, V] logits (greedy, or sampled after top-k / top-p); `race`:
    eager_race or the compiled drawn_race, called as race(logits, temperature). Graph-safe
    (fixed shapes, no host sync), unlike torch.multinomial's host-side checks."""
    if not s.do_sample:
        return logits.argmax(-1)
    temperature = s.temperature
    if s.top_k is not None or s.top_p < 1.0:
        logits, temperature = logits.float() / temperature, 1.0
    if s.top_k is not None:
        kth = logits.topk(s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1 - s.top_p
        drop_sorted[:, -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    return race(logits, temperature)


class Kernels(NamedTuple):
    """The elementwise pieces of a forward pass, eager (EAGER) or compiled."""

    norm: Callable
    add_norm: Callable
    split_rope: Callable
    split_norm_rope: Callable
    rope_store: Callable
    softmax: Callable
    swiglu: Callable
    race: Callable


EAGER = Kernels(
    rms_norm,
    add_rms_norm,
    split_rope,
    split_norm_rope,
    rope_store,
    masked_softmax,
    swiglu,
    eager_race,
)


def compiled_kernels(backend: str | Callable) -> Kernels:
    """EAGER's functions through torch.compile with fixed shapes (a decode step's never change),
    but the softmax, whose width is the read width of the step (one kernel for all widths), and
    the race, compiled as drawn_race (its noise drawn inside the one pass)."""
    kernels = EAGER._replace(race=drawn_race)
    return Kernels(
        *(torch.compile(k, dynamic=k is masked_softmax, backend=backend) for k in kernels)
    )

"""The static-cache sampler against transformers' generate, and its sampling distribution."""

from __future__ import annotations

import pytest
import torch

from rlinf_twoworker.demo import make_inputs
from rlinf_twoworker.models import load_causal_lm, load_tokenizer
from rlinf_twoworker.rollout import left_pad
from rlinf_twoworker.sampler import (
    SamplingSettings,
    StaticSampler,
    fuse_projections,
    pick_tokens,
)
from rlinf_twoworker.weight_sync import weights_digest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    inputs = make_inputs(tmp_path_factory.mktemp("sampler"))
    return inputs.model_path


def _prompts(tokenizer) -> list[list[int]]:
    texts = ["<｜User｜>What is 3+4?", "Hi 7", "What is 12*3? Please", "x"]
    return [tokenizer(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_greedy_tokens_equal_generate(tiny, device):
    model = load_causal_lm(tiny, torch.float32, torch.device(device)).eval()
    tokenizer = load_tokenizer(tiny)
    ids, mask = left_pad(_prompts(tokenizer), tokenizer.pad_token_id, width=24)
    ref = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        do_sample=False,
        max_new_tokens=30,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )[:, ids.shape[1] :].cpu()
    sampler = StaticSampler(model, ids.shape[0], ids.shape[1] + 30)
    settings = SamplingSettings(do_sample=False)
    for _ in range(2):  # the second call replays the captured graph on CUDA
        out = sampler.generate(
            ids, mask, 30, [tokenizer.eos_token_id], tokenizer.pad_token_id, settings
        )
        assert torch.equal(out, ref[:, : out.shape[1]])
        assert out.shape[1] == ref.shape[1]


def test_fused_projections_alias_the_parameters(tiny):
    """Fusing q/k/v and gate/up keeps every parameter's name, shape and value, and a weight
    written in place afterwards (as weight sync writes) reaches the sampler's fused GEMMs."""
    model = load_causal_lm(tiny, torch.float32, torch.device("cpu")).eval()
    tokenizer = load_tokenizer(tiny)
    before = weights_digest(model, torch.float32)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    sampler = StaticSampler(model, 4, 24 + 16)
    assert fuse_projections(model) is sampler.fused  # idempotent
    assert {n: p.shape for n, p in model.named_parameters()} == shapes
    assert weights_digest(model, torch.float32) == before
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, param in model.named_parameters():
            param.copy_(param + 0.05 * torch.randn(param.shape, generator=generator))
    ids, mask = left_pad(_prompts(tokenizer), tokenizer.pad_token_id, width=24)
    out = sampler.generate(ids, mask, 16, [-1], 0, SamplingSettings(do_sample=False))
    ref = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0
    )[:, 24:]
    assert torch.equal(out, ref)


def test_stops_at_eos_and_pads_after_it(tiny):
    model = load_causal_lm(tiny, torch.float32, torch.device("cpu")).eval()
    tokenizer = load_tokenizer(tiny)
    ids, mask = left_pad(_prompts(tokenizer), tokenizer.pad_token_id)
    greedy = StaticSampler(model, 4, ids.shape[1] + 12).generate(
        ids,
        mask,
        12,
        [tokenizer.eos_token_id],
        tokenizer.pad_token_id,
        SamplingSettings(do_sample=False),
    )
    # Declare the token each row emits third an EOS: every row must end there, padded after.
    eos = sorted({int(t) for t in greedy[:, 2]})
    out = StaticSampler(model, 4, ids.shape[1] + 12).generate(
        ids, mask, 12, eos, tokenizer.pad_token_id, SamplingSettings(do_sample=False)
    )
    for row in out:
        first = next(i for i, t in enumerate(row.tolist()) if t in eos)
        assert first <= 2
        assert all(t == tokenizer.pad_token_id for t in row[first + 1 :].tolist())


def test_sampling_matches_the_model_distribution(tiny):
    torch.manual_seed(0)
    model = load_causal_lm(tiny, torch.float32, torch.device("cpu")).eval()
    tokenizer = load_tokenizer(tiny)
    prompt = tokenizer("What is 3+4?")["input_ids"]
    rows = 4000
    ids, mask = left_pad([prompt] * rows, tokenizer.pad_token_id)
    settings = SamplingSettings(do_sample=True, temperature=0.7)
    out = StaticSampler(model, rows, ids.shape[1] + 1).generate(ids, mask, 1, [-1], 0, settings)
    with torch.no_grad():
        logits = model(input_ids=ids[:1]).logits[0, -1]
    expected = (logits / 0.7).softmax(-1)
    seen = torch.bincount(out[:, 0], minlength=expected.numel()).float() / rows
    # Total variation distance: about sqrt(V / rows) / 2 ~ 0.06 for 66 tokens by chance alone.
    assert 0.5 * (seen - expected).abs().sum() < 0.1


def test_top_k_and_top_p_filter_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    top_k = pick_tokens(logits, SamplingSettings(top_k=2))
    assert set(top_k.tolist()) == {0, 1}
    top_p = pick_tokens(logits, SamplingSettings(top_p=0.75))
    assert set(top_p.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.75; 0.15 and 0.05 are cut
    greedy = pick_tokens(logits, SamplingSettings(do_sample=False))
    assert set(greedy.tolist()) == {0}


def test_llama_without_projection_biases_matches_generate():
    """The bias-free q/k/v path (Llama) and a non-SiLU MLP, which keeps the model's own MLP."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    for act in ("silu", "gelu"):
        cfg = LlamaConfig(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_act=act,
            max_position_embeddings=128,
        )
        model = LlamaForCausalLM(cfg).eval()
        ids, mask = left_pad([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], pad_id=0, width=8)
        ref = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=12,
            min_new_tokens=12,
            pad_token_id=0,
        )[:, 8:]
        out = StaticSampler(model, 3, 8 + 12).generate(
            ids, mask, 12, [-1], 0, SamplingSettings(do_sample=False)
        )
        assert torch.equal(out, ref), act
        assert fuse_projections(model)[0].qkv_bias is None
        assert (fuse_projections(model)[0].gate_up_weight is None) == (act != "silu")

"""The static-cache sampler against transformers' generate, and its sampling distribution."""

from __future__ import annotations

import json
import logging
import re
import warnings
from typing import Any

import pytest
import torch
from support import generate_greedy, tiny_lm

from rlinf_twoworker.api.demo import build_tokenizer, demo_config, make_inputs
from rlinf_twoworker.cluster.memory_parts import model_shape, prompt_width_fixed
from rlinf_twoworker.config import to_typed
from rlinf_twoworker.config.settings import rollout_settings
from rlinf_twoworker.engines.decode_attention import kernel_supports
from rlinf_twoworker.engines.models import load_causal_lm, load_tokenizer
from rlinf_twoworker.engines.static import (
    SamplingSettings,
    StaticSampler,
    first_prompt_column,
    fuse_projections,
    penalize_repeats,
    pick_tokens,
    supports,
)
from rlinf_twoworker.engines.weight_sync import weights_digest
from rlinf_twoworker.errors import TwoWorkerError
from rlinf_twoworker.workers.rollout import RolloutWorker, left_pad


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    # The plain random demo model: the addition tasks' prior answers a digit then EOS, which
    # would end every answer after two tokens.
    return make_inputs(tmp_path_factory.mktemp("sampler"), task="arithmetic")


@pytest.fixture(scope="module")
def tiny(demo):
    return demo.model_path


def _tiny_lm(arch: str = "qwen2", vocab: int = 32, logit_scale: float = 1.0, **config: Any) -> Any:
    """A seeded random fp32 Qwen2, Qwen3 or Mistral model of a few thousand weights. `logit_scale`
    multiplies the output layer: random init gives nearly flat next-token distributions, on
    which temperatures barely differ."""
    model = tiny_lm(arch, vocab=vocab, **{"max_position_embeddings": 128, **config})
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_padding_every_row_shares_is_dropped_and_answers_stay_the_same(device):
    """The same prompts (longest 5 tokens) left-padded to 8 and to 8 + 37 columns, 6 rows in 2
    slots (refills): the columns that are padding in every row are dropped before the prefill,
    so both widths prefill and read 5 columns a prompt and give the same greedy answers
    (generate's) and, at one seed, the same sampled answers. A row's own padding stays."""
    model = _tiny_lm(vocab=61, logit_scale=4.0).to(device)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15], [16, 17, 18, 19], [20, 21]]
    new, narrow = 24, 8
    greedy, sampled = SamplingSettings(do_sample=False), SamplingSettings(do_sample=True)
    answers, stats = {}, {}
    for width in (narrow, narrow + 37):
        ids, mask = left_pad(prompts, pad_id=0, width=width)
        sampler = StaticSampler(model, 2, width + new, read_step=8)
        answers[width, "greedy"] = sampler.generate(ids, mask, new, [-1], 0, greedy)
        stats[width] = sampler.stats
        assert sampler.stats.prompt_columns == 5, sampler.stats
        assert sampler.stats.refilled_rows == 4
        assert torch.equal(answers[width, "greedy"], generate_greedy(model, ids, mask, new))
        torch.manual_seed(0)
        answers[width, "sampled"] = sampler.generate(ids, mask, new, [-1], 0, sampled)
    wide = narrow + 37
    assert torch.equal(answers[narrow, "greedy"], answers[wide, "greedy"])
    assert torch.equal(answers[narrow, "sampled"], answers[wide, "sampled"])
    assert not torch.equal(answers[wide, "greedy"], answers[wide, "sampled"])
    # Decode reads the same columns whatever the padded width.
    assert stats[wide].read_columns == stats[narrow].read_columns
    # Every column padding in every row: the last one is kept (the prefill needs a token).
    assert first_prompt_column(torch.zeros(3, 7, dtype=torch.bool)) == 6
    assert first_prompt_column(left_pad([[1], [2, 3]], pad_id=0, width=9)[1]) == 7


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


def test_top_k_and_top_p_filter_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    top_k = pick_tokens(logits, SamplingSettings(top_k=2))
    assert set(top_k.tolist()) == {0, 1}
    top_p = pick_tokens(logits, SamplingSettings(top_p=0.75))
    assert set(top_p.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.75; 0.15 and 0.05 are cut
    greedy = pick_tokens(logits, SamplingSettings(do_sample=False))
    assert set(greedy.tolist()) == {0}


def test_the_compiled_race_picks_the_eager_races_tokens():
    """The decode step samples through the compiled race (one fused pass over the logits that
    draws its noise as it goes); given the same uniform draws (the compiler's fallback to
    PyTorch's own random numbers) it picks what the eager drawn race picks, at any
    temperature, with bf16 or float32 logits and with top-k's -inf entries; and the eager
    drawn race picks what the exponential race picks with that noise."""
    import torch._inductor.config as inductor_config

    from rlinf_twoworker.engines import static_kernels as sk

    torch._dynamo.reset()
    torch.manual_seed(0)
    logits = torch.randn(64, 3000) * 4
    logits[:, ::3] = float("-inf")  # what a top-k or top-p filter leaves
    with inductor_config.patch(fallback_random=True):
        compiled = sk.compiled_kernels("inductor").race
        for dtype in (torch.bfloat16, torch.float32):
            for temperature in (1.0, 0.6):
                torch.manual_seed(7)
                eager = sk.drawn_race(logits.to(dtype), temperature)
                torch.manual_seed(7)
                assert torch.equal(compiled(logits.to(dtype), temperature), eager)
                assert (eager % 3 != 0).all()  # never an -inf entry
                torch.manual_seed(7)
                u = torch.rand(logits.shape)
                noise = (-torch.log1p(-u)).clamp_min(sk.EXPONENTIAL_FLOOR)
                assert torch.equal(sk.exponential_race(logits.to(dtype), noise, temperature), eager)
    torch._dynamo.reset()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_compiled_race_samples_softmax_of_logits_over_t(temperature):
    """With the compiler's own random numbers (the default), the compiled race's tokens follow
    softmax(logits / T): 40,000 rows of one distribution, each token's count within 5 standard
    deviations of its expectation; and the eager race's alike. A floor of 0 or a reused
    draw would put a visible share on the least likely token or repeat rows."""
    from rlinf_twoworker.engines import static_kernels as sk

    torch._dynamo.reset()
    compiled = sk.compiled_kernels("inductor").race
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01])
    rows = 40_000
    logits = probs.log().repeat(rows, 1).to(torch.bfloat16)
    want = torch.softmax(logits[0].float() / temperature, -1)
    for race in (compiled, sk.eager_race):
        torch.manual_seed(3)
        _assert_within_5_sigma(race(logits, temperature), want)
    first, second = compiled(logits, temperature), compiled(logits, temperature)
    assert not torch.equal(first, second)  # each call draws afresh
    torch._dynamo.reset()


@pytest.mark.gpu
def test_the_compiled_race_draws_afresh_at_every_cuda_graph_replay():
    """A decode step's race runs inside a captured CUDA graph: each replay must draw new noise
    (two replays over the same logits pick different tokens) from the right distribution."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from rlinf_twoworker.engines import static_kernels as sk

    torch._dynamo.reset()
    compiled = sk.compiled_kernels("inductor").race
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01])
    rows = 40_000
    logits = probs.log().repeat(rows, 1).to(torch.bfloat16).cuda()
    out = torch.zeros(rows, dtype=torch.long, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(compiled(logits, 1.0))  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(compiled(logits, 1.0))
    picks = []
    for _ in range(2):
        graph.replay()
        picks.append(out.clone().cpu())
    assert not torch.equal(picks[0], picks[1])
    for tokens in picks:
        _assert_within_5_sigma(tokens, probs)
    torch._dynamo.reset()


def _assert_within_5_sigma(tokens: torch.Tensor, want: torch.Tensor) -> None:
    """Each token's count among `tokens` (one draw a row, every row from `want`) within 5
    binomial standard deviations of its expectation."""
    rows, want = len(tokens), want.double()
    counts = torch.bincount(tokens.cpu(), minlength=len(want)).double()
    sigma = (rows * want * (1 - want)).sqrt()
    assert ((counts - rows * want).abs() < 5 * sigma).all(), (counts / rows, want)


def test_the_race_is_compiled_only_where_the_logits_are_many(tiny, monkeypatch):
    """The compiled sampler races eagerly below RACE_COMPILED_FROM logit entries a step (the
    tutorial's 16 slots: compiling would cost the first step more than it saves) and through
    its compiled kernels from there; an eager sampler always eagerly."""
    from rlinf_twoworker.engines import sampling
    from rlinf_twoworker.engines import static_kernels as sk

    model = load_causal_lm(tiny, torch.float32, torch.device("cpu")).eval()
    vocab = model.lm_head.weight.shape[0]
    assert not sampling.race_compiled(2, vocab)
    assert StaticSampler(model, 2, 16, compiled=True, backend="eager").kernels.race is (
        sk.eager_race
    )
    monkeypatch.setattr(sampling, "RACE_COMPILED_FROM", 2 * vocab)
    assert sampling.race_compiled(2, vocab) and not sampling.race_compiled(1, vocab)
    compiled = StaticSampler(model, 2, 16, compiled=True, backend="eager")
    assert compiled.kernels.race is not sk.eager_race
    assert StaticSampler(model, 2, 16, compiled=False).kernels.race is sk.eager_race


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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_qwen3_greedy_tokens_equal_generate(device, penalty):
    """Qwen3: per-head q/k RMSNorm before the rotary, head_dim (16) independent of
    hidden_size / heads (32 / 4 = 8), no q/k/v biases; with and without a repetition penalty."""
    model = _tiny_lm("qwen3", vocab=61, logit_scale=4.0, head_dim=16).to(device)
    with torch.no_grad():  # non-trivial norm weights: a skipped q/k norm changes the tokens
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    assert model.config.head_dim * model.config.num_attention_heads != model.config.hidden_size
    ids, mask = left_pad([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 3]], pad_id=0, width=8)
    ref = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        do_sample=False,
        max_new_tokens=20,
        min_new_tokens=20,
        repetition_penalty=penalty,
        pad_token_id=0,
    )[:, 8:].cpu()
    sampler = StaticSampler(model, 3, 8 + 20)
    settings = SamplingSettings(do_sample=False, repetition_penalty=penalty)
    for _ in range(2):  # the second call replays the captured graph on CUDA
        assert torch.equal(sampler.generate(ids, mask, 20, [-1], 0, settings), ref)
    assert fuse_projections(model)[0].qkv_bias is None
    assert len(set(ref.flatten().tolist())) > 3  # not a degenerate answer


def test_the_engines_behind_one_interface():
    """choose_engine: auto picks static for the families it supports, hf otherwise; both
    answer through the same generate(), and the static engine keeps one sampler per shape."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlinf_twoworker.engines.rollout_engine import choose_engine

    qwen3 = _tiny_lm("qwen3", vocab=61, logit_scale=4.0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=61, n_embd=32, n_layer=1, n_head=2)).eval()
    static = choose_engine("auto", qwen3, 28, "test")
    assert static.name == "static" and static.fixed_prompt_width
    assert choose_engine("auto", gpt2, 28, "test").name == "hf"
    with pytest.raises(TwoWorkerError, match=r"rollout.engine=static \(test\).*GPT2LMHeadModel"):
        choose_engine("static", gpt2, 28, "test")
    hf = choose_engine("hf", qwen3, 28, "test")
    ids, mask = left_pad([[5, 6, 7], [8, 9]], pad_id=0, width=8)
    greedy = SamplingSettings(do_sample=False)
    answers = [e.generate(ids, mask, 20, [-1], 0, greedy) for e in (static, hf)]
    assert torch.equal(answers[0], answers[1])
    static.generate(ids, mask, 20, [-1], 0, greedy)
    assert list(static.samplers) == [(2, 28)]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic of token `counts` against probabilities `probs`, and the value it
    exceeds by chance with probability about 3e-7 (the chi-square quantile at z = 5, by
    Wilson-Hilferty). Bins expected to hold fewer than 5 tokens are pooled into one."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum().view(1)]).double()
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    statistic = ((observed - expected)[keep] ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    quantile = df * (1 - 2 / (9 * df) + 5 * (2 / (9 * df)) ** 0.5) ** 3
    return float(statistic), quantile


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_decode_step_samples_softmax_of_logits_over_temperature(device, monkeypatch):
    """16000 answers of 8 tokens each, at T = 0.7 and T = 1.0 (on CUDA: compiled kernels, the
    compiled sampling race included, and graph replays). At every step the tokens must fit the exact distribution, the mean over
    rows of softmax(logits / T) for each row's own prefix, and must not fit the other
    temperature's: a step that dropped or misapplied the temperature fails. Rows are
    independent and each token is drawn from its row's softmax, so the statistic is at most
    chi-square distributed (the limit holds)."""
    from rlinf_twoworker.engines import sampling

    monkeypatch.setattr(sampling, "RACE_COMPILED_FROM", 1)  # on CUDA: the compiled race too
    model = _tiny_lm(logit_scale=20.0).to(device)
    rows, steps, prompt = 16000, 8, [3, 9, 17, 4]
    ids, mask = left_pad([prompt] * rows, pad_id=0)
    for temperature, other in ((0.7, 1.0), (1.0, 0.7)):
        torch.manual_seed(1)
        sampler = StaticSampler(model, rows, len(prompt) + steps)
        out = sampler.generate(ids, mask, steps, [-1], 0, SamplingSettings(temperature=temperature))
        assert out.shape == (rows, steps)
        with torch.no_grad():
            full = torch.cat([ids, out], 1).to(device)
            logits = model(input_ids=full).logits[:, len(prompt) - 1 : -1].double().cpu()
        for step in range(steps):
            counts = torch.bincount(out[:, step], minlength=logits.shape[-1])
            right, limit = _chi_square(counts, (logits[:, step] / temperature).softmax(-1).mean(0))
            wrong, _ = _chi_square(counts, (logits[:, step] / other).softmax(-1).mean(0))
            assert right < limit, f"T={temperature}, step {step}: chi2 {right:.0f} > {limit:.0f}"
            # The test's power: the other temperature is rejected with a wide margin.
            assert wrong > 3 * limit, f"T={temperature}, step {step}: T={other} fits too"


def test_repetition_penalty_is_hfs():
    """penalize_repeats equals transformers' RepetitionPenaltyLogitsProcessor, negative logits
    (multiplied) and positive ones (divided) alike."""
    from transformers import RepetitionPenaltyLogitsProcessor

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=generator) * 3
    history = torch.randint(0, 40, (3, 12), generator=generator)
    seen = torch.zeros(3, 40, dtype=torch.bool).scatter_(1, history, True)
    ref = RepetitionPenaltyLogitsProcessor(1.5)(history, logits.clone())
    assert torch.equal(penalize_repeats(logits, seen, 1.5), ref)
    assert not torch.equal(ref, logits)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_greedy_tokens_with_a_repetition_penalty_equal_generate(device):
    """Each row's reference is generate() on that row alone, unpadded, so the penalty counts
    exactly its prompt and answer. The pad id is a token the short row emits first: a sampler
    that counted padding as seen would penalize it. Penalty 1.0 gives other tokens, so the
    test fails if the penalty is ignored."""
    model = _tiny_lm(vocab=48, logit_scale=10.0).to(device)
    prompts, new = [[5, 6, 7, 8, 9, 5, 20, 21], [10, 11], [12, 13, 12, 14, 30]], 16
    answers = {}
    for penalty in (1.0, 1.5):
        refs = torch.stack([_generate_one(model, p, new, penalty) for p in prompts])
        pad_id = int(refs[1, 0])
        ids, mask = left_pad(prompts, pad_id, width=10)
        sampler = StaticSampler(model, len(prompts), 10 + new)
        settings = SamplingSettings(do_sample=False, repetition_penalty=penalty)
        for _ in range(2):  # the second call replays the captured graph on CUDA
            answers[penalty] = sampler.generate(ids, mask, new, [-1], pad_id, settings)
            assert torch.equal(answers[penalty], refs), penalty
    assert not torch.equal(answers[1.0], answers[1.5])


def _generate_one(model: Any, prompt: list[int], new: int, penalty: float) -> torch.Tensor:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        repetition_penalty=penalty,
        max_new_tokens=new,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].cpu()


@pytest.mark.parametrize(
    ("arch", "window", "config", "refused"),
    [
        ("qwen2", 16, {"use_sliding_window": True, "max_window_layers": 0}, True),
        ("qwen2", 16, {"use_sliding_window": True, "max_window_layers": 1}, True),
        ("qwen2", 16, {"use_sliding_window": True, "max_window_layers": 2}, False),
        ("qwen2", 40, {"use_sliding_window": True, "max_window_layers": 0}, False),
        ("qwen2", 16, {"use_sliding_window": False}, False),
        ("qwen3", 16, {"use_sliding_window": True, "max_window_layers": 0}, True),
        ("qwen3", 16, {"use_sliding_window": True, "max_window_layers": 2}, False),
        ("qwen3", 16, {"use_sliding_window": False}, False),
        ("mistral", 16, {}, True),
        ("mistral", 40, {}, False),
        ("mistral", None, {}, False),
    ],
)
def test_a_sliding_window_shorter_than_the_sequence_is_refused(arch, window, config, refused):
    """40 tokens (8 prompt + 32 answer). Qwen2 slides only with use_sliding_window and only from
    layer max_window_layers on (of 2); Mistral slides whenever sliding_window is set. A refused
    model's own tokens are not full attention's (refusing is needed); a model let through gives
    generate's tokens past its window (the refusal is not too wide)."""
    model = _tiny_lm(arch, logit_scale=10.0, sliding_window=window, **config)
    assert supports(model, 40) is not refused
    ids, mask = left_pad([[5, 6, 7, 8, 9, 5, 20, 21], [10, 11, 3]], pad_id=0, width=8)
    ref = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=32, pad_token_id=0
    )[:, 8:]
    greedy = SamplingSettings(do_sample=False)
    full_attention = _tiny_lm(arch, logit_scale=10.0, sliding_window=None)  # the same weights
    out = StaticSampler(full_attention, 2, 40).generate(ids, mask, 32, [-1], 0, greedy)
    assert torch.equal(out, ref) is not refused
    if refused:
        with pytest.raises(TwoWorkerError, match="sliding window of 16 tokens.*rollout.engine=hf"):
            StaticSampler(model, 2, 40)
    else:
        assert torch.equal(
            StaticSampler(model, 2, 40).generate(ids, mask, 32, [-1], 0, greedy), ref
        )


def _config(demo, tmp_path, model_path, *overrides: str) -> Any:
    cfg = demo_config(
        demo,
        tmp_path / "runs",
        "sampler-test",
        [f"rollout.model.model_path={json.dumps(str(model_path))}", *overrides],
    )
    return to_typed(cfg)


def _rollout(demo, tmp_path, model_path, *overrides: str) -> RolloutWorker:
    return RolloutWorker(rollout_settings(_config(demo, tmp_path, model_path, *overrides)))


def test_the_engine_falls_back_to_hf_on_a_sliding_window(demo, tmp_path, caplog):
    """runner.seq_length=96: a 64-token window is refused; auto takes hf with a warning that
    says why, static stops with a TwoWorkerError that says what to do."""
    sliding = tmp_path / "sliding"
    tokenizer = build_tokenizer()
    window = {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}
    _tiny_lm(vocab=len(tokenizer), **window).save_pretrained(sliding)
    with caplog.at_level(logging.WARNING, logger="rlinf_twoworker.engines.rollout_engine"):
        assert not _rollout(demo, tmp_path, sliding, "rollout.engine=auto").static
    assert "rollout.engine=auto uses hf" in caplog.text
    assert "sliding window of 64 tokens" in caplog.text
    with pytest.raises(TwoWorkerError, match=r"rollout.engine=static .*rollout rank 0.*window"):
        _rollout(demo, tmp_path, sliding, "rollout.engine=static")
    assert _rollout(demo, tmp_path, demo.model_path, "rollout.engine=auto").static
    # The memory plan reads the same answer from config.json (with the model's shape) before
    # any model loads (whether the batches' prompt columns are fixed: memory_parts.answer_share).
    auto = _config(demo, tmp_path, demo.model_path, "rollout.engine=auto")
    assert not prompt_width_fixed(auto, model_shape(sliding))
    assert prompt_width_fixed(auto, model_shape(demo.model_path))


def test_both_engines_decode_greedily_and_pass_the_repetition_penalty(demo, tmp_path):
    """do_sample=false is greedy on either engine whatever the temperature, and the hf engine
    gets the repetition penalty: the two engines' answers agree token for token with it and
    without it, and the penalty changes them."""
    tokenizer = load_tokenizer(demo.model_path)
    prompts = _prompts(tokenizer)
    answers = {}
    for engine in ("static", "hf"):
        for penalty in (1.0, 1.5):
            worker = _rollout(
                demo,
                tmp_path,
                demo.model_path,
                f"rollout.engine={engine}",
                "algorithm.sampling_params.do_sample=false",
                "algorithm.sampling_params.temperature=0.3",
                f"algorithm.sampling_params.repetition_penalty={penalty}",
            )
            assert worker.static is (engine == "static")
            seed = 0 if engine == "static" else 1  # greedy: the seed must not matter
            batch = worker.generate(prompts, seed).batch
            answers[engine, penalty] = [
                r[m.bool()].tolist() for r, m in zip(batch.responses, batch.response_mask)
            ]
    assert answers["hf", 1.0] == answers["static", 1.0]
    assert answers["hf", 1.5] == answers["static", 1.5]
    assert answers["static", 1.0] != answers["static", 1.5]


def _broken_backend(graph, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


def test_a_compiler_failure_falls_back_to_eager_with_the_same_tokens(tiny):
    model = load_causal_lm(tiny, torch.float32, torch.device("cpu")).eval()
    ids, mask = left_pad([[5, 6, 7, 8], [9, 10]], pad_id=0, width=6)
    settings = SamplingSettings(do_sample=False)
    eager = StaticSampler(model, 2, 6 + 12, compiled=False).generate(
        ids, mask, 12, [-1], 0, settings
    )
    torch._dynamo.reset()  # no compiled code cached from another test or backend
    sampler = StaticSampler(model, 2, 6 + 12, compiled=True, backend=_broken_backend)
    with pytest.warns(
        UserWarning, match="(?s)compiled sampler kernels failed.*running them eagerly"
    ):
        out = sampler.generate(ids, mask, 12, [-1], 0, settings)
    assert torch.equal(out, eager)
    assert not sampler.compiled


@pytest.mark.gpu
def test_a_fallback_after_captured_graphs_captures_again_in_a_new_pool():
    """A fallback (compiled kernels to eager, split-KV to the grouped product) drops the
    captured decode steps; the next generate captures again, in a new pool: PyTorch refuses a
    capture into a pool whose graphs are all gone (an internal assert), so the old one must not
    be reused. The answers stay the same greedy answers."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = _tiny_lm(logit_scale=4.0).cuda()
    ids, mask = left_pad([[5, 6, 7, 8], [9, 10], [11, 12, 13]], pad_id=0, width=6)
    greedy = SamplingSettings(do_sample=False)
    sampler = StaticSampler(model, 3, 6 + 300, read_step=64)
    first = sampler.generate(ids, mask, 300, [-1], 0, greedy)
    assert len(sampler.graphs) > 1  # widths 64, 128, ...: several graphs in one pool
    pool = sampler.graph_pool
    for fall_back in (sampler._use_grouped, sampler._go_eager):
        fall_back()
        assert not sampler.graphs
        assert torch.equal(sampler.generate(ids, mask, 300, [-1], 0, greedy), first)
        assert sampler.graphs and sampler.graph_pool != pool
        pool = sampler.graph_pool


@pytest.mark.parametrize(
    "error",
    [RuntimeError("the model broke"), torch.OutOfMemoryError("CUDA out of memory (test)")],
    ids=["model-error", "out-of-memory"],
)
def test_an_error_that_is_not_the_compilers_propagates(tiny, error):
    """The kernels compile (Dynamo's eager backend); the model's embedding raises once. A
    fallback would hide the error and generate again, successfully: it must not happen."""
    model = load_causal_lm(tiny, torch.float32, torch.device("cpu")).eval()
    ids, mask = left_pad([[5, 6, 7, 8], [9, 10]], pad_id=0, width=6)
    torch._dynamo.reset()
    sampler = StaticSampler(model, 2, 6 + 4, compiled=True, backend="eager")
    raised = []

    def fail_once(module, args):
        if not raised:
            raised.append(error)
            raise error

    hook = model.model.embed_tokens.register_forward_pre_hook(fail_once)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback's warning fails the test
            with pytest.raises(type(error), match=re.escape(str(error))):
                sampler.generate(ids, mask, 4, [-1], 0, SamplingSettings(do_sample=False))
    finally:
        hook.remove()
    assert sampler.compiled
    out = sampler.generate(ids, mask, 4, [-1], 0, SamplingSettings(do_sample=False))
    assert out.shape == (2, 4)


@pytest.mark.parametrize("norms", [False, True], ids=["qwen2", "qwen3"])
def test_compiled_rotary_writes_the_step_into_the_cache_in_place(norms):
    """The decode step's rotary and its cache write, compiled as the sampler compiles them
    (inductor): q as eager, every row's k and v at its own column and nothing else changed,
    written into the cache tensors themselves (the captured graph replays into them)."""
    from rlinf_twoworker.engines import static_kernels as sk

    gen = torch.Generator().manual_seed(0)
    b, heads, kv, dim, length = 3, 4, 2, 8, 12
    keys = torch.randn(b, kv, length, dim, generator=gen)
    values = torch.randn(b, kv, length, dim, generator=gen)
    rows, col = torch.arange(b), torch.tensor([0, 5, 11])
    qkv = torch.randn(b, 1, (heads + 2 * kv) * dim, generator=gen)
    cos, sin = (torch.randn(b, 1, 1, dim, generator=gen) for _ in range(2))
    extra: tuple[Any, ...] = ()
    fn = sk.rope_store
    if norms:  # Qwen3's per-head norms: q weight, k weight, eps
        extra = (torch.rand(dim, generator=gen) + 0.5, torch.rand(dim, generator=gen), 1e-6)
    eager_k, eager_v = keys.clone(), values.clone()
    original_k, original_v = keys.clone(), values.clone()
    want = fn(eager_k, eager_v, rows, col, qkv, cos, sin, heads, kv, dim, *extra)
    torch._dynamo.reset()
    before = (keys.data_ptr(), values.data_ptr())
    got = torch.compile(fn, dynamic=False)(
        keys, values, rows, col, qkv, cos, sin, heads, kv, dim, *extra
    )
    assert (keys.data_ptr(), values.data_ptr()) == before
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(keys, eager_k)
    torch.testing.assert_close(values, eager_v)
    split = sk.split_norm_rope if norms else sk.split_rope
    _, k, v = split(qkv, cos, sin, heads, kv, dim, *extra)
    for row, column in enumerate(col.tolist()):
        torch.testing.assert_close(keys[row, :, column], k[row, :, 0])
        torch.testing.assert_close(values[row, :, column], v[row, :, 0])
    untouched = torch.ones_like(keys, dtype=torch.bool)
    untouched[rows, :, col] = False
    assert torch.equal(keys[untouched], original_k[untouched])
    assert torch.equal(values[untouched], original_v[untouched])


def test_decode_attention_choice_is_checked():
    """On a CPU the sampler decodes with the grouped product; asking for the split-KV kernel
    there (or for an unknown attention) fails at construction, saying what to use instead."""
    model = _tiny_lm(head_dim=16)
    assert StaticSampler(model, 2, 16).attention == "grouped"
    with pytest.raises(TwoWorkerError, match=r"split_kv .*CUDA with Triton.*attention='grouped'"):
        StaticSampler(model, 2, 16, attention="split_kv")
    with pytest.raises(ValueError, match="flash.*not one of"):
        StaticSampler(model, 2, 16, attention="flash")
    # The kernel's shapes: up to 16 query heads a KV head, a power-of-two head_dim in 16..128.
    assert kernel_supports(12, 2, 128) and kernel_supports(16, 1, 16)
    assert not kernel_supports(40, 2, 128)  # 20 query heads a KV head
    assert not kernel_supports(8, 2, 256) and not kernel_supports(4, 2, 8)
    assert not kernel_supports(4, 2, 96)


def test_a_compiled_decode_step_compiles_each_kernel_once(tiny, monkeypatch):
    """Every call of a compiled kernel in a decode step has one shape: the last position's
    final norm takes [B, 1, hidden] as the layers' norms do, not [B, hidden]. A second rank
    compiled the residual norm again inside the first rollout's decoding (seen on an H100 as
    `Recompiling function add_rms_norm ... rank mismatch. expected 3, actual 2`)."""
    model = load_causal_lm(tiny, torch.float32, torch.device("cpu")).eval()
    ids, mask = left_pad([[5, 6, 7, 8], [9, 10]], pad_id=0, width=6)
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    sampler = StaticSampler(model, 2, 6 + 5, compiled=True, backend="eager")
    greedy = SamplingSettings(do_sample=False)
    out = sampler.generate(ids, mask, 5, [-1], 0, greedy)
    assert sampler.compiled, "the compiled kernels fell back to eager"
    eager = StaticSampler(model, 2, 6 + 5, compiled=False).generate(ids, mask, 5, [-1], 0, greedy)
    assert torch.equal(out, eager)

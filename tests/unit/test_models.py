"""Model loading errors and the batch layout, without Ray."""

from __future__ import annotations

import json

import pytest
import torch
from support import varied_batch

from rlinf_twoworker.api.demo import make_inputs
from rlinf_twoworker.config.schema import MicroBatchRule
from rlinf_twoworker.engines.models import (
    SequenceBatch,
    kept_columns,
    load_causal_lm,
    micro_batches,
    response_logprobs,
    run_or_eager,
    to_device,
)
from rlinf_twoworker.errors import TwoWorkerError
from rlinf_twoworker.workers.rollout import left_pad, response_mask


def test_a_model_that_is_not_a_causal_lm_is_refused(tmp_path):
    inputs = make_inputs(tmp_path)
    config = inputs.model_path / "config.json"
    config.write_text(
        json.dumps({**json.loads(config.read_text()), "architectures": ["BertModel"]})
    )
    with pytest.raises(TwoWorkerError, match=r"is \['BertModel'\], not a causal LM"):
        load_causal_lm(inputs.model_path, torch.float32, torch.device("cpu"))
    with pytest.raises(TwoWorkerError, match="nowhere does not exist"):
        load_causal_lm(tmp_path / "nowhere", torch.float32, torch.device("cpu"))
    with pytest.raises(TwoWorkerError, match="config.json is a file, not a directory"):
        load_causal_lm(config, torch.float32, torch.device("cpu"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TwoWorkerError, match="empty has no config.json"):
        load_causal_lm(tmp_path / "empty", torch.float32, torch.device("cpu"))


def test_left_padding_positions_and_response_mask():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    responses = torch.tensor([[3, 2, 9, 9], [4, 4, 4, 4]])  # 2 is EOS; 9 pads after it
    resp = response_mask(responses, eos_ids=[2])
    assert resp.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]  # EOS itself is part of the answer
    batch = SequenceBatch(torch.cat([ids, responses], 1), torch.cat([mask, resp], 1), resp, 3)
    assert batch.position_ids[1].tolist()[:4] == [0, 0, 0, 1]  # real tokens count from 0
    assert batch.responses.tolist() == responses.tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The demo's tiny Qwen2 in float32 on the CPU (read-only in these tests)."""
    path = make_inputs(tmp_path_factory.mktemp("tiny")).model_path
    return load_causal_lm(path, torch.float32, torch.device("cpu"))


def _plain_call_logprobs(model, batch):
    """Each answer token's log-prob from one plain call of `model` with the 2-D padding mask
    (transformers' own masks), the whole vocabulary's log-softmax: the reference."""
    p = batch.prompt_length
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
        ).logits
    return logits[:, p - 1 : -1].log_softmax(-1).gather(-1, batch.responses.unsqueeze(-1))[..., 0]


@pytest.mark.parametrize(("packed", "head"), [("0", 7), ("1", 6)])
def test_response_logprobs_line_up_with_the_response_tokens(model, monkeypatch, packed, head):
    """Row b, column t is log p(response[b, t] | everything before it), on left-padded rows;
    the output head runs only on positions that predict an answer token, not on all 22.
    Masked: the last prompt position and the answer's (7, the last one's logits dropped).
    Packed (each row's padding moved after its tokens, RLINF_PACK_LEFT=1): the 6 that predict
    the answer's tokens, picked row by row, though the rows' answers now start in different
    columns."""
    monkeypatch.setenv("RLINF_PACK_LEFT", packed)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=generator).tolist() for n in (5, 9, 3)]
    ids, mask = left_pad(prompts, pad_id=0, width=16)
    responses = torch.randint(3, 60, (3, 6), generator=generator)
    resp = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1] * 6])
    batch = SequenceBatch(torch.cat([ids, responses], 1), torch.cat([mask, resp], 1), resp, 16)
    expected = _plain_call_logprobs(model, batch)
    with torch.no_grad():
        head_rows = []  # the positions the output head computes logits for
        hook = model.lm_head.register_forward_hook(
            lambda _m, args, _out: head_rows.append(args[0].shape[1])
        )
        try:
            got = response_logprobs(model, batch)
        finally:
            hook.remove()
    assert got.shape == (3, 6)
    assert head_rows == [head]  # not the whole 22
    torch.testing.assert_close(got * resp, expected * resp, rtol=1e-5, atol=1e-5)


def _plain_softmax_attention(module, query, key, value, attention_mask, scaling=None, **_):
    """Attention whose softmax makes NaN for a query position that sees no key: what the
    memory-efficient SDPA kernel's gradient can do on GPUs for such rows, here on the CPU."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query @ key.transpose(-1, -2)) * scaling
    width = scores.shape[-1]
    if attention_mask is None:  # no padding: transformers leaves the causal mask implicit
        attention_mask = torch.ones(width, width, dtype=torch.bool).tril()
    probs = scores.masked_fill(~attention_mask, float("-inf")).softmax(-1)
    return (probs @ value).transpose(1, 2).contiguous(), probs


def test_no_position_attends_to_nothing_so_left_padding_makes_no_nan(tmp_path):
    """Left padding leaves a row's padding positions no key to attend to (every key before
    them is padding). Under an attention that turns such rows into NaN (as the memory-
    efficient SDPA kernel's gradient did on an H100: every gradient NaN at the tutorial's
    shape), the forwards' mask (SequenceBatch.model_attention_mask: each position also sees
    itself) keeps the log-probs and every gradient finite, and the log-probs of real answer
    tokens equal those under transformers' own mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("rlinf_plain_softmax", _plain_softmax_attention)
    AttentionMaskInterface.register("rlinf_plain_softmax", sdpa_mask)
    model = load_causal_lm(make_inputs(tmp_path).model_path, torch.float32, torch.device("cpu"))
    batch = varied_batch((5, 9, 3, 12), (6, 3, 10, 1), 16, 10)  # every row left-padded
    mask4 = batch.model_attention_mask()
    assert mask4.shape == (4, 1, 26, 26) and bool(mask4.any(-1).all())
    expected = _plain_call_logprobs(model, batch)  # under SDPA (the CPU's: no NaN)
    model.config._attn_implementation = "rlinf_plain_softmax"
    out = response_logprobs(model, batch)
    (out * 0.0).sum().backward()  # zero advantages: the gradient must be exactly 0
    resp = batch.response_mask
    torch.testing.assert_close(out * resp, expected * resp, rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        assert param.grad is not None and bool((param.grad == 0).all()), name
    full = varied_batch((16, 16), (10, 10), 16, 10)  # no left padding: the 2-D mask stays
    assert full.model_attention_mask() is full.attention_mask


def _two_layers_of_the_1_5b_attention_on_the_gpu():
    """Two decoder layers with the 1.5B shape's hidden size and attention (12 heads, 2 KV
    heads, head_dim 128), a small MLP and vocabulary, in bf16 on the GPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=1536,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)


def test_to_device_leaves_a_tensor_bound_for_the_cpu_as_it_is():
    """to_device's CPU branch: a CPU tensor bound for the CPU is the tensor itself (no pinned
    copy is made where no GPU reads it)."""
    rows = torch.arange(12).reshape(3, 4)
    assert to_device(rows, torch.device("cpu")) is rows


@pytest.mark.gpu
def test_to_device_queues_the_copy_behind_running_kernels_and_keeps_the_values():
    """to_device's GPU branch: while a kernel still runs on the stream, the copy of a CPU
    batch returns without waiting for it (a copy from pageable memory would have waited for
    the stream to drain), and once the stream has run the GPU holds the batch's values, even
    where the CPU tensor changed after the call (the copy is from a pinned copy of it)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda")
    batch = torch.randint(0, 150000, (64, 2048))
    expected = batch.clone()
    done = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles
    done.record()
    on_gpu = to_device(batch, device)
    assert not done.query(), "to_device waited for the stream's running kernel"
    batch.zero_()
    torch.cuda.synchronize()
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), expected)


@pytest.mark.gpu
def test_the_tutorials_trimmed_rows_give_finite_gradients_on_the_gpu():
    """The layout whose update made every gradient NaN on an H100 (the tutorial's rows trimmed
    to 64 columns: 54 columns of padding, a 10-token prompt, 768 answer tokens), through two
    decoder layers with the 1.5B shape's attention (12 heads, 2 KV heads, head_dim 128) in
    bf16 on the GPU's SDPA kernels: with the forwards' mask the log-probs and every gradient
    are finite (zero loss weights: the gradient is exactly zero)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = _two_layers_of_the_1_5b_attention_on_the_gpu()
    rows, pad, real, answer = 4, 54, 10, 768
    mask = torch.cat([torch.zeros(rows, pad), torch.ones(rows, real + answer)], 1).long()
    ids = torch.randint(3, 256, mask.shape) * mask
    batch = SequenceBatch(ids, mask, torch.ones(rows, answer, dtype=torch.long), pad + real)
    out = response_logprobs(model, batch.to(torch.device("cuda")))
    (out * 0.0).sum().backward()
    assert bool(out.isfinite().all())
    for name, param in model.named_parameters():
        assert param.grad is not None and bool(param.grad.isfinite().all()), name


def test_layers_compiled_for_many_shapes_skip_inductors_size_dependent_fusion_checks():
    """This PyTorch has the option compile_layers(many_shapes=True) passes (the GPU test below
    shows what it prevents): Inductor's mix-order reduction in non-strict mode."""
    from rlinf_twoworker.engines.models import many_shapes_options

    assert many_shapes_options() == {"triton.mix_order_reduction_non_strict_mode": True}


@pytest.mark.gpu
def test_micro_batches_on_both_sides_of_4096_tokens_compile_the_layer_once_on_the_gpu():
    """Layers compiled for the length-aware cut's many shapes, on the GPU (where Inductor's
    mix-order reduction fuses an RMSNorm backward's reductions, its checks at 4096 tokens):
    a forward and backward at 5,120 tokens, then at 1,280 and 10,240, run through one layer
    graph (the warm-up's shape, then a step's smaller and larger micro-batches)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch._dynamo.utils import counters

    from rlinf_twoworker.engines.models import compile_layers

    model = _two_layers_of_the_1_5b_attention_on_the_gpu()
    torch._dynamo.reset()
    counters.clear()
    compile_layers(model, True, many_shapes=True)
    graphs = []
    for rows in (8, 2, 16):
        batch = varied_batch((40,) * rows, (576,) * rows, 64, 576).to(torch.device("cuda"))
        out = response_logprobs(model, batch, trim_multiple=64, fused=True)
        (out * batch.response_mask).sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [graphs[0]] * 3, graphs


def test_a_windowed_model_keeps_transformers_masks():
    """A model whose attention is windowed (Mistral's sliding_window) gets the 2-D padding
    mask, from which transformers makes its windowed masks: its log-probs are those of a
    plain call, where a ready causal 4-D mask would let each position see past the window."""
    from transformers import MistralConfig, MistralForCausalLM

    from rlinf_twoworker.engines.models import windows_attention

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
        attn_implementation="sdpa",
    )
    windowed = MistralForCausalLM(config).eval()
    assert windows_attention(windowed)
    batch = varied_batch((5, 9, 3), (6, 3, 10), 16, 10)
    expected = _plain_call_logprobs(windowed, batch)
    with torch.no_grad():
        got = response_logprobs(windowed, batch)
    resp = batch.response_mask
    torch.testing.assert_close(got * resp, expected * resp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("multiple", [1, 4, 128])
def test_trimmed_batches_give_the_same_logprobs(model, multiple):
    """runner.trim_padding_multiple: dropping the columns that are padding in every row (left prompt
    padding, right after the longest answer) changes no log-prob of a real response token."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 60, (n,), generator=generator).tolist() for n in (5, 9, 3)]
    ids, mask = left_pad(prompts, pad_id=0, width=16)  # 7 leading columns pad every row
    responses = torch.randint(3, 60, (3, 10), generator=generator)
    resp = torch.zeros(3, 10, dtype=torch.long)
    for row, length in enumerate((6, 3, 4)):  # the last 4 columns pad every row
        resp[row, :length] = 1
    batch = SequenceBatch(torch.cat([ids, responses], 1), torch.cat([mask, resp], 1), resp, 16)
    part, kept = batch.trimmed(multiple)
    width = part.input_ids.shape[1]
    assert width % multiple == 0 or width == 26
    assert kept >= 6 and part.prompt_length >= 9 and width <= 26
    assert torch.equal(part.responses[:, :6], batch.responses[:, :6])
    with torch.no_grad():
        full = response_logprobs(model, batch)
        short = response_logprobs(model, part)
        padded = response_logprobs(model, batch, trim_multiple=multiple)
    assert short.shape == (3, kept) and padded.shape == full.shape
    torch.testing.assert_close(short * resp[:, :kept], full[:, :kept] * resp[:, :kept])
    torch.testing.assert_close(padded * resp, full * resp, rtol=1e-5, atol=1e-5)
    if multiple == 1:
        assert width == 26 - 7 - 4 and kept == 6
        assert torch.all(padded[:, kept:] == 0)  # dropped columns, padding in every row


def test_length_aware_micro_batches_put_like_lengths_together_within_the_budget(model):
    """With trimming on, rows are cut by where their answers end, longest first, each
    micro-batch as many rows as fit in the token budget at the width it trims to; every row
    once; far fewer columns than the rows in order at the whole width; the same log-probs."""
    answers = (12, 2, 9, 3, 12, 1, 7, 2)
    batch = varied_batch((5, 8, 3, 6, 2, 7, 4, 8), answers, 8, 12)
    rule = MicroBatchRule(least=1, tokens=40)
    cuts = micro_batches(batch, rule, 4)
    rows = [sorted(c.tolist()) for c in cuts]
    assert sorted(i for r in rows for i in r) == list(range(8))
    first, last = batch.spans()
    ends, columns = [], 0
    for r in rows:
        begin, end = kept_columns(min(first[i] for i in r), max(last[i] for i in r), 8, 20, 4)
        assert len(r) * (end - begin) <= 40 or len(r) == 1
        ends.append(max(answers[i] for i in r))
        columns += len(r) * (end - begin)
    assert ends == sorted(ends, reverse=True)  # the longest answers first
    assert rows[0] == [0, 4]  # the two 12-token answers
    in_order = micro_batches(batch, rule, 0)
    assert in_order == rule.slices(8, 20) and columns <= 8 * 20 * 3 // 4
    with torch.no_grad():
        full = response_logprobs(model, batch)
        out = torch.zeros_like(full)
        for cut in cuts:
            out[cut] = response_logprobs(model, batch.rows(cut), trim_multiple=4)
    resp = batch.response_mask
    torch.testing.assert_close(out * resp, full * resp, rtol=1e-5, atol=1e-5)
    # No token budget: RLinf's row count, still grouped by length.
    pairs = [sorted(c.tolist()) for c in micro_batches(batch, MicroBatchRule(least=2, tokens=0), 4)]
    assert pairs == [[0, 4], [2, 6], [1, 3], [5, 7]]
    # A row without a real column (all padding) still lands in one micro-batch.
    empty = varied_batch((0, 3), (0, 4), 4, 6)
    assert [c.tolist() for c in micro_batches(empty, MicroBatchRule(least=1, tokens=8), 2)] == [
        [1],
        [0],
    ]


def test_inference_gives_the_same_logprobs_in_row_order_with_the_length_aware_cut(tmp_path):
    """InferenceWorker with runner.trim_padding_multiple: micro-batches out of row order, the
    log-probs put back in each row's place; equal to the full-width cut's."""
    from rlinf_twoworker.api.demo import demo_config
    from rlinf_twoworker.config import to_typed
    from rlinf_twoworker.config.settings import inference_settings
    from rlinf_twoworker.workers.inference import InferenceWorker

    inputs = make_inputs(tmp_path / "inputs")
    batch = varied_batch((5, 8, 3, 6, 2, 7, 4, 8), (12, 2, 9, 3, 12, 1, 7, 2), 8, 12)
    budget = [
        "runner.logprob_micro_batch_tokens=40",
        "algorithm.logprob_forward_micro_batch_size=1",
    ]
    out = {}
    for trim in (0, 4):
        cfg = to_typed(
            demo_config(
                inputs,
                str(tmp_path / "runs"),
                f"t{trim}",
                [*budget, f"runner.trim_padding_multiple={trim}"],
            )
        )
        settings = inference_settings(cfg)
        cuts = micro_batches(batch, settings.micro_batch, trim)
        if trim:
            assert [c.tolist() for c in cuts][0] == [0, 4]  # not in row order
        out[trim] = InferenceWorker(settings).compute_logprobs(batch).logprobs
    assert torch.all(out[4][batch.response_mask == 0] == 0)
    torch.testing.assert_close(out[4], out[0], rtol=1e-5, atol=1e-5)


def _warm_up_batch() -> SequenceBatch:
    """The warm-up's rows (run/warmup.full_length_batch: 6 rows, prompts of 8 tokens and
    answers of 16, no padding) with random tokens in them."""
    from rlinf_twoworker.run.warmup import full_length_batch

    class Shape:  # what full_length_batch reads of a config
        class data:
            max_prompt_length = 8

        max_new_tokens = 16

    warm = full_length_batch(Shape, 6)
    return SequenceBatch(
        torch.randint(3, 60, warm.input_ids.shape), warm.attention_mask, warm.response_mask, 8
    )


def test_marked_layers_compile_once_for_the_length_aware_cuts_shapes(tmp_path):
    """compile_layers(many_shapes=True) and the trimmed forward's fused log-softmax: the
    length-aware cut's micro-batches (several rows and widths) run through one compiled graph
    each (the decoder layer, the log-softmax's statistics and its backward), not one per new
    shape until
    torch.compile makes the sizes symbolic itself; the log-probs and gradients are eager's."""
    from torch._dynamo.utils import counters

    from rlinf_twoworker.engines.models import compile_layers

    path = make_inputs(tmp_path).model_path
    gen = torch.Generator().manual_seed(0)
    prompts = tuple(int(x) for x in torch.randint(4, 17, (24,), generator=gen))
    answers = tuple(int(x) for x in torch.randint(2, 49, (24,), generator=gen))
    batch = varied_batch(prompts, answers, 16, 48)
    cuts = micro_batches(batch, MicroBatchRule(least=2, tokens=160), 8)
    assert len({(len(c), int(batch.rows(c).trimmed(8)[0].input_ids.shape[1])) for c in cuts}) > 2
    runs = {}
    for marked in (False, True):
        model = load_causal_lm(path, torch.float32, torch.device("cpu"))
        if marked:
            torch._dynamo.reset()
            counters.clear()
            compile_layers(model, True, many_shapes=True)
        logprobs = torch.zeros(batch.response_mask.shape)
        for cut in cuts:
            part = batch.rows(cut)
            out = response_logprobs(model, part, trim_multiple=8, fused=marked)
            (out * part.response_mask).sum().backward()
            logprobs[cut] = out.detach() * part.response_mask
        runs[marked] = logprobs, {n: p.grad for n, p in model.named_parameters()}
    # the layer, and the log-softmax's two kernels (its statistics and its own backward)
    assert counters["stats"]["unique_graphs"] == 3
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-5, atol=1e-5)
    for name, grad in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][name], grad, rtol=1e-4, atol=1e-5)


def test_a_step_with_one_row_over_compiles_nothing_the_warm_up_did_not(tmp_path):
    """Rows that leave one over after whole micro-batches (7 rows, 3 fit): the length-aware
    cut makes no one-row micro-batch where the one before has a row to spare, since
    torch.compile specializes a size of 1 even where rows are marked dynamic. The warm-up's
    full-length rows and then such a step run through the graphs compiled once (the decoder
    layer, the log-softmax's two kernels), every micro-batch within the budget."""
    from torch._dynamo.utils import counters

    from rlinf_twoworker.engines.models import compile_layers

    rule = MicroBatchRule(least=1, tokens=48)  # 3 rows at the step's trimmed width, 16
    step = varied_batch((3,) * 7, (12,) * 7, 8, 16)
    cuts = micro_batches(step, rule, 8)
    assert [tuple(step.rows(c).trimmed(8)[0].input_ids.shape) for c in cuts] == [
        (3, 16),
        (2, 16),
        (2, 16),
    ]
    assert sorted(i for c in cuts for i in c.tolist()) == list(range(7))
    first, last = step.spans()
    for c in cuts:
        rows = c.tolist()
        begin, end = kept_columns(min(first[i] for i in rows), max(last[i] for i in rows), 8, 24, 8)
        assert len(rows) * (end - begin) <= rule.tokens

    warm = _warm_up_batch()
    model = load_causal_lm(make_inputs(tmp_path).model_path, torch.float32, torch.device("cpu"))
    torch._dynamo.reset()
    counters.clear()
    compile_layers(model, True, many_shapes=True)
    graphs = []
    for batch in (warm, step):
        for cut in micro_batches(batch, rule, 8):
            part = batch.rows(cut)
            out = response_logprobs(model, part, trim_multiple=8, fused=True)
            (out * part.response_mask).sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [3, 3]  # the layer and the log-softmax's two kernels, all in the warm-up


def test_a_micro_batch_without_padding_runs_through_the_warm_ups_graphs(tmp_path):
    """A micro-batch with no padding at all (prompts as long as data.max_prompt_length,
    answers at the limit: what random weights make) gets a mask tensor like every other, not
    the mask transformers leaves out for such a batch, which made torch.compile compile the
    decoder layer again in the middle of a step; its log-probs equal the uncompiled
    model's."""
    from torch._dynamo.utils import counters

    from rlinf_twoworker.engines.models import compile_layers

    rule = MicroBatchRule(least=1, tokens=48)
    warm = _warm_up_batch()
    step = varied_batch((8,) * 6, (16, 9, 16, 12, 16, 16), 8, 16)
    whole = [
        bool(step.rows(c).trimmed(8)[0].attention_mask.all()) for c in micro_batches(step, rule, 8)
    ]
    assert True in whole and False in whole  # one micro-batch without padding, one with
    model = load_causal_lm(make_inputs(tmp_path).model_path, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        eager = response_logprobs(model, step, trim_multiple=8)
    torch._dynamo.reset()
    counters.clear()
    compile_layers(model, True, many_shapes=True)
    graphs, compiled = [], []
    for batch in (warm, step):
        for cut in micro_batches(batch, rule, 8):
            part = batch.rows(cut)
            out = response_logprobs(model, part, trim_multiple=8, fused=True)
            (out * part.response_mask).sum().backward()
            compiled.append((cut, out.detach()))
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [3, 3]  # the layer and the log-softmax's two kernels, all in the warm-up
    for cut, out in compiled[-len(whole) :]:
        mask = step.response_mask[cut].bool()
        torch.testing.assert_close(out[mask], eager[cut][mask], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("packed", ["0", "1"])
def test_rows_of_any_padding_run_through_the_warm_ups_graphs(tmp_path, monkeypatch, packed):
    """After the warm-up's full-length rows (no padding), steps whose rows' prompts are padded
    by different amounts compile nothing more, masked or packed: packed, each row's answer
    starts in another column, and the output head and the log-softmax still get the shapes
    (and the labels' layout) of the warm-up, not a width that follows the rows' padding."""
    from torch._dynamo.utils import counters

    from rlinf_twoworker.engines.models import compile_layers

    monkeypatch.setenv("RLINF_PACK_LEFT", packed)
    rule = MicroBatchRule(least=1, tokens=48)
    warm = _warm_up_batch()
    answers = (16, 9, 16, 12, 16, 16)
    steps = [varied_batch((8, 3, 5, 1, 8, 2), answers, 8, 16)]
    steps.append(varied_batch((2, 3, 7, 1, 4, 2), answers, 8, 16))
    model = load_causal_lm(make_inputs(tmp_path).model_path, torch.float32, torch.device("cpu"))
    torch._dynamo.reset()
    counters.clear()
    compile_layers(model, True, many_shapes=False)
    graphs = []
    for batch in (warm, *steps):
        for cut in micro_batches(batch, rule, 0):
            part = batch.rows(cut)
            out = response_logprobs(model, part, fused=True)
            (out * part.response_mask).sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [3, 3, 3]  # the layer and the log-softmax's two, all in the warm-up


def _without_logits_to_keep(model):
    """`model` as an instance of a subclass whose forward does not take transformers'
    logits_to_keep (a family without it): the forwards then read the full logits."""
    base = type(model)

    class FullHead(base):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None):
            return base.forward(
                self,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=use_cache,
            )

    model.__class__ = FullHead
    return model


@pytest.mark.parametrize("trim", [0, 8])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("head", ["kept", "full"])
def test_rows_packed_left_give_the_same_logprobs_and_gradients(
    tmp_path, monkeypatch, trim, with_entropy, head
):
    """Packed (RLINF_PACK_LEFT=1): each row's padding moved after its real tokens, plain causal
    attention with no mask, the output head reading of each row the positions that predict
    its answer. Prompts of 1-8 tokens
    left-padded to 8 and answers of 4-16 tokens: the log-probs (and entropies) of the answer
    tokens and every gradient equal the masked forward's, full width and trimmed, with the
    head on the kept positions and (a model without logits_to_keep) on all."""
    from rlinf_twoworker.engines.models import keeps_logits

    model = load_causal_lm(make_inputs(tmp_path).model_path, torch.float32, torch.device("cpu"))
    if head == "full":
        model = _without_logits_to_keep(model)
    assert keeps_logits(model) == (head == "kept")
    batch = varied_batch((3, 8, 5, 1), (12, 4, 16, 9), 8, 16)
    real = batch.response_mask.bool()
    got = {}
    for packed in ("0", "1"):
        monkeypatch.setenv("RLINF_PACK_LEFT", packed)
        model.zero_grad()
        out = response_logprobs(
            model, batch, trim_multiple=trim, temperature=0.7, with_entropy=with_entropy
        )
        parts = out if with_entropy else (out,)
        sum((part * batch.response_mask).sum() for part in parts).backward()
        got[packed] = ([part[real] for part in parts], [p.grad.clone() for p in model.parameters()])
    for plain, packed in zip(got["0"][0], got["1"][0]):
        torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    for plain, packed in zip(got["0"][1], got["1"][1]):
        torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)


def test_marks_leave_the_feature_sizes_static_when_a_batch_size_equals_them(model):
    """mark_dynamic_layers marks rows and width but never a 3-D input's last dimension: with a
    width equal to the hidden size (64 in the tiny model), hidden_states' width is marked and
    its hidden size is not (a symbolic hidden size would make every norm a looped reduction)."""
    from rlinf_twoworker.engines.models import mark_dynamic_layers

    hidden_size = model.config.hidden_size
    seen: list[torch.Tensor] = []
    layers = model.model.layers
    try:
        for layer in layers:  # record what the compiled call would get, without compiling
            layer._compiled_call_impl = lambda *args, _layer=layer, **kwargs: (
                seen.append(args[0] if args else kwargs["hidden_states"]),
                _layer.forward(*args, **kwargs),
            )[1]
        mark_dynamic_layers(model)
        ids = torch.randint(3, 60, (3, hidden_size))
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    finally:
        for layer in layers:
            layer._compiled_call_impl = None
    assert len(seen) == len(layers)
    for hidden in seen:
        assert hidden.shape == (3, hidden_size, hidden_size)
        assert hidden._dynamo_weak_dynamic_indices == {0, 1}


def test_weights_travel_in_the_consumers_dtype():
    """One dtype for both consumers when they share it; float32 when rollout and inference
    differ, so each casts once to its own precision (inference gets its own, not the
    rollout's)."""
    from rlinf_twoworker.config import load_config, to_typed
    from rlinf_twoworker.run.step import sync_dtype

    def dtype(*overrides: str) -> str:
        return sync_dtype(to_typed(load_config(overrides=overrides)))

    assert dtype() == "bfloat16"  # rollout's and inference's default precision on GPUs
    fp16 = ("rollout.model.precision=fp16", "inference.model.precision=fp16")
    assert dtype(*fp16) == "float16"
    assert dtype("rollout.model.precision=fp16") == "float32"  # inference stays bf16
    assert dtype("cluster.accelerator=cpu") == "float32"  # CPUs always run fp32


def _broken_backend(graph, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


def test_run_or_eager_redoes_a_compiler_failure_eagerly_and_nothing_else():
    """The fallback the actor and inference share: a real torch.compile failure warns, goes
    eager and runs again; a model's own error, or a failure while eager, propagates."""
    state = {"compiled": True}
    compiled = torch.compile(lambda x: x * 2 + 1, backend=_broken_backend)

    def run() -> torch.Tensor:
        x = torch.ones(3)
        return compiled(x) if state["compiled"] else x * 2 + 1

    def go_eager() -> None:
        state["compiled"] = False

    with pytest.warns(
        UserWarning,
        match=r"(?s)^inference rank 0: the kernel failed \(BackendCompilerFailed: .+\); eager now$",
    ):
        out = run_or_eager(run, True, go_eager, "inference rank 0: the kernel", "eager now")
    assert torch.equal(out, torch.full((3,), 3.0)) and state == {"compiled": False}

    state["compiled"] = True  # a compiler failure in code not marked compiled is not retried
    with pytest.raises(RuntimeError, match="cannot compile"):
        run_or_eager(run, False, go_eager, "x", "y")
    assert state == {"compiled": True}

    calls: list[str] = []

    def model_error() -> None:
        calls.append("run")
        raise ValueError("shapes do not match")

    with pytest.raises(ValueError, match="shapes do not match"):
        run_or_eager(model_error, True, lambda: calls.append("eager"), "x", "y")
    assert calls == ["run"]


@pytest.mark.parametrize(("value", "packed"), [(None, True), ("1", True), ("0", False)])
def test_rows_are_packed_unless_the_environment_says_0(monkeypatch, value, packed):
    """Rows are packed by default and with RLINF_PACK_LEFT=1, masked with RLINF_PACK_LEFT=0,
    and any other value than 0 or 1 is refused by name instead of read as one of the two."""
    from rlinf_twoworker.engines.config_rules import PACK_ENV, packs_left

    if value is None:
        monkeypatch.delenv(PACK_ENV, raising=False)
    else:
        monkeypatch.setenv(PACK_ENV, value)
    assert packs_left() is packed
    monkeypatch.setenv(PACK_ENV, "yes")
    with pytest.raises(ValueError, match="RLINF_PACK_LEFT='yes'"):
        packs_left()

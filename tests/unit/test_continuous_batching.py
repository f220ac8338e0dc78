"""Continuous batching in the static engine: answers equal those of one static batch, slots
are refilled as answers end, and the slots are sized to memory (engines/kv_memory.py)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support import generate_greedy, tiny_lm

from rlinf_twoworker.api.demo import demo_config, make_inputs
from rlinf_twoworker.config import to_typed
from rlinf_twoworker.config.settings import rollout_settings
from rlinf_twoworker.engines.kv_memory import (
    HEADROOM,
    decode_bytes_per_slot,
    kv_bytes_per_slot,
    prefill_margin_bytes,
    slot_bytes,
    slots_that_fit,
)
from rlinf_twoworker.engines.static import SamplingSettings, StaticEngine, StaticSampler
from rlinf_twoworker.errors import TwoWorkerError
from rlinf_twoworker.workers.rollout import RolloutWorker, left_pad

VOCAB, WIDTH, NEW = 61, 8, 40


def _tiny_lm(arch: str) -> Any:
    """A seeded random fp32 model of a few thousand weights; a sharpened output layer keeps
    greedy choices far from ties, and Qwen3 gets non-trivial q/k norms and a head_dim apart
    from hidden / heads."""
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tiny_lm(arch, vocab=VOCAB, seed=None, max_position_embeddings=128, **extra)
        with torch.no_grad():
            model.lm_head.weight.mul_(4.0)
            for layer in model.model.layers if arch == "qwen3" else []:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


def _prompts(rows: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` prompts of 1 to WIDTH tokens, left-padded to WIDTH (pad id 0)."""
    generator = torch.Generator().manual_seed(1)
    lengths = [1 + i % WIDTH for i in range(rows)]
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]
    return left_pad(prompts, pad_id=0, width=WIDTH)


def _lengths(answers: torch.Tensor, eos: list[int]) -> list[int]:
    """Each answer's length up to and including its first EOS."""
    out = []
    for row in answers.tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        out.append(ends[0] + 1 if ends else len(row))
    return out


def _eos_at_varied_lengths(answers: torch.Tensor) -> list[int]:
    """The token whose first appearance is spread over the most answer lengths (from the
    answers without EOS), declared the EOS: answers then end at varied steps."""
    return [max(range(1, VOCAB), key=lambda t: (len(set(_lengths(answers, [t]))), -t))]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_continuous_batching_answers_equal_one_static_batch(arch, penalty, device):
    """12 rows in 4 slots against one batch of 12 slots, greedy, answers ending at varied
    lengths (EOS between steps 1 and 40): the same answers in the same order, and slots were
    refilled (8 rows took the slot of a finished one). On CUDA: compiled kernels, graph
    replays, refills written between replays."""
    model = _tiny_lm(arch).to(device)
    ids, mask = _prompts()
    greedy = SamplingSettings(do_sample=False, repetition_penalty=penalty)
    unended = StaticSampler(model, 12, WIDTH + NEW).generate(ids, mask, NEW, [-1], 0, greedy)
    # 30 more ids the model never emits: past the count torch.isin checks without sorting, a
    # host sync that a captured decode step cannot hold.
    eos = _eos_at_varied_lengths(unended) + list(range(VOCAB, VOCAB + 30))
    lengths = _lengths(unended, eos)
    assert len(set(lengths)) >= 4 and min(lengths) < 16 < max(lengths), lengths

    static = StaticSampler(model, 12, WIDTH + NEW)
    reference = static.generate(ids, mask, NEW, eos, 0, greedy)
    assert static.stats.prefills == 1 and static.stats.refilled_rows == 0
    continuous = StaticSampler(model, 4, WIDTH + NEW)
    for _ in range(2):  # the second run reuses the slots' stale caches
        answers = continuous.generate(ids, mask, NEW, eos, 0, greedy)
        assert torch.equal(answers, reference)
        assert continuous.stats.refilled_rows == 8 and continuous.stats.prefills >= 3
    assert _lengths(answers, eos) == lengths
    assert answers.shape == (12, max(lengths))
    if penalty != 1.0:
        return  # generate would count the left padding as seen tokens
    ref_hf = generate_greedy(model, ids, mask, NEW, eos[0])
    assert torch.equal(answers, ref_hf)  # and both are generate's tokens


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_decode_reads_only_the_filled_columns_and_answers_stay_generates(arch, device):
    """Decode attention reads the first W cache columns, W the longest live answer's filled
    length rounded up to read_step (here 8 of 48): the same greedy answers as a sampler that
    reads every column and as generate, with refills (12 rows, 4 slots), and well under the
    whole cache read per step on average."""
    model = _tiny_lm(arch).to(device)
    ids, mask = _prompts()
    greedy = SamplingSettings(do_sample=False)
    unended = StaticSampler(model, 12, WIDTH + NEW).generate(ids, mask, NEW, [-1], 0, greedy)
    eos = _eos_at_varied_lengths(unended)
    whole = StaticSampler(model, 4, WIDTH + NEW, read_step=WIDTH + NEW)
    reference = whole.generate(ids, mask, NEW, eos, 0, greedy)
    assert whole.stats.mean_read_fraction == 1.0
    windowed = StaticSampler(model, 4, WIDTH + NEW, read_step=8)
    for _ in range(2):  # the second run starts from the first's stale caches and columns
        answers = windowed.generate(ids, mask, NEW, eos, 0, greedy)
        assert torch.equal(answers, reference)
        assert windowed.stats.refilled_rows == 8
        assert windowed.stats.mean_read_fraction < 0.9, windowed.stats
    assert torch.equal(
        answers, generate_greedy(model, ids, mask, NEW, eos[0])[:, : answers.shape[1]]
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_a_groups_prompt_is_prefilled_once_and_its_answers_stay_generates(arch, device):
    """GRPO rows: 3 prompts x 4 answers each (each prompt repeated in consecutive rows). Each
    distinct prompt is forwarded once and its keys copied into its group's slots; greedy
    answers equal generate's for every row, with 5 slots (a group split over refills), and
    sampled answers of one group still differ."""
    model = _tiny_lm(arch).to(device)
    base_ids, base_mask = _prompts(3)
    ids, mask = base_ids.repeat_interleave(4, 0), base_mask.repeat_interleave(4, 0)
    greedy = SamplingSettings(do_sample=False)
    unended = StaticSampler(model, 12, WIDTH + NEW).generate(ids, mask, NEW, [-1], 0, greedy)
    eos = _eos_at_varied_lengths(unended)
    sampler = StaticSampler(model, 5, WIDTH + NEW, read_step=8)
    answers = sampler.generate(ids, mask, NEW, eos, 0, greedy)
    # The first fill holds prompt 0 (4 rows) and prompt 1 (1 row): two forwards' rows; the
    # refills forward each distinct prompt they meet once more.
    assert sampler.stats.prefill_rows < 12, sampler.stats
    assert sampler.stats.prefill_rows >= 3
    expected = generate_greedy(model, ids, mask, NEW, eos[0])[:, : answers.shape[1]]
    assert torch.equal(answers, expected)
    one_fill = StaticSampler(model, 12, WIDTH + NEW)
    one_fill.generate(ids, mask, NEW, eos, 0, greedy)
    assert one_fill.stats.prefill_rows == 3 and one_fill.stats.prefills == 1
    torch.manual_seed(0)
    sampled = one_fill.generate(ids, mask, NEW, [-1], 0, SamplingSettings(do_sample=True))
    assert len({tuple(row) for row in sampled[:4].tolist()}) > 1


def test_each_slot_reads_its_prompt_from_a_slot_that_holds_it():
    """The split-KV kernel reads a slot's prompt columns from `source[slot]` (its group's first
    slot). Sampled GRPO rows (4 prompts x 3 answers) ending at varied lengths in 5 slots, so a
    group's first slot is refilled while others of its group still decode: after every fill,
    each slot's source holds that slot's prompt keys, values and mask (its own slot once the
    source has taken another prompt), and a group's later slots point at its first."""
    model = _tiny_lm("qwen2")
    base_ids, base_mask = _prompts(4)
    ids, mask = base_ids.repeat_interleave(3, 0), base_mask.repeat_interleave(3, 0)
    sampler = StaticSampler(model, 5, WIDTH + NEW)
    checks = {"fills": 0, "shared": 0, "orphaned": 0}
    fill = sampler._fill

    def checked_fill(free, slots, *args):
        before = sampler.source.clone()
        fill(free, slots, *args)
        checks["fills"] += 1
        # The prompts' columns: WIDTH less the padding every row shares (dropped).
        p = sampler.stats.prompt_columns
        for slot in range(5):
            src = int(sampler.source[slot])
            assert torch.equal(sampler.k[:, src, :, :p], sampler.k[:, slot, :, :p])
            assert torch.equal(sampler.v[:, src, :, :p], sampler.v[:, slot, :, :p])
            assert torch.equal(sampler.valid[src, :p], sampler.valid[slot, :p])
            checks["shared"] += src != slot
            was = int(before[slot])
            checks["orphaned"] += slot not in free.tolist() and was != slot and src == slot

    sampler._fill = checked_fill
    torch.manual_seed(0)
    answers = sampler.generate(ids, mask, NEW, [3, 4, 5], 0, SamplingSettings(do_sample=True))
    assert sampler.stats.refilled_rows == 7 and checks["fills"] >= 3
    assert sampler.stats.prompt_columns == 4  # prompts of 1 to 4 tokens
    assert len(set(_lengths(answers, [3, 4, 5]))) >= 3
    assert checks["shared"] > 0 and checks["orphaned"] > 0, checks


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_more_slots_than_rows_and_answers_of_max_new_tokens(device):
    """3 rows in 8 slots (5 idle) with no EOS: every answer is max_new long, as one batch's."""
    model = _tiny_lm("qwen2").to(device)
    ids, mask = _prompts(3)
    greedy = SamplingSettings(do_sample=False)
    reference = StaticSampler(model, 3, WIDTH + NEW).generate(ids, mask, NEW, [-1], 0, greedy)
    sampler = StaticSampler(model, 8, WIDTH + NEW)
    assert torch.equal(sampler.generate(ids, mask, NEW, [-1], 0, greedy), reference)
    assert reference.shape == (3, NEW) and sampler.stats.decode_steps == NEW


def test_the_engine_sizes_its_slots_by_max_batch_size_and_the_memory_budget(caplog):
    """StaticEngine takes every row: slots = min(rows, max_batch_size, what the budget holds),
    and logs each sampler it builds with its decode attention; a budget below one slot stops
    with an error that says what to do."""
    model = _tiny_lm("qwen2")
    ids, mask = _prompts()
    greedy = SamplingSettings(do_sample=False)
    per_slot = slot_bytes(model.config, WIDTH + NEW, torch.float32)
    reference = StaticEngine(model).generate(ids, mask, NEW, [5], 0, greedy)
    for limits, slots in (
        ({"max_batch_size": 4}, 4),
        ({"max_batch_size": 4, "memory_budget_bytes": 3 * per_slot + 1}, 3),
        ({"memory_budget_bytes": 5 * per_slot}, 5),
    ):
        engine = StaticEngine(model, **limits, where="rollout rank 0")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="rlinf_twoworker"):
            assert torch.equal(engine.generate(ids, mask, NEW, [5], 0, greedy), reference)
            engine.generate(ids, mask, NEW, [5], 0, greedy)  # the same sampler: no new line
        assert engine.last_run is not None
        assert (engine.last_run.rows, engine.last_run.slots) == (12, slots), limits
        built = f"rollout rank 0: a sampler of {slots} slots x {WIDTH + NEW} cache columns, "
        assert caplog.messages == [built + "decode attention grouped"]  # CPU: the product
    engine = StaticEngine(model, memory_budget_bytes=per_slot - 1, where="rollout rank 0")
    with pytest.raises(TwoWorkerError, match=r"\(rollout rank 0\).*runner.seq_length"):
        engine.generate(ids, mask, NEW, [5], 0, greedy)


TINY = SimpleNamespace(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_memory_arithmetic_against_hand_computed_sizes():
    # KV: 2 (k, v) x 2 layers x 2 KV heads x 40 columns x head_dim 8 (32 / 4) x 4 bytes.
    assert kv_bytes_per_slot(TINY, 40, torch.float32) == 10240
    assert kv_bytes_per_slot(TINY, 40, torch.bfloat16) == 5120
    qwen3 = SimpleNamespace(**vars(TINY), head_dim=16)  # head_dim apart from hidden / heads
    assert kv_bytes_per_slot(qwen3, 40, torch.float32) == 20480
    # Decode: 40 columns x (1 valid + 8 out) = 360; 4 heads x 40 columns x 12 = 1920; 61
    # vocabulary entries x (4 logits + 64 working copies + 1 seen) = 4209; 64 scalars.
    assert decode_bytes_per_slot(TINY, 40, torch.float32) == 6553
    assert slot_bytes(TINY, 40, torch.float32) == 16793
    # Prefill of 8-token prompts: 16384 // 8 = 2048 rows, 16384 tokens x (4 x 32 hidden +
    # (4 + 2 x 2) x 8 q/k/v + 3 x 64 intermediate = 384) x 4 bytes = 25165824; scores 2048 rows
    # x 4 heads x 8 x 8 x 4 = 2097152; logits 2048 x 61 x (4 + 4) = 999424; and the headroom.
    assert prefill_margin_bytes(TINY, 8, torch.float32) == 28262400 + HEADROOM
    # The DeepSeek-R1-Distill-Qwen-1.5B shape at 8k tokens in bf16: 2 x 28 x 2 x 8192 x 128 x 2.
    qwen_1p5b = SimpleNamespace(num_hidden_layers=28, num_attention_heads=12, hidden_size=1536)
    qwen_1p5b.num_key_value_heads = 2
    assert kv_bytes_per_slot(qwen_1p5b, 8192, torch.bfloat16) == 234881024  # 224 MiB


def test_slots_that_fit_free_memory_and_budget():
    per_slot, margin = (
        slot_bytes(TINY, 40, torch.float32),
        prefill_margin_bytes(TINY, 8, torch.float32),
    )

    def fit(wanted: int, free: int | None, budget: int | None = None) -> int:
        return slots_that_fit(TINY, 40, 8, torch.float32, wanted, free, budget)

    assert fit(12, None) == 12  # a CPU: no memory query, no budget
    assert fit(12, margin + 3 * per_slot + per_slot // 2) == 3  # the margin stays free
    assert fit(2, margin + 3 * per_slot) == 2
    assert fit(12, margin + 10 * per_slot, budget=4 * per_slot) == 4
    assert fit(12, None, budget=7 * per_slot - 1) == 6


def test_nothing_fits_says_what_where_and_what_to_do():
    per_slot, margin = (
        slot_bytes(TINY, 40, torch.float32),
        prefill_margin_bytes(TINY, 8, torch.float32),
    )
    with pytest.raises(TwoWorkerError) as info:
        slots_that_fit(
            TINY, 40, 8, torch.float32, 12, margin + per_slot - 1, None, "rollout rank 1", "GPU 0"
        )
    said = str(info.value)
    assert f"one decode slot needs 0.000 GiB ({per_slot} bytes)" in said
    assert f"GPU 0 has {(margin + per_slot - 1) / 2**30:.3f} GiB" in said
    assert "(rollout rank 1)" in said
    assert "Lower runner.seq_length" in said and "free memory on that GPU" in said
    with pytest.raises(TwoWorkerError, match=r"memory budget is 0.000 GiB \(100 bytes\)"):
        slots_that_fit(TINY, 40, 8, torch.float32, 12, None, 100)


def test_the_rollout_worker_hands_every_row_to_a_continuous_engine(tmp_path):
    """rollout.max_batch_size=3 bounds the static engine's slots, not its rows: one call with
    all 8 rows (4 prompts x group_size 2), the answers equal to one batch's (greedy); the hf
    engine still gets chunks."""
    demo = make_inputs(tmp_path / "inputs", task="arithmetic")
    answers = {}
    for engine, batch in (("static", 3), ("static", 256), ("hf", 3)):
        cfg = demo_config(
            demo,
            tmp_path / "runs",
            f"cb-{engine}-{batch}",
            [
                f"rollout.model.model_path={json.dumps(str(demo.model_path))}",
                f"rollout.engine={engine}",
                f"rollout.max_batch_size={batch}",
                "algorithm.sampling_params.do_sample=false",
            ],
        )
        worker = RolloutWorker(rollout_settings(to_typed(cfg)))
        assert worker.engine.continuous is (engine == "static")
        prompts = [worker.tokenizer(t)["input_ids"] for t in ("1+2=", "Hi 7", "x", "12*3?")]
        batch_out = worker.generate(prompts, seed=0).batch
        answers[engine, batch] = [
            r[m.bool()].tolist() for r, m in zip(batch_out.responses, batch_out.response_mask)
        ]
        if engine == "static":
            run = worker.engine.last_run
            assert run is not None and (run.rows, run.slots) == (8, min(8, batch))
    assert answers["static", 3] == answers["static", 256] == answers["hf", 3]

"""Reading AReaL-boba JSONL, the resumable prompt sampler, and prompt tokenisation."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from rlinf_twoworker.storage.data import (
    DataError,
    PromptSampler,
    Sample,
    encode_prompts,
    load_jsonl,
)

PROMPT = "<｜User｜>What is 6*7? Please reason step by step.<｜Assistant｜><think>\n"


def _write(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _line(**obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False)


def test_reads_samples_in_order_and_normalises_solutions(tmp_path):
    first = _write(
        tmp_path / "a.jsonl",
        [
            _line(prompt=PROMPT, task="math", query_id="q1", solutions=["\\boxed{42}"]),
            "",
            _line(prompt="p2", solutions="\\boxed{7}", query_id=17),
        ],
    )
    second = _write(tmp_path / "b.jsonl", [_line(prompt="p3", solutions=["1", "one"])])
    samples = load_jsonl([first, second])
    assert samples == [
        Sample(PROMPT, ["\\boxed{42}"], "q1"),
        Sample("p2", ["\\boxed{7}"], "17"),
        Sample("p3", ["1", "one"], None),
    ]


def test_custom_keys(tmp_path):
    path = _write(tmp_path / "c.jsonl", [_line(question="q", answer="\\boxed{1}")])
    assert load_jsonl([path], prompt_key="question", answer_key="answer") == [
        Sample("q", ["\\boxed{1}"], None)
    ]


@pytest.mark.parametrize(
    "bad, problem",
    [
        ('{"prompt": "p", "solutions": ', "invalid JSON"),
        ('["prompt", "solutions"]', "expected a JSON object, got list"),
        (_line(solutions=["1"]), "key 'prompt'"),
        (_line(prompt="p", solutions=[1]), "key 'solutions'"),
        (_line(prompt="p", solutions=[]), "key 'solutions'"),
    ],
)
def test_malformed_line_names_file_line_problem_and_setting(tmp_path, bad, problem):
    path = _write(tmp_path / "bad.jsonl", [_line(prompt="p", solutions="1"), "", bad])
    with pytest.raises(DataError) as info:
        load_jsonl([path])
    message = str(info.value)
    assert f"{path}:3:" in message
    assert problem in message
    assert "data.skip_malformed_lines=true" in message


def test_skip_mode_skips_and_counts(tmp_path, caplog):
    path = _write(
        tmp_path / "mixed.jsonl",
        ["not json", _line(prompt="p", solutions="1"), "42", _line(prompt="q", solutions="2")],
    )
    with caplog.at_level(logging.WARNING, logger="rlinf_twoworker.storage.data"):
        samples = load_jsonl([path], skip_malformed=True)
    assert [s.prompt for s in samples] == ["p", "q"]
    assert "skipped 2 malformed line(s)" in caplog.text
    assert f"{path}:1:" in caplog.text
    notes: list[str] = []  # the run passes its own log, so the count lands in log/main.log
    load_jsonl([path], skip_malformed=True, log=notes.append)
    assert len(notes) == 1 and notes[0].startswith("skipped 2 malformed line(s)")


def test_empty_or_missing_data_is_an_error(tmp_path):
    empty = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match="no samples"):
        load_jsonl([empty])
    all_bad = _write(tmp_path / "bad.jsonl", ["nope"])
    with pytest.raises(DataError, match="no samples"):
        load_jsonl([all_bad], skip_malformed=True)
    with pytest.raises(DataError, match="cannot read data file .*missing.jsonl"):
        load_jsonl([str(tmp_path / "missing.jsonl")])


def _draw(sampler: PromptSampler, n: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(n)]


def test_sampler_is_deterministic_per_seed():
    assert _draw(PromptSampler(20, 4, True, 1234), 12) == _draw(
        PromptSampler(20, 4, True, 1234), 12
    )
    assert _draw(PromptSampler(20, 4, True, 1234), 5) != _draw(PromptSampler(20, 4, True, 1), 5)


def test_sampler_epochs_drop_the_remainder_and_reshuffle():
    sampler = PromptSampler(10, 4, shuffle=True, seed=7)
    epoch0 = sampler.next_batch() + sampler.next_batch()
    assert len(set(epoch0)) == 8 and sampler.epoch == 0
    epoch1 = sampler.next_batch() + sampler.next_batch()
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["position"] == 8
    assert len(set(epoch1)) == 8
    assert epoch0 != epoch1


def _rlinf_batches(num_samples: int, batch_size: int, seed: int, steps: int) -> list[list[int]]:
    """RLinf's training loader's batches (rlinf/runners/reasoning_runner.py:166-186): a torch
    RandomSampler over a generator seeded once with data.seed, batched with drop_last, one
    pass a epoch (`for batch in self.train_dataloader` inside the epoch loop)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    sampler = torch.utils.data.RandomSampler(range(num_samples), generator=generator)
    batches = torch.utils.data.BatchSampler(sampler, batch_size, drop_last=True)
    out: list[list[int]] = []
    while len(out) < steps:
        out.extend(list(batch) for batch in batches)
    return out[:steps]


@pytest.mark.parametrize(("num_samples", "batch_size"), [(10, 4), (12, 4), (50, 8), (7, 7)])
def test_sampler_order_is_rlinfs_across_epochs(num_samples, batch_size):
    steps = 4 * (num_samples // batch_size) + 1  # four epochs and a step of the fifth
    expected = _rlinf_batches(num_samples, batch_size, 1234, steps)
    assert _draw(PromptSampler(num_samples, batch_size, True, 1234), steps) == expected


def test_sampler_resumed_anywhere_continues_rlinfs_order(tmp_path):
    expected = _rlinf_batches(10, 3, 1, 12)
    for stop in range(1, 11):  # stops inside an epoch and at epoch boundaries
        original = PromptSampler(10, 3, shuffle=True, seed=1)
        assert _draw(original, stop) == expected[:stop]
        torch.save({"sampler": original.state_dict()}, tmp_path / "data.pt")
        state = torch.load(tmp_path / "data.pt", weights_only=True)["sampler"]
        resumed = PromptSampler(10, 3, shuffle=True, seed=1)
        resumed.load_state_dict(state)
        assert _draw(resumed, 12 - stop) == expected[stop:], stop


def test_sampler_without_shuffle_walks_in_order():
    sampler = PromptSampler(10, 4, shuffle=False, seed=0)
    assert _draw(sampler, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


def test_sampler_state_round_trip_continues_exactly(tmp_path):
    original = PromptSampler(10, 3, shuffle=True, seed=1234)
    _draw(original, 4)  # into the second epoch
    torch.save({"sampler": original.state_dict()}, tmp_path / "data.pt")
    state = torch.load(tmp_path / "data.pt", weights_only=True)["sampler"]
    resumed = PromptSampler(10, 3, shuffle=True, seed=1234)
    resumed.load_state_dict(state)
    assert _draw(resumed, 7) == _draw(original, 7)


@pytest.mark.parametrize("changed", ["num_samples", "batch_size", "seed"])
def test_sampler_state_must_fit_the_data(changed):
    state = PromptSampler(10, 3, True, 1).state_dict()
    state[changed] += 1
    with pytest.raises(DataError, match=f"{changed} was"):
        PromptSampler(10, 3, True, 1).load_state_dict(state)


def test_sampler_rejects_batches_larger_than_the_data():
    with pytest.raises(DataError, match="data.rollout_batch_size=5"):
        PromptSampler(4, 5, True, 0)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A 6-word tokenizer that, like DeepSeek-R1-Distill's, prepends BOS by default."""
    vocab = {"[UNK]": 0, "<bos>": 1, "a": 2, "b": 3, "c": 4, "d": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 1)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", unk_token="[UNK]")


def test_encode_prompts_keeps_the_first_tokens_as_rlinf_with_one_warning(tokenizer):
    """RLinf's ReasoningDataset: `tokenizer.encode(prompt)[: max_prompt_length]`, BOS kept."""
    warnings: list[str] = []
    prompts = ["a b c d", "a", "d c b a"]
    ids = encode_prompts(tokenizer, prompts, 3, log=warnings.append)
    assert ids == [tokenizer.encode(p)[:3] for p in prompts]
    assert ids == [[1, 2, 3], [1, 2], [1, 5, 4]]
    assert len(warnings) == 1
    assert "2 of 3 prompts" in warnings[0] and "data.max_prompt_length=3" in warnings[0]
    assert "first 3 tokens" in warnings[0]


def test_encode_prompts_special_tokens(tokenizer):
    warnings: list[str] = []
    assert encode_prompts(tokenizer, ["a b"], 8, log=warnings.append) == [[1, 2, 3]]
    assert encode_prompts(tokenizer, ["<bos> a b"], 8, log=warnings.append) == [[1, 2, 3]]
    plain = encode_prompts(tokenizer, ["a b"], 8, add_special_tokens=False, log=warnings.append)
    assert plain == [[2, 3]]
    assert warnings == []

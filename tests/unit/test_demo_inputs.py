"""The embedded demo inputs: a loadable tiny Qwen2 model, AReaL-boba data, manifests, config."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from math_verify import parse, verify
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlinf_twoworker.api.demo import DemoInputs, demo_config, make_inputs, make_samples
from rlinf_twoworker.config import to_typed
from rlinf_twoworker.errors import ConfigError
from rlinf_twoworker.storage.data import PromptSampler, encode_prompts
from rlinf_twoworker.workers.reward import grade_one
from rlinf_twoworker.workers.rollout import left_pad


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> DemoInputs:
    return make_inputs(tmp_path_factory.mktemp("demo"), task="arithmetic", num_samples=16)


def _manifest(directory: Path) -> dict[str, str]:
    lines = (directory / "SHA256SUMS").read_text().splitlines()
    return {name: digest for digest, name in (line.split("  ", 1) for line in lines)}


def test_model_and_tokenizer_load_and_generate(inputs: DemoInputs) -> None:
    tokenizer = AutoTokenizer.from_pretrained(inputs.model_path)
    model = AutoModelForCausalLM.from_pretrained(inputs.model_path)
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size >= len(tokenizer)
    assert len(tokenizer) < 100
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        assert getattr(model.config, key) == getattr(tokenizer, key) is not None
    prompt = json.loads(inputs.data_path.read_text().splitlines()[0])["prompt"]
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert ids.shape[1] <= 64  # fits data.max_prompt_length of demo_config
    assert tokenizer.decode(ids[0]) == prompt
    out = model.generate(ids, max_new_tokens=4, do_sample=True, min_new_tokens=4)
    assert out.shape[1] == ids.shape[1] + 4
    assert tokenizer.unk_token_id not in tokenizer(prompt)["input_ids"]


def test_manifests_match_files(inputs: DemoInputs) -> None:
    model_files = {p.name for p in inputs.model_path.iterdir() if p.name != "SHA256SUMS"}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= (
        model_files
    )
    for directory, expected in (
        (inputs.model_path, model_files),
        (inputs.data_path.parent, {inputs.data_path.name}),
    ):
        manifest = _manifest(directory)
        assert set(manifest) == expected
        for name, digest in manifest.items():
            assert hashlib.sha256((directory / name).read_bytes()).hexdigest() == digest


def test_data_file_is_areal_boba(inputs: DemoInputs) -> None:
    records = [json.loads(line) for line in inputs.data_path.read_text().splitlines()]
    assert len(records) == 16
    assert [r["query_id"] for r in records] == [f"demo-{i}" for i in range(16)]
    for record in records:
        assert record["task"] == "math"
        assert record["prompt"].startswith("<｜User｜>What is ")
        assert record["prompt"].endswith("\\boxed{}.<｜Assistant｜><think>\n")
        question = record["prompt"].split("What is ")[1].split("?")[0]
        assert record["solutions"] == [f"\\boxed{{{eval(question)}}}"]


def test_inputs_are_deterministic_and_rebuildable(tmp_path: Path) -> None:
    first = make_inputs(tmp_path / "a", task="digit7", num_samples=4, seed=3)
    (first.model_path / "stale.bin").write_bytes(b"old")
    again = make_inputs(tmp_path / "a", task="digit7", num_samples=4, seed=3)
    other = make_inputs(tmp_path / "b", task="digit7", num_samples=4, seed=3)
    assert not (again.model_path / "stale.bin").exists()
    assert _manifest(again.model_path) == _manifest(other.model_path)
    assert again.data_path.read_bytes() == other.data_path.read_bytes()
    assert make_samples("arithmetic", 8, 1) != make_samples("arithmetic", 8, 2)


def test_digit7_bare_seven_is_one_token_and_graded_right(tmp_path: Path) -> None:
    inputs = make_inputs(tmp_path, task="digit7", num_samples=8)
    records = [json.loads(line) for line in inputs.data_path.read_text().splitlines()]
    assert all(r["solutions"] == ["\\boxed{7}"] for r in records)
    assert all("7" in r["prompt"] for r in records)
    tokenizer = AutoTokenizer.from_pretrained(inputs.model_path)
    seven = tokenizer("7", add_special_tokens=False)["input_ids"]
    assert len(seven) == 1
    answer = tokenizer.decode([*seven, tokenizer.eos_token_id], skip_special_tokens=True)
    gold = parse("\\boxed{7}")
    assert verify(gold, parse(answer))
    assert not verify(gold, parse("8"))
    assert not verify(gold, parse("77"))


def test_make_inputs_rejects_unknown_task(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="digit7"):
        make_inputs(tmp_path, task="poetry")


def test_demo_config_sets_the_demo_keys(inputs: DemoInputs, tmp_path: Path) -> None:
    cfg = demo_config(inputs, tmp_path / "runs", "1e5", ["runner.max_steps=3"])
    model = str(inputs.model_path.resolve())
    assert cfg.cluster.accelerator == "cpu"
    assert (cfg.cluster.num_nodes, cfg.cluster.num_gpus_per_node) == (2, 2)
    assert dict(cfg.cluster.component_placement) == {
        "rollout": 0,
        "inference": 1,
        "actor": "2-3",
        "reward": 0,
    }
    assert cfg.actor.model.model_path == cfg.rollout.model.model_path == model
    assert cfg.inference.model.model_path == cfg.actor.tokenizer.tokenizer_model == model
    assert list(cfg.data.train_data_paths) == [str(inputs.data_path.resolve())]
    assert cfg.runner.output_dir == str((tmp_path / "runs").resolve())
    assert cfg.runner.experiment_name == "1e5"  # stays a string
    assert cfg.runner.max_steps == 3  # the caller's override wins
    assert (cfg.runner.save_interval, cfg.runner.seq_length) == (2, 96)
    assert (cfg.data.max_prompt_length, cfg.data.rollout_batch_size) == (64, 8)
    assert (cfg.algorithm.group_size, cfg.algorithm.n_minibatches) == (2, 4)
    assert list(cfg.cluster.preflight.required_modules) == [
        "torch",
        "transformers",
        "math_verify",
        "tensorboard",
    ]
    typed = to_typed(cfg)
    assert typed.max_new_tokens == 32
    assert typed.run_dir == (tmp_path / "runs" / "1e5").resolve()
    assert typed.actor.seed == typed.data.seed == 1234


def test_demo_config_rejects_a_bad_override(inputs: DemoInputs, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="runner.no_such_key"):
        demo_config(inputs, tmp_path, "run", ["runner.no_such_key=1"])


# -- the answer prior: a random policy that is sometimes right ----------------------------------


def _records(inputs: DemoInputs) -> list[dict]:
    return [json.loads(line) for line in inputs.data_path.read_text().splitlines()]


def _answer(
    model: torch.nn.Module, tokenizer: Any, records: list[dict], per_prompt: int, seed: int
) -> list[list[tuple[str, bool]]]:
    """Per record, `per_prompt` sampled answers (decoded as the rollout decodes them) and
    whether math_verify grades each right; the demo's sampling settings."""
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in records], max_prompt_length=64)
    ids, mask = left_pad([p for p in prompts for _ in range(per_prompt)], tokenizer.pad_token_id)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            max_new_tokens=32,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )[:, ids.shape[1] :]
    groups = []
    for i, record in enumerate(records):
        rows = out[i * per_prompt : (i + 1) * per_prompt]
        texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
        groups.append(
            [
                (_shape(row, t, tokenizer), grade_one(t, record["solutions"]))
                for row, t in zip(rows, texts)
            ]
        )
    return groups


def _shape(row: torch.Tensor, text: str, tokenizer: Any) -> str:
    """The answer's text when it is one digit then EOS, else '?'."""
    one_digit = len(text) == 1 and text.isdigit() and int(row[1]) == tokenizer.eos_token_id
    return text if one_digit else "?"


def _load(inputs: DemoInputs) -> tuple[torch.nn.Module, Any]:
    model = AutoModelForCausalLM.from_pretrained(inputs.model_path).eval()
    return model, AutoTokenizer.from_pretrained(inputs.model_path)


@pytest.mark.parametrize(("task", "largest"), [("add", 1), ("add-hard", 4)])
def test_addition_records_are_areal_boba_with_uniform_answers(task: str, largest: int) -> None:
    """Operands in 0..largest; every answer 0..2*largest about equally often, so a policy
    that ignores the prompt cannot beat the prior by always giving the commonest answer."""
    answers = 2 * largest + 1
    records = make_samples(task, 100 * answers, seed=5)
    counts = dict.fromkeys(range(answers), 0)
    operands = set()
    for record in records:
        assert record["prompt"].startswith("<｜User｜>What is ")
        assert record["prompt"].endswith("\\boxed{}.<｜Assistant｜><think>\n")
        question = record["prompt"].split("What is ")[1].split("?")[0]
        a, b = (int(x) for x in question.split("+"))
        operands |= {a, b}
        assert record["solutions"] == [f"\\boxed{{{a + b}}}"]
        counts[a + b] += 1
    assert operands == set(range(largest + 1))
    assert all(60 <= n <= 140 for n in counts.values()), counts  # 100 expected, sd < 10


def test_the_demo_model_answers_one_digit_and_is_right_about_a_third(tmp_path: Path) -> None:
    """The untrained demo model (the default inputs, as `rlinf-twoworker demo` makes them)
    answers with a digit 0..2 then EOS, and the grader finds about 1/3 of its answers right:
    the plain random model it replaces is almost never right, so the demo's GRPO advantages
    were all 0."""
    inputs = make_inputs(tmp_path, num_samples=40)
    model, tokenizer = _load(inputs)
    answers = [
        a for group in _answer(model, tokenizer, _records(inputs), 25, seed=0) for a in group
    ]
    shapes = [shape for shape, _ in answers]
    correct = sum(ok for _, ok in answers) / len(answers)
    assert len(answers) == 1000
    assert shapes.count("?") <= 20, shapes  # ~0.3% expected
    assert set(shapes) - {"?"} == {"0", "1", "2"}
    assert 0.15 <= correct <= 0.6, correct  # 0.34 over 4096 answers; 0.015 is one sd here


def test_the_demo_steps_have_groups_that_disagree(tmp_path: Path) -> None:
    """The demo's first two steps (its prompts, 8 x group_size 2, its seeds) each have a group
    whose two answers get different rewards, so the loss and the gradient are not 0. The
    per-step odds that all 8 groups agree are (5/9)^8, under 1%; over the first 20 steps'
    worth of prompts at most 2 such steps are allowed (expected 0.2), and on average at least
    2 of the 8 groups must disagree (expected 3.6, measured 3.25; today's demo: 0.15). The
    answers come from `generate`, not the rollout's sampler, so they are the demo's in
    distribution, not token for token."""
    inputs = make_inputs(tmp_path)
    cfg = to_typed(demo_config(inputs, tmp_path / "runs", "demo"))
    group, records = cfg.algorithm.group_size, _records(inputs)
    assert (cfg.data.rollout_batch_size, group) == (8, 2)
    sampler = PromptSampler(len(records), cfg.data.rollout_batch_size, True, cfg.data.seed)
    model, tokenizer = _load(inputs)
    disagreeing = []
    for step in range(1, 21):
        batch = [records[i] for i in sampler.next_batch()]
        groups = _answer(model, tokenizer, batch, group, seed=cfg.actor.seed + step)
        disagreeing.append(sum(len({ok for _, ok in g}) > 1 for g in groups))
    assert disagreeing[0] >= 1 and disagreeing[1] >= 1, disagreeing
    assert sum(n == 0 for n in disagreeing) <= 2, disagreeing
    assert sum(disagreeing) >= 2 * len(disagreeing), disagreeing  # 8 x 4/9 = 3.6 a step


def test_only_the_addition_tasks_get_the_prior(tmp_path: Path) -> None:
    """arithmetic and digit7 keep the plain random model that other tests rely on."""
    tasks = (("add", True), ("add-hard", True), ("arithmetic", False), ("digit7", False))
    for task, prior in tasks:
        model, tokenizer = _load(make_inputs(tmp_path / task, task=task, num_samples=2))
        seven = tokenizer.convert_tokens_to_ids("7")
        column = model.model.embed_tokens.weight.detach()[:, 0]
        assert bool(column.abs().max() < 0.2) != prior, task
        assert (float(column[seven]) == 1.0) == prior, task


def test_the_small_model_has_tens_of_millions_of_parameters_and_the_prior(
    tmp_path: Path,
) -> None:
    """The learning benchmark's model and task: 24M parameters, and one digit 0..8 then EOS,
    right about one time in nine on add-hard."""
    inputs = make_inputs(tmp_path, task="add-hard", num_samples=8, size="small")
    model, tokenizer = _load(inputs)
    parameters = sum(p.numel() for p in model.parameters())
    assert 10_000_000 <= parameters <= 100_000_000, parameters
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (8, 512)
    assert len(tokenizer) < 100  # the demo's tokenizer
    answers = [
        a for group in _answer(model, tokenizer, _records(inputs), 32, seed=0) for a in group
    ]
    shapes = [shape for shape, _ in answers]
    correct = sum(ok for _, ok in answers) / len(answers)
    assert shapes.count("?") <= 13, shapes  # 5% of 256
    assert len(set(shapes) - {"?"}) >= 7 and set(shapes) <= set("012345678?"), shapes
    assert 0.04 <= correct <= 0.25, correct  # 1/9 expected; +-0.02 is one standard error


def test_make_inputs_rejects_an_unknown_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="small"):
        make_inputs(tmp_path, size="huge")


def _digit_features(inputs: DemoInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """For "Write the digit d." (d = 0..8): the answer's distribution over the digits and the
    last hidden state at the answer's position, one row per d."""
    model, tokenizer = _load(inputs)
    digits = tokenizer.convert_tokens_to_ids(list("012345678"))
    before, after = make_samples("digit", 1, 0)[0]["prompt"].split("Write the digit ")
    probs, hidden = [], []
    for d in range(9):
        text = f"{before}Write the digit {d}{after[1:]}"
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        probs.append(out.logits[0, -1].softmax(-1)[digits])
        hidden.append(out.hidden_states[-1][0, -1])
    return torch.stack(probs), torch.stack(hidden)


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_the_reader_head_carries_the_prompts_digit_and_leaves_the_prior_uniform(
    tmp_path: Path, size: str
) -> None:
    """The learning benchmark's model: with the reader head the answer's last hidden state
    varies with the prompt's digit many times more than without, while the answer stays one
    digit, about uniform (right 1 time in 9), and EOS still follows a digit."""
    spread = {}
    for reader in (False, True):
        inputs = make_inputs(tmp_path / str(reader), "digit", 4, size=size, reader=reader)
        probs, hidden = _digit_features(inputs)
        assert bool((probs.sum(1) > 0.99).all()), probs.sum(1)  # a digit comes first
        answer = probs / probs.sum(1, keepdim=True)
        mean = answer.mean(0)
        entropy = float(-(mean * mean.log()).sum())
        assert entropy > 0.97 * float(torch.log(torch.tensor(9.0))), entropy
        assert abs(float(answer.diag().mean()) - 1 / 9) < 0.02  # nothing read out yet
        spread[reader] = float(
            (hidden - hidden.mean(0)).norm(dim=1).mean() / hidden.norm(dim=1).mean()
        )
    assert spread[True] > 10 * spread[False], spread


def test_the_reader_head_is_for_the_prior_tasks_only(tmp_path: Path) -> None:
    """reader=True on a task without the prior leaves its plain random model as it is."""
    plain = _load(make_inputs(tmp_path / "a", "digit7", 2))[0].state_dict()
    asked = _load(make_inputs(tmp_path / "b", "digit7", 2, reader=True))[0].state_dict()
    assert all(torch.equal(plain[k], asked[k]) for k in plain)

"""The embedded demo inputs: a loadable tiny Qwen2 model, AReaL-boba data, manifests, config."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from math_verify import parse, verify
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlinf_twoworker.config import to_typed
from rlinf_twoworker.demo import DemoInputs, demo_config, make_inputs, make_samples
from rlinf_twoworker.errors import ConfigError


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

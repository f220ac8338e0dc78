"""The embedded demo inputs: a tiny random Qwen2 model and a small math data set, made on the spot.

Nothing is downloaded. The model has the real model's architecture (Qwen2, untied embeddings,
grouped KV heads) at toy size, with a character-level tokenizer of 66 tokens, so that a random
policy answers a bare "7" (graded right against \\boxed{7}) with probability about 1/66 a token:
enough for a learning test to see reward. The data file has the AReaL-boba format and, like the
model, a SHA256SUMS manifest.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from rlinf_twoworker.config import load_config
from rlinf_twoworker.manifest import write_manifest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TASKS = ("arithmetic", "digit7")
DATA_NAME = "demo-math.jsonl"
USER, ASSISTANT, THINK = "<｜User｜>", "<｜Assistant｜>", "<think>"
BOS, EOS, PAD, UNK = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜pad｜>", "<｜unk｜>"
SPECIAL_TOKENS = (UNK, PAD, BOS, EOS, USER, ASSISTANT, THINK, "</think>")
INSTRUCTION = " Please reason step by step, and put your final answer within \\boxed{}."
# Whole-phrase tokens keep a prompt about 20 tokens long (data.max_prompt_length is 64) while
# every other piece of text, answers included, is spelled one character a token.
PHRASE_TOKENS = (INSTRUCTION, "What is ", "\\boxed{")
DIGIT7_QUESTIONS = ("Answer with the digit 7.", "Write the digit 7.", "Reply with 7.")
CHARACTERS = string.digits + string.ascii_lowercase + "APRW +-*=?.,:()\\{}\n"
MAX_POSITIONS = 2048
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@dataclass
class DemoInputs:
    root: Path
    model_path: Path
    """A Hugging Face model directory with its SHA256SUMS."""
    data_path: Path
    """The JSONL file; its SHA256SUMS lies beside it."""


def make_inputs(
    root: Path, task: str = "arithmetic", num_samples: int = 64, seed: int = 0
) -> DemoInputs:
    """Write root/model/ and root/data/demo-math.jsonl (each with SHA256SUMS); deterministic.

    Safe on an existing root: the model directory is rebuilt beside the old one and swapped in,
    and the data file and its manifest are overwritten.
    """
    if task not in TASKS:
        raise ValueError(f"demo task {task!r} is unknown; choose one of {', '.join(TASKS)}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    root = Path(root).resolve()
    model_path = _replace_dir(root / "model", lambda tmp: _write_model(tmp, seed))
    data_dir = root / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    data_path = data_dir / DATA_NAME
    _write_jsonl(data_path, make_samples(task, num_samples, seed))
    write_manifest(data_dir, [DATA_NAME])
    return DemoInputs(root=root, model_path=model_path, data_path=data_path)


def make_samples(task: str, num_samples: int, seed: int) -> list[dict]:
    """AReaL-boba records: prompt, task 'math', query_id, solutions ['\\boxed{answer}']."""
    rng = random.Random(seed)
    samples = []
    for i in range(num_samples):
        question, answer = _arithmetic(rng) if task == "arithmetic" else _digit7(rng)
        samples.append(
            {
                "prompt": f"{USER}{question}{INSTRUCTION}{ASSISTANT}{THINK}\n",
                "task": "math",
                "query_id": f"demo-{i}",
                "solutions": [f"\\boxed{{{answer}}}"],
            }
        )
    return samples


def _arithmetic(rng: random.Random) -> tuple[str, int]:
    a, b, op = rng.randint(0, 20), rng.randint(0, 20), rng.choice("+-*")
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    return f"What is {a}{op}{b}?", answer


def _digit7(rng: random.Random) -> tuple[str, int]:
    return rng.choice(DIGIT7_QUESTIONS), 7


def _write_jsonl(path: Path, samples: list[dict]) -> None:
    lines = "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples)
    path.write_text(lines, encoding="utf-8")


def _replace_dir(target: Path, build: Callable[[Path], None]) -> Path:
    """Build a directory under a temporary name, then swap it in for `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    build(tmp)
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return target


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with no merges, so one character is one token, plus the
    special and phrase tokens.

    Its pipeline is Qwen2's (split regex, byte-level, NFC): transformers 5 rebuilds a qwen2
    model's tokenizer as `Qwen2Tokenizer` from the saved vocabulary, and the two must agree.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre
    from transformers import PreTrainedTokenizerFast

    characters = sorted(set(CHARACTERS + "".join(DIGIT7_QUESTIONS)))
    symbols = [*SPECIAL_TOKENS, *(_byte_level_symbol(c) for c in characters)]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(symbols)}, merges=[]))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
            pre.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    backend.add_tokens([AddedToken(t, normalized=False) for t in PHRASE_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=MAX_POSITIONS,
    )


def _byte_level_symbol(character: str) -> str:
    """GPT-2's byte-to-unicode map for ASCII: printable bytes stand for themselves, bytes 0-32
    (space, newline) become chr(256 + byte)."""
    byte = ord(character)
    if byte > 126:
        raise ValueError(f"demo tokenizer characters are ASCII, got {character!r}")
    return character if 33 <= byte <= 126 else chr(256 + byte)


def _write_model(directory: Path, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),  # no ids the tokenizer cannot decode
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        dtype="float32",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG untouched
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    for path in directory.iterdir():  # transformers writes the weights 0600; other nodes read them
        path.chmod(0o644)
    write_manifest(directory)


def demo_config(
    inputs: DemoInputs, output_root: Path, run_id: str, overrides: Sequence[str] = ()
) -> DictConfig:
    """The tutorial's config at demo size on CPU: 2 nodes x 2 logical GPUs, 2 steps, short
    sequences; the caller's overrides come last."""
    model = json.dumps(str(Path(inputs.model_path).resolve()))
    demo = [
        "cluster.accelerator=cpu",
        "cluster.num_nodes=2",
        "cluster.num_gpus_per_node=2",
        "cluster.preflight.required_modules=[torch,transformers,math_verify,tensorboard]",
        f"actor.model.model_path={model}",
        f"rollout.model.model_path={model}",
        f"inference.model.model_path={model}",
        f"actor.tokenizer.tokenizer_model={model}",
        f"data.train_data_paths=[{json.dumps(str(Path(inputs.data_path).resolve()))}]",
        f"runner.output_dir={json.dumps(str(Path(output_root).resolve()))}",
        f"runner.experiment_name={json.dumps(run_id)}",  # quoted: '1e5' must stay a string
        "runner.max_steps=2",
        "runner.save_interval=2",
        "runner.seq_length=96",
        "data.max_prompt_length=64",
        "algorithm.group_size=2",
        "data.rollout_batch_size=8",
        "algorithm.n_minibatches=4",
    ]
    return load_config(overrides=[*demo, *overrides])

"""The embedded demo inputs: a small random Qwen2 model and a math data set, made on the spot.

Nothing is downloaded. The model has the real model's architecture (Qwen2, untied embeddings,
grouped KV heads) at toy size, with a character-level tokenizer of 66 tokens. The data file has
the AReaL-boba format and, like the model, a SHA256SUMS manifest.

For the addition tasks the untrained model gets a prior (`_add_answer_prior`): it answers with
one of the task's answer digits, uniformly, then EOS. A random policy is then right about one
time in three on "add", so GRPO groups disagree and the demo's first steps train (an answer that
is always wrong gives every advantage 0, a loss of 0 and a gradient of 0).
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
from rlinf_twoworker.storage.manifest import write_manifest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

ADD_TASKS = {"add": 1, "add-hard": 4}
"""Addition tasks: "What is a+b?" with a, b in 0..value and the answer (0..2, 0..8) uniform."""
PRIOR_TASKS = (*ADD_TASKS, "digit")
"""Tasks whose model gets the answer prior (one answer digit, then EOS)."""
TASKS = (*PRIOR_TASKS, "arithmetic", "digit7")
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
PRIOR_AXIS = 0
"""The hidden coordinate that carries "the current token is a digit" (+) or not (-)."""
PRIOR_MARGIN = 14.0
"""The prior's logit margin: the answer digits after a non-digit, EOS after a digit."""
READER_LOGIT = 8.0
"""The reader head's attention logit: +this for a digit token, -this for any other."""
READER_GAIN = 8.0
"""How much the reader head's values are raised over the random init (module docstring)."""


@dataclass(frozen=True)
class ModelSize:
    """A demo model's shape and the numbers of its answer prior."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    residual_scale: float
    """Multiplies the random init of every layer's o_proj and down_proj (GPT-2's scaled init,
    1/sqrt(2 x layers), for small): at the plain init 8 layers of width 512 add a vector of
    norm ~12 to the residual stream, which drowns the embeddings (norm ~0.45) and with them
    the prompt's tokens, so RL has almost nothing prompt-dependent to start from."""
    prior_scale: float
    """The embedding's PRIOR_AXIS value (+ for digits, - otherwise): it must outweigh what the
    layers add (norm ~0.2 for tiny, ~3 for small) and still leave the token's identity (the
    other coordinates) visible."""


# tiny: the CPU demo (83k parameters); small: the GPU learning benchmark (24M).
MODEL_SIZES = {
    "tiny": ModelSize(64, 128, 2, 4, 2, residual_scale=1.0, prior_scale=1.0),
    "small": ModelSize(512, 1536, 8, 8, 2, residual_scale=0.25, prior_scale=3.0),
}
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
    root: Path,
    task: str = "add",
    num_samples: int = 512,
    seed: int = 0,
    size: str = "tiny",
    reader: bool = False,
) -> DemoInputs:
    """Write root/model/ and root/data/demo-math.jsonl (each with SHA256SUMS); deterministic.

    `size` is a key of MODEL_SIZES. For the tasks of PRIOR_TASKS (add, add-hard, digit) the
    model gets the answer prior (see the module's docstring); for the others it is plain
    random. `reader` (prior tasks only) adds the reader head (`_add_digit_reader`): the
    prompt's digits reach the answer's position, still untrained to be used.
    Safe on an existing root: the model directory is rebuilt beside the old one and swapped in,
    and the data file and its manifest are overwritten.
    """
    if task not in TASKS:
        raise ValueError(f"demo task {task!r} is unknown; choose one of {', '.join(TASKS)}")
    if size not in MODEL_SIZES:
        raise ValueError(f"demo model size {size!r} is unknown; choose one of {list(MODEL_SIZES)}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    root = Path(root).resolve()
    digits = answer_digits(task)
    model_path = _replace_dir(
        root / "model",
        lambda tmp: _write_model(tmp, seed, MODEL_SIZES[size], digits, reader and bool(digits)),
    )
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
        question, answer = _question(task, rng)
        samples.append(
            {
                "prompt": f"{USER}{question}{INSTRUCTION}{ASSISTANT}{THINK}\n",
                "task": "math",
                "query_id": f"demo-{i}",
                "solutions": [f"\\boxed{{{answer}}}"],
            }
        )
    return samples


def answer_digits(task: str) -> str:
    """The digits that answer a prior task ("" for the other tasks)."""
    if task == "digit":
        return string.digits[:9]
    if task not in ADD_TASKS:
        return ""
    return string.digits[: 2 * ADD_TASKS[task] + 1]


def _question(task: str, rng: random.Random) -> tuple[str, int]:
    if task in ADD_TASKS:
        # The answer is uniform, so no answer is right more often than another: a policy that
        # ignores the prompt (always "4", say) earns no more than the prior does.
        largest = ADD_TASKS[task]
        answer = rng.randint(0, 2 * largest)
        a = rng.randint(max(0, answer - largest), min(answer, largest))
        return f"What is {a}+{answer - a}?", answer
    if task == "digit":  # the answer is in the prompt: a policy that reads it can copy it
        digit = rng.randint(0, 8)
        return f"Write the digit {digit}.", digit
    return _arithmetic(rng) if task == "arithmetic" else _digit7(rng)


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


def _write_model(
    directory: Path, seed: int, size: ModelSize, digits: str, reader: bool = False
) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),  # no ids the tokenizer cannot decode
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
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
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight *= size.residual_scale
                layer.mlp.down_proj.weight *= size.residual_scale
    if digits:
        _add_answer_prior(model, tokenizer, digits, size.prior_scale)
    if reader:
        _add_digit_reader(model)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    from rlinf_twoworker.engines.models import quiet_progress

    with quiet_progress():
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    for path in directory.iterdir():  # transformers writes the weights 0600; other nodes read them
        path.chmod(0o644)
    write_manifest(directory)


def _add_answer_prior(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, digits: str, scale: float
) -> None:
    """Make the untrained model a bigram "non-digit -> one of `digits` -> EOS".

    The embedding's PRIOR_AXIS coordinate is +scale for a digit token and -scale for any other.
    After the final RMSNorm that coordinate is about +-sqrt(hidden), so giving the lm_head rows
    of `digits` the value -m and the EOS row +m there (m = PRIOR_MARGIN / sqrt(hidden)) puts the
    answer digits PRIOR_MARGIN logits above the rest after the prompt (which ends in a newline)
    and EOS that far above the rest after a digit. The other coordinates keep their random
    init, so the prompt reaches the answer only through the layers, which RL can train.
    """
    import torch

    hidden = model.config.hidden_size
    tokens = tokenizer.convert_ids_to_tokens(list(range(model.config.vocab_size)))
    is_digit = torch.tensor([token.isdigit() for token in tokens])
    margin = PRIOR_MARGIN / hidden**0.5
    answers = tokenizer.convert_tokens_to_ids(list(digits))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, PRIOR_AXIS] = torch.where(is_digit, scale, -scale)
        model.lm_head.weight[answers, PRIOR_AXIS] = -margin
        model.lm_head.weight[tokenizer.eos_token_id, PRIOR_AXIS] = margin


def _add_digit_reader(model: Qwen2ForCausalLM) -> None:
    """Make layer 0's first attention head read the prompt's digits: from every position it
    attends to the digit tokens before it (through PRIOR_AXIS), and its values carry which
    digit each is, so the answer's position holds the prompt's digit. Nothing maps that to an
    answer yet: the answer prior stays about uniform over the digits, and RL must learn the
    read-out. Without it the digit reaches the answer's position only through random
    attention spread over the whole prompt (about 1/20 of it), so GRPO first has to grow that
    attention, and when it does so depends on the seed.

    The query and key use the lowest-frequency rotary pair of the head (index head_dim/2 - 1
    and its partner), whose rotation over a prompt of a few hundred positions is negligible, so
    the logit is READER_LOGIT x (+1 for a digit, -1 otherwise) wherever the digit is. The
    head's values leave PRIOR_AXIS out and are raised READER_GAIN times, and its output leaves
    PRIOR_AXIS alone, so the answer prior's digit/non-digit signal is unchanged."""
    import torch

    config = model.config
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    pair = head_dim // 2 - 1
    partner = pair + head_dim // 2
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        q, k = attention.q_proj, attention.k_proj
        q.weight[:head_dim] = 0.0
        q.bias[:head_dim] = 0.0
        q.bias[pair] = READER_LOGIT * head_dim**0.5  # scores are q.k / sqrt(head_dim)
        for row in (pair, partner):
            k.weight[row] = 0.0
            k.bias[row] = 0.0
        # After the input RMSNorm a token's PRIOR_AXIS is about +-sqrt(hidden): k = +-1.
        k.weight[pair, PRIOR_AXIS] = 1.0 / hidden**0.5
        v = attention.v_proj
        v.weight[:head_dim] *= READER_GAIN
        v.weight[:head_dim, PRIOR_AXIS] = 0.0
        v.bias[:head_dim] = 0.0
        attention.o_proj.weight[PRIOR_AXIS, :head_dim] = 0.0


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
        # The demo model answers a bare digit (its answer prior): math_verify reads it, while
        # RLinf's grader (the default) scores every unboxed answer wrong, so nothing would train.
        "reward.grader=math_verify",
    ]
    return load_config(overrides=[*demo, *overrides])

"""What several test modules share: the repository's paths and one builder of tiny models.

pytest puts this folder on sys.path (pyproject's `pythonpath`): `from support import tiny_lm`.
"""

from __future__ import annotations

import importlib.util
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
BENCHMARKS = REPO / "benchmarks"
RLINF_REF = REPO.parent / "shared" / "rlinf_ref"
"""RLinf's reference data (the grader's verdicts, its YAML), beside the repository where the
project's shared folder is; the tests that read it skip, saying why, where it is absent."""

NODE_CODE = Path(tempfile.mkdtemp(prefix="rlinf-node-code-"))
"""A directory on the PYTHONPATH the session's cluster nodes start with (conftest.py), empty
then: a test writes a module there that a run's processes import by name, as on a platform
whose nodes' environment holds the user's code (test_reward_fn)."""


WRAPPED = ["actor.fsdp_at_one_rank=true"]
"""One actor rank in FSDP2's wrapper, for tests whose subject is the wrapper (DTensor shards,
gathered layers)."""

ONE_RANK = ["cluster.component_placement={rollout:0,reward:0,inference:1,actor:2}"]
"""The tutorial's two nodes with one actor rank (the second node's second GPU idle), for runs
whose subject is not the actor's ranks: the ranks' sharding, collectives and checkpoint shards
are the subject of test_engine's end-to-end run and its other two-rank runs, test_resume, and
test_reliability's killed-rank, keep-last, mid-checkpoint and removed-node tests. One process
fewer makes a run about a fifth cheaper on a CPU host (benchmarks' run_cost)."""

KEPT = ["cluster.keep_processes=true"]
"""The run's model processes serve the next run of the same placement (run/kept.py), for runs
whose subject is not a process's start or death: a run in kept processes trains as a fresh
run (test_kept), and starts in about a third of the time on a CPU host."""

REFERENCE_SETTINGS = ["actor.optim.lr=1e-3", "rollout.validate_weight=true"]
"""The reference run's overrides of the demo: lr high enough that training moves the weights,
the weight sync checked bit for bit after every step."""


LOGGED_EXTRAS = [name for name in ("wandb", "mlflow") if importlib.util.find_spec(name) is not None]
"""The optional metric backends installed here: the reference run logs to each of them beside
TensorBoard (wandb offline, MLflow's file store in the run directory), and
test_metric_loggers reads them back; where one is absent, its part is skipped."""

REFERENCE_LOGGERS = [
    f"runner.logger.logger_backends=[{','.join(['tensorboard', *LOGGED_EXTRAS])}]",
    "runner.logger.project_name=reference",
]
"""The reference run's logger settings (they change no training: test_warmup's run without
them trains as the reference run)."""


@dataclass
class FinishedRun:
    """A run started through the library and awaited to its end, as a user would."""

    cfg: Any
    handle: Any
    steps: list[Any]
    checkpoint: Any
    report: Any
    run_dir: Path


FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def tiny_lm(
    family: str = "qwen2",
    *,
    vocab: int = 64,
    hidden: int = 32,
    intermediate: int = 64,
    layers: int = 2,
    seed: int | None = 0,
    tied: bool = False,
    **config: Any,
) -> Any:
    """A transformers causal LM of a few thousand weights (4 attention heads, 2 KV heads),
    fp32, in eval mode; seeded without touching the caller's RNG unless `seed` is None.
    `config`: any other field of the family's config (head_dim, max_position_embeddings...)."""
    import torch
    import transformers

    config_name, model_name = FAMILIES[family]
    settings = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    made = getattr(transformers, config_name)(**{**settings, **config})
    model_class = getattr(transformers, model_name)
    if seed is None:
        return model_class(made).eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(made).eval()


def generate_greedy(model: Any, ids: Any, mask: Any, new: int, eos: int | None = None) -> Any:
    """transformers' own greedy `generate` of left-padded prompts [R, P] (pad id 0) on the
    model's device, at most `new` tokens, stopping at `eos` (None: never): the answers
    [R, <= new] on the CPU, the reference the static sampler's greedy answers must equal."""
    device = next(model.parameters()).device
    return model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        do_sample=False,
        max_new_tokens=new,
        eos_token_id=eos,
        pad_token_id=0,
    )[:, ids.shape[1] :].cpu()


def settled_free_gpus(timeout_s: float = 10.0) -> float:
    """The connected cluster's free GPUs, once processes killed just before have handed theirs
    back (ray.kill and a group's removal are asynchronous); waits at most timeout_s."""
    import time

    import ray

    total = ray.cluster_resources().get("GPU", 0)
    deadline = time.monotonic() + timeout_s
    while (free := ray.available_resources().get("GPU", 0)) < total and time.monotonic() < deadline:
        time.sleep(0.1)
    return free


def varied_batch(prompts: tuple[int, ...], answers: tuple[int, ...], p: int, r: int) -> Any:
    """Rows as the rollout writes them: prompts of the given lengths left-padded to `p`,
    answers of the given lengths right-padded to `r` (attention and response masks 0 there)."""
    import torch

    from rlinf_twoworker.engines.models import SequenceBatch
    from rlinf_twoworker.workers.rollout import left_pad

    generator = torch.Generator().manual_seed(len(prompts))
    ids, mask = left_pad(
        [torch.randint(3, 60, (n,), generator=generator).tolist() for n in prompts], 0, width=p
    )
    responses = torch.randint(3, 60, (len(answers), r), generator=generator)
    resp = (torch.arange(r) < torch.tensor(answers).unsqueeze(1)).long()
    return SequenceBatch(torch.cat([ids, responses * resp], 1), torch.cat([mask, resp], 1), resp, p)

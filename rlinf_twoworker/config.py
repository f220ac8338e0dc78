"""The one config schema (RLinf's shape), its defaults, Hydra-style overrides and validation.

Defaults equal RLinf's starting config (`qwen2.5-1.5b-grpo-pipeline-fsdp-sgl.yaml`) plus the
two-Worker tutorial's overrides: 2 nodes x 2 GPUs, 2 steps, a checkpoint at step 2, seeds 1234.
`load_config` returns a struct-mode `DictConfig`; `to_typed` turns it into the dataclasses below,
whose `__post_init__` methods are the validation rules.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlinf_twoworker.errors import ConfigError
from rlinf_twoworker.overrides import (  # noqa: F401  (re-exported: part of the config API)
    IGNORED_RLINF_KEYS,
    apply_override,
    merge_file,
    omegaconf_reason,
    parse_override,
    register_rlinf_resolvers,
)

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
COMPONENTS = ("rollout", "reward", "inference", "actor")
PRECISIONS = ("fp32", "bf16", "fp16")


def _require(ok: bool, key: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(key, value, rule)


@dataclass(kw_only=True)
class Timeouts:
    placement_s: float = 120.0
    """How long to wait for the placement group before failing with a per-node diagnostic."""
    actor_start_s: float = 300.0
    """How long a component may take to start and load its model."""
    collective_s: float = 300.0
    """Timeout of torch.distributed process groups (a stalled collective fails after this)."""
    preflight_s: float = 300.0
    """How long the per-node probes may take together."""
    step_s: float = 3600.0
    """Upper bound on one GRPO step (all stages)."""
    checkpoint_s: float = 1800.0
    """Upper bound on writing one checkpoint."""
    failure_detection_s: float = 60.0
    """A dead component fails the run within this many seconds."""

    def __post_init__(self) -> None:
        for name in (
            "placement_s",
            "actor_start_s",
            "collective_s",
            "preflight_s",
            "step_s",
            "checkpoint_s",
            "failure_detection_s",
        ):
            value = getattr(self, name)
            _require(value > 0, f"runner.timeouts.{name}", value, "must be > 0 seconds")


@dataclass(kw_only=True)
class PreflightConfig:
    expected_gpu_model: str | None = None
    """Substring the GPU name must contain on every node (for example 'H200'); None skips."""
    expected_compute_capability: str | None = None
    """For example '9.0'; None skips."""
    require_nccl_ib_disable: bool = True
    """Require NCCL_IB_DISABLE=1 on every node (plain-IP clusters without RDMA)."""
    expected_python_prefix: str | None = None
    """sys.prefix every node must have (the platform's Python environment); None skips."""
    code_path: str | None = None
    """A git checkout every node must have at `code_commit` with a clean tree; None skips."""
    code_commit: str | None = None
    required_modules: list[str] = field(
        default_factory=lambda: ["torch", "transformers", "math_verify", "tensorboard"]
    )
    """Modules every node must import."""
    check_collective: bool = True
    """Run an all-reduce across the probes of all nodes before training."""


@dataclass(kw_only=True)
class ClusterConfig:
    num_nodes: int = 2
    """Ray nodes the placement group spreads over (one bundle each, STRICT_SPREAD)."""
    num_gpus_per_node: int = 2
    """GPUs (resource ranks) per node; resource rank r is node r // n, local GPU r % n."""
    component_placement: dict[str, Any] = field(
        default_factory=lambda: {"rollout": 0, "inference": 1, "actor": "2-3", "reward": 0}
    )
    """Component -> resource ranks: an int, 'a-b', 'a,b' (RLinf syntax)."""
    accelerator: str = "cuda"
    """'cuda' (NCCL) or 'cpu' (gloo; GPUs are logical Ray resources only)."""
    cpus_per_bundle: int = 1
    """CPUs each bundle reserves besides its GPUs."""
    preflight: PreflightConfig = field(default_factory=PreflightConfig)

    def __post_init__(self) -> None:
        _require(self.num_nodes >= 1, "cluster.num_nodes", self.num_nodes, "must be >= 1")
        _require(
            self.num_gpus_per_node >= 1,
            "cluster.num_gpus_per_node",
            self.num_gpus_per_node,
            "must be >= 1",
        )
        _require(
            self.accelerator in ("cuda", "cpu"),
            "cluster.accelerator",
            self.accelerator,
            "must be 'cuda' or 'cpu'",
        )
        _require(
            self.cpus_per_bundle >= 0,
            "cluster.cpus_per_bundle",
            self.cpus_per_bundle,
            "must be >= 0",
        )


@dataclass(kw_only=True)
class RunnerConfig:
    experiment_name: str = "grpo-1.5b"
    """The RUN_ID: the run directory is output_dir/experiment_name."""
    output_dir: str = "./results"
    """Parent of every run directory (on shared storage in a multi-node cluster)."""
    max_steps: int = 2
    """GRPO steps to train (RLinf's runner.max_steps)."""
    save_interval: int = 2
    """Checkpoint every N steps and at the last step; -1 saves only at the last step."""
    keep_last_checkpoints: int = 0
    """Keep only the newest K complete checkpoints (0 keeps all)."""
    save_full_weights: bool = False
    """Also write a full-model Hugging Face copy of each checkpoint (actor/huggingface/), as
    `rlinf-twoworker export-hf` would; off by default (the tutorial saves only the shards)."""
    seq_length: int = 1024
    """Prompt plus answer tokens; max_new_tokens defaults to seq_length - max_prompt_length."""
    enable_dynamic_batch_size: bool = False
    """Form the actor's micro-batches by token budget (max_tokens_per_mbs) instead of
    algorithm.training_batch_size_per_gpu rows; the update is the same, fewer passes run."""
    max_tokens_per_mbs: int = 1024
    """Token budget of one actor micro-batch (rows x padded length) with dynamic batch size."""
    trim_padding_multiple: int = 0
    """0 keeps every micro-batch at full width. N >= 1: the inference and actor forwards drop
    the columns that are padding in every row of a micro-batch (prompt padding on the left,
    columns after the longest answer on the right), keeping a width that is a multiple of N
    (128 keeps the shapes few on GPUs). Exact. On an H200 it made the starting config's step
    slightly slower (2.85 s instead of 2.78 s: little padding there, and the compiled actor
    meets several widths), hence off by default."""
    resume_dir: str | None = None
    """'auto' or a run directory to continue from its last complete checkpoint."""
    timeouts: Timeouts = field(default_factory=Timeouts)

    def __post_init__(self) -> None:
        _require(
            bool(RUN_ID_PATTERN.match(self.experiment_name)),
            "runner.experiment_name",
            self.experiment_name,
            f"must match {RUN_ID_PATTERN.pattern}",
        )
        _require(self.max_steps >= 1, "runner.max_steps", self.max_steps, "must be >= 1")
        _require(
            self.save_interval == -1 or self.save_interval >= 1,
            "runner.save_interval",
            self.save_interval,
            "must be -1 or >= 1",
        )
        _require(
            self.keep_last_checkpoints >= 0,
            "runner.keep_last_checkpoints",
            self.keep_last_checkpoints,
            "must be >= 0",
        )
        _require(self.seq_length >= 2, "runner.seq_length", self.seq_length, "must be >= 2")
        _require(
            self.trim_padding_multiple >= 0,
            "runner.trim_padding_multiple",
            self.trim_padding_multiple,
            "must be >= 0 (0 turns trimming off)",
        )
        _require(
            self.max_tokens_per_mbs >= 1,
            "runner.max_tokens_per_mbs",
            self.max_tokens_per_mbs,
            "must be >= 1",
        )
        _require(bool(self.output_dir), "runner.output_dir", self.output_dir, "must be set")


@dataclass(kw_only=True)
class SamplingParams:
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 1000000
    """<= 0 or >= the vocabulary size turns top-k off."""
    top_p: float = 1.0
    max_new_tokens: int | None = None
    """None: runner.seq_length - data.max_prompt_length."""

    def __post_init__(self) -> None:
        _require(
            self.temperature > 0,
            "algorithm.sampling_params.temperature",
            self.temperature,
            "must be > 0",
        )
        _require(
            0 < self.top_p <= 1, "algorithm.sampling_params.top_p", self.top_p, "must be in (0, 1]"
        )
        _require(
            self.max_new_tokens is None or self.max_new_tokens >= 1,
            "algorithm.sampling_params.max_new_tokens",
            self.max_new_tokens,
            "must be >= 1",
        )


@dataclass(kw_only=True)
class AlgorithmConfig:
    group_size: int = 2
    """Answers sampled per prompt; advantages are normalised within a group."""
    n_minibatches: int = 4
    """Optimiser steps per GRPO step."""
    training_batch_size_per_gpu: int = 1
    """Micro-batch size of the actor."""
    logprob_forward_micro_batch_size: int = 1
    """Micro-batch size of the log-prob recompute."""
    recompute_logprobs: bool = True
    adv_type: str = "grpo"
    loss_agg_func: str = "token-mean"
    """'token-mean' or 'seq-mean-token-mean'."""
    ratio_clip_eps: float = 0.2
    kl_beta: float = 0.0
    kl_penalty_type: str = "low_var_kl"
    """'kl', 'abs', 'mse' or 'low_var_kl' (used when kl_beta > 0)."""
    sampling_params: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        for name in (
            "group_size",
            "n_minibatches",
            "training_batch_size_per_gpu",
            "logprob_forward_micro_batch_size",
        ):
            value = getattr(self, name)
            _require(value >= 1, f"algorithm.{name}", value, "must be >= 1")
        _require(self.adv_type == "grpo", "algorithm.adv_type", self.adv_type, "must be 'grpo'")
        _require(
            self.loss_agg_func in ("token-mean", "seq-mean-token-mean"),
            "algorithm.loss_agg_func",
            self.loss_agg_func,
            "must be 'token-mean' or 'seq-mean-token-mean'",
        )
        _require(
            self.ratio_clip_eps > 0, "algorithm.ratio_clip_eps", self.ratio_clip_eps, "must be > 0"
        )
        _require(
            self.kl_beta == 0,
            "algorithm.kl_beta",
            self.kl_beta,
            "must be 0: no reference model is loaded, so a KL penalty has no reference",
        )
        _require(
            self.recompute_logprobs,
            "algorithm.recompute_logprobs",
            self.recompute_logprobs,
            "must be true: the inference component recomputes "
            "the old log-probabilities of every answer",
        )
        _require(
            self.kl_penalty_type in ("kl", "abs", "mse", "low_var_kl"),
            "algorithm.kl_penalty_type",
            self.kl_penalty_type,
            "must be one of kl, abs, mse, low_var_kl",
        )


@dataclass(kw_only=True)
class ModelConfig:
    model_path: str = "/workspace/dataset/DeepSeek-R1-Distill-Qwen-1.5B"
    """A local Hugging Face model directory (config.json, tokenizer, *.safetensors)."""
    precision: str = "bf16"
    """Weights dtype of this component on a GPU: fp32, bf16 or fp16 (CPU always uses fp32)."""


@dataclass(kw_only=True)
class RolloutConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    max_batch_size: int = 256
    """Most sequences decoded together (prompts x group_size are split into such batches)."""
    engine: str = "auto"
    """'static' (preallocated KV cache, CUDA-graph decode), 'hf' (transformers' generate), or
    'auto' (static for Qwen2/Llama/Mistral models, hf otherwise)."""
    validate_weight: bool = False
    """After every weight sync, compare digests of the actor's, rollout's and inference's full
    weights and fail the step on any difference (costs one more gather of the weights)."""

    def __post_init__(self) -> None:
        _require(
            self.model.precision in PRECISIONS,
            "rollout.model.precision",
            self.model.precision,
            f"must be one of {PRECISIONS}",
        )
        _require(
            self.max_batch_size >= 1, "rollout.max_batch_size", self.max_batch_size, "must be >= 1"
        )


@dataclass(kw_only=True)
class InferenceConfig:
    model: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        _require(
            self.model.precision in PRECISIONS,
            "inference.model.precision",
            self.model.precision,
            f"must be one of {PRECISIONS}",
        )


@dataclass(kw_only=True)
class OptimConfig:
    optimizer: str = "adam"
    """AdamW with decoupled weight decay."""
    lr: float = 2e-5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-5
    weight_decay: float = 0.05
    clip_grad: float = 0.8
    """Max global grad norm; <= 0 turns clipping off."""

    def __post_init__(self) -> None:
        _require(
            self.optimizer == "adam", "actor.optim.optimizer", self.optimizer, "must be 'adam'"
        )
        _require(self.lr > 0, "actor.optim.lr", self.lr, "must be > 0")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            _require(0 <= value < 1, f"actor.optim.{name}", value, "must be in [0, 1)")
        _require(
            self.weight_decay >= 0, "actor.optim.weight_decay", self.weight_decay, "must be >= 0"
        )


@dataclass(kw_only=True)
class LrSchedConfig:
    lr_decay_style: str = "constant"
    """'constant', 'linear' or 'cosine' (decaying to min_lr over runner.max_steps)."""
    lr_warmup_iters: int = 0
    """Optimiser steps of linear warm-up from lr_warmup_init."""
    lr_warmup_init: float = 0.0
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        _require(
            self.lr_decay_style in ("constant", "linear", "cosine"),
            "actor.lr_sched.lr_decay_style",
            self.lr_decay_style,
            "must be constant, linear or cosine",
        )
        _require(
            self.lr_warmup_iters >= 0,
            "actor.lr_sched.lr_warmup_iters",
            self.lr_warmup_iters,
            "must be >= 0",
        )


@dataclass(kw_only=True)
class TokenizerConfig:
    tokenizer_model: str | None = None
    """Tokenizer directory; None uses actor.model.model_path."""


@dataclass(kw_only=True)
class ActorConfig:
    seed: int = 1234
    model: ModelConfig = field(default_factory=lambda: ModelConfig(precision="fp32"))
    optim: OptimConfig = field(default_factory=OptimConfig)
    lr_sched: LrSchedConfig = field(default_factory=LrSchedConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    mixed_precision: bool = True
    """On GPUs: FSDP2 bf16 parameters with fp32 gradient reduction (master weights stay fp32)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, one more
    forward of compute)."""
    compile: bool = True
    """On GPUs: each decoder layer's forward and the log-softmax of the log-probs run through
    torch.compile (fused elementwise kernels; the first update pays the compilation). If the
    compiler fails, the actor warns and trains eagerly. Ignored on CPUs."""

    def __post_init__(self) -> None:
        _require(
            self.model.precision in PRECISIONS,
            "actor.model.precision",
            self.model.precision,
            f"must be one of {PRECISIONS}",
        )


@dataclass(kw_only=True)
class DataConfig:
    train_data_paths: list[str] = field(
        default_factory=lambda: ["/workspace/dataset/AReaL-boba-106k.jsonl"]
    )
    """JSONL files, one object a line, in the AReaL-boba format."""
    prompt_key: str = "prompt"
    answer_key: str = "solutions"
    max_prompt_length: int = 256
    """Prompts longer than this (in tokens) are truncated from the left, with a warning."""
    rollout_batch_size: int = 8
    """Prompts per GRPO step."""
    shuffle: bool = True
    seed: int = 1234
    skip_malformed_lines: bool = False
    """Skip (and count) lines that are not valid JSON objects instead of failing."""

    def __post_init__(self) -> None:
        _require(
            len(self.train_data_paths) >= 1,
            "data.train_data_paths",
            self.train_data_paths,
            "must list at least one JSONL file",
        )
        _require(
            self.max_prompt_length >= 1,
            "data.max_prompt_length",
            self.max_prompt_length,
            "must be >= 1",
        )
        _require(
            self.rollout_batch_size >= 1,
            "data.rollout_batch_size",
            self.rollout_batch_size,
            "must be >= 1",
        )


@dataclass(kw_only=True)
class RewardConfig:
    reward_type: str = "math"
    reward_scale: float = 5.0
    """A correct answer scores +reward_scale, a wrong one -reward_scale."""
    timeout_s: float = 10.0
    """Per-answer grading timeout; an answer that times out scores as wrong."""

    def __post_init__(self) -> None:
        _require(
            self.reward_type == "math", "reward.reward_type", self.reward_type, "must be 'math'"
        )
        _require(self.timeout_s > 0, "reward.timeout_s", self.timeout_s, "must be > 0")


@dataclass(kw_only=True)
class GRPOConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)

    def __post_init__(self) -> None:
        from rlinf_twoworker.placement import resolve_placement

        resolve_placement(self.cluster)  # raises ConfigError naming the component
        _require(
            self.data.max_prompt_length < self.runner.seq_length,
            "data.max_prompt_length",
            self.data.max_prompt_length,
            f"must be < runner.seq_length ({self.runner.seq_length})",
        )
        total = self.data.rollout_batch_size * self.algorithm.group_size
        actor_ranks = len(resolve_placement(self.cluster).ranks("actor"))
        per_update = total // self.algorithm.n_minibatches
        _require(
            total % self.algorithm.n_minibatches == 0 and per_update % actor_ranks == 0,
            "algorithm.n_minibatches",
            self.algorithm.n_minibatches,
            f"rollout_batch_size x group_size ({total}) must split into n_minibatches "
            f"equal parts, each divisible by the {actor_ranks} actor ranks",
        )

    @property
    def max_new_tokens(self) -> int:
        configured = self.algorithm.sampling_params.max_new_tokens
        return configured or self.runner.seq_length - self.data.max_prompt_length

    @property
    def tokenizer_path(self) -> str:
        """The one tokenizer every component uses."""
        return self.actor.tokenizer.tokenizer_model or self.actor.model.model_path

    @property
    def run_dir(self) -> Path:
        return Path(self.runner.output_dir) / self.runner.experiment_name


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> DictConfig:
    """Defaults, then an optional YAML file in RLinf's layout, then Hydra-style overrides.

    Returns a validated, struct-mode DictConfig. Raises ConfigError naming the key, the value
    and the rule that was broken.
    """
    register_rlinf_resolvers()
    cfg = OmegaConf.structured(GRPOConfig)
    if path is not None:
        cfg = merge_file(cfg, Path(path))
    for text in overrides:
        apply_override(cfg, text)
    to_typed(cfg)  # runs every __post_init__ rule
    return cfg


def to_typed(cfg: DictConfig) -> GRPOConfig:
    """The config as dataclasses (interpolations resolved); validates on the way."""
    try:
        typed = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or "?"
        raise ConfigError(key, getattr(exc, "value", None), omegaconf_reason(exc)) from exc
    assert isinstance(typed, GRPOConfig)
    return typed


def to_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML (what hydra/.hydra/config.yaml holds)."""
    return OmegaConf.to_yaml(cfg, resolve=True)

"""RLinf's keys that are not training settings of their own: Hydra's, the logger's, engine and
Megatron knobs, FSDP options. Each key is in the schema (so the resolved config keeps it as the
user gave it) and has exactly one rule here:

- `Rule(key, None, why)`: the value changes nothing, in RLinf's FSDP path as here (a name, a
  Megatron-only knob, a setting of an engine the library replaces); a value other than the
  default is accepted and noted once in log/main.log with `why`.
- `Rule(key, allowed, why)`: only these values ask for what the library does; another value is
  refused with a ConfigError naming the key, the value and `why` (what to do instead).

Keys with behaviour of their own are implemented where they act: the actor's precision
(actor.fsdp_config.mixed_precision, grad_scaler, amp_autocast: config/precision.py),
hydra.run.dir and hydra.output_subdir (where the Hydra record is also written, rundir.py),
runner.logger.log_path (where tensorboard/ goes), inference.tokenizer.tokenizer_model (noted
when it differs from the actor's: inference reads token ids only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import Container, DictConfig, OmegaConf

from rlinf_twoworker.config.precision import AmpAutocast, GradScalerConfig, MixedPrecision
from rlinf_twoworker.errors import ConfigError

_ENGINE = (
    "a setting of RLinf's SGLang/vLLM engine; the library generates with its own (rollout.engine)"
)
_MEGATRON = (
    "read only by RLinf's Megatron backend; RLinf's FSDP actor ignores it, as does the library"
)
_NAME = "a name; it changes no result"
_MEGATRON_MODEL_KNOBS = (
    "add_bias_linear",
    "activation",
    "sequence_parallel",
    "recompute_method",
    "recompute_granularity",
    "recompute_num_layers",
    "normalization",
    "position_embedding_type",
    "apply_rope_fusion",
    "bias_dropout_fusion",
    "persist_layer_norm",
    "bias_activation_fusion",
    "attention_softmax_in_fp32",
    "batch_p2p_comm",
    "gradient_accumulation_fusion",
    "moe_token_dispatcher_type",
    "use_cpu_initialization",
)


@dataclass(frozen=True)
class Rule:
    key: str
    allowed: tuple[Any, ...] | None
    why: str


RULES: tuple[Rule, ...] = (
    Rule("defaults", None, "Hydra's defaults list: the schema already holds RLinf's FSDP defaults"),
    Rule("hydra.searchpath", None, "where Hydra looks for defaults files; nothing is composed"),
    Rule(
        "hydra.job.chdir",
        (False,),
        "the library never changes the Driver's working directory; set hydra.job.chdir=false",
    ),
    Rule(
        "critic.use_critic_model", (False,), "GRPO has no critic; set critic.use_critic_model=false"
    ),
    Rule("runner.task_type", ("reasoning",), "the library trains reasoning (math) tasks only"),
    Rule("runner.logger.swanlab_mode", None, "a swanlab setting; swanlab is not a backend here"),
    Rule("algorithm.loss_type", ("actor",), "GRPO's actor loss is the only loss here"),
    Rule(
        "algorithm.max_num_gen_batches",
        (1,),
        "over-generation needs RLinf's down-sampling, which the library does not have; set 1",
    ),
    Rule(
        "algorithm.rollout_batch_size_per_gpu", None, "RLinf reads it nowhere at the pinned commit"
    ),
    Rule(
        "algorithm.val_rollout_batch_size_per_gpu",
        None,
        "RLinf reads it nowhere at the pinned commit",
    ),
    Rule("algorithm.use_valid_token_scale", None, _MEGATRON),
    Rule("algorithm.early_stop_imp_ratio", None, _MEGATRON),
    Rule(
        "algorithm.entropy_op_type",
        None,
        "which kernel computes log-probs and entropy; the values are the same",
    ),
    Rule(
        "algorithm.importance_sampling_fix",
        (False,),
        "it reweights by the rollout engine's own log-probs, which the library does not "
        "return; recompute_logprobs=true is the library's way",
    ),
    Rule("algorithm.importance_sampling_clip", None, "used only with importance_sampling_fix"),
    Rule("algorithm.reinpp_kl_beta", (0, 0.0), "it belongs to adv_type=reinpp; GRPO only here"),
    Rule("algorithm.use_reinpp_baseline", None, "it belongs to adv_type=reinpp; no effect on GRPO"),
    Rule("algorithm.down_sampling.do_down_sampling", (False,), "down-sampling is not supported"),
    Rule(
        "algorithm.down_sampling.down_sampling_config",
        None,
        "used only with do_down_sampling, which must be false",
    ),
    Rule("data.type", ("math",), "the library trains math data (AReaL-boba JSONL) only"),
    Rule("data.dataset_name", None, _NAME),
    Rule("data.num_workers", None, "data-loader processes; the library reads the file once"),
    Rule(
        "data.apply_chat_template",
        (False,),
        "AReaL-boba prompts already carry the chat markup; set data.apply_chat_template=false",
    ),
    Rule(
        "data.val_rollout_batch_size",
        (None,),
        "the batch of a validation RLinf's reasoning runner never runs; the library's own "
        "(runner.validate) answers data.val_num_prompts prompts: set that instead",
    ),
    Rule("rollout.group_name", None, _NAME),
    Rule("rollout.model.model_type", None, "the architecture is read from config.json"),
    Rule("rollout.model.is_lora", (False,), "LoRA is not supported; set it false"),
    Rule("rollout.gpu_memory_utilization", None, _ENGINE),
    Rule("rollout.enforce_eager", None, _ENGINE),
    Rule("rollout.distributed_executor_backend", None, _ENGINE),
    Rule("rollout.disable_log_stats", None, _ENGINE),
    Rule("rollout.detokenize", None, "answers are always decoded (the reward grades text)"),
    Rule("rollout.padding", (None,), "the pad id is the tokenizer's; leave rollout.padding null"),
    Rule(
        "rollout.eos",
        (None,),
        "EOS ids are the tokenizer's and the model's; leave rollout.eos null",
    ),
    Rule("rollout.rollout_backend", None, _ENGINE),
    Rule("rollout.sglang", None, _ENGINE),
    Rule("rollout.vllm", None, _ENGINE),
    Rule(
        "rollout.return_logprobs",
        (False,),
        "inference recomputes the old log-probs (recompute_logprobs=true); set it false",
    ),
    Rule("rollout.tensor_parallel_size", (1,), "the rollout runs on one GPU; set 1"),
    Rule("rollout.pipeline_parallel_size", (1,), "the rollout runs on one GPU; set 1"),
    Rule("rollout.validate_save_dir", None, "rollout.validate_weight compares digests in memory"),
    Rule("rollout.print_outputs", None, "answers are not printed; read them with the reward log"),
    Rule("rollout.sglang_decode_log_interval", None, _ENGINE),
    Rule("rollout.max_running_requests", None, _ENGINE),
    Rule("rollout.cuda_graph_max_bs", None, _ENGINE),
    Rule("rollout.use_torch_compile", None, _ENGINE),
    Rule("rollout.torch_compile_max_bs", None, _ENGINE),
    Rule("inference.group_name", None, _NAME),
    Rule(
        "inference.load_from_actor",
        (True,),
        "inference always takes the actor's weights at each sync; set it true",
    ),
    Rule("inference.model.model_type", None, "the architecture is read from config.json"),
    Rule("inference.model.is_lora", (False,), "LoRA is not supported; set it false"),
    Rule("inference.fsdp_config", None, "inference is one process here: FSDP options do not apply"),
    Rule("inference.tokenizer.use_fast", None, "inference reads token ids, not text"),
    Rule("inference.tokenizer.trust_remote_code", None, "inference reads token ids, not text"),
    Rule("inference.tokenizer.padding_side", None, "inference reads token ids, not text"),
    Rule("actor.group_name", None, _NAME),
    Rule("actor.training_backend", ("fsdp",), "the actor trains with FSDP2; set fsdp"),
    Rule("actor.model.model_type", None, "the architecture is read from config.json"),
    Rule("actor.model.is_lora", (False,), "LoRA is not supported; set it false"),
    Rule("actor.model.tensor_model_parallel_size", (1,), "the actor is FSDP only; set 1"),
    Rule("actor.model.pipeline_model_parallel_size", (1,), "the actor is FSDP only; set 1"),
    *(Rule(f"actor.model.{knob}", None, _MEGATRON) for knob in _MEGATRON_MODEL_KNOBS),
    Rule("actor.model.variable_seq_lengths", None, "sequence packing; the same log-probs"),
    Rule("actor.tokenizer.use_fast", None, "the fast tokenizer is always used"),
    Rule("actor.tokenizer.trust_remote_code", None, "the tokenizer is loaded from local files"),
    Rule("actor.tokenizer.padding_side", None, "padding is laid out by the library itself"),
    Rule("actor.optim.bf16", None, _MEGATRON),
    Rule("actor.optim.fp16", None, _MEGATRON),
    Rule("actor.optim.loss_scale", None, _MEGATRON),
    Rule("actor.optim.use_distributed_optimizer", None, _MEGATRON),
    Rule("actor.optim.overlap_grad_reduce", None, _MEGATRON),
    Rule("actor.optim.overlap_param_gather", None, _MEGATRON),
    Rule("actor.optim.optimizer_enable_pin", None, _MEGATRON),
    Rule("actor.optim.overlap_param_gather_with_optimizer_step", None, _MEGATRON),
    Rule("actor.lr_sched", None, _MEGATRON + " (the FSDP schedule is actor.optim.lr_scheduler)"),
    Rule("actor.fsdp_config.strategy", ("fsdp", "fsdp2"), "the actor is sharded with FSDP2"),
    Rule(
        "actor.fsdp_config.sharding_strategy",
        ("full_shard",),
        "the actor shards parameters, gradients and optimiser state; set full_shard",
    ),
    Rule("actor.fsdp_config.cpu_offload", (False,), "CPU offload is not supported; set false"),
    Rule("actor.fsdp_config.offload_pin_memory", None, "used only with cpu_offload"),
    Rule("actor.fsdp_config.enable_gradient_accumulation", None, "a speed knob; same gradient"),
    Rule("actor.fsdp_config.forward_prefetch", None, "a speed knob; same result"),
    Rule("actor.fsdp_config.limit_all_gathers", None, "a speed knob; same result"),
    Rule("actor.fsdp_config.backward_prefetch", None, "a speed knob; same result"),
    Rule("actor.fsdp_config.use_orig_params", None, "an FSDP1 knob; FSDP2 keeps the parameters"),
    Rule("actor.fsdp_config.use_liger_kernel", None, "a kernel choice; same result"),
    Rule("reward.group_name", None, _NAME),
    Rule("reward.use_reward_model", (False,), "rewards are graded by reward.grader; set false"),
    Rule("reward.tokenizer", None, "answers are decoded with actor.tokenizer.tokenizer_model"),
)


@dataclass(kw_only=True)
class HydraRun:
    dir: str | None = None
    """RLinf's Hydra run directory: the Hydra record (config.yaml, overrides.yaml) is also
    written to <dir>/<output_subdir>; None: <run dir>/hydra. It must lie inside the run
    directory (a relative path is taken from it; `..` is refused), or a run refuses to start."""


@dataclass(kw_only=True)
class HydraJob:
    chdir: bool = False
    """Only false: the Driver's working directory never changes."""


@dataclass(kw_only=True)
class HydraConfig:
    run: HydraRun = field(default_factory=HydraRun)
    job: HydraJob = field(default_factory=HydraJob)
    output_subdir: str | None = ".hydra"
    """Where under hydra.run.dir the Hydra record is also written (inside the run directory;
    `..` is refused); null: nowhere else (RLinf keeps none; the library always keeps
    <run dir>/hydra/.hydra/, which the postflight reads)."""
    searchpath: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class LoggerConfig:
    log_path: str | None = None
    """Where tensorboard/ goes (RLinf's meaning); None: the run directory. It must lie inside
    the run directory (a relative path is taken from it; `..` is refused). The postflight and
    `report` read it from the run's record."""
    project_name: str = "rlinf"
    """The wandb project and the MLflow experiment (RLinf's meaning for wandb)."""
    experiment_name: str | None = None
    """The wandb and MLflow run's name; None: runner.experiment_name (the run id)."""
    logger_backends: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Where each step's metrics go besides the run's record: tensorboard, wandb, mlflow
    (LOGGER_BACKENDS). TensorBoard is always written (the postflight and `report` read it);
    wandb (extra `wandb`) and MLflow (extra `mlflow`) are added when listed. RLinf's swanlab is
    refused by name."""
    wandb_proxy: str | None = None
    """wandb's https proxy (wandb.Settings(https_proxy=...)), as in RLinf."""
    wandb_entity: str | None = None
    """wandb's entity (team or user); None: wandb's default."""
    swanlab_mode: str | None = None

    def __post_init__(self) -> None:
        backends = self.logger_backends
        for name in backends or []:
            if name not in LOGGER_BACKENDS:
                why = (
                    "swanlab is not a backend of the library; use tensorboard, wandb or mlflow"
                    if name == "swanlab"
                    else f"the backends are {', '.join(LOGGER_BACKENDS)}"
                )
                raise ConfigError("runner.logger.logger_backends", backends, why)

    def uses(self, backend: str) -> bool:
        return backend in (self.logger_backends or [])


LOGGER_BACKENDS = ("tensorboard", "wandb", "mlflow")
"""The metric loggers `runner.logger.logger_backends` may list (RLinf has tensorboard, wandb
and swanlab; MLflow is the library's)."""


@dataclass(kw_only=True)
class EngineSettings:
    """RLinf's rollout-engine knobs (SGLang/vLLM); recorded, not used (see config.rlinf.RULES)."""

    group_name: str = "RolloutGroup"
    gpu_memory_utilization: float = 0.55
    enforce_eager: bool = False
    distributed_executor_backend: str = "mp"
    disable_log_stats: bool = False
    detokenize: bool = False
    padding: Any = None
    eos: Any = None
    rollout_backend: str = "sglang"
    sglang: dict[str, Any] = field(default_factory=dict)
    vllm: dict[str, Any] = field(default_factory=dict)
    return_logprobs: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    validate_save_dir: str | None = None
    print_outputs: bool = False
    sglang_decode_log_interval: int = 500000
    max_running_requests: int = 64
    cuda_graph_max_bs: int = 128
    use_torch_compile: bool = False
    torch_compile_max_bs: int = 128


@dataclass(kw_only=True)
class FsdpConfig:
    """RLinf's actor.fsdp_config. gradient_checkpointing, reshard_after_forward,
    save_full_model_weights and the precision keys (mixed_precision, amp_autocast, grad_scaler:
    config.precision) act; every other key has its rule in config.rlinf.RULES."""

    strategy: str = "fsdp"
    sharding_strategy: str = "full_shard"
    gradient_checkpointing: bool | None = None
    """RLinf's name for actor.activation_checkpointing; when set, it sets that key."""
    cpu_offload: bool = False
    offload_pin_memory: bool = False
    reshard_after_forward: bool = True
    """As FSDP2's fully_shard takes it (RLinf passes it there): true frees each decoder layer's
    gathered parameters after its forward and gathers them again for its backward; false keeps
    them from the forward to the backward, which saves a gather and holds the whole model
    gathered, in mixed_precision.param_dtype, which the memory plan counts. The update is the
    same. It acts where FSDP2 wraps the actor (two ranks, or actor.fsdp_at_one_rank=true)."""
    enable_gradient_accumulation: bool = True
    forward_prefetch: bool = False
    limit_all_gathers: bool = False
    backward_prefetch: str | None = None
    use_orig_params: bool = False
    use_liger_kernel: bool = False
    mixed_precision: MixedPrecision = field(default_factory=MixedPrecision)
    """The actor's compute and gradient-reduction dtypes (config.precision)."""
    amp_autocast: AmpAutocast = field(default_factory=AmpAutocast)
    grad_scaler: GradScalerConfig = field(default_factory=GradScalerConfig)
    """Dynamic loss scaling (config.precision)."""
    save_full_model_weights: bool = False
    """Also write each checkpoint's full weights to actor/model_state_dict/full_weights.pt
    (RLinf's file). RLinf's default is true; the tutorial (and this library) turns it off."""


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, Container) else value


def check_rules(cfg: DictConfig, defaults: DictConfig) -> list[str]:
    """Apply RULES: raise ConfigError for a refused value; return the notes for the run's log
    (one per accepted key whose value differs from the default)."""
    notes = []
    missing = object()
    for rule in RULES:
        value = OmegaConf.select(cfg, rule.key, default=missing)
        if value is missing:
            continue
        plain = _plain(value)
        if rule.allowed is not None and plain not in rule.allowed:
            allowed = ", ".join(repr(a) for a in rule.allowed)
            raise ConfigError(rule.key, plain, f"must be {allowed}: {rule.why}")
        if rule.allowed is None and plain != _plain(OmegaConf.select(defaults, rule.key)):
            notes.append(f"{rule.key}={plain!r} accepted: {rule.why}")
    return notes


@dataclass(frozen=True)
class CodeDefault:
    """A key RLinf reads with `.get(key, value)`: a YAML file that omits it runs with `value`."""

    key: str
    value: Any
    where: str
    """Where RLinf reads it, at the pinned commit."""


CODE_DEFAULTS: tuple[CodeDefault, ...] = (
    CodeDefault("algorithm.clip_ratio_c", 3.0, "workers/actor/fsdp_actor_worker.py:720"),
    CodeDefault("algorithm.shuffle_rollout", True, "workers/actor/fsdp_actor_worker.py:916"),
    CodeDefault("algorithm.n_minibatches", 1, "config.py:1353"),
    CodeDefault("runner.max_tokens_per_mbs", 2048, "workers/actor/fsdp_actor_worker.py:167"),
    CodeDefault("data.seed", 1, "runners/reasoning_runner.py:168"),
    CodeDefault("actor.optim.adam_eps", 1e-8, "hybrid_engines/fsdp/fsdp_model_manager.py:517"),
    CodeDefault("actor.optim.weight_decay", 1e-2, "hybrid_engines/fsdp/fsdp_model_manager.py:518"),
    CodeDefault("actor.fsdp_config.mixed_precision.param_dtype", None, "config.py:554"),
    CodeDefault("actor.fsdp_config.mixed_precision.reduce_dtype", None, "config.py:557"),
    CodeDefault("actor.fsdp_config.mixed_precision.buffer_dtype", None, "config.py:560"),
    CodeDefault(
        "actor.fsdp_config.save_full_model_weights",
        True,
        "hybrid_engines/fsdp/fsdp_model_manager.py:381",
    ),
)
"""RLinf's in-code defaults that differ from the schema's (the starting config's values)."""


def apply_code_defaults(cfg: DictConfig, file_keys: set[str]) -> None:
    """Give each CODE_DEFAULTS key that a YAML file omits RLinf's in-code value, where the file
    has the key's section (a file without the section is an overlay on the library's
    defaults, not a config RLinf could run)."""
    for default in CODE_DEFAULTS:
        section = default.key.rpartition(".")[0]
        if section in file_keys and default.key not in file_keys:
            OmegaConf.update(cfg, default.key, default.value)

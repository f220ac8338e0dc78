"""The one config schema (RLinf's shape): the dataclasses, their defaults and validation.

Defaults equal RLinf's starting config (`qwen2.5-1.5b-grpo-pipeline-fsdp-sgl.yaml`) plus the
two-Worker tutorial's overrides: 2 nodes x 2 GPUs, 2 steps, a checkpoint at step 2, seeds 1234.
`config.load_config` returns a struct-mode `DictConfig` (overrides: config/overrides.py);
`config.to_typed` turns it into the dataclasses below, whose `__post_init__` methods are the
validation rules.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from rlinf_twoworker import components
from rlinf_twoworker.config.placement import Placement, resolve_placement
from rlinf_twoworker.config.rlinf import EngineSettings, FsdpConfig, HydraConfig, LoggerConfig
from rlinf_twoworker.errors import ConfigError
from rlinf_twoworker.rewards.graders import GRADERS

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def run_id_problem(run_id: str | None) -> str | None:
    """Why `run_id` cannot name a run directory, or None: the one RUN_ID rule."""
    if run_id and RUN_ID_PATTERN.match(run_id):
        return None
    return (
        f"must match {RUN_ID_PATTERN.pattern} (letters, digits, '.', '_', '-'; not empty, "
        "no path separators)"
    )


PRECISIONS = ("fp32", "bf16", "fp16")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "global-token-mean")
"""RLinf's three aggregations (each per micro-batch, as RLinf computes them) and the library's
true token-mean over the whole minibatch."""
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
LR_SCHEDULERS = ("constant", "cosine")
PIPELINE_MODES = ("auto", "pipelined", "sequential")
"""runner.pipeline's values (not on/off: YAML 1.1 reads those as booleans)."""


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
    hash_cache_dir: str | None = "~/.cache/rlinf_twoworker/sha256"
    """Where each node remembers the SHA256 digests it computed for the inputs' files, with
    each file's identity and change time (path, device, inode, size, mtime, ctime): a file
    unchanged since is not hashed again (a changed one always is). A directory on the node's
    own disk; None hashes every file every run."""


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
    max_gpu_memory_gb: float | None = None
    """The most memory a run may plan to use on each GPU, in GiB (what nvidia-smi and card
    labels call GB: a 40 GB A100 is 40). None: the free memory the preflight sees on each GPU.
    The memory plan (cluster/memory_plan.py) refuses a run that would not fit, before any
    model loads; on CPU runs it checks the GPU plan against this budget when it is set."""
    keep_processes: bool = False
    """true: when the run has trained to its end, its model components' processes (rollout,
    inference, actor ranks, reference) and its placement group stay, idle, and the next run
    of this Ray job with the same placement loads its models into them instead of starting
    processes (no imports of torch and transformers: seconds a process). Any run that does
    not take them frees them as it starts, and so do rlinf_twoworker.release_kept() and the
    job's end; a run that fails or is cancelled after its models began to load keeps nothing,
    one that fails before (preflight, data, memory plan) gives them back unused (run/kept.py)."""
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
        _require(
            self.max_gpu_memory_gb is None or self.max_gpu_memory_gb > 0,
            "cluster.max_gpu_memory_gb",
            self.max_gpu_memory_gb,
            "must be null (the free memory of each GPU) or > 0",
        )


MICRO_BATCH_TOKENS_FLOOR = 4096
"""The actor's micro-batch tokens where runner.micro_batch_tokens is null and no GPU budget is
known, and the smallest the memory plan picks (below it, activation recompute or the offload
is the cheaper way to fit)."""
LOGPROB_MICRO_BATCH_TOKENS_FLOOR = 16384
"""The same for runner.logprob_micro_batch_tokens."""


@dataclass(kw_only=True)
class RunnerConfig:
    experiment_name: str = "grpo-1.5b"
    """The RUN_ID: the run directory is output_dir/experiment_name."""
    output_dir: str = "./results"
    """Parent of every run directory (on shared storage in a multi-node cluster)."""
    task_type: str = "reasoning"
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    max_steps: int = 2
    """GRPO steps to train (RLinf's runner.max_steps); the run stops at the earlier of this
    and the runner.max_epochs limit. RLinf's -1 (epochs only) is refused: the library plans
    its futures and checkpoints on a known step count."""
    max_epochs: int = 1
    """Passes over the training data; an epoch is len(data) // data.rollout_batch_size steps
    (the last incomplete batch is dropped, as RLinf's loader does)."""
    val_check_interval: int = 1
    """When the run validates (runner.validate): every N steps and at the last step; <= 0
    never."""
    validate: bool | None = None
    """The library's validation (RLinf's reasoning runner never validates): true answers
    data.val_data_paths' prompts on runner.val_check_interval's schedule, false never. None:
    at load, false for an RLinf config file (one with Hydra's `defaults` list), true
    otherwise (config.load.load_config)."""
    per_worker_log: bool = False
    """Also write one log file per component process: log/<component>-<rank>.log."""
    save_interval: int = 2
    """Checkpoint every N steps and at the last step; -1 never checkpoints (RLinf's meaning)."""
    keep_last_checkpoints: int = 0
    """Keep only the newest K complete checkpoints (0 keeps all)."""
    checkpoint_write_threads: int = 8
    """Files each actor rank writes its checkpoint shard into, at once (torch DCP's
    FileSystemWriter thread_count): one rank's shard is __<rank>_0.distcp .. __<rank>_<N-1>.distcp.
    Storage that limits each stream (network file systems, cloud disks) writes several streams
    faster than one; 1 writes RLinf's one file per rank."""
    checkpoint_staging: bool = True
    """On GPUs, each actor rank keeps host-memory buffers for its checkpoint shard (fp32 weights
    and AdamW's two moments), allocated once, in the background, as soon as it is built; every
    checkpoint copies its state into them in one pass and writes from there at the storage's
    rate. Holds that much host memory for the run (21.3 GB a rank for the 1.5B model on one
    rank); skipped, with a warning in the actor's log, when it would take over half of the
    node's available memory, with actor.enable_offload, and when no checkpoint is scheduled.
    false: DCP copies each tensor from the GPU as it writes (slower, no memory held)."""
    compile_warm_up: bool | None = None
    """Right after the first weight sync, while step 1's rollout generates, inference (and the
    reference) compute log-probs of one made-up batch, and each actor rank runs the forward
    and backward of one made-up minibatch (gradients dropped, no optimiser step, random state
    kept), both in the shapes of a step whose longest answer reaches the token limit: what
    they compile for those shapes is compiled before the step needs it. The training is the
    same either way. None: on where something compiles (GPUs with actor.compile or
    inference.compile), unless the actor offloads (actor.enable_offload, set or planned: it is
    skipped and main.log says so); true: on anywhere (on the CPU nothing compiles: it only
    costs the extra forward and backward); false: off."""
    save_full_weights: bool = False
    """Also write a full-model Hugging Face copy of each checkpoint (actor/huggingface/), as
    `rlinf-twoworker export-hf` would; off by default (the tutorial saves only the shards)."""
    seq_length: int = 1024
    """Prompt plus answer tokens; max_new_tokens defaults to seq_length - max_prompt_length."""
    enable_dynamic_batch_size: bool = False
    """Run the actor's forward/backward in micro-batches of up to max_tokens_per_mbs tokens
    instead of algorithm.training_batch_size_per_gpu rows: fewer, fuller passes. The loss
    weights stay those of training_batch_size_per_gpu-row micro-batches, so the gradient is
    the same (see config_notes for how this differs from RLinf)."""
    max_tokens_per_mbs: int = 1024
    """Token budget of one actor micro-batch (rows x padded length) with dynamic batch size."""
    micro_batch_tokens: int | None = None
    """The library's own cut of the actor's forward/backward, for speed: as many rows as fit in
    this many tokens (rows x padded length), never fewer than training_batch_size_per_gpu. The
    loss weights stay those of RLinf's training_batch_size_per_gpu-row micro-batches, so the
    gradient is the same as RLinf's cut (up to the order of float sums); 0 cuts exactly as
    RLinf's keys say. enable_dynamic_batch_size=true uses max_tokens_per_mbs instead. None: on
    GPUs the memory plan picks it, with the log-prob cut and actor.activation_checkpointing
    when that is null too: the fastest combination that fits each GPU's budget, never below
    MICRO_BATCH_TOKENS_FLOOR (cluster/memory_plan.py, choose_cuts); where no GPU budget is
    known (CPUs), MICRO_BATCH_TOKENS_FLOOR."""
    logprob_micro_batch_tokens: int | None = None
    """The same for the log-prob recompute (inference, reference): as many rows as fit in this
    many tokens, never fewer than algorithm.logprob_forward_micro_batch_size; 0 takes that
    key's rows. A forward without gradients: the result does not depend on the cut. None: the
    memory plan picks it (as micro_batch_tokens), never below LOGPROB_MICRO_BATCH_TOKENS_FLOOR,
    which is also the value where no GPU budget is known."""
    trim_padding_multiple: int = 0
    """0 keeps every micro-batch at full width, its rows in order. N >= 1: the inference and
    actor forwards cut rows by where their answers end (longest first; as many rows as fit the
    micro-batch token budget at the width they trim to, engines/models.micro_batches) and drop
    the columns that are padding in every row of a micro-batch (prompt padding on the left,
    columns after its longest answer on the right), keeping a width that is a multiple of N
    (128 keeps the shapes few on GPUs). Exact: the same log-probs and gradient. With answers
    of varied length the forwards then compute about the real tokens, not rows x the longest
    answer (on an H100 at 64x8@2048, answers of 112-1792 tokens: the update 27% and the
    log-prob forward 34% faster; answers at full length: the same). The compiled layers and
    log-softmax then take their rows and width as dynamic from their first compile
    (engines/models.mark_dynamic_layers). Off by default: on empty compile caches on both
    sides (benchmarks' --scale-cold, one H100) the tutorial's step 1 took about 10 s longer
    with it (19.1 s against 9.2 with 64, after the fix that made its gradients finite; 21.4
    against 15.3 on another host once step 1's update compiled nothing again: the warm-up
    compiles for dynamic shapes longer than for one). Set 128 for long runs of varied answers."""
    rollout_dump: bool = True
    """Write every step's answers to rollouts/step_<N>.jsonl in the run directory, one JSON
    line per answer (data index, query id, prompt, answer, reward, advantage, length, whether
    it ended before the token limit; storage/rollouts.py), as verl's rollout dumps."""
    resume_dir: str | None = None
    """'auto' or a run directory (or one of its checkpoints/global_step_<N>) to continue from
    its last complete checkpoint. 'auto' takes the newest complete checkpoint among the other
    runs under runner.output_dir of this run's lineage only (storage/lineage.py: the same model
    and data manifests and training settings; step limits may differ), narrowed further by
    resume_prefix / resume_runs; a named directory is taken as it is."""
    resume_prefix: str | None = None
    """With resume_dir=auto: consider only runs whose name (RUN_ID) starts with this."""
    resume_runs: list[str] = field(default_factory=list)
    """With resume_dir=auto: consider only the runs of these names (under runner.output_dir)."""
    compile_cache_dir: str | None = "auto"
    """Where compiled kernels are kept for the next run of the same model shape, software and
    GPU (engines/compile_cache.py): 'auto' is <output_dir>/.compile-cache (shared storage, so
    every node and every later run finds it), a path puts it there, null turns it off. Only
    matters where something is compiled (GPUs with actor.compile)."""
    pipeline: str = "auto"
    """How a step's stages run (run/pipeline.py). 'pipelined', RLinf's pipeline mode: each of
    the step's runner.rollout_chunks chunks is graded and its old log-probs recomputed as soon
    as the rollout has generated it, and the actor trains on a minibatch as soon as its chunk
    is ready, while the rollout generates the next chunks. 'sequential': each stage over the
    whole step, then the next. 'auto': pipelined where the rollout shares no GPU with the actor
    (RLinf's disaggregated placement, the tutorial's), sequential where it does (RLinf's
    collocated mode; overlapping there would only time-share one GPU). Rollout and inference
    keep the step's starting weights until the sync after the update in both schedules, so the
    same seeds and the same runner.rollout_chunks give the same update."""
    rollout_chunks: int | None = None
    """Rollout calls per step: the step's prompts in this many equal chunks of whole groups,
    each sampled with its own seed (chunk 0 with actor.seed + step) and cut into its own
    minibatches. Must divide data.rollout_batch_size and algorithm.n_minibatches. None:
    gcd(data.rollout_batch_size, algorithm.n_minibatches) when pipelined (one chunk per
    minibatch in the starting config), 1 when sequential."""
    timeouts: Timeouts = field(default_factory=Timeouts)

    def __post_init__(self) -> None:
        _require(
            self.pipeline in PIPELINE_MODES,
            "runner.pipeline",
            self.pipeline,
            f"must be one of {', '.join(PIPELINE_MODES)}",
        )
        _require(
            self.rollout_chunks is None or self.rollout_chunks >= 1,
            "runner.rollout_chunks",
            self.rollout_chunks,
            "must be >= 1 (or null: one chunk per minibatch when pipelined, 1 when sequential)",
        )
        problem = run_id_problem(self.experiment_name)
        _require(problem is None, "runner.experiment_name", self.experiment_name, problem or "")
        _require(
            self.max_steps >= 1,
            "runner.max_steps",
            self.max_steps,
            "must be >= 1 (RLinf's -1, epochs only, is not supported: give the step count; "
            "runner.max_epochs still stops the run earlier when the epochs end first)",
        )
        _require(self.max_epochs >= 1, "runner.max_epochs", self.max_epochs, "must be >= 1")
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
        _require(
            self.checkpoint_write_threads >= 1,
            "runner.checkpoint_write_threads",
            self.checkpoint_write_threads,
            "must be >= 1 (1 writes one file per actor rank)",
        )
        _require(self.seq_length >= 2, "runner.seq_length", self.seq_length, "must be >= 2")
        _require(
            self.trim_padding_multiple >= 0,
            "runner.trim_padding_multiple",
            self.trim_padding_multiple,
            "must be >= 0 (0 turns trimming off)",
        )
        for key in ("micro_batch_tokens", "logprob_micro_batch_tokens"):
            value = getattr(self, key)
            _require(
                value is None or value >= 0,
                f"runner.{key}",
                value,
                "must be >= 0, or null (the memory plan picks it)",
            )
        _require(
            self.max_tokens_per_mbs >= 1,
            "runner.max_tokens_per_mbs",
            self.max_tokens_per_mbs,
            "must be >= 1",
        )
        _require(bool(self.output_dir), "runner.output_dir", self.output_dir, "must be set")

    @property
    def actor_cut_tokens(self) -> int:
        """micro_batch_tokens as the actor cuts by it: MICRO_BATCH_TOKENS_FLOOR while null."""
        value = self.micro_batch_tokens
        return MICRO_BATCH_TOKENS_FLOOR if value is None else value

    @property
    def logprob_cut_tokens(self) -> int:
        """logprob_micro_batch_tokens as the log-prob recompute cuts by it."""
        value = self.logprob_micro_batch_tokens
        return LOGPROB_MICRO_BATCH_TOKENS_FLOOR if value is None else value


@dataclass(kw_only=True)
class SamplingParams:
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 1000000
    """<= 0 or >= the vocabulary size turns top-k off."""
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    """HF/SGLang's repetition penalty on every token already in the prompt or the answer:
    a positive logit is divided by it, a negative one multiplied (1.0 turns it off). As in
    RLinf, the log-prob recompute does not apply it."""
    max_new_tokens: int | None = None
    """None: runner.seq_length - data.max_prompt_length."""
    min_new_tokens: int = 1
    """RLinf's key; RLinf passes it to no engine, so (as there) it has no effect. Must be 1."""

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
            self.repetition_penalty > 0,
            "algorithm.sampling_params.repetition_penalty",
            self.repetition_penalty,
            "must be > 0 (1.0 turns it off)",
        )
        _require(
            self.min_new_tokens == 1,
            "algorithm.sampling_params.min_new_tokens",
            self.min_new_tokens,
            "must be 1: RLinf passes min_new_tokens to no engine, and the library keeps "
            "that meaning (every answer has at least one token)",
        )
        _require(
            self.max_new_tokens is None or self.max_new_tokens >= 1,
            "algorithm.sampling_params.max_new_tokens",
            self.max_new_tokens,
            "must be >= 1",
        )


@dataclass(kw_only=True)
class DownSampling:
    do_down_sampling: bool = False
    down_sampling_config: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class AlgorithmConfig:
    group_size: int = 2
    """Answers sampled per prompt; advantages are normalised within a group."""
    n_minibatches: int = 4
    """Optimiser steps per GRPO step."""
    training_batch_size_per_gpu: int = 1
    """Rows of one RLinf micro-batch; the loss is aggregated per such micro-batch (see
    loss_agg_func), whatever micro-batches the library runs for speed."""
    logprob_forward_micro_batch_size: int = 1
    """Micro-batch size of the log-prob recompute."""
    recompute_logprobs: bool = True
    adv_type: str = "grpo"
    normalize_advantages: bool = False
    """Whiten the advantages over every valid token of the step's batch (RLinf's
    masked_normalization: (A - mean) / (std + 1e-5), biased std)."""
    shuffle_rollout: bool = False
    """Shuffle the step's answers (seeded by actor.seed and the step) before they are cut
    into minibatches; groups are then spread over minibatches."""
    loss_type: str = "actor"
    loss_agg_func: str = "token-mean"
    """How a micro-batch's per-token loss is reduced, as RLinf does it: 'token-mean' (over the
    micro-batch's valid tokens), 'seq-mean-token-mean', 'seq-mean-token-sum'; each divided by
    the micro-batches of the rank and averaged over ranks. 'global-token-mean' (the library's)
    weighs every valid token of the minibatch the same."""
    ratio_clip_eps: float = 0.2
    clip_ratio_low: float | None = None
    """Lower clip of the ratio (1 - clip_ratio_low); None: ratio_clip_eps."""
    clip_ratio_high: float | None = None
    """Upper clip of the ratio (1 + clip_ratio_high); None: ratio_clip_eps."""
    clip_ratio_c: float | None = None
    """Dual clip: a token's loss is at most clip_ratio_c * |A| (binds for A < 0); None off."""
    clip_log_ratio_min: float | None = None
    """Clamp log(ratio) from below before exp (None: no clamp)."""
    clip_log_ratio_max: float | None = None
    entropy_bonus: float = 0.0
    """Subtract entropy_bonus x the aggregated entropy of the policy from the loss."""
    calculate_entropy: bool = True
    """Compute the policy's entropy (logged as actor/entropy_loss); needed by entropy_bonus."""
    entropy_op_type: str = "flash_attn"
    kl_beta: float = 0.0
    """> 0 adds kl_beta x the aggregated KL term to the loss, against the reference policy
    (the actor's initial weights, a `reference` component placed by
    cluster.component_placement.reference, by default on inference's rank)."""
    kl_penalty_type: str = "low_var_kl"
    """'low_var_kl'/'k3', 'mse'/'k2', 'abs' (or 'kl'/'k1', refused with kl_beta > 0), taken
    as RLinf's FSDP actor takes it: kl_penalty(ref_logprobs, logprobs)."""
    max_num_gen_batches: int = 1
    rollout_batch_size_per_gpu: int | None = None
    val_rollout_batch_size_per_gpu: int | None = None
    use_valid_token_scale: bool = True
    early_stop_imp_ratio: float | None = 5.0
    importance_sampling_fix: bool = False
    importance_sampling_clip: float | None = None
    reinpp_kl_beta: float = 0.0
    use_reinpp_baseline: bool = False
    down_sampling: DownSampling = field(default_factory=DownSampling)
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
        _require(
            self.group_size >= 2,
            "algorithm.group_size",
            self.group_size,
            "must be >= 2 with algorithm.adv_type='grpo': a group of one answer has no baseline "
            "(its advantage would divide by a zero std; RLinf asserts group_size > 1); set "
            "algorithm.group_size to 2 or more",
        )
        _require(self.adv_type == "grpo", "algorithm.adv_type", self.adv_type, "must be 'grpo'")
        _require(
            self.loss_agg_func in LOSS_AGGREGATIONS,
            "algorithm.loss_agg_func",
            self.loss_agg_func,
            f"must be one of {', '.join(LOSS_AGGREGATIONS)}",
        )
        _require(
            self.ratio_clip_eps > 0, "algorithm.ratio_clip_eps", self.ratio_clip_eps, "must be > 0"
        )
        for name in ("clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            _require(value is None or value >= 0, f"algorithm.{name}", value, "must be >= 0")
        _require(
            self.clip_ratio_c is None or self.clip_ratio_c > 1,
            "algorithm.clip_ratio_c",
            self.clip_ratio_c,
            "must be > 1 (or null: no dual clip), as RLinf asserts",
        )
        _require(
            self.entropy_bonus >= 0, "algorithm.entropy_bonus", self.entropy_bonus, "must be >= 0"
        )
        _require(
            self.entropy_bonus == 0 or self.calculate_entropy,
            "algorithm.entropy_bonus",
            self.entropy_bonus,
            "needs algorithm.calculate_entropy=true (RLinf applies the bonus only then)",
        )
        _require(self.kl_beta >= 0, "algorithm.kl_beta", self.kl_beta, "must be >= 0")
        _require(
            self.kl_beta == 0 or self.kl_penalty_type not in ("kl", "k1"),
            "algorithm.kl_penalty_type",
            self.kl_penalty_type,
            "with kl_beta > 0 must not be kl/k1: RLinf's FSDP actor takes that term as "
            "ref - logp, whose gradient raises every log-prob (no penalty at all); use "
            "low_var_kl (k3), mse (k2) or abs",
        )
        _require(
            self.recompute_logprobs,
            "algorithm.recompute_logprobs",
            self.recompute_logprobs,
            "must be true: the inference component recomputes "
            "the old log-probabilities of every answer",
        )
        _require(
            self.kl_penalty_type in KL_KINDS,
            "algorithm.kl_penalty_type",
            self.kl_penalty_type,
            f"must be one of {', '.join(KL_KINDS)} (RLinf implements no other)",
        )

    @property
    def clip_low(self) -> float:
        return self.ratio_clip_eps if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.ratio_clip_eps if self.clip_ratio_high is None else self.clip_ratio_high


@dataclass(kw_only=True)
class ModelConfig:
    model_path: str = "/workspace/dataset/DeepSeek-R1-Distill-Qwen-1.5B"
    """A local Hugging Face model directory (config.json, tokenizer, *.safetensors)."""
    precision: str = "bf16"
    """Weights dtype of this component on a GPU: fp32, bf16 or fp16 (CPU always uses fp32).
    The rollout and inference compute in it; the actor keeps its master weights in it and
    computes in actor.fsdp_config.mixed_precision.param_dtype."""
    model_type: str = "qwen2.5"
    is_lora: bool = False


@dataclass(kw_only=True)
class ActorModelConfig(ModelConfig):
    """The actor's model; besides the path and precision, RLinf's Megatron knobs (no effect on
    its FSDP actor, as here) and the sequence lengths, which must be runner.seq_length."""

    seq_length: int | None = None
    """None or runner.seq_length (RLinf's YAML interpolates it)."""
    encoder_seq_length: int | None = None
    """None or runner.seq_length: RLinf's FSDP actor takes the answer length from it."""
    add_bias_linear: bool = False
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    activation: str = "swiglu"
    sequence_parallel: bool = False
    recompute_method: str | None = "block"
    recompute_granularity: str | None = "full"
    recompute_num_layers: int | None = 20
    normalization: str = "rmsnorm"
    position_embedding_type: str = "rope"
    apply_rope_fusion: bool = True
    bias_dropout_fusion: bool = False
    persist_layer_norm: bool = False
    bias_activation_fusion: bool = False
    attention_softmax_in_fp32: bool = True
    batch_p2p_comm: bool = False
    variable_seq_lengths: bool = True
    gradient_accumulation_fusion: bool = False
    moe_token_dispatcher_type: str = "alltoall"
    use_cpu_initialization: bool = False


@dataclass(kw_only=True)
class RolloutConfig(EngineSettings):
    model: ModelConfig = field(default_factory=ModelConfig)
    max_batch_size: int = 256
    """Most sequences decoded together: the static engine's decode slots (fewer where the KV
    cache would not fit; a slot is refilled as soon as its answer ends), the hf engine's batch."""
    engine: str = "auto"
    """'static' (preallocated KV cache, CUDA-graph decode), 'hf' (transformers' generate), or
    'auto' (static for Qwen2/Qwen3/Llama/Mistral models, hf otherwise)."""
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
class TokenizerConfig:
    tokenizer_model: str | None = None
    """Tokenizer directory; None uses the component's model directory."""
    use_fast: bool = True
    trust_remote_code: bool = True
    padding_side: str = "right"


@dataclass(kw_only=True)
class InferenceConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """tokenizer_model: None or the actor's tokenizer (one tokenizer for every component)."""
    group_name: str = "InferenceGroup"
    load_from_actor: bool = True
    fsdp_config: dict[str, Any] = field(default_factory=dict)
    compile: bool | None = None
    """On GPUs: compile the decoder layers and log-softmax as the actor does. None follows
    actor.compile (the same kernels on both sides: the first minibatch's ratio is 1 up to
    rounding); false computes the old log-probs eagerly (no compile time, and a small
    mismatch with the actor's compiled kernels)."""

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
    """Max global grad norm; <= 0 turns clipping off. A non-finite norm skips the step."""
    lr_scheduler: str = "constant"
    """RLinf's FSDP schedule: 'constant' (after the warm-up) or 'cosine' (transformers'
    cosine-with-min-lr), both with a linear warm-up from 0."""
    lr_warmup_steps: int = -1
    """Optimiser steps of warm-up; -1: lr_warmup_steps_ratio x total_training_steps."""
    lr_warmup_steps_ratio: float = 0.0
    total_training_steps: int | None = 0
    """Optimiser steps the cosine (and lr_warmup_steps_ratio) runs over. 0, RLinf's value when
    the key is unset (rlinf/hybrid_engines/fsdp/fsdp_model_manager.py:480), makes the cosine
    swing between lr and its floor each optimiser step, as in RLinf: set it (runner.max_steps x
    algorithm.n_minibatches) with lr_scheduler=cosine. null is taken as 0."""
    num_cycles: float = 0.5
    min_lr: float = 0.0
    """The cosine's floor (ignored when min_lr_rate is set)."""
    min_lr_rate: float | None = None
    """The cosine's floor as a fraction of lr."""
    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    optimizer_enable_pin: bool = False
    overlap_param_gather_with_optimizer_step: bool = False

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
        _require(
            self.total_training_steps is None or self.total_training_steps >= 0,
            "actor.optim.total_training_steps",
            self.total_training_steps,
            "must be >= 0 (0: unset, as in RLinf)",
        )
        _require(
            self.lr_scheduler in LR_SCHEDULERS,
            "actor.optim.lr_scheduler",
            self.lr_scheduler,
            f"must be one of {', '.join(LR_SCHEDULERS)}",
        )


@dataclass(kw_only=True)
class LrSchedConfig:
    """RLinf's Megatron schedule: no effect on its FSDP actor, nor here (config.rlinf.RULES)."""

    lr_decay_style: str = "constant"
    lr_warmup_iters: int = 0
    lr_warmup_init: float = 0.0
    lr_warmup_fraction: float | None = None
    max_lr: float | None = None
    min_lr: float = 0.0
    lr_decay_iters: int | None = None


@dataclass(kw_only=True)
class ActorConfig:
    seed: int = 1234
    model: ActorModelConfig = field(default_factory=lambda: ActorModelConfig(precision="fp32"))
    optim: OptimConfig = field(default_factory=OptimConfig)
    lr_sched: LrSchedConfig = field(default_factory=LrSchedConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    fsdp_config: FsdpConfig = field(default_factory=FsdpConfig)
    group_name: str = "ActorGroup"
    training_backend: str = "fsdp"
    enable_offload: bool | None = None
    """RLinf's meaning: outside its update the actor keeps its parameters and optimiser state in
    CPU memory (gradients freed), loading them back to train and to sync, so the components it
    shares a GPU with can use that memory; where the rollout or inference share a GPU with an
    actor rank they also give theirs back during the update (the rollout its KV cache, both
    their weights, which the sync refills). Ignored when the step is pipelined (as RLinf
    does). None: off, unless the memory plan finds that a GPU fits only with it."""
    activation_checkpointing: bool | None = None
    """Recompute each decoder layer's activations in the backward pass (less memory, one more
    forward of compute). None: off, unless the memory plan finds that an actor's GPU fits only
    with it (it then turns it on and says so in main.log). actor.fsdp_config.
    gradient_checkpointing, when set, decides."""
    compile: bool = True
    """On GPUs: each decoder layer's forward and the log-softmax of the log-probs run through
    torch.compile (fused elementwise kernels; the first update pays the compilation); the
    inference copy compiles the same way, so old and new log-probs come from the same
    kernels. If the compiler fails, the component warns and runs eagerly. Ignored on CPUs."""
    fsdp_at_one_rank: bool = False
    """With one actor rank (a one-GPU job): false trains the model without FSDP2's wrapper,
    with the same numerics (for each micro-batch every parameter is cast to
    fsdp_config.mixed_precision.param_dtype, the forward and backward compute in it and each
    gradient reaches the master weight cast back, as FSDP2 gathers and reduces at one rank),
    holding every layer's cast from its forward to its backward, which the memory plan counts
    (about 3 GiB for a 1.5B model in bf16); true wraps the model in FSDP2 as with two ranks,
    which frees each layer's cast after its forward (actor.fsdp_config.reshard_after_forward)
    but copies every parameter into FSDP2's buffers twice a micro-batch (about 0.3 s a step
    at the tutorial's shape on an H100). Two ranks or more always use FSDP2."""

    def fsdp_wraps(self, ranks: int, gpu: bool) -> bool:
        """Whether `ranks` actor ranks train through FSDP2's wrapper (fsdp_at_one_rank). At
        one rank the wrapper stays where its gradient is not the cast's: a reduce_dtype other
        than param_dtype and the master weights' dtype rounds each gradient once more."""
        if ranks > 1 or self.fsdp_at_one_rank:
            return True
        mp = self.fsdp_config.mixed_precision
        if not gpu or mp.param_dtype is None or mp.reduce_dtype is None:
            return False
        return mp.reduce_dtype not in (mp.param_dtype, self.model.precision)

    def __post_init__(self) -> None:
        _require(
            self.model.precision in PRECISIONS,
            "actor.model.precision",
            self.model.precision,
            f"must be one of {PRECISIONS}",
        )

    @property
    def recompute(self) -> bool:
        """Whether decoder-layer activations are recomputed in the backward pass."""
        return bool(self.recompute_choice)

    @property
    def offload(self) -> bool:
        """Whether the actor offloads between updates (as set; the plan may turn it on)."""
        return bool(self.enable_offload)

    @property
    def recompute_choice(self) -> bool | None:
        """The user's choice of activation recompute, None when left to the memory plan."""
        rlinf = self.fsdp_config.gradient_checkpointing
        return self.activation_checkpointing if rlinf is None else rlinf


@dataclass(kw_only=True)
class DataConfig:
    train_data_paths: list[str] = field(
        default_factory=lambda: ["/workspace/dataset/AReaL-boba-106k.jsonl"]
    )
    """JSONL files, one object a line, in the AReaL-boba format."""
    val_data_paths: list[str] = field(default_factory=list)
    """Validation JSONL files; with runner.val_check_interval > 0 (and runner.validate) the
    policy answers data.val_num_prompts of their prompts every that many steps and at the
    last step."""
    val_num_prompts: int | None = None
    """Validation prompts per validation (the same ones every time, drawn once with
    data.seed); None: data.rollout_batch_size."""
    validation_shuffle: bool = True
    """Draw the validation prompts at random (seeded); false takes the first ones."""
    prompt_key: str = "prompt"
    answer_key: str = "solutions"
    max_prompt_length: int = 256
    """A longer prompt keeps its first max_prompt_length tokens, as RLinf cuts it (a warning
    counts the prompts cut)."""
    rollout_batch_size: int = 8
    """Prompts per GRPO step."""
    shuffle: bool = True
    """Each epoch in RLinf's shuffled order (storage.data.PromptSampler); false: file order."""
    seed: int = 1234
    """Seeds the prompt order as RLinf's loader's torch.Generator, and the validation draw."""
    skip_malformed_lines: bool = False
    """Skip (and count) lines that are not valid JSON objects instead of failing."""
    type: str = "math"
    dataset_name: str = "boba"
    val_rollout_batch_size: int | None = None
    num_workers: int = 2
    apply_chat_template: bool = False

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
        _require(
            self.val_num_prompts is None or self.val_num_prompts >= 1,
            "data.val_num_prompts",
            self.val_num_prompts,
            "must be >= 1 (or null: data.rollout_batch_size)",
        )


@dataclass(kw_only=True)
class RewardConfig:
    reward_type: str = "math"
    reward_scale: float = 5.0
    """A correct answer scores +reward_scale, a wrong one -reward_scale (the math grader only:
    a reward.reward_fn's values are taken as they are)."""
    timeout_s: float = 10.0
    """Per-answer grading timeout; an answer that times out scores as wrong (RLinf: 10 s), or
    0.0 under reward.reward_fn."""
    grader: str = "rlinf"
    """How an answer is judged: 'rlinf' (RLinf's math verifier: the last \\boxed{}, sympy
    equivalence within a relative 1e-4, no box is wrong) or 'math_verify' (HF math_verify)."""
    reward_fn: str | None = None
    """'package.module:function': a Python function that gives each answer its reward instead
    of reward.grader, called as fn(prompt, answer, row) -> float in the reward's grading
    processes (prompt: the data's prompt text; row: its JSONL record, every key). Its float is
    the reward as it is: reward.reward_scale does not apply. reward.timeout_s bounds each call
    (an answer past it scores 0.0); a function that raises, or returns no finite float, fails
    the step with its traceback. Not an RLinf key (reward.reward_type stays 'math'). The name is
    checked here; the import, by the request check and in every grading process."""
    group_name: str = "RewardGroup"
    use_reward_model: bool = False
    tokenizer: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from rlinf_twoworker.rewards.graders import reward_fn_syntax_problem

        _require(
            self.reward_type == "math", "reward.reward_type", self.reward_type, "must be 'math'"
        )
        _require(self.timeout_s > 0, "reward.timeout_s", self.timeout_s, "must be > 0")
        _require(
            self.grader in GRADERS,
            "reward.grader",
            self.grader,
            f"must be one of {', '.join(GRADERS)}",
        )
        if self.reward_fn is not None:
            problem = reward_fn_syntax_problem(self.reward_fn)
            _require(problem is None, "reward.reward_fn", self.reward_fn, str(problem))


@dataclass(kw_only=True)
class CriticConfig:
    use_critic_model: bool = False


@dataclass(frozen=True, kw_only=True)
class MicroBatchRule:
    """How one pass cuts a batch of equal-width rows into compute micro-batches: as many rows
    as fit in `tokens`, at least `least` (`tokens` 0: `least` rows)."""

    least: int
    tokens: int

    def rows(self, width: int) -> int:
        if not self.tokens:
            return self.least
        return max(self.least, self.tokens // max(width, 1))

    def slices(self, rows: int, width: int) -> list[slice]:
        """Row slices of `rows` rows of `width` tokens, in order."""
        size = self.rows(width)
        return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]


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
    critic: CriticConfig = field(default_factory=CriticConfig)
    hydra: HydraConfig = field(default_factory=HydraConfig)
    defaults: list[Any] = field(default_factory=list)
    """Hydra's defaults list of an RLinf YAML file; kept as given, nothing is composed."""

    def __post_init__(self) -> None:
        placement = self.placement  # raises ConfigError naming the component
        _require(
            self.data.max_prompt_length < self.runner.seq_length,
            "data.max_prompt_length",
            self.data.max_prompt_length,
            f"must be < runner.seq_length ({self.runner.seq_length})",
        )
        self._check_batches(len(placement.ranks("actor")))
        self._check_chunks()
        self._check_validation()
        for key in ("seq_length", "encoder_seq_length"):
            value = getattr(self.actor.model, key)
            _require(
                value is None or value == self.runner.seq_length,
                f"actor.model.{key}",
                value,
                f"must be runner.seq_length ({self.runner.seq_length}) or unset",
            )

    def _check_batches(self, actor_ranks: int) -> None:
        total = self.data.rollout_batch_size * self.algorithm.group_size
        per_update = total // self.algorithm.n_minibatches
        _require(
            total % self.algorithm.n_minibatches == 0 and per_update % actor_ranks == 0,
            "algorithm.n_minibatches",
            self.algorithm.n_minibatches,
            f"rollout_batch_size x group_size ({total}) must split into n_minibatches "
            f"equal parts, each divisible by the {actor_ranks} actor ranks",
        )
        per_rank = per_update // actor_ranks
        _require(
            per_rank % self.algorithm.training_batch_size_per_gpu == 0,
            "algorithm.training_batch_size_per_gpu",
            self.algorithm.training_batch_size_per_gpu,
            f"must divide each actor rank's share of a minibatch ({per_rank} answers), as "
            "RLinf asserts",
        )

    def _check_chunks(self) -> None:
        chunks = self.runner.rollout_chunks
        _require(
            chunks is None
            or (
                self.data.rollout_batch_size % chunks == 0
                and self.algorithm.n_minibatches % chunks == 0
            ),
            "runner.rollout_chunks",
            chunks,
            f"must divide data.rollout_batch_size ({self.data.rollout_batch_size}: chunks of "
            f"whole groups) and algorithm.n_minibatches ({self.algorithm.n_minibatches}: each "
            "minibatch within one chunk)",
        )

    def _check_validation(self) -> None:
        interval, save = self.runner.val_check_interval, self.runner.save_interval
        # RLinf asserts it whatever runner.validate says (its runner never validates).
        if self.data.val_data_paths and interval > 0 and save > 0:
            _require(
                save % interval == 0,
                "runner.save_interval",
                save,
                f"must be a multiple of runner.val_check_interval ({interval}) when "
                "data.val_data_paths is given, as RLinf asserts (runner.validate=false too)",
            )

    @cached_property
    def placement(self) -> Placement:
        """Every component process of this run with its resource rank, bundle and GPU."""
        return resolve_placement(self.cluster, components.in_run(self))

    @property
    def pipelined(self) -> bool:
        """runner.pipeline resolved: 'auto' pipelines where no GPU runs both the rollout and
        an actor rank."""
        if self.runner.pipeline != "auto":
            return self.runner.pipeline == "pipelined"
        trainer = next(c.name for c in components.in_run(self) if c.trains)
        placement = self.placement
        return not set(placement.ranks("rollout")) & set(placement.ranks(trainer))

    @property
    def offloads(self) -> bool:
        """actor.enable_offload in effect: on and the step sequential (RLinf ignores it in its
        pipeline mode, where the stages run at once)."""
        return self.actor.offload and not self.pipelined

    @property
    def warms_up(self) -> bool:
        """runner.compile_warm_up resolved (before the actor's offload, which skips it)."""
        if self.runner.compile_warm_up is not None:
            return self.runner.compile_warm_up
        compiles = self.actor.compile or bool(self.inference.compile)
        return self.cluster.accelerator == "cuda" and compiles

    @property
    def rollout_chunks(self) -> int:
        """runner.rollout_chunks resolved: the rollout calls of each step."""
        if self.runner.rollout_chunks is not None:
            return self.runner.rollout_chunks
        if not self.pipelined:
            return 1
        return math.gcd(self.data.rollout_batch_size, self.algorithm.n_minibatches)

    @property
    def validates(self) -> bool:
        """Whether the run answers validation prompts (runner.validate not false, val data
        given, interval > 0)."""
        return (
            self.runner.validate is not False
            and bool(self.data.val_data_paths)
            and self.runner.val_check_interval > 0
        )

    @property
    def minibatch_rows(self) -> int:
        """Answers in one minibatch of a step (all actor ranks together)."""
        return (
            self.data.rollout_batch_size * self.algorithm.group_size // self.algorithm.n_minibatches
        )

    def micro_batch_rule(self, training: bool, cut: int | None = None) -> MicroBatchRule:
        """The micro-batch cut of one pass, the one rule of both (the loss weights do not
        depend on it). The actor's update (`training`, one rank's minibatch): as many rows as
        fit in runner.max_tokens_per_mbs (at least one) under dynamic batch size, else in
        runner.micro_batch_tokens, at least algorithm.training_batch_size_per_gpu. The
        log-prob forward: as many as fit in runner.logprob_micro_batch_tokens, at least
        algorithm.logprob_forward_micro_batch_size. A token cut of 0 leaves the RLinf key's
        row count alone; `cut` stands for the settled token cut (the memory plan tries
        several)."""
        runner, algo = self.runner, self.algorithm
        if training:
            if runner.enable_dynamic_batch_size:
                return MicroBatchRule(least=1, tokens=runner.max_tokens_per_mbs)
            least = algo.training_batch_size_per_gpu
            tokens = runner.actor_cut_tokens if cut is None else cut
        else:
            least = algo.logprob_forward_micro_batch_size
            tokens = runner.logprob_cut_tokens if cut is None else cut
        return MicroBatchRule(least=least, tokens=tokens)

    def micro_batch_rows(self, training: bool, width: int, cut: int | None = None) -> int:
        """Rows of one compute micro-batch of `width`-token rows (micro_batch_rule)."""
        return self.micro_batch_rule(training, cut).rows(width)

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

    @property
    def compile_cache_root(self) -> Path | None:
        """runner.compile_cache_dir resolved: None when off."""
        configured = self.runner.compile_cache_dir
        if not configured:
            return None
        if configured == "auto":
            return Path(self.runner.output_dir) / ".compile-cache"
        return Path(configured)

    @property
    def log_dir(self) -> Path:
        """Where TensorBoard (tensorboard/) goes: runner.logger.log_path, as in RLinf (a
        relative path taken from the run directory), or the run directory when unset (the
        tutorial sets it to the run directory)."""
        log_path = self.runner.logger.log_path
        return self.run_dir / log_path if log_path else self.run_dir

    @property
    def hydra_record_dir(self) -> Path | None:
        """Where RLinf's Hydra would keep its record (hydra.run.dir/hydra.output_subdir, a
        relative hydra.run.dir taken from the run directory), or None when
        hydra.output_subdir is null. The library writes it there, and always to
        <run dir>/hydra/.hydra/, which the postflight reads."""
        if self.hydra.output_subdir is None:
            return None
        run = self.run_dir / (self.hydra.run.dir or "hydra")
        return run / self.hydra.output_subdir

"""Each component's own settings: what its process reads of the run's config, settled once by
the controller (after the memory plan) and sent to that process alone. A worker is built as
`Worker(settings, rank)`; its row in the component table names the function here that makes
its settings (`components.Component.settings`), so a worker cannot come to depend on a key
nobody gave it, and what each one reads is written down in one place.

Values, not rules: what the config resolves (the compile choice, the answer length, the
offload in effect, the micro-batch cut) is resolved here, by the config's own properties.
No torch: the controller builds these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from rlinf_twoworker.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    GRPOConfig,
    MicroBatchRule,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    SamplingParams,
)


@dataclass(frozen=True, kw_only=True)
class ProcessSettings:
    """What every component process reads, and its host (run/group.ComponentHost) with it."""

    accelerator: str
    """cluster.accelerator: 'cuda' or 'cpu'."""
    seed: int
    """actor.seed; each process seeds torch with it plus its rank."""
    collective_timeout_s: float
    """runner.timeouts.collective_s: the process groups' timeout."""
    compile_cache_root: Path | None
    """runner.compile_cache_dir resolved (None: off); the host keeps bytecode there too."""
    model: ModelConfig | None
    """The model it loads, path and precision as it loads it (None: it loads none)."""


@dataclass(frozen=True, kw_only=True)
class RewardSettings(ProcessSettings):
    reward: RewardConfig


@dataclass(frozen=True, kw_only=True)
class RolloutSettings(ProcessSettings):
    model: ModelConfig
    engine: RolloutConfig
    """rollout: its engine, decode slots and weight check."""
    sampling: SamplingParams
    group_size: int
    """algorithm.group_size: answers per prompt."""
    max_prompt_length: int
    max_new_tokens: int
    """algorithm.sampling_params.max_new_tokens, or what runner.seq_length leaves."""
    tokenizer_path: str


@dataclass(frozen=True, kw_only=True)
class InferenceSettings(ProcessSettings):
    """A log-prob model: the inference copy, or the frozen reference policy."""

    model: ModelConfig

    compile: bool
    """inference.compile, or actor.compile where it is None."""
    micro_batch: MicroBatchRule
    """The log-prob forward's cut (GRPOConfig.micro_batch_rule(False))."""
    trim_padding_multiple: int
    temperature: float
    """algorithm.sampling_params.temperature: the log-probs are of the sampled distribution."""


@dataclass(frozen=True, kw_only=True)
class ActorSettings(ProcessSettings):
    model: ModelConfig
    actor: ActorConfig
    algorithm: AlgorithmConfig
    micro_batch: MicroBatchRule
    """The update's cut (GRPOConfig.micro_batch_rule(True))."""
    trim_padding_multiple: int
    offloads: bool
    """actor.enable_offload in effect (GRPOConfig.offloads)."""
    checkpoint_staging: bool
    save_interval: int
    checkpoint_write_threads: int


def _process(cfg: GRPOConfig, model: ModelConfig | None) -> dict:
    return {
        "accelerator": cfg.cluster.accelerator,
        "seed": cfg.actor.seed,
        "collective_timeout_s": cfg.runner.timeouts.collective_s,
        "compile_cache_root": cfg.compile_cache_root,
        "model": model,
    }


def reward_settings(cfg: GRPOConfig) -> RewardSettings:
    return RewardSettings(**_process(cfg, None), reward=cfg.reward)


def rollout_settings(cfg: GRPOConfig) -> RolloutSettings:
    return RolloutSettings(
        **_process(cfg, cfg.rollout.model),
        engine=cfg.rollout,
        sampling=cfg.algorithm.sampling_params,
        group_size=cfg.algorithm.group_size,
        max_prompt_length=cfg.data.max_prompt_length,
        max_new_tokens=cfg.max_new_tokens,
        tokenizer_path=cfg.tokenizer_path,
    )


def _logprob_settings(cfg: GRPOConfig, model: ModelConfig) -> InferenceSettings:
    wanted = cfg.inference.compile
    return InferenceSettings(
        **_process(cfg, model),
        compile=cfg.actor.compile if wanted is None else wanted,
        micro_batch=cfg.micro_batch_rule(False),
        trim_padding_multiple=cfg.runner.trim_padding_multiple,
        temperature=cfg.algorithm.sampling_params.temperature,
    )


def inference_settings(cfg: GRPOConfig) -> InferenceSettings:
    return _logprob_settings(cfg, cfg.inference.model)


def reference_settings(cfg: GRPOConfig) -> InferenceSettings:
    """The actor's initial weights, loaded and computed as the inference copy's."""
    model = replace(cfg.inference.model, model_path=cfg.actor.model.model_path)
    return _logprob_settings(cfg, model)


def actor_settings(cfg: GRPOConfig) -> ActorSettings:
    return ActorSettings(
        **_process(cfg, cfg.actor.model),
        actor=cfg.actor,
        algorithm=cfg.algorithm,
        micro_batch=cfg.micro_batch_rule(True),
        trim_padding_multiple=cfg.runner.trim_padding_multiple,
        offloads=cfg.offloads,
        checkpoint_staging=cfg.runner.checkpoint_staging,
        save_interval=cfg.runner.save_interval,
        checkpoint_write_threads=cfg.runner.checkpoint_write_threads,
    )

"""Loading a config: the defaults, an RLinf-layout YAML file, Hydra-style overrides; validation
once at the end; the conversion to the dataclasses; how RLinf's keys were taken."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlinf_twoworker.config.overrides import (
    apply_override,
    merge_file,
    omegaconf_reason,
    register_rlinf_resolvers,
)
from rlinf_twoworker.config.precision import precision_notes
from rlinf_twoworker.config.rlinf import apply_code_defaults, check_rules
from rlinf_twoworker.config.schema import GRPOConfig
from rlinf_twoworker.errors import ConfigError


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> DictConfig:
    """Defaults, then an optional YAML file in RLinf's layout, then Hydra-style overrides.

    Returns a validated, struct-mode DictConfig. Raises ConfigError naming the key, the value
    and the rule that was broken.
    """
    register_rlinf_resolvers()
    cfg = OmegaConf.structured(GRPOConfig)
    given: set[str] = set()
    rlinf_file = False
    if path is not None:
        cfg = merge_file(cfg, Path(path), given)
        apply_code_defaults(cfg, given)  # what RLinf's code reads for keys the file omits
        rlinf_file = bool(cfg.defaults)  # Hydra's defaults list: a config RLinf composes
    for text in overrides:
        apply_override(cfg, text, given)
    if cfg.runner.validate is None:  # decided here, so the run's record keeps the choice
        cfg.runner.validate = not rlinf_file
    config_notes(cfg, to_typed(cfg))  # every __post_init__ rule, then RLinf's key rules
    return cfg


def config_notes(cfg: DictConfig, typed: GRPOConfig | None = None) -> list[str]:
    """How the RLinf keys without a setting of their own were taken (config.rlinf.RULES): raises
    ConfigError for a refused value; returns one note per accepted non-default value, for the
    run's log. `typed`: the config's dataclasses when the caller has them already."""
    typed = to_typed(cfg) if typed is None else typed
    notes = check_rules(cfg, OmegaConf.structured(GRPOConfig))
    if typed.hydra.output_subdir is None:
        notes.append(
            "hydra.output_subdir=None accepted: RLinf keeps no Hydra record; the library keeps "
            "the resolved config in <run dir>/hydra/.hydra/ anyway (the postflight reads it)"
        )
    if typed.runner.enable_dynamic_batch_size:
        notes.append(
            "runner.enable_dynamic_batch_size=True accepted: the actor runs micro-batches of "
            f"up to runner.max_tokens_per_mbs={typed.runner.max_tokens_per_mbs} tokens for "
            "speed, and the loss keeps the weights of algorithm.training_batch_size_per_gpu-row "
            "micro-batches, so the gradient does not change (RLinf refuses dynamic batches in "
            "its pipeline mode; in its collocated mode it normalises per token-balanced "
            "micro-batch instead)"
        )
    optim = typed.actor.optim
    if optim.lr_scheduler == "cosine" and not optim.total_training_steps:
        notes.append(
            "actor.optim.lr_scheduler=cosine with actor.optim.total_training_steps unset (0, "
            "as RLinf reads it): the cosine runs over 0 steps, so the lr swings between "
            "actor.optim.lr and its floor each optimiser step, as in RLinf; set "
            "actor.optim.total_training_steps (runner.max_steps x algorithm.n_minibatches = "
            f"{typed.runner.max_steps * typed.algorithm.n_minibatches} here) for a decay"
        )
    runner = typed.runner
    if runner.validate is False and typed.data.val_data_paths and runner.val_check_interval > 0:
        notes.append(
            "runner.validate=False: data.val_data_paths is not answered, as RLinf's reasoning "
            "runner never validates (runner.val_check_interval only sets when it would); "
            "runner.validate=true adds the library's validation (val/reward_scores, "
            "val/correct_fraction)"
        )
    notes.extend(precision_notes(typed))
    inference_tokenizer = typed.inference.tokenizer.tokenizer_model
    if inference_tokenizer and inference_tokenizer != typed.tokenizer_path:
        notes.append(
            f"inference.tokenizer.tokenizer_model={inference_tokenizer!r} accepted: inference "
            f"reads token ids only; text is encoded and decoded with {typed.tokenizer_path}"
        )
    return notes


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

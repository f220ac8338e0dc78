"""The actor's precision in RLinf's keys, with RLinf's meaning: actor.fsdp_config.
mixed_precision (FSDP2's casts: the dtype the layers compute in and the one gradients are
reduced in), actor.fsdp_config.grad_scaler (dynamic loss scaling: an overflow skips the
optimiser step and halves the scale) and actor.fsdp_config.amp_autocast (not offered: FSDP2's
casts do the same). The rollout's and inference's precision is their `model.precision`.

The library's own defaults compute in bf16 and reduce gradients in fp32, without loss scaling;
RLinf's starting config asks for fp16 compute and reduction with a scaler, and gets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlinf_twoworker.errors import ConfigError

DTYPES = ("fp16", "bf16", "fp32")
"""What RLinf's precision keys take (its `torch_dtype_from_precision`); null: no cast."""
_MP = "actor.fsdp_config.mixed_precision"
_SCALER = "actor.fsdp_config.grad_scaler"


def _dtype(key: str, value: str | None) -> None:
    if value is not None and value not in DTYPES:
        raise ConfigError(key, value, "must be fp16, bf16, fp32 or null (no cast)")


@dataclass(kw_only=True)
class MixedPrecision:
    """RLinf's actor.fsdp_config.mixed_precision, applied by FSDP2 on GPUs (the CPU path
    computes in fp32). The master weights keep actor.model.precision."""

    param_dtype: str | None = "bf16"
    """The dtype each decoder layer is gathered in and computes in (forward and backward);
    null: the master weights' own dtype. RLinf's starting config: fp16."""
    reduce_dtype: str | None = "fp32"
    """The dtype gradients are reduce-scattered in over the actor ranks (the sharded
    gradients then keep the master weights' dtype); null: param_dtype's. RLinf's starting
    config: fp16."""
    buffer_dtype: str | None = "fp32"
    """The dtype of the model's floating-point buffers (the rotary frequencies); null: as
    loaded. RLinf's FSDP1 strategy applies it and its FSDP2 strategy ignores it; the library
    casts the buffers before sharding."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            _dtype(f"{_MP}.{name}", getattr(self, name))


@dataclass(kw_only=True)
class AmpAutocast:
    """RLinf's actor.fsdp_config.amp_autocast: autocast instead of FSDP's casts. Not offered:
    mixed_precision.param_dtype gives the same compute dtype."""

    enabled: bool = False
    """Only false: set actor.fsdp_config.mixed_precision.param_dtype to the precision instead."""
    precision: str = "bf16"

    def __post_init__(self) -> None:
        key = "actor.fsdp_config.amp_autocast"
        _dtype(f"{key}.precision", self.precision)
        if self.enabled:
            raise ConfigError(
                f"{key}.enabled",
                True,
                "autocast is not offered: the actor computes in FSDP2's mixed precision; set "
                f"{key}.enabled=false and {_MP}.param_dtype={self.precision}: the layers then "
                f"compute in {self.precision} as under autocast",
            )


@dataclass(kw_only=True)
class GradScalerConfig:
    """RLinf's actor.fsdp_config.grad_scaler: dynamic loss scaling (torch's ShardedGradScaler,
    as RLinf's FSDP actor builds it). The loss is multiplied by the scale before the backward
    pass and the gradients divided by it before clipping; a step whose gradients hold an inf or
    a nan on any actor rank is skipped and the scale multiplied by backoff_factor; after
    growth_interval good steps in a row it is multiplied by growth_factor. Its state is in each
    checkpoint."""

    enabled: bool = False
    """RLinf's starting config: true (with fp16). Off, the gradients are used unscaled."""
    init_scale: float | None = 65536.0
    """The first scale; null: 65536 (torch's default, which RLinf uses when unset)."""
    growth_interval: int | None = 2000
    """Good optimiser steps in a row before the scale grows; null: 2000 (torch's default)."""
    growth_factor: float = 2.0
    """torch's name; RLinf does not pass it on (it always runs with 2.0)."""
    backoff_factor: float = 0.5
    """torch's name; RLinf does not pass it on (it always runs with 0.5)."""

    def __post_init__(self) -> None:
        checks = (
            ("init_scale", self.init_scale is None or self.init_scale > 0, "must be > 0 or null"),
            (
                "growth_interval",
                self.growth_interval is None or self.growth_interval >= 1,
                "must be >= 1 or null",
            ),
            ("growth_factor", self.growth_factor > 1, "must be > 1"),
            ("backoff_factor", 0 < self.backoff_factor < 1, "must be in (0, 1)"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"{_SCALER}.{name}", getattr(self, name), rule)

    @property
    def scale(self) -> float:
        return 65536.0 if self.init_scale is None else float(self.init_scale)

    @property
    def interval(self) -> int:
        return 2000 if self.growth_interval is None else self.growth_interval


# `cfg` below is a GRPOConfig, typed Any: config.schema imports this module through config.rlinf,
# so naming GRPOConfig here would close an import circle.
def actor_compute(cfg: Any) -> str:
    """The dtype the actor's layers compute in on GPUs: param_dtype, else the master weights'."""
    return cfg.actor.fsdp_config.mixed_precision.param_dtype or cfg.actor.model.precision


def precision_warning(cfg: Any) -> str | None:
    """Why the actor's new log-probs and the inference's old ones come from different
    precisions (the first minibatch's ratio is then not 1 up to rounding), with the keys to
    change; None when they agree or on CPUs (everything computes in fp32 there)."""
    if cfg.cluster.accelerator != "cuda":
        return None
    actor, inference = actor_compute(cfg), cfg.inference.model.precision
    if actor == inference:
        return None
    return (
        f"the actor computes in {actor} ({_MP}.param_dtype, or actor.model.precision when it "
        f"is null) but inference computes the old log-probs in {inference} "
        "(inference.model.precision): the importance ratios carry the difference of the two "
        f"precisions. Set inference.model.precision={actor} or {_MP}.param_dtype={inference} "
        "for one precision on both sides"
    )


def precision_notes(cfg: Any) -> list[str]:
    """Notes for the run's log on precision settings that are accepted but worth knowing."""
    notes = []
    scaler = cfg.actor.fsdp_config.grad_scaler
    if actor_compute(cfg) == "fp16" and not scaler.enabled:
        notes.append(
            f"{_MP}.param_dtype=fp16 with {_SCALER}.enabled=false accepted: small fp16 "
            f"gradients flush to zero without loss scaling; set {_SCALER}.enabled=true"
        )
    for name, torch_default in (("growth_factor", 2.0), ("backoff_factor", 0.5)):
        value = getattr(scaler, name)
        if value != torch_default:
            notes.append(
                f"{_SCALER}.{name}={value!r} accepted: the library applies it; RLinf does not "
                f"pass it to its scaler and runs with {torch_default}"
            )
    return notes

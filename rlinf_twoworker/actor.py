"""The actor: FSDP2 training of the policy with the GRPO (PPO-clip) loss, and its checkpoints.

Each rank gets its share of every minibatch; gradients are reduced by FSDP2 over the actor
group. Loss scaling makes the update equal to the configured aggregation over the whole
minibatch, independent of how rows are split across ranks and micro-batches.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rlinf_twoworker.algorithm import lr_at, ppo_clip_loss
from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.models import (
    SequenceBatch,
    dtype_for,
    load_causal_lm,
    response_logprobs,
    run_or_eager,
)
from rlinf_twoworker.weight_sync import export_weights, send_weights
from rlinf_twoworker.worker import Worker


def micro_batches(cfg: GRPOConfig, rows: int, width: int) -> list[slice]:
    """Row slices of one rank's minibatch: training_batch_size_per_gpu rows each, or as many
    rows as fit in runner.max_tokens_per_mbs (at least one) with dynamic batch size."""
    size = cfg.algorithm.training_batch_size_per_gpu
    if cfg.runner.enable_dynamic_batch_size:
        size = max(1, cfg.runner.max_tokens_per_mbs // max(width, 1))
    return [slice(begin, begin + size) for begin in range(0, rows, size)]


def prepare_for_training(
    model: Any,
    mesh: Any,
    *,
    mixed_precision: bool,
    activation_checkpointing: bool,
    compile_layers: bool,
) -> Any:
    """Shard `model` with FSDP2 over `mesh`, one unit per decoder layer plus the root.

    mixed_precision: bf16 parameters in forward/backward, fp32 gradient reduction (the master
    weights keep the loaded dtype). compile_layers: each decoder layer's forward goes through
    `torch.compile` (its norms, rotary, SwiGLU and residual adds fuse into few kernels; the
    GEMMs and attention stay cuBLAS / SDPA); compiled in place, so parameter names, state dicts
    and checkpoints are those of the eager model. FSDP2's hooks stay outside the compiled code.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.train()  # from_pretrained returns eval mode, where transformers skips checkpointing
    if activation_checkpointing:  # transformers >= 5.2x renamed gradient_checkpointing_*
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    model.config.use_cache = False
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in model.model.layers:
        if compile_layers:
            layer.compile()
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


class ActorWorker(Worker):
    """One FSDP2 rank of the policy being trained."""

    def __init__(self, cfg: GRPOConfig, rank: int) -> None:
        super().__init__(cfg, "actor", rank)
        self.model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self._exported: list[torch.Tensor] = []
        self.compiled = False  # compiled decoder layers and log-softmax (set by `build`)

    def build(self) -> None:
        """Load, shard and set up the optimiser (after `join`, which makes the actor group)."""
        from torch.distributed.device_mesh import DeviceMesh

        cfg = self.cfg
        dtype = dtype_for(cfg.actor.model.precision, self.device)
        model = load_causal_lm(cfg.actor.model.model_path, dtype, self.device)
        self.compiled = self.device.type == "cuda" and cfg.actor.compile
        model = prepare_for_training(
            model,
            DeviceMesh.from_group(self.actor_group, self.device.type),
            mixed_precision=self.device.type == "cuda" and cfg.actor.mixed_precision,
            activation_checkpointing=cfg.actor.activation_checkpointing,
            compile_layers=self.compiled,
        )
        self.model = model
        optim = cfg.actor.optim
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=optim.lr,
            betas=(optim.adam_beta1, optim.adam_beta2),
            eps=optim.adam_eps,
            weight_decay=optim.weight_decay,
            fused=self.device.type == "cuda",
        )
        sched = cfg.actor.lr_sched
        total = cfg.runner.max_steps * cfg.algorithm.n_minibatches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: (
                lr_at(
                    step,
                    optim.lr,
                    sched.lr_decay_style,
                    sched.lr_warmup_iters,
                    sched.lr_warmup_init,
                    sched.min_lr,
                    total,
                )
                / optim.lr
            ),
        )

    def _minibatch(
        self, batch: SequenceBatch, old: torch.Tensor, adv: torch.Tensor, norm: float
    ) -> dict[str, float]:
        """Accumulate gradients over micro-batches, clip, step. `norm` = global aggregation
        denominator (valid tokens or sequences of the whole minibatch, all ranks)."""
        algo, world = self.cfg.algorithm, dist.get_world_size(self.actor_group)
        token_mean = algo.loss_agg_func == "token-mean"
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(4, dtype=torch.float64)  # loss, clip_fraction, approx_kl, tokens
        for rows in micro_batches(self.cfg, len(batch), batch.input_ids.shape[1]):
            part = batch.rows(rows).to(self.device)
            trim = self.cfg.runner.trim_padding_multiple
            logprobs = response_logprobs(self.model, part, trim, self.compiled)
            loss, metrics = ppo_clip_loss(
                logprobs,
                old[rows].to(self.device),
                adv[rows].to(self.device),
                part.response_mask,
                clip_eps=algo.ratio_clip_eps,
                agg=algo.loss_agg_func,
            )
            weight = float(part.response_mask.sum()) if token_mean else float(len(part))
            (loss * (weight / norm) * world).backward()
            tokens = float(part.response_mask.sum())
            sums += torch.tensor(
                [
                    float(loss.detach()) * weight / norm,
                    float(metrics["clip_fraction"]) * tokens,
                    float(metrics["approx_kl"]) * tokens,
                    tokens,
                ],
                dtype=torch.float64,
            )
        self._sync_device()
        optimizer_start = time.perf_counter()
        clip = self.cfg.actor.optim.clip_grad
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), clip if clip > 0 else float("inf")
        )
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        dist.all_reduce(sums, group=self.actor_group)
        self._sync_device()
        return {
            "optimizer_seconds": time.perf_counter() - optimizer_start,
            "loss": float(sums[0]),
            "clip_fraction": float(sums[1] / sums[3].clamp(min=1)),
            "approx_kl": float(sums[2] / sums[3].clamp(min=1)),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens": float(sums[3]),
        }

    def _minibatch_or_eager(self, shard: dict[str, Any]) -> dict[str, float]:
        """One minibatch; if torch.compile fails on it, warn, go eager for good and redo it
        (nothing is lost: the optimiser only steps once the whole minibatch succeeded)."""
        args = (shard["batch"], shard["old_logprobs"], shard["advantages"], shard["norm"])
        return run_or_eager(
            lambda: self._minibatch(*args),
            self.compiled,
            self.go_eager,
            f"actor rank {self.rank}: compiled decoder layers / log-softmax kernel",
            "training eagerly from now on (set actor.compile=false to skip compiling)",
        )

    def go_eager(self) -> None:
        """Undo the compiled layers and log-softmax: every later forward runs eagerly."""
        for layer in self.model.model.layers:
            layer._compiled_call_impl = None  # what nn.Module.compile() set
        self.compiled = False

    def train_step(self, shards: list[dict[str, Any]]) -> dict[str, Any]:
        """One GRPO update: one optimiser step per minibatch shard given to this rank."""
        start = time.perf_counter()
        self.model.train()
        results = [self._minibatch_or_eager(s) for s in shards]
        keys = ("loss", "clip_fraction", "approx_kl", "grad_norm")
        metrics = {k: sum(r[k] for r in results) / len(results) for k in keys}
        seconds = time.perf_counter() - start
        optimizer_s = sum(r["optimizer_seconds"] for r in results)
        metrics.update(
            lr=results[-1]["lr"],
            trained_tokens=sum(r["tokens"] for r in results),
            seconds=seconds,
            optimizer_seconds=optimizer_s,
            forward_backward_seconds=seconds - optimizer_s,
        )
        return metrics

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def export_weights(self, sync_dtype: str) -> dict[str, Any]:
        """Colocated sync: keep the weight buckets on the GPU and hand out CUDA IPC handles
        (rank 0; other ranks only join the gathers). `release_weights` frees the buckets."""
        start = time.perf_counter()
        is_source = dist.get_rank() == self.sync.source
        self._exported, handles = export_weights(self.model, getattr(torch, sync_dtype), is_source)
        nbytes = sum(b.numel() * b.element_size() for b in self._exported)
        return {"handles": handles, "bytes": nbytes, "seconds": time.perf_counter() - start}

    def release_weights(self) -> None:
        self._exported = []

    def send_weights(self, sync_dtype: str) -> dict[str, float]:
        start = time.perf_counter()
        sent = send_weights(self.model, self.sync, getattr(torch, sync_dtype))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return {"bytes": sent, "seconds": time.perf_counter() - start}

    def _state(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        rng = {f"rank_{self.rank}": torch.get_rng_state()}
        return {
            "fsdp_checkpoint": {
                "model": model_sd,
                "optimizers": optim_sd,
                "lr_schedulers": self.scheduler.state_dict(),
                "rng": rng,
            }
        }

    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """Write this rank's DCP shard (a collective of the actor group)."""
        start = time.perf_counter()
        Path(path).mkdir(parents=True, exist_ok=True)
        dcp.save(self._state(), checkpoint_id=path, process_group=self.actor_group)
        return {"seconds": time.perf_counter() - start}

    def load_checkpoint(self, path: str) -> None:
        """Restore model, optimiser, lr schedule and this rank's RNG from a DCP checkpoint."""
        state = self._state()
        dcp.load(state, checkpoint_id=path, process_group=self.actor_group)
        inner = state["fsdp_checkpoint"]
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=inner["model"],
            optim_state_dict=inner["optimizers"],
        )
        self.scheduler.load_state_dict(inner["lr_schedulers"])
        torch.set_rng_state(inner["rng"][f"rank_{self.rank}"])

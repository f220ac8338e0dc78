"""The actor: FSDP2 training of the policy with the GRPO (PPO-clip) loss, and its checkpoints.

Each rank gets its share of every minibatch; gradients are reduced by FSDP2 over the actor
group (one rank trains without the wrapper, with the same numerics: ActorConfig.fsdp_wraps).
Loss scaling makes the update equal to the configured aggregation over the whole minibatch,
independent of how rows are split across ranks and micro-batches.
"""

from __future__ import annotations

import contextlib
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from rlinf_twoworker.algorithm import PolicyLoss, ppo_loss
from rlinf_twoworker.config import AlgorithmConfig, MixedPrecision, OptimConfig
from rlinf_twoworker.config.settings import ActorSettings
from rlinf_twoworker.engines import staging
from rlinf_twoworker.engines.grad_scaler import (
    adamw,
    build_grad_scaler,
    clip_and_step,
    loss_scale,
)
from rlinf_twoworker.engines.models import (
    DTYPES,
    SequenceBatch,
    compile_layers,
    dtype_for,
    mark_dynamic_after_fsdp,
    marks_on,
    micro_batches,
    response_logprobs,
    run_or_eager,
    to_device,
)
from rlinf_twoworker.engines.offload import ActorOffload, collect_garbage, settle_heap
from rlinf_twoworker.engines.weight_sync import export_weights, send_weights
from rlinf_twoworker.messages import ActorShard, TrainStats, step_metrics
from rlinf_twoworker.storage import checkpoints
from rlinf_twoworker.workers.base import Worker

T = TypeVar("T")


def policy_loss_settings(algo: AlgorithmConfig) -> PolicyLoss:
    return PolicyLoss(
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        clip_c=algo.clip_ratio_c,
        log_ratio_min=algo.clip_log_ratio_min,
        log_ratio_max=algo.clip_log_ratio_max,
        entropy_bonus=algo.entropy_bonus,
        kl_beta=algo.kl_beta,
        kl_type=algo.kl_penalty_type,
    )


def total_optimizer_steps(optim: OptimConfig) -> int:
    """The lr schedule's length: actor.optim.total_training_steps, 0 when unset, as RLinf's
    FSDP actor takes it (`optim_config.get("total_training_steps", 0)`), never derived from
    the run's steps."""
    return optim.total_training_steps or 0


def lr_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig) -> Any:
    """RLinf's FSDP schedule (actor.optim.lr_scheduler), from transformers: a linear warm-up
    from 0 over lr_warmup_steps (or lr_warmup_steps_ratio x the total), then constant or a
    cosine to min_lr / min_lr_rate."""
    from transformers.optimization import (
        get_constant_schedule_with_warmup,
        get_cosine_with_min_lr_schedule_with_warmup,
    )

    total = total_optimizer_steps(optim)
    warmup = optim.lr_warmup_steps
    if warmup < 0:
        warmup = int(optim.lr_warmup_steps_ratio * total)
    if optim.lr_scheduler == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    if optim.min_lr_rate is not None:  # as RLinf: the rate wins over min_lr
        return get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, warmup, total, num_cycles=optim.num_cycles, min_lr_rate=optim.min_lr_rate
        )
    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, warmup, total, num_cycles=optim.num_cycles, min_lr=optim.min_lr
    )


def set_training_mode(model: Any, activation_checkpointing: bool) -> None:
    """What an update needs of a loaded model before any wrapping: train mode, activation
    recompute when asked, no KV cache."""
    model.train()  # from_pretrained returns eval mode, where transformers skips checkpointing
    if activation_checkpointing:  # transformers >= 5.2x renamed gradient_checkpointing_*
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    model.config.use_cache = False


def prepare_unwrapped(
    model: Any,
    *,
    precision: MixedPrecision | None,
    activation_checkpointing: bool,
    compiled: bool,
    many_shapes: bool = False,
) -> Any:
    """`model` ready to train, before any wrapping: train mode, activation recompute, the
    buffers in buffer_dtype and the compiled layers. `prepare_for_training` wraps it in FSDP2
    after this; one actor rank trains it as it is (ActorConfig.fsdp_wraps), its forward and
    backward under `computing_in(model, param_dtype)`, which gives them FSDP2's mixed
    precision at one rank."""
    set_training_mode(model, activation_checkpointing)
    if precision is not None:
        _cast_buffers(model, _dtype(precision.buffer_dtype))
    compile_layers(model, compiled, many_shapes)
    return model


def prepare_for_training(
    model: Any,
    mesh: Any,
    *,
    precision: MixedPrecision | None,
    activation_checkpointing: bool,
    compiled: bool,
    reshard_after_forward: bool = True,
    many_shapes: bool = False,
) -> Any:
    """Shard `model` with FSDP2 over `mesh`, one unit per decoder layer plus the root.

    precision: actor.fsdp_config.mixed_precision as RLinf's FSDP2 strategy applies it: each
    layer is gathered in param_dtype to compute (forward and backward) and its gradients are
    reduce-scattered in reduce_dtype; floating buffers are cast to buffer_dtype; the master
    weights keep the loaded dtype. None: no cast (the CPU path). reshard_after_forward:
    actor.fsdp_config.reshard_after_forward, for every unit. compiled: each decoder
    layer's forward goes through
    `torch.compile` (its norms, rotary, SwiGLU and residual adds fuse into few kernels; the
    GEMMs and attention stay cuBLAS / SDPA); compiled in place, so parameter names, state dicts
    and checkpoints are those of the eager model. FSDP2's hooks stay outside the compiled code.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    prepare_unwrapped(
        model,
        precision=precision,
        activation_checkpointing=activation_checkpointing,
        compiled=compiled,
        many_shapes=many_shapes,
    )
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if precision is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=_dtype(precision.param_dtype),
            reduce_dtype=_dtype(precision.reduce_dtype),
        )
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if compiled and many_shapes and marks_on():
        mark_dynamic_after_fsdp(model)
    return model


@contextlib.contextmanager
def computing_in(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """While open, each parameter of `model` is its cast to `dtype` (one cast for parameters
    that are tied): the forward and backward compute in `dtype` and each gradient reaches the
    master weight's .grad cast back to its dtype. That is what FSDP2's mixed precision
    computes at one rank (its all-gather is the cast, its reduce-scatter the cast back). Keep
    it open across the backward pass: a layer recomputed there (activation checkpointing)
    reads the same casts. Kept open over the micro-batches of one optimiser step, the
    parameters are cast once a step, not once a micro-batch.

    Each cast is a leaf of its own whose gradient, once autograd has summed it, is added to
    the master's .grad and dropped (`_to_master`): one kernel that reads the low-precision
    gradient and adds it in the master's precision, where autograd through the cast would
    write it cast back and then add that (the same values; a third less memory traffic and
    half the kernels). dtype None, or the parameters' own: nothing changes.
    torch.func.functional_call swaps parameters the same way but only around the forward."""
    slots = [
        (module, name, param)
        for module in model.modules()
        for name, param in module._parameters.items()
        if param is not None and dtype is not None and param.dtype != dtype
    ]
    casts: dict[int, torch.Tensor] = {}
    hooks = []
    for module, name, param in slots:
        if id(param) not in casts:
            cast = param.detach().to(dtype).requires_grad_(param.requires_grad)
            if param.requires_grad:
                hooks.append(cast.register_post_accumulate_grad_hook(_to_master(param)))
            casts[id(param)] = cast
        module._parameters[name] = casts[id(param)]  # type: ignore[assignment]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for module, name, param in slots:
            module._parameters[name] = param


def _to_master(master: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A cast's post-accumulate hook: its gradient added to `master`'s .grad (or, the first,
    set as it, cast to the master's dtype), then dropped from the cast."""

    def add(cast: torch.Tensor) -> None:  # called once autograd has set cast.grad
        grad, cast.grad = cast.grad, None
        assert grad is not None
        if master.grad is None:
            master.grad = grad.to(master.dtype)
        else:
            master.grad.add_(grad)

    return add


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else DTYPES[name]


def _cast_buffers(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Floating-point buffers to `dtype` (RLinf's buffer_dtype; FSDP2 has no such option)."""
    if dtype is None:
        return
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtype)


class ActorWorker(Worker):
    """One FSDP2 rank of the policy being trained."""

    def __init__(self, settings: ActorSettings, rank: int) -> None:
        super().__init__(settings, "actor", rank)
        self.settings: ActorSettings = settings
        self.model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.scaler: Any = None  # actor.fsdp_config.grad_scaler (engines/grad_scaler.py)
        self._exported: list[torch.Tensor] = []
        self.lr_used = 0.0  # the lr of the latest optimiser step
        self.compiled = False  # compiled decoder layers and log-softmax (set by `build`)
        self.staging: staging.StagingBuffers | None = None  # runner.checkpoint_staging (by `build`)
        self.wrapped = True  # FSDP2 wraps the model (ActorConfig.fsdp_wraps; set by `build`)
        self.compute_dtype: torch.dtype | None = None  # unwrapped: param_dtype (`computing_in`)
        # Loaded now, while the other components load theirs; sharded by `build`, which needs
        # the actor group.
        self.dtype = dtype_for(settings.actor.model.precision, self.device)
        self._unsharded: Any = self.load_model(settings.actor.model.model_path, self.dtype)

    def build(self) -> None:
        """Load, shard and set up the optimiser (after `join`, which makes the actor group)."""
        from torch.distributed.device_mesh import DeviceMesh

        cfg = self.settings
        model, self._unsharded = self._unsharded, None
        if model is None:  # built once already
            model = self.load_model(cfg.actor.model.model_path, self.dtype)
        gpu = self.device.type == "cuda"
        self.compiled = gpu and cfg.actor.compile
        precision = cfg.actor.fsdp_config.mixed_precision if gpu else None
        self.wrapped = cfg.actor.fsdp_wraps(dist.get_world_size(self.actor_group), gpu)
        many_shapes = cfg.trim_padding_multiple >= 1  # the length-aware cut's micro-batches
        if self.wrapped:
            model = prepare_for_training(
                model,
                DeviceMesh.from_group(self.actor_group, self.device.type),
                precision=precision,
                activation_checkpointing=cfg.actor.recompute,
                compiled=self.compiled,
                reshard_after_forward=cfg.actor.fsdp_config.reshard_after_forward,
                many_shapes=many_shapes,
            )
        else:
            model = prepare_unwrapped(
                model,
                precision=precision,
                activation_checkpointing=cfg.actor.recompute,
                compiled=self.compiled,
                many_shapes=many_shapes,
            )
            self.compute_dtype = _dtype(precision.param_dtype) if precision else None
        self.model = model
        self.optimizer = adamw(model.parameters(), cfg.actor.optim, self.device.type == "cuda")
        self.scheduler = lr_scheduler(self.optimizer, cfg.actor.optim)
        self.scaler = build_grad_scaler(
            cfg.actor.fsdp_config.grad_scaler, self.device, self.actor_group
        )
        # actor.enable_offload (sequential steps): parameters and optimiser state live in CPU
        # memory outside the update, as in RLinf from the start.
        self.offloader = ActorOffload(model, self.optimizer, self.device)
        if cfg.offloads:
            self.offloader.offload()
        self.staging = self._start_staging()

    def _start_staging(self) -> staging.StagingBuffers | None:
        """runner.checkpoint_staging: host buffers for this rank's checkpoint shard, allocated
        in a thread from now on (while step 1 runs); None where it does not apply."""
        cfg = self.settings
        if not cfg.checkpoint_staging or self.device.type != "cuda":
            return None
        if cfg.offloads or cfg.save_interval <= 0:
            return None  # the state lives in CPU memory already / nothing to write
        import psutil

        return staging.started_if_room(
            staging.for_model(self.model, copies=3),  # the weights, AdamW's 2 moments
            psutil.virtual_memory().available,
            f"actor rank {self.rank} on {socket.gethostname()}",
        )

    def _minibatch(self, shard: ActorShard, first: bool) -> dict[str, float]:
        """One optimiser step on this rank's share of a minibatch. `first`: also measure the
        largest |actor - inference| log-prob difference (before the step's first update the
        two hold the same weights)."""
        self.optimizer.zero_grad(set_to_none=True)
        sums, maxes = self.accumulate(shard, first)
        self._sync_device()
        optimizer_start = time.perf_counter()
        grad_norm, stepped = self._clip_and_step()
        keys = sorted(sums)
        totals = torch.stack([sums[k] for k in keys]).double()
        dist.all_reduce(totals, group=self.actor_group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=self.actor_group)
        self._sync_device()
        out = {k: float(v) for k, v in zip(keys, totals.tolist())}
        out.update(
            optimizer_seconds=time.perf_counter() - optimizer_start,
            ratio_max=float(maxes[0]),
            grad_norm=grad_norm,
            lr=self.lr_used,
            skipped_steps=0.0 if stepped else 1.0,
        )
        scale = loss_scale(self.scaler)
        if scale is not None:  # the scale the next minibatch uses
            out["loss_scale"] = scale
        if first:
            out["logprob_diff_max"] = float(maxes[1])
        return out

    def accumulate(
        self, shard: ActorShard, first: bool = False
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Add the gradient of sum(weights * per-token loss) over the shard to the parameters'
        .grad, one compute micro-batch at a time (any cut gives the same gradient). Returns the
        weighted metric sums and [ratio max, log-prob difference max], on the device."""
        algo, world = self.settings.algorithm, dist.get_world_size(self.actor_group)
        settings = policy_loss_settings(algo)
        sums: dict[str, torch.Tensor] = {}  # weighted metric sums, kept on the device
        maxes = torch.zeros(2, device=self.device)
        cut, trim = self.settings.micro_batch, self.settings.trim_padding_multiple

        def rows_of(tensor: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
            return to_device(tensor[rows], self.device)

        # One cast of the parameters for every micro-batch: they change only at the step.
        with computing_in(self.model, self.compute_dtype):
            for rows in micro_batches(shard.batch, cut, trim):
                part = shard.batch.rows(rows).to(self.device)
                logprobs, entropy = self._logprobs(part)
                old = rows_of(shard.old_logprobs, rows)
                loss, metrics = ppo_loss(
                    logprobs,
                    old,
                    rows_of(shard.advantages, rows),
                    rows_of(shard.weights, rows),
                    rows_of(shard.metric_weights, rows),
                    settings,
                    entropy,
                    None if shard.ref_logprobs is None else rows_of(shard.ref_logprobs, rows),
                )
                # FSDP averages gradients over the ranks; the scaler multiplies by its scale.
                self.scaler.scale(loss * world).backward()
                metrics["final_loss"] = loss.detach()
                metrics["tokens"] = part.response_mask.sum().float()
                maxes[0] = torch.maximum(maxes[0], metrics.pop("ratio_max"))
                for key, value in metrics.items():
                    sums[key] = sums[key] + value if key in sums else value
                if first:
                    diff = ((logprobs.detach() - old).abs() * part.response_mask).max()
                    maxes[1] = torch.maximum(maxes[1], diff)
        return sums, maxes

    def _logprobs(self, part: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        algo = self.settings.algorithm
        out = response_logprobs(
            self.model,
            part,
            self.settings.trim_padding_multiple,
            self.compiled,
            algo.sampling_params.temperature,
            with_entropy=algo.calculate_entropy,
        )
        if not algo.calculate_entropy:
            return out, None
        logprobs, entropy = out
        # The entropy is a metric unless the bonus puts it in the loss (no backward through it).
        return logprobs, entropy if algo.entropy_bonus > 0 else entropy.detach()

    def _clip_and_step(self) -> tuple[float, bool]:
        """Unscale, clip the gradient and step, unless its norm is not finite: then, as RLinf,
        the optimiser step is skipped (with a warning) and the loss scale lowered. The lr
        schedule steps either way."""
        self.lr_used = self.optimizer.param_groups[0]["lr"]
        clip = self.settings.actor.optim.clip_grad
        grad_norm, stepped = clip_and_step(self.model, self.optimizer, self.scaler, clip)
        scale = loss_scale(self.scaler)
        if not stepped and scale is not None:
            warnings.warn(
                f"actor rank {self.rank}: gradient norm {grad_norm} (an overflow under loss "
                f"scaling); the optimiser step is skipped and the loss scale lowered to {scale} "
                "(as RLinf does). If every step skips, lower actor.fsdp_config.grad_scaler."
                "init_scale or compute in bf16 (actor.fsdp_config.mixed_precision.param_dtype="
                "bf16)",
                stacklevel=2,
            )
        elif not stepped:
            warnings.warn(
                f"actor rank {self.rank}: gradient norm {grad_norm} is not finite; the "
                "optimiser step is skipped (as RLinf does). Lower actor.optim.lr if it recurs",
                stacklevel=2,
            )
        self.scheduler.step()
        return grad_norm, stepped

    def _minibatch_or_eager(self, shard: ActorShard, first: bool) -> dict[str, float]:
        """One minibatch; if torch.compile fails on it, warn, go eager for good and redo it
        (nothing is lost: the optimiser only steps once the whole minibatch succeeded)."""
        return self._or_eager(lambda: self._minibatch(shard, first))

    def _or_eager(self, run: Callable[[], T]) -> T:
        """`run()`, redone eagerly for good if torch.compile fails in it (run_or_eager)."""
        return run_or_eager(
            run,
            self.compiled,
            self.go_eager,
            f"actor rank {self.rank}: compiled decoder layers / log-softmax kernel",
            "training eagerly from now on (set actor.compile=false to skip compiling)",
        )

    def warm_up(self, shard: ActorShard) -> dict[str, float]:
        """runner.compile_warm_up (run/warmup.py): the forward and backward of a made-up
        minibatch shard in a step's shapes (every actor rank at once: FSDP2's collectives), so
        what they compile is made while step 1's rollout runs. The training is untouched: the
        gradients are dropped, the optimiser does not step, the random state is restored.
        Returns its seconds (timed_warm_up)."""
        cuda = self.device.type == "cuda"
        rng = torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None
        self.model.train()
        try:
            return self.timed_warm_up(lambda: self._warm_up_pass(shard))
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1])

    def _warm_up_pass(self, shard: ActorShard) -> None:
        self._or_eager(lambda: self.accumulate(shard))
        self._sync_device()

    def go_eager(self) -> None:
        """Undo the compiled layers and log-softmax: every later forward runs eagerly."""
        compile_layers(self.model, False)
        self.compiled = False

    def train_step(self, shards: list[ActorShard]) -> TrainStats:
        """One GRPO update: one optimiser step per minibatch shard given to this rank. Means
        over the minibatches (RLinf logs each minibatch; a step's value is their mean)."""
        start = time.perf_counter()
        if self.settings.offloads:  # the offloads' collections then walk only what a step makes
            settle_heap()
        self.offloader.load()  # back from CPU memory when offloaded
        self.model.train()
        results = [self._minibatch_or_eager(s, i == 0) for i, s in enumerate(shards)]
        if self.settings.offloads:  # as RLinf: the optimiser state leaves before the sync
            self.offloader.offload_optimizer()
        metrics = step_metrics(results)
        metrics["offload_seconds"] = self.offloader.take_seconds()
        if self.device.type == "cuda":  # what the weight sync and the other stages find held
            gib = 1024**3
            metrics["gpu_reserved_after_update_gib"] = torch.cuda.memory_reserved(self.device) / gib
            metrics["gpu_allocated_after_update_gib"] = (
                torch.cuda.memory_allocated(self.device) / gib
            )
        return TrainStats(
            metrics=metrics,
            trained_tokens=sum(r["tokens"] for r in results),
            seconds=time.perf_counter() - start,
            optimizer_seconds=sum(r["optimizer_seconds"] for r in results),
            minibatches=results,  # each minibatch as it was, for RLinf's per-minibatch log
        )

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def export_weights(
        self, sync_dtype: str, consumers: int = 1, offload_after: bool = False
    ) -> dict[str, Any]:
        """Colocated sync: keep the weight buckets on the GPU and hand out CUDA IPC handles
        (rank 0; other ranks only join the gathers). `release_weights` frees the buckets.
        `offload_after` (actor.enable_offload): the parameters leave the GPU as soon as the
        buckets hold their copy, before the copies reallocate their weights, so the sync
        never holds the actor's parameters, the buckets and both copies at once."""
        start = time.perf_counter()
        self.offloader.load_params()
        is_source = dist.get_rank() == self.sync.source
        self._exported, handles = export_weights(
            self.model, getattr(torch, sync_dtype), is_source, consumers
        )
        if offload_after:
            self._sync_device()
            self.offloader.offload()
        nbytes = sum(b.numel() * b.element_size() for b in self._exported)
        return {"handles": handles, "bytes": nbytes, "seconds": time.perf_counter() - start}

    def release_weights(self) -> None:
        """Free the exported buckets once every consumer has copied them."""
        self._exported = []
        if self.device.type == "cuda":
            # A block sent through CUDA IPC stays allocated until the sender collects it, even
            # after the consumers let go: without this, every colocated sync kept one more
            # copy of the weights (3.3 GiB a step at the 1.5B shape, measured).
            collect_garbage()
            torch.cuda.ipc_collect()

    def send_weights(self, sync_dtype: str) -> dict[str, float]:
        start = time.perf_counter()
        self.offloader.load_params()
        sent = send_weights(self.model, self.sync, getattr(torch, sync_dtype))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return {"bytes": sent, "seconds": time.perf_counter() - start}

    def offload(self) -> dict[str, float]:
        """After the step's sync (actor.enable_offload): parameters and optimiser state to CPU
        memory, gradients freed, the cached blocks handed back for the other components."""
        self.offloader.offload()
        return {"seconds": self.offloader.take_seconds()}

    def weights_digest(self, sync_dtype: str) -> str:
        self.offloader.load_params()
        return super().weights_digest(sync_dtype)

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        """Everything on the GPU for a checkpoint, offloaded again after when it was."""
        was_away = self.offloader.params_away or self.offloader.optimizer_away
        self.offloader.load()
        try:
            yield
        finally:
            if was_away:
                self.offloader.offload()

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        rng = {f"rank_{self.rank}": torch.get_rng_state()}
        inner = {
            "model": model_sd,
            "optimizers": optim_sd,
            "lr_schedulers": self.scheduler.state_dict(),
            "rng": rng,
        }
        if self.scaler.is_enabled():  # the scale and its growth count: resume is exact
            inner["grad_scaler"] = self.scaler.state_dict()
        return {"fsdp_checkpoint": inner}

    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """Write this rank's DCP shard (a collective of the actor group)."""
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        out: dict[str, Any] = {}
        with self._on_device():
            state: Any = self._state()
            taken: list[torch.Tensor] = []
            if self.staging is not None:  # copied into the run's host buffers, written from there
                waited = time.perf_counter()
                state, taken = self.staging.stage(state)
                out.update(
                    staging_alloc_s=self.staging.seconds,
                    staging_wait_and_copy_s=time.perf_counter() - waited,
                    staging_misses=self.staging.misses,
                )
                if self.staging.error is not None:
                    out["staging_error"] = (
                        f"{type(self.staging.error).__name__}: {self.staging.error}"
                    )
            try:
                Path(path).mkdir(parents=True, exist_ok=True)
                # Several files a rank, written at once: storage that limits each stream
                # (network file systems) takes them several times faster than one.
                writer = dcp.FileSystemWriter(
                    path, thread_count=self.settings.checkpoint_write_threads
                )
                dcp.save(state, storage_writer=writer, process_group=self.actor_group)
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                error = checkpoints.write_error(path, exc)
                if error is exc:
                    raise
                raise error from exc
            finally:
                if self.staging is not None:
                    self.staging.release(taken)
        return {"seconds": time.perf_counter() - start, **out}

    def load_checkpoint(self, path: str) -> None:
        """Restore model, optimiser, lr schedule, loss scale and this rank's RNG from a DCP
        checkpoint."""
        with self._on_device():
            self._load_checkpoint(path)

    def _load_checkpoint(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from rlinf_twoworker.storage.safe_dcp import (
            SafeFileSystemReader,
            SafeLoadPlanner,
            refusal_in,
        )

        state = self._state()
        try:
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(path),
                planner=SafeLoadPlanner(),
                process_group=self.actor_group,
            )
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            refused = refusal_in(exc)
            if refused is not None:
                raise refused from None  # one line naming the file, not every rank's trace
            raise
        inner = state["fsdp_checkpoint"]
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=inner["model"],
            optim_state_dict=inner["optimizers"],
        )
        self.scheduler.load_state_dict(inner["lr_schedulers"])
        if "grad_scaler" in inner:
            self.scaler.load_state_dict(inner["grad_scaler"])
        torch.set_rng_state(inner["rng"][f"rank_{self.rank}"])


# For mypy: ActorWorker is what the run asks of an actor rank (workers/contract.py).
if TYPE_CHECKING:
    from rlinf_twoworker.workers import contract

    _trainer: type[contract.Trainer] = ActorWorker

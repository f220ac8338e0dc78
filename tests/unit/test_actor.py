"""The actor's training setup: compiled decoder layers equal eager ones, and a compiler failure
falls back to eager training without losing the update."""

from __future__ import annotations

import gc
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
from support import WRAPPED, varied_batch
from torch.distributed.device_mesh import DeviceMesh
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

from rlinf_twoworker.api.demo import demo_config, make_inputs
from rlinf_twoworker.config import GRPOConfig, MixedPrecision, to_typed
from rlinf_twoworker.config.settings import actor_settings
from rlinf_twoworker.engines.models import (
    DTYPES,
    SequenceBatch,
    load_causal_lm,
    micro_batches,
    response_logprobs,
)
from rlinf_twoworker.engines.tensors import full, local
from rlinf_twoworker.messages import ActorShard
from rlinf_twoworker.run.step import split_for_actors
from rlinf_twoworker.run.warmup import warm_up_inputs
from rlinf_twoworker.workers.actor import (
    ActorWorker,
    computing_in,
    lr_scheduler,
    prepare_for_training,
    prepare_unwrapped,
)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A one-rank gloo world in this process (FSDP2 needs a process group): a file store and
    gloo on loopback, so the test process never listens on another interface."""
    root = tmp_path_factory.mktemp("actor")
    patch = pytest.MonkeyPatch()
    patch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=0, world_size=1)
    yield make_inputs(root / "inputs"), root
    dist.destroy_process_group()
    gc.collect()  # FSDP modules hold reference cycles that keep the group's sockets open
    patch.undo()


def _batch(rows: int, width: int, prompt: int) -> SequenceBatch:
    gen = torch.Generator().manual_seed(rows * 100 + width)
    ids = torch.randint(5, 60, (rows, width), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, : prompt // 2] = 0  # left padding in the first row
    response = torch.ones(rows, width - prompt, dtype=torch.long)
    response[-1, -3:] = 0  # the last answer ends early
    return SequenceBatch(ids, mask, response, prompt)


def _fsdp_model(world, **options):
    """The test model in FSDP2's wrapper on the one-rank world (prepare_for_training with
    `options`, no mixed precision)."""
    inputs, _ = world
    model = load_causal_lm(inputs.model_path, torch.float32, torch.device("cpu"))
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    return prepare_for_training(model, mesh, precision=None, **options)


def _grads(model, batches: list[SequenceBatch]) -> tuple[list[float], dict[str, torch.Tensor]]:
    sums = []
    for batch in batches:
        logprobs = response_logprobs(model, batch)
        (logprobs * batch.response_mask).sum().backward()
        sums.append(float(logprobs.detach().sum()))
    return sums, {n: full(p.grad).clone() for n, p in model.named_parameters()}


def test_compiled_layers_give_the_eager_logprobs_and_gradients(world):
    """Two batch shapes (the second triggers a recompile); names stay those of the eager model,
    so checkpoints and weight sync are unaffected; checkpointing composes with compilation."""
    batches = [_batch(3, 20, 8), _batch(2, 14, 6)]
    runs = {}
    for compiled in (False, True):
        model = _fsdp_model(world, activation_checkpointing=compiled, compiled=compiled)
        runs[compiled] = _grads(model, batches)
    (eager_sums, eager), (compiled_sums, compiled) = runs[False], runs[True]
    assert list(compiled) == list(eager)
    assert compiled_sums == pytest.approx(eager_sums, abs=1e-4)
    for name, grad in eager.items():
        assert torch.allclose(compiled[name], grad, atol=1e-5), name


@pytest.mark.parametrize("recompute", [False, True])
def test_fsdp_wrapped_marked_layers_compile_once_for_the_length_aware_cuts_widths(world, recompute):
    """Under FSDP2 (as every actor rank of a multi-rank run), the compiled decoder layers with
    the length-aware cut's dynamic marks compile once for micro-batches of three widths: FSDP2's
    pre-forward hook hands the layer new hidden states (its post-backward hook's autograd
    function), and without marks on those the first compile fixed the width and the next width
    compiled again. The log-probs and gradients are eager's."""
    from torch._dynamo.utils import counters

    batch = varied_batch((3, 5, 8, 2, 3, 3), (20, 15, 10, 5, 4, 3), 16, 24)
    cuts = [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5])]
    widths = {batch.rows(c).trimmed(4)[0].input_ids.shape[1] for c in cuts}
    assert len(widths) == 3
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = _fsdp_model(
            world, activation_checkpointing=recompute, compiled=compiled, many_shapes=True
        )
        sums, frames = [], []
        for cut in cuts:
            part = batch.rows(cut)
            out = response_logprobs(model, part, trim_multiple=4)
            (out * part.response_mask).sum().backward()
            sums.append(float((out.detach() * part.response_mask).sum()))
            frames.append(counters["frames"]["total"])
        runs[compiled] = sums, {n: full(p.grad).clone() for n, p in model.named_parameters()}
        if compiled:  # frames compiled for the first width only
            assert frames[0] > 0 and frames == [frames[0]] * len(cuts)
    assert runs[True][0] == pytest.approx(runs[False][0], abs=1e-4)
    for name, grad in runs[False][1].items():
        assert torch.allclose(runs[True][1][name], grad, atol=1e-5), name


def _shard(cfg) -> ActorShard:
    """A minibatch of 4 answers of different lengths with the weights the controller gives it
    (RLinf's token-mean per 1-row micro-batch), as one rank's shard."""
    batch = _batch(4, 20, 8)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(-1) * batch.response_mask
    old = torch.full((4, 12), -4.0) * batch.response_mask
    [[shard]] = split_for_actors(cfg, batch, old, adv, ranks=1)
    return shard


def _broken_backend(graph, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


# One minibatch of 4 answers (2 prompts x 2), one actor rank: the shard is the minibatch.
ONE_MINIBATCH = [
    "data.rollout_batch_size=2",
    "algorithm.n_minibatches=1",
    "cluster.component_placement={rollout:0,inference:1,actor:2,reward:0}",
]


class _Actor(ActorWorker):
    """An actor rank with the run's whole config beside its own settings: the tests make its
    shards from it, as the controller does."""

    def __init__(self, cfg: GRPOConfig) -> None:
        super().__init__(actor_settings(cfg), 0)
        self.run_cfg = cfg


def _built_actor(world, run_id: str, overrides: list[str] | None = None) -> _Actor:
    """A built rank-0 actor of the one-rank world, on the demo's config with ONE_MINIBATCH and
    `overrides`."""
    inputs, root = world
    config = demo_config(inputs, str(root / "runs"), run_id, ONE_MINIBATCH + (overrides or []))
    actor = _Actor(to_typed(config))
    actor.actor_group = dist.group.WORLD
    actor.build()
    return actor


def _trained_actor(world, break_compiler: bool) -> tuple[dict, dict[str, torch.Tensor], list]:
    actor = _built_actor(world, "actor-test")
    if break_compiler:  # a real torch.compile failure, in the first forward of the update
        for layer in actor.model.model.layers:
            layer.compile(backend=_broken_backend)
        actor.compiled = True
    shard = _shard(actor.run_cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = actor.train_step([shard]).metrics
    params = {n: full(p.detach()).clone() for n, p in actor.model.named_parameters()}
    return metrics, params, [str(w.message) for w in caught]


def test_a_compiler_failure_falls_back_to_eager_and_keeps_the_update(world):
    eager_metrics, eager_params, _ = _trained_actor(world, break_compiler=False)
    metrics, params, messages = _trained_actor(world, break_compiler=True)
    assert any("training eagerly from now on" in m and "actor rank 0" in m for m in messages)
    assert metrics["final_loss"] == pytest.approx(eager_metrics["final_loss"], abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(eager_metrics["grad_norm"], rel=1e-5)
    for name, value in eager_params.items():
        assert torch.allclose(params[name], value, atol=1e-6), name


def _gradients(world, overrides: list[str], shard: ActorShard | None = None):
    actor = _built_actor(world, "grad", overrides)
    shard = shard or _shard(actor.run_cfg)
    actor.optimizer.zero_grad(set_to_none=True)
    sums, _ = actor.accumulate(shard)
    grads = {n: full(p.grad).clone() for n, p in actor.model.named_parameters()}
    return grads, {k: float(v) for k, v in sums.items()}, shard


def test_token_budget_micro_batches_give_the_one_row_gradient(world):
    """The loss weights are fixed per minibatch (RLinf's 1-row token-means), so cutting the
    forward/backward by a token budget instead of 1 row at a time changes no gradient."""
    one_row, one_row_sums, shard = _gradients(world, ["runner.micro_batch_tokens=0"])
    inputs, root = world
    cfg = to_typed(demo_config(inputs, str(root / "runs"), "cut", []))
    width = shard.batch.input_ids.shape[1]
    rows = len(shard.batch.input_ids)
    assert len(cfg.micro_batch_rule(True).slices(rows, width)) == 1  # the default cut
    for cut in (
        [],  # the library's default: runner.micro_batch_tokens
        ["runner.enable_dynamic_batch_size=true", "runner.max_tokens_per_mbs=40"],
    ):
        budget, budget_sums, _ = _gradients(world, cut, shard)
        assert one_row_sums["final_loss"] == pytest.approx(budget_sums["final_loss"], rel=1e-5)
        for name, grad in one_row.items():
            assert torch.allclose(budget[name], grad, atol=1e-6, rtol=1e-4), name
    # RLinf's per-micro-batch token-mean is not the global token-mean: that one differs
    other, _, _ = _gradients(world, ["algorithm.loss_agg_func=global-token-mean"])
    assert any(not torch.allclose(other[n], g, atol=1e-6) for n, g in one_row.items())


def test_length_aware_micro_batches_give_the_one_row_gradient(world):
    """runner.trim_padding_multiple >= 1 cuts the update by answer length (longest first, each
    micro-batch at its own trimmed width): several micro-batches, not in row order, and the
    gradient and loss of RLinf's one-row cut."""
    inputs, root = world
    cfg = to_typed(demo_config(inputs, str(root / "runs"), "lengths", ONE_MINIBATCH))
    batch = varied_batch((6, 3, 8, 2), (3, 12, 1, 9), 8, 12)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(-1) * batch.response_mask
    old = torch.full((4, 12), -4.0) * batch.response_mask
    [[shard]] = split_for_actors(cfg, batch, old, adv, ranks=1)
    one_row, one_row_sums, _ = _gradients(world, ["runner.micro_batch_tokens=0"], shard)
    lengths = ["runner.trim_padding_multiple=2", "runner.micro_batch_tokens=30"]
    cut = to_typed(demo_config(inputs, str(root / "runs"), "lengths", ONE_MINIBATCH + lengths))
    cuts = micro_batches(shard.batch, cut.micro_batch_rule(True), 2)
    assert [c.tolist() for c in cuts] == [[1], [3], [0, 2]]  # 12, 9, then 3 and 1 tokens
    budget, budget_sums, _ = _gradients(world, lengths, shard)
    assert budget_sums["final_loss"] == pytest.approx(one_row_sums["final_loss"], rel=1e-5)
    assert budget_sums["tokens"] == one_row_sums["tokens"] == 25
    for name, grad in one_row.items():
        assert torch.allclose(budget[name], grad, atol=1e-6, rtol=1e-4), name


def test_layers_kept_gathered_after_the_forward_give_the_same_gradient(world):
    """actor.fsdp_config.reshard_after_forward=false (RLinf passes it to fully_shard): after a
    forward each decoder layer keeps its parameters gathered (plain tensors, not DTensor
    shards) until its backward, and the gradient is the default's."""
    from torch.distributed.tensor import DTensor

    resharded, resharded_sums, shard = _gradients(world, WRAPPED)
    actor = _built_actor(world, "kept", [*WRAPPED, "actor.fsdp_config.reshard_after_forward=false"])
    weight = lambda: actor.model.model.layers[0].mlp.down_proj.weight  # noqa: E731
    assert isinstance(weight(), DTensor)
    part = shard.batch.rows(list(range(len(shard.batch.input_ids))))
    logprobs, _ = actor._logprobs(part)
    assert not isinstance(weight(), DTensor)  # still gathered between forward and backward
    logprobs.sum().backward()
    assert isinstance(weight(), DTensor)  # resharded after its backward
    actor.optimizer.zero_grad(set_to_none=True)
    kept_sums, _ = actor.accumulate(shard)
    kept = {n: full(p.grad) for n, p in actor.model.named_parameters()}
    assert float(kept_sums["final_loss"]) == pytest.approx(resharded_sums["final_loss"], rel=1e-6)
    for name, grad in resharded.items():
        assert torch.allclose(kept[name], grad, atol=1e-7, rtol=1e-6), name


def _dropout_actor(world, run_id: str) -> ActorWorker:
    """A built actor whose attention drops out (so its updates draw random numbers)."""
    actor = _built_actor(world, run_id)
    for layer in actor.model.model.layers:
        layer.self_attn.attention_dropout = 0.3
    return actor


def test_the_compile_warm_up_leaves_the_training_untouched(world):
    """runner.compile_warm_up: a made-up minibatch's forward and backward, in the shapes of a
    full-length step, drops its gradients, steps nothing and restores the random state, so the
    update after it is the update without it (dropout on: the update draws random numbers)."""
    plain = _dropout_actor(world, "plain")
    torch.manual_seed(7)
    expected = plain.train_step([_shard(plain.run_cfg)]).metrics
    expected_params = {n: full(p.detach()).clone() for n, p in plain.model.named_parameters()}

    actor = _dropout_actor(world, "warmed")
    batch, [shard] = warm_up_inputs(actor.run_cfg, ranks=1)
    rows = actor.run_cfg.data.rollout_batch_size * actor.run_cfg.algorithm.group_size
    assert tuple(batch.input_ids.shape) == (rows, actor.run_cfg.runner.seq_length)
    assert bool(batch.response_mask[0].all()) and not bool(batch.attention_mask.all())
    assert len(shard) == rows  # one minibatch, one rank
    before = {n: full(p.detach()).clone() for n, p in actor.model.named_parameters()}
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    answer = actor.warm_up(shard)
    assert answer["seconds"] > 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in actor.model.parameters())
    assert not actor.optimizer.state  # no optimiser step: AdamW made no moments
    for name, value in actor.model.named_parameters():
        assert torch.equal(full(value.detach()), before[name]), name
    metrics = actor.train_step([_shard(actor.run_cfg)]).metrics
    timings = {"offload_seconds"}
    assert {k: v for k, v in metrics.items() if k not in timings} == {
        k: v for k, v in expected.items() if k not in timings
    }
    for name, value in actor.model.named_parameters():
        assert torch.equal(full(value.detach()), expected_params[name]), name


def test_lr_schedules_follow_rlinfs_fsdp_keys(world):
    inputs, root = world

    def lrs(overrides: list[str], steps: int) -> list[float]:
        cfg = to_typed(demo_config(inputs, str(root / "runs"), "lr", overrides))
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.actor.optim.lr)
        scheduler = lr_scheduler(optimizer, cfg.actor.optim)
        out = []
        for _ in range(steps):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    assert lrs([], 3) == pytest.approx([2e-5] * 3)  # RLinf's constant, no warm-up
    # warm-up from 0 over 4 optimiser steps, then constant
    warm = lrs(["actor.optim.lr_warmup_steps=4"], 6)
    assert warm == pytest.approx([0.0, 0.5e-5, 1e-5, 1.5e-5, 2e-5, 2e-5])
    # cosine over total_training_steps = 8 steps, down to min_lr 0: halfway is lr / 2
    cosine = lrs(["actor.optim.lr_scheduler=cosine", "actor.optim.total_training_steps=8"], 5)
    assert cosine[0] == pytest.approx(2e-5) and cosine[4] == pytest.approx(1e-5)
    # total_training_steps unset is 0, as RLinf's FSDP actor reads it (never the run's steps):
    # its cosine is transformers' over 0 steps (hybrid_engines/fsdp/utils.py get_lr_scheduler)
    reference = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-5)
    rlinf = get_cosine_with_min_lr_schedule_with_warmup(reference, 0, 0, 0.5, min_lr=0.0)
    expected = []
    for _ in range(4):
        expected.append(reference.param_groups[0]["lr"])
        reference.step()
        rlinf.step()
    assert lrs(["actor.optim.lr_scheduler=cosine"], 4) == pytest.approx(expected)


@pytest.mark.parametrize("wrapped", [False, True], ids=["unwrapped", "fsdp2"])
def test_a_checkpoint_staged_in_host_buffers_restores_the_trained_state(
    world, tmp_path, caplog, wrapped
):
    """runner.checkpoint_staging's path, on the CPU: the state copied into the run's buffers
    (FSDP2 DTensor shards rebuilt over them, or the one-rank model's plain tensors) and written
    by DCP from there restores the same weights and AdamW moments; a second checkpoint reuses
    the same buffers."""
    from rlinf_twoworker.engines import staging

    actor = _built_actor(world, "staging-test", WRAPPED if wrapped else [])
    assert actor.wrapped == wrapped
    assert actor.staging is None  # on GPUs only, where the copy sets the checkpoint's pace
    actor.train_step([_shard(actor.run_cfg)])
    actor.staging = buffers = staging.for_model(actor.model, copies=3)
    # What the host-memory guard weighs: three fp32 copies of this rank's parameter shards.
    shards = sum(local(p).numel() * p.element_size() for p in actor.model.parameters())
    assert buffers.bytes == 3 * shards
    with caplog.at_level(logging.WARNING, logger="rlinf_twoworker"):  # the host-memory guard
        assert staging.started_if_room(buffers, 2 * buffers.bytes - 1, "actor rank 0") is None
    assert "actor rank 0: runner.checkpoint_staging skipped" in caplog.text
    assert "checkpoint_staging=false" in caplog.text and not buffers.wait(timeout=0)
    assert staging.started_if_room(buffers, 2 * buffers.bytes, "actor rank 0") is buffers
    assert buffers.wait(timeout=60) and buffers.error is None

    def snapshot() -> dict[str, torch.Tensor]:
        out = {n: full(p.detach()).clone() for n, p in actor.model.named_parameters()}
        for p, state in actor.optimizer.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{id(p)}.{key}"] = full(state[key]).clone()
        return out

    trained = snapshot()
    answer = actor.save_checkpoint(str(tmp_path / "first"))
    params = len(list(actor.model.parameters()))
    # Every weight and moment went through a buffer; only AdamW's step scalars and the rank's
    # RNG state (small) were copied to fresh memory.
    scalars = sum(1 for s in actor.optimizer.state.values() for v in s.values() if v.dim() == 0)
    assert answer["staging_misses"] == scalars + 1
    assert sum(len(free) for free in buffers._pool.values()) == 3 * params  # all given back
    pointers = {b.data_ptr() for free in buffers._pool.values() for b in free}
    staged, taken = buffers.stage(actor._state())
    assert {b.data_ptr() for b in taken} == pointers  # the same buffers, every time
    buffers.release(taken)
    with torch.no_grad():
        for p in actor.model.parameters():
            p.zero_()
        for state in actor.optimizer.state.values():
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()
    actor.load_checkpoint(str(tmp_path / "first"))
    restored = snapshot()
    assert restored.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(restored[name], tensor), name
    assert any(t.abs().sum() > 0 for t in trained.values())  # a real state, not zeros


def _mixed_precision_grads(world, wrapped: bool, dtype: str, recompute: bool, parts: int):
    """The log-probs and gradients of the test model computing in `dtype` over a batch of 3
    rows in `parts` micro-batches, in FSDP2's wrapper (its MixedPrecisionPolicy) or unwrapped
    under one `computing_in` for all of them (as the actor holds it over an optimiser step)."""
    inputs, _ = world
    model = load_causal_lm(inputs.model_path, torch.float32, torch.device("cpu"))
    precision = MixedPrecision(param_dtype=dtype, reduce_dtype="fp32")
    if wrapped:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        model = prepare_for_training(
            model, mesh, precision=precision, activation_checkpointing=recompute, compiled=False
        )
        cast = None
    else:
        model = prepare_unwrapped(
            model, precision=precision, activation_checkpointing=recompute, compiled=False
        )
        cast = DTYPES[dtype]
    seen: list[torch.dtype] = []
    model.model.layers[0].mlp.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    batch = _batch(3, 20, 8)
    outs = []
    with computing_in(model, cast):
        for rows in torch.arange(3).tensor_split(parts):
            part = batch.rows(rows)
            logprobs = response_logprobs(model, part)
            (logprobs * part.response_mask).sum().backward()
            outs.append(logprobs.detach())
    logprobs = torch.cat(outs)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters, back
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert set(seen) == {DTYPES[dtype]}
    return logprobs.detach(), {n: full(p.grad).clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("parts", [1, 3], ids=["one_micro_batch", "three_micro_batches"])
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_one_rank_without_the_wrapper_computes_fsdp2s_mixed_precision_gradient(
    world, dtype, recompute, parts
):
    """At one actor rank the model trains unwrapped (actor.fsdp_at_one_rank=false): its
    parameters cast to param_dtype for the forward and the backward (a recomputed layer reads
    the same casts), each gradient cast back to the fp32 master. The log-probs and every
    gradient equal FSDP2's at one rank, bit for bit (the same kernels on the same values),
    also where the casts made once serve several micro-batches, each backward adding its
    gradient to the fp32 master's as FSDP2's reduce-scatter does."""
    fsdp_logprobs, fsdp = _mixed_precision_grads(world, True, dtype, recompute, parts)
    logprobs, grads = _mixed_precision_grads(world, False, dtype, recompute, parts)
    assert torch.equal(logprobs, fsdp_logprobs)
    assert grads.keys() == fsdp.keys()
    for name, grad in fsdp.items():
        assert torch.equal(grads[name], grad), name
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_the_wrapper_at_one_rank_is_the_users_choice_or_a_lossy_reduce_dtype(world):
    """ActorConfig.fsdp_wraps: two ranks always wrap; one rank wraps with
    actor.fsdp_at_one_rank=true or where reduce_dtype would round the gradient once more (a
    cast the unwrapped path does not make), and the memory plan counts what each holds."""
    from rlinf_twoworker.cluster.memory_parts import ModelShape, actor_parts

    inputs, root = world

    def cfg(overrides: list[str]):
        return to_typed(demo_config(inputs, str(root / "runs"), "wraps", overrides)).actor

    mp = "actor.fsdp_config.mixed_precision"
    assert cfg([]).fsdp_wraps(2, gpu=True) and not cfg([]).fsdp_wraps(1, gpu=True)
    assert cfg(WRAPPED).fsdp_wraps(1, gpu=True) and not cfg([]).fsdp_wraps(1, gpu=False)
    lossy = [f"{mp}.param_dtype=bf16", f"{mp}.reduce_dtype=fp16"]
    assert cfg(lossy).fsdp_wraps(1, gpu=True)
    assert not cfg([f"{mp}.param_dtype=fp16", f"{mp}.reduce_dtype=fp16"]).fsdp_wraps(1, True)

    shape = ModelShape(
        params=1000,
        embedding_params=100,
        layer_params=300,
        layers=3,
        hidden=8,
        intermediate=16,
        kv_heads=1,
        head_dim=4,
        vocab=50,
    )
    gpu = ["cluster.accelerator=cuda"]

    def gathered(overrides: list[str], ranks: int) -> int:
        full_cfg = to_typed(demo_config(inputs, str(root / "runs"), "plan", gpu + overrides))
        return actor_parts(full_cfg, shape, ranks, recompute=False)["gathered"]

    assert gathered([], 2) == (100 + 2 * 300) * 2  # two bf16 layers and the embedding
    assert gathered(WRAPPED, 1) == (100 + 2 * 300) * 2
    assert gathered([], 1) == 1000 * 2  # every parameter's bf16 cast
    assert gathered([f"{mp}.param_dtype=null"], 1) == 0  # the fp32 masters compute themselves


def test_checkpoints_of_the_wrapped_and_the_unwrapped_rank_load_into_each_other(world, tmp_path):
    """A one-rank checkpoint is the same DCP layout with or without the wrapper (the same
    names; plain tensors or DTensor shards of the whole shape), so a run resumes from either
    (and from a two-rank one: DCP reshards on load): the weights and AdamW's moments come back
    equal, and the next update from them is the same."""
    trained = {}
    for wrapped in (True, False):
        actor = _built_actor(world, f"cross-{wrapped}", WRAPPED if wrapped else [])
        actor.train_step([_shard(actor.run_cfg)])
        actor.save_checkpoint(str(tmp_path / str(wrapped)))
        trained[wrapped] = actor

    def state(actor) -> dict[str, torch.Tensor]:
        out = {n: full(p.detach()).clone() for n, p in actor.model.named_parameters()}
        names = {id(p): n for n, p in actor.model.named_parameters()}
        for p, moments in actor.optimizer.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{names[id(p)]}.{key}"] = full(moments[key]).clone()
        return out

    for wrapped in (True, False):
        source = trained[wrapped]
        target = _built_actor(world, f"cross-load-{wrapped}", [] if wrapped else WRAPPED)
        assert target.wrapped != wrapped
        target.train_step([_shard(target.run_cfg)])  # AdamW's state exists: the load overwrites it
        target.load_checkpoint(str(tmp_path / str(wrapped)))
        expected, loaded = state(source), state(target)
        assert loaded.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(loaded[name], tensor), name
        after = [a.train_step([_shard(a.run_cfg)]).metrics for a in (source, target)]
        assert after[1]["grad_norm"] == pytest.approx(after[0]["grad_norm"], rel=1e-5)
        for name, tensor in state(source).items():
            assert torch.allclose(state(target)[name], tensor, atol=1e-6), name

"""actor.enable_offload: the policy copies free their weights' memory for the update and the
sync refills it; the actor's state leaves the device between updates. A run with it trains
exactly as one without, on a real cluster (CPU: the same moves, to and from CPU memory)."""

from __future__ import annotations

import gc
import weakref

import pytest
import ray
import torch
from support import KEPT, tiny_lm

from rlinf_twoworker import run_grpo_two_worker
from rlinf_twoworker.api.demo import demo_config, make_inputs
from rlinf_twoworker.engines import offload
from rlinf_twoworker.engines.static_kernels import fuse_projections
from rlinf_twoworker.errors import TwoWorkerError

ONE_GPU = [
    "cluster.num_nodes=1",
    "cluster.num_gpus_per_node=2",
    "cluster.component_placement={rollout:0,inference:0,reward:0,actor:'0-1'}",
]
SAME = (
    "rollout/reward_scores",
    "rollout/response_length",
    "actor/training/actor/final_loss",
    "actor/training/actor/grad_norm",
    "actor/training/actor/approx_kl",
    "actor/training/actor/logprob_diff_max",
)


def tiny_qwen2():
    torch.manual_seed(0)  # also seeds what the test draws next
    return tiny_lm(hidden=16, intermediate=32, seed=None)


def test_released_weights_free_their_memory_and_refuse_use_until_refilled():
    model = tiny_qwen2()
    fused = fuse_projections(model)  # q/k/v and gate/up become views of one storage each
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    total = sum(s.nbytes() for s in offload._storages(model))
    assert total < sum(p.numel() * p.element_size() for p in model.parameters()) * 2
    assert offload.release_weights(model) == total
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert offload.release_weights(model) == 0  # once
    with pytest.raises(TwoWorkerError, match=r"rollout rank 0: its weights were given back"):
        offload.require_weights(model, "rollout rank 0")
    offload.restore_weights(model)
    with torch.no_grad():  # what a sync does: write every parameter
        for name, p in model.named_parameters():
            p.copy_(before[name])
    offload.require_weights(model, "rollout rank 0")
    assert fuse_projections(model) is fused  # the views still alias the fused weights
    torch.testing.assert_close(
        fused[0].qkv_weight[:16], model.model.layers[0].self_attn.q_proj.weight
    )
    ids = torch.tensor([[1, 2, 3]])
    assert torch.isfinite(model(ids).logits).all()


def test_the_actors_state_leaves_and_comes_back_in_place_and_its_gradients_are_freed():
    model = tiny_qwen2().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    params = list(model.parameters())
    before = [t.detach().clone() for t in (*states, *params)]
    mover = offload.ActorOffload(model, optimizer, torch.device("cpu"))
    mover.offload_optimizer()
    assert all(p.grad is None for p in params) and mover.optimizer_away
    assert all(v.untyped_storage().nbytes() == 0 for v in states)
    mover.offload_params()
    assert all(p.untyped_storage().nbytes() == 0 for p in params) and mover.params_away
    mover.offload()  # idempotent
    mover.load()
    assert not (mover.params_away or mover.optimizer_away)
    now = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert [id(v) for v in now] == [id(v) for v in states]  # the same tensors, refilled
    for was, tensor in zip(before, (*states, *params)):
        torch.testing.assert_close(tensor.detach(), was, rtol=0, atol=0)
    optimizer.step()  # and the optimiser steps on them as before
    assert mover.take_seconds() >= 0 and mover.take_seconds() == 0


def _full_collections(fn) -> int:
    """How many full (generation 2) garbage collections `fn()` ran, seen by gc itself."""
    seen = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen.append(1)

    gc.callbacks.append(count)
    try:
        fn()
    finally:
        gc.callbacks.remove(count)
    return len(seen)


def test_an_offload_with_nothing_left_to_move_collects_nothing():
    model = tiny_qwen2().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    mover = offload.ActorOffload(model, optimizer, torch.device("cpu"))
    try:
        # The update's end moves the optimiser state and frees the gradients: one collection.
        assert _full_collections(mover.offload_optimizer) == 1
        assert _full_collections(mover.offload) == 1  # the parameters follow: one more
        # What the step asks after the sync already moved everything: nothing to do.
        assert _full_collections(mover.offload) == 0
        assert _full_collections(mover.offload_optimizer) == 0
        mover.load()
        assert _full_collections(mover.offload_params) == 1
    finally:
        gc.unfreeze()


class _Cycle:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.me = tensor, self


def test_settle_heap_frees_tensors_held_by_cycles_and_later_collections_skip_the_old_heap():
    try:
        held = weakref.ref(_Cycle(torch.ones(4)).tensor)
        assert held() is not None  # only the cycle holds it: reference counts cannot free it
        offload.settle_heap()
        assert held() is None
        frozen = gc.get_freeze_count()
        # What a full collection walks now: a small part of what it walked (torch, the
        # model, the test session), which stays out of its view.
        assert frozen > 10 * len(gc.get_objects())
        later = weakref.ref(_Cycle(torch.ones(4)).tensor)  # made after the freeze
        offload.collect_garbage()
        assert later() is None  # what is made after it is still collected
        # A plain collection freezes nothing. The count may fall: frozen objects are still
        # freed by reference counting (a module's cached entry, a finished frame).
        assert gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def _run(inputs, tmp_path, run_id: str, overrides: list[str]):
    cfg = demo_config(
        inputs,
        tmp_path,
        run_id,
        [
            *ONE_GPU,
            *KEPT,  # the second run in the first one's processes
            "actor.optim.lr=1e-3",  # step 2 samples from visibly moved weights
            "rollout.validate_weight=true",  # the refilled copies equal the actor, bit for bit
            "runner.save_interval=2",  # the checkpoint is written from offloaded state
            *overrides,
        ],
    )
    handle = run_grpo_two_worker(cfg)
    report = handle.result(timeout=600)
    assert report.passed, report.errors
    steps = [ray.get(handle.step(n), timeout=30) for n in (1, 2)]
    return steps, (tmp_path / run_id / "log" / "main.log").read_text()


def test_a_run_with_offload_trains_as_the_run_without(cluster_2x2, tmp_path):
    inputs = make_inputs(tmp_path / "inputs")
    moved, log = _run(inputs, tmp_path, "offload", ["actor.enable_offload=true"])
    kept, _ = _run(inputs, tmp_path, "no-offload", ["actor.enable_offload=false"])
    for m, k in zip(moved, kept):
        assert m.metrics["pipeline/pipelined"] == 0.0  # a shared GPU: sequential
        for key in SAME:
            assert m.metrics[key] == pytest.approx(k.metrics[key], rel=1e-6, abs=1e-9), key
        assert m.metrics["sync/verified"] == 1.0
        assert m.timings["time/actor/offload"] >= 0 and "time/actor/offload" not in k.timings
        for copy in ("rollout/0", "inference/0"):  # both gave their memory back (CPU: no GPU)
            assert m.metrics[f"memory/{copy}/gpu_reserved_during_update_gib"] == 0.0
            assert f"memory/{copy}/gpu_reserved_during_update_gib" not in k.metrics
    assert "actor offload turned on" not in log  # set by the user, not by the plan


class _RecordingGroup:
    """The calls a colocated weight sync makes on the run's component group, in order (the
    sync's CUDA IPC needs a GPU; its order is the controller's and is checked here)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def actors(self) -> list[str]:
        return ["actor:0"]

    def policy_copies(self) -> list[str]:
        return ["rollout:0", "inference:0"]

    def shared_gpus(self) -> tuple[bool, bool]:
        return (True, True)

    async def settle(self) -> None:
        self.calls.append(("settle", ()))

    async def call_each(self, members, method, *args, timeout, stage, per_member=None):
        method = method.__name__  # a function of the component contract
        self.calls.append((method, args))
        if method == "export_weights":
            return [{"handles": [["h-rollout"], ["h-inference"]], "bytes": 8, "seconds": 0.0}]
        if method == "offload":
            return [{"seconds": 0.0}]
        return [{} for _ in members]

    def call_behind(self, member, method, *args, timeout, stage) -> None:
        self.calls.append((method.__name__, args))


@pytest.mark.parametrize("offload", [True, False])
def test_the_colocated_sync_offloads_the_actor_before_the_copies_take_their_memory(offload):
    """With actor.enable_offload the actor is asked to give its parameters and state back as
    part of the export, before rollout and inference reallocate their weights in the import,
    and the buckets are released, and waited for, before the step goes on; without it the
    export keeps the actor's state and the release runs behind."""
    import asyncio

    from rlinf_twoworker.config import load_config, to_typed
    from rlinf_twoworker.run.step import sync_weights

    cfg = to_typed(
        load_config(
            None,
            [
                "actor.enable_offload=" + str(offload).lower(),
                "rollout.validate_weight=false",
                "runner.pipeline=sequential",
            ],
        )
    )
    group = _RecordingGroup()
    asyncio.run(sync_weights(group, cfg))
    methods = [m for m, _ in group.calls]
    export = methods.index("export_weights")
    assert group.calls[export][1][2] is offload  # offload_after, handed to the actor
    assert export < methods.index("import_weights") < methods.index("release_weights")
    if offload:
        assert methods.index("release_weights") < methods.index("settle", 1)
        assert methods[-1] == "offload"
    else:
        assert "offload" not in methods

"""RLinf's precision keys: the config they give (RLinf's starting config: fp16 compute and
reduction with dynamic loss scaling, fp16 rollout and inference; the library's own: bf16), the
refusals, the warning when the actor and inference compute differently, the fp16 FSDP2 path and
the loss scaler on real tensors (an overflow skips the step and halves the scale), and the
scaler's state through a checkpoint."""

from __future__ import annotations

import gc
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support import RLINF_REF
from torch.distributed.device_mesh import DeviceMesh

from rlinf_twoworker.api.demo import demo_config, make_inputs
from rlinf_twoworker.config import (
    GradScalerConfig,
    MixedPrecision,
    OptimConfig,
    config_notes,
    load_config,
    precision_warning,
    to_typed,
)
from rlinf_twoworker.config.settings import actor_settings
from rlinf_twoworker.engines.grad_scaler import adamw, build_grad_scaler, clip_and_step
from rlinf_twoworker.engines.models import SequenceBatch, load_causal_lm, response_logprobs
from rlinf_twoworker.engines.tensors import full
from rlinf_twoworker.errors import ConfigError
from rlinf_twoworker.messages import ActorShard, mean_grad_norm
from rlinf_twoworker.run.step import split_for_actors
from rlinf_twoworker.storage.safe_dcp import unpickle_metadata
from rlinf_twoworker.workers.actor import (
    ActorWorker,
    computing_in,
    prepare_for_training,
    prepare_unwrapped,
)

RLINF_YAML = RLINF_REF
RLINF_YAML /= "qwen2.5-1.5b-grpo-pipeline-fsdp-sgl.yaml"
ON_ONE_NODE = ("cluster.num_gpus_per_node=4",)  # the file's own placement: 4 GPUs on one node
BF16 = (
    "actor.fsdp_config.mixed_precision.param_dtype=bf16",
    "actor.fsdp_config.mixed_precision.reduce_dtype=fp32",
    "actor.fsdp_config.grad_scaler.enabled=false",
    "rollout.model.precision=bf16",
    "inference.model.precision=bf16",
)
"""RLinf's starting config in the library's default precision (docs/config.md gives it)."""
ONE_MINIBATCH = [  # one minibatch of 4 answers (2 prompts x 2), one actor rank
    "data.rollout_batch_size=2",
    "algorithm.n_minibatches=1",
    "cluster.component_placement={rollout:0,inference:1,actor:2,reward:0}",
]
MP = "actor.fsdp_config.mixed_precision"
SCALER = "actor.fsdp_config.grad_scaler"


@pytest.fixture
def rlinf_file(monkeypatch) -> Path:
    if not RLINF_YAML.is_file():
        pytest.skip(f"{RLINF_YAML} is absent (RLinf's starting config, kept outside the repo)")
    monkeypatch.setenv("REPO_PATH", "/nonexistent")  # its hydra.searchpath interpolates it
    return RLINF_YAML


# --- config ----------------------------------------------------------------------------------


def test_rlinfs_starting_config_asks_for_fp16_with_loss_scaling(rlinf_file):
    cfg = to_typed(load_config(rlinf_file, ON_ONE_NODE))
    fsdp = cfg.actor.fsdp_config
    assert (fsdp.mixed_precision.param_dtype, fsdp.mixed_precision.reduce_dtype) == ("fp16",) * 2
    assert fsdp.mixed_precision.buffer_dtype == "fp32"
    assert fsdp.grad_scaler.enabled and fsdp.grad_scaler.scale == 65536.0
    assert fsdp.grad_scaler.interval == 2000  # torch's default, as RLinf leaves it
    assert not fsdp.amp_autocast.enabled
    assert cfg.actor.model.precision == "fp32"  # fp32 master weights
    assert (cfg.rollout.model.precision, cfg.inference.model.precision) == ("fp16", "fp16")
    assert precision_warning(cfg) is None  # the actor and inference both compute in fp16


def test_the_librarys_default_is_bf16_and_rlinfs_file_one_command_line_from_it(rlinf_file):
    default = to_typed(load_config())
    mp = default.actor.fsdp_config.mixed_precision
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == ("bf16", "fp32", "fp32")
    assert not default.actor.fsdp_config.grad_scaler.enabled
    assert (default.rollout.model.precision, default.inference.model.precision) == ("bf16",) * 2
    bf16 = to_typed(load_config(rlinf_file, [*ON_ONE_NODE, *BF16]))
    assert bf16.actor.fsdp_config.mixed_precision == mp
    assert bf16.actor.fsdp_config.grad_scaler == default.actor.fsdp_config.grad_scaler
    assert (bf16.rollout.model.precision, bf16.inference.model.precision) == ("bf16",) * 2
    assert precision_warning(bf16) is None


@pytest.mark.parametrize(
    ("override", "key", "says"),
    [
        (f"{MP}.param_dtype=fp8", f"{MP}.param_dtype", "must be fp16, bf16, fp32 or null"),
        (f"{MP}.reduce_dtype=float16", f"{MP}.reduce_dtype", "must be fp16, bf16, fp32 or null"),
        (
            "actor.fsdp_config.amp_autocast.enabled=true",
            "actor.fsdp_config.amp_autocast.enabled",
            f"{MP}.param_dtype=bf16",
        ),
        (f"{SCALER}.init_scale=0", f"{SCALER}.init_scale", "must be > 0"),
        (f"{SCALER}.growth_factor=1.0", f"{SCALER}.growth_factor", "must be > 1"),
        (f"{SCALER}.backoff_factor=1.5", f"{SCALER}.backoff_factor", "must be in (0, 1)"),
        (f"{SCALER}.growth_interval=0", f"{SCALER}.growth_interval", "must be >= 1"),
    ],
)
def test_values_the_library_cannot_do_are_refused_by_name(override, key, says):
    with pytest.raises(ConfigError) as caught:
        load_config(overrides=[override])
    assert caught.value.key == key and says in str(caught.value)


def test_an_unknown_precision_key_is_refused():
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config(overrides=[f"{SCALER}.min_scale=1"])


def test_a_warning_names_both_precisions_and_the_keys_when_actor_and_inference_differ():
    cfg = to_typed(load_config(overrides=["inference.model.precision=fp16"]))
    warning = precision_warning(cfg)
    assert warning is not None
    assert "actor computes in bf16" in warning and "old log-probs in fp16" in warning
    assert "inference.model.precision=bf16" in warning and f"{MP}.param_dtype=fp16" in warning
    # null param_dtype: the layers compute in the master weights' dtype
    master = to_typed(load_config(overrides=[f"{MP}.param_dtype=null"]))
    assert "actor computes in fp32" in (precision_warning(master) or "")
    fp16 = [f"{MP}.param_dtype=fp16", "inference.model.precision=fp16"]
    assert precision_warning(to_typed(load_config(overrides=fp16))) is None
    # on CPUs every component computes in fp32: nothing differs
    cpu = ["inference.model.precision=fp16", "cluster.accelerator=cpu"]
    cpu = to_typed(load_config(overrides=cpu))
    assert precision_warning(cpu) is None


def test_notes_for_fp16_without_a_scaler_and_for_factors_rlinf_does_not_pass():
    cfg = load_config(overrides=[f"{MP}.param_dtype=fp16", f"{SCALER}.backoff_factor=0.25"])
    notes = config_notes(cfg)
    assert any(f"{SCALER}.enabled=false accepted" in n for n in notes)
    assert any(f"{SCALER}.backoff_factor=0.25 accepted" in n and "0.5" in n for n in notes)


def test_mean_grad_norm_leaves_out_skipped_minibatches():
    assert mean_grad_norm([1.0, math.inf, 3.0]) == 2.0
    assert math.isnan(mean_grad_norm([math.nan, math.inf]))  # none stepped: said as it is


# --- the actor, on real tensors ----------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A one-rank gloo world in this process (FSDP2 and the scaler's all-reduce need one)."""
    root = tmp_path_factory.mktemp("precision")
    patch = pytest.MonkeyPatch()
    patch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=0, world_size=1)
    yield make_inputs(root / "inputs"), root
    dist.destroy_process_group()
    gc.collect()
    patch.undo()


def _batch(rows: int, width: int, prompt: int) -> SequenceBatch:
    gen = torch.Generator().manual_seed(rows * 100 + width)
    ids = torch.randint(5, 60, (rows, width), generator=gen)
    response = torch.ones(rows, width - prompt, dtype=torch.long)
    response[-1, -3:] = 0  # the last answer ends early
    return SequenceBatch(ids, torch.ones_like(ids), response, prompt)


def _fp16_model(world, precision: MixedPrecision, wrapped: bool = True):
    """The test model in FSDP2's wrapper with `precision`, or unwrapped as one actor rank
    trains it (its forward and backward then under `computing_in`)."""
    inputs, _ = world
    model = load_causal_lm(inputs.model_path, torch.float32, torch.device("cpu"))
    if not wrapped:
        return prepare_unwrapped(
            model, precision=precision, activation_checkpointing=False, compiled=False
        )
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    return prepare_for_training(
        model, mesh, precision=precision, activation_checkpointing=False, compiled=False
    )


def _checkpoint_keys(path: Path) -> set[str]:
    return set(unpickle_metadata(path / ".metadata").state_dict_metadata)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("wrapped", [True, False], ids=["fsdp2", "unwrapped"])
def test_fp16_computes_in_fp16_and_an_overflow_skips_the_step(world, wrapped):
    """RLinf's starting precision on the CPU, in FSDP2's wrapper and as one unwrapped actor
    rank: layers compute in fp16, the master weights and their gradients stay fp32; a loss
    large enough to overflow fp16 gradients under the scale skips the step and halves the
    scale; a normal loss then updates the weights."""
    precision = MixedPrecision(param_dtype="fp16", reduce_dtype="fp16")
    model = _fp16_model(world, precision, wrapped)
    cast = None if wrapped else torch.float16
    seen: list[torch.dtype] = []
    model.model.layers[0].mlp.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = build_grad_scaler(GradScalerConfig(enabled=True), torch.device("cpu"), None)
    batch = _batch(3, 20, 8)

    def update(factor: float) -> tuple[float, bool]:
        optimizer.zero_grad(set_to_none=True)
        with computing_in(model, cast):
            loss = (response_logprobs(model, batch) * batch.response_mask).mean() * factor
            scaler.scale(loss).backward()
        return clip_and_step(model, optimizer, scaler, clip=1.0)

    before = _params(model)
    norm, stepped = update(1e6)  # x 65536: past fp16's 65504 in the gradients
    assert seen and seen[0] == torch.float16
    assert not math.isfinite(norm) and not stepped
    assert scaler.get_scale() == 32768.0
    after = _params(model)
    assert all(torch.equal(after[n], t) for n, t in before.items())  # nothing moved
    assert all(p.dtype == torch.float32 for p in model.parameters())
    norm, stepped = update(1e-2)  # the gradients x 32768 fit in fp16
    assert math.isfinite(norm) and stepped and scaler.get_scale() == 32768.0
    assert any(not torch.equal(_params(model)[n], t) for n, t in before.items())


@pytest.mark.parametrize("scaling", [True, False])
def test_the_actors_fused_optimizer_steps_with_and_without_the_scaler(world, scaling):
    """The actor's AdamW is fused on GPUs. torch's ShardedGradScaler.step hands a fused
    optimiser a found-inf tensor its step counters cannot take (the first fp16 run on a GPU
    failed so), so the library steps the optimiser itself once the norm is finite. CPU AdamW
    has the same fused kernel and the same failure."""
    model = _fp16_model(world, MixedPrecision(param_dtype="fp16", reduce_dtype="fp16"))
    optimizer = adamw(model.parameters(), OptimConfig(lr=1e-3), fused=True)
    assert optimizer.defaults["fused"]
    scaler = build_grad_scaler(GradScalerConfig(enabled=scaling), torch.device("cpu"), None)
    batch = _batch(3, 20, 8)
    before = _params(model)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        loss = (response_logprobs(model, batch) * batch.response_mask).mean() * 1e-2
        scaler.scale(loss).backward()  # x 65536 fits in fp16
        norm, stepped = clip_and_step(model, optimizer, scaler, clip=1.0)
        assert math.isfinite(norm) and stepped
    assert any(not torch.equal(_params(model)[n], t) for n, t in before.items())
    assert all(int(s["step"]) == 2 for s in optimizer.state.values())


def test_buffer_dtype_casts_the_models_buffers(world):
    model = _fp16_model(world, MixedPrecision(param_dtype="fp16", buffer_dtype="fp16"))
    floating = [b for b in model.buffers() if b.is_floating_point()]
    assert floating and all(b.dtype == torch.float16 for b in floating)


def _shard(cfg, advantage: float) -> ActorShard:
    batch = _batch(4, 20, 8)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(-1) * batch.response_mask * advantage
    old = torch.full((4, 12), -4.0) * batch.response_mask
    [[shard]] = split_for_actors(cfg, batch, old, adv, ranks=1)
    return shard


def _actor(world, run_id: str, overrides: list[str]) -> tuple[ActorWorker, object]:
    inputs, root = world
    raw = demo_config(inputs, str(root / "runs"), run_id, ONE_MINIBATCH + overrides)
    cfg = to_typed(raw)
    actor = ActorWorker(actor_settings(cfg), 0)
    actor.actor_group = dist.group.WORLD
    actor.build()
    return actor, cfg


SCALED = [f"{SCALER}.enabled=true", f"{SCALER}.growth_interval=1"]


def test_the_actor_skips_an_overflowing_step_counts_it_and_resumes_the_scale(world, tmp_path):
    """The actor's own update with loss scaling: advantages large enough that the scaled loss
    overflows float32 make a real inf gradient; the step is skipped, counted and the scale
    halved; the next good step updates and (growth_interval=1) doubles the scale. The scale
    and its growth count go through a checkpoint into a fresh actor."""
    actor, cfg = _actor(world, "scaler", SCALED)
    before = _params(actor.model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bad = actor.train_step([_shard(cfg, 1e37)]).metrics
    assert bad["skipped_steps"] == 1 and bad["loss_scale"] == 32768.0
    assert any("loss scale lowered to 32768.0" in str(w.message) for w in caught)
    assert all(torch.equal(_params(actor.model)[n], t) for n, t in before.items())
    good = actor.train_step([_shard(cfg, 1.0)]).metrics
    assert good["skipped_steps"] == 0 and math.isfinite(good["grad_norm"])
    assert good["loss_scale"] == 65536.0  # one good step in a row: grown
    assert any(not torch.equal(_params(actor.model)[n], t) for n, t in before.items())
    with pytest.warns(UserWarning, match="loss scale lowered to 32768.0"):
        actor.train_step([_shard(cfg, 1e37)])  # a state worth restoring: 65536 -> 32768
    saved = actor.scaler.state_dict()
    assert saved["scale"] == 32768.0

    path = tmp_path / "checkpoint"
    actor.save_checkpoint(str(path))
    assert {"fsdp_checkpoint.grad_scaler.scale"} <= _checkpoint_keys(path)
    fresh, _ = _actor(world, "scaler-resumed", SCALED)
    assert fresh.scaler.state_dict() != saved
    fresh.load_checkpoint(str(path))
    assert fresh.scaler.state_dict() == saved
    # the restored actor continues as the original would
    shard = _shard(cfg, 1.0)
    mine, theirs = actor.train_step([shard]).metrics, fresh.train_step([shard]).metrics
    assert mine["loss_scale"] == theirs["loss_scale"] == 65536.0
    assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-6)


def test_without_a_scaler_the_checkpoint_has_no_scaler_state(world, tmp_path):
    actor, cfg = _actor(world, "plain", [])
    metrics = actor.train_step([_shard(cfg, 1.0)]).metrics
    assert "loss_scale" not in metrics and metrics["skipped_steps"] == 0
    actor.save_checkpoint(str(tmp_path / "plain"))
    assert not any("grad_scaler" in k for k in _checkpoint_keys(tmp_path / "plain"))


def test_the_precision_belongs_to_the_lineage_and_an_older_record_reads_as_bf16(tmp_path):
    """A run trained in another precision is not continued by resume_dir=auto; a lineage
    written before RLinf's keys acted (the library's bool actor.mixed_precision) reads as
    the bf16 compute with fp32 reduction it meant."""
    import json

    from rlinf_twoworker.storage.lineage import LINEAGE_JSON, lineage_of, lineage_problems

    mine = lineage_of(to_typed(load_config()))
    older = {k: v for k, v in mine["training"].items() if not k.startswith("actor.fsdp_config")}
    older["actor.mixed_precision"] = True
    (tmp_path / LINEAGE_JSON).write_text(json.dumps({**mine, "training": older}))

    def settings(lineage: dict) -> list[str]:  # no model here: the manifests differ anyway
        return [p for p in lineage_problems(tmp_path, lineage) if "training settings" in p]

    assert settings(mine) == []
    [problem] = settings(lineage_of(to_typed(load_config(overrides=[f"{MP}.param_dtype=fp16"]))))
    assert f"{MP}.param_dtype ('bf16' there, 'fp16' here)" in problem

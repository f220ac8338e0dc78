"""Where one GRPO step's actor update goes at the tutorial job's shape, on one GPU.

    python -m benchmarks actor_step [--rows 16] [--group 2] [--seq 1024] [--prompt 256] [--cut 4096]
        [--lengths full|varied|short_prompts] [--also-cuts 8192,16384] [--override KEY=VALUE ...]

The library's ActorWorker, built as a run builds it (one rank of an NCCL group: unwrapped with
FSDP2's mixed precision, or FSDP2 with --override actor.fsdp_at_one_rank=true; compiled
decoder layers, fused AdamW), on the 1.5B shape with random weights (bench_gpu.make_model_dir)
and the starting config (the tutorial's minibatches: algorithm.n_minibatches of its rows);
runner.micro_batch_tokens is --cut (what the memory plan picks for the tutorial job). With
--lengths full every answer runs to the token limit, as a random model's do; with varied the
prompt and answer lengths are drawn as a trained model's vary (compare
runner.trim_padding_multiple=0 and 128 there: the length-aware cut); with short_prompts every
prompt is 10 tokens left-padded to --prompt and every answer at the limit, the tutorial job's
rows (the layout whose trimmed update made NaN gradients on an H100 before every position was
given a key to attend to). Two updates compile
and warm up; four are timed; one more is profiled (CPU and CUDA); then the log-prob recompute's
forward over the same rows, cut as inference cuts it with --cut tokens, is timed three times.
Prints one JSON object: the update's seconds by part (forward/backward, optimizer), each timed
update's gradient norms (NaN: a broken update, whatever its seconds), the real and padded
tokens, the GPU's busy share of the wall time (kernel time over wall time: well
under 1 means the GPU waits on the host), the kernels by GPU time and the host operators by
their own CPU time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


SHORT_PROMPT = 10
"""Real tokens of a --lengths short_prompts prompt: the demo data's prompts are 10 tokens."""


def _on_gpu(event) -> bool:
    """A kernel or a copy the GPU ran. Operators (aten::mm) and annotated ranges (the
    optimizer's step, FSDP's hooks: GPU-side ranges) also carry the device time of the kernels
    under them: counting them too would count it twice."""
    from torch.autograd import DeviceType

    return event.device_type != DeviceType.CPU and not event.is_user_annotation


def _table(prof, key: str, limit: int, gpu: bool) -> list[dict]:
    rows = []
    for event in prof.key_averages():
        value = getattr(event, key, 0.0) or 0.0
        if value and _on_gpu(event) == gpu:
            rows.append(
                {"name": event.key[:90], "ms": round(value / 1000, 3), "calls": event.count}
            )
    return sorted(rows, key=lambda r: -r["ms"])[:limit]


def main() -> None:
    import torch.distributed as dist
    from bench_gpu import job_overrides, make_model_dir
    from torch.profiler import ProfilerActivity, profile

    from rlinf_twoworker.api.demo import make_inputs
    from rlinf_twoworker.config import load_config, to_typed
    from rlinf_twoworker.config.settings import actor_settings
    from rlinf_twoworker.engines.models import SequenceBatch
    from rlinf_twoworker.run.chunks import split_for_actors
    from rlinf_twoworker.workers.actor import ActorWorker, computing_in
    from rlinf_twoworker.workers.base import free_port

    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16, help="answers a step")
    parser.add_argument("--group", type=int, default=2, help="answers a prompt")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--cut", type=int, default=4096, help="runner.micro_batch_tokens")
    parser.add_argument("--root", default="/tmp/rlinf-bench")
    parser.add_argument(
        "--model",
        default=None,
        help="a model directory (default: the 1.5B; with --cpu the demo's tiny model)",
    )
    parser.add_argument("--cpu", action="store_true", help="a smoke run on CPUs (gloo)")
    parser.add_argument(
        "--lengths",
        choices=("full", "varied", "short_prompts"),
        default="full",
        help="full: every answer runs to the token limit (a random model's); varied: prompt and "
        "answer lengths drawn uniformly (prompts 1/4..1 of --prompt, answers 1/16..1 of the "
        "answer tokens), as a trained model's answers are; short_prompts: prompts of "
        f"{SHORT_PROMPT} tokens left-padded to --prompt, answers at the limit (the tutorial "
        "job's rows with the benchmarks' random model)",
    )
    parser.add_argument(
        "--also-cuts",
        default="",
        help="comma-separated further runner.micro_batch_tokens values timed on the same model "
        "after the profiled update (one warm-up and three timed updates each): a cost-model "
        "fit by cut in one process, without building and compiling the model again",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="a config override, e.g. actor.fsdp_at_one_rank=true (repeatable)",
    )
    args = parser.parse_args()
    root = Path(args.root)
    inputs = make_inputs(root / "inputs")
    cuda = not args.cpu
    # The CPU smoke run takes the demo's tiny model: the 1.5B is built on a GPU.
    model_dir = (
        Path(args.model) if args.model else (make_model_dir(root) if cuda else inputs.model_path)
    )
    data = inputs.data_path
    overrides = [
        *job_overrides(model_dir, data, root, "actor-step", 2),
        f"runner.micro_batch_tokens={args.cut}",
        f"data.rollout_batch_size={args.rows // args.group}",
        f"algorithm.group_size={args.group}",
        f"runner.seq_length={args.seq}",
        f"data.max_prompt_length={args.prompt}",
        *([] if cuda else ["cluster.accelerator=cpu"]),
        *args.override,
    ]
    cfg = to_typed(load_config(overrides=overrides))
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if cuda:
        torch.cuda.set_device(0)  # before the NCCL group, which binds to the current device
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}",
        rank=0,
        world_size=1,
    )
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    actor = ActorWorker(actor_settings(cfg), 0)
    actor.actor_group = dist.group.WORLD
    actor.build()

    gen = torch.Generator().manual_seed(0)
    answer = args.seq - args.prompt
    vocab = actor.model.config.vocab_size
    ids = torch.randint(0, vocab, (args.rows, args.seq), generator=gen)
    mask = torch.ones_like(ids)
    response = torch.ones(args.rows, answer, dtype=torch.long)
    if args.lengths == "varied":
        prompts = torch.randint(
            max(args.prompt // 4, 1), args.prompt + 1, (args.rows, 1), generator=gen
        )
        answers = torch.randint(max(answer // 16, 1), answer + 1, (args.rows, 1), generator=gen)
        response = (torch.arange(answer) < answers).long()
        mask = torch.cat([(torch.arange(args.prompt) >= args.prompt - prompts).long(), response], 1)
        ids = ids * mask
    elif args.lengths == "short_prompts":
        real = min(SHORT_PROMPT, args.prompt)
        mask[:, : args.prompt - real] = 0
        ids = ids * mask
    batch = SequenceBatch(ids, mask, response, args.prompt)
    sign = torch.where(torch.arange(args.rows) % 2 == 0, 1.0, -1.0).unsqueeze(-1)
    adv = sign * response
    old = torch.full((args.rows, answer), -11.9)  # about log(1 / vocab): a random policy's
    [shards] = split_for_actors(cfg, batch, old, adv, ranks=1)

    def update() -> tuple[float, dict]:
        sync()
        start = time.perf_counter()
        stats = actor.train_step(shards)
        sync()
        return time.perf_counter() - start, stats

    def logprobs() -> float:
        """The log-prob recompute's forward over the step's rows, cut as inference cuts it
        (workers/inference.py), with the actor's model (compiled layers, no gradient)."""
        from rlinf_twoworker.engines.models import micro_batches, response_logprobs

        rule, trim = cfg.micro_batch_rule(False, args.cut), cfg.runner.trim_padding_multiple
        sync()
        start = time.perf_counter()
        with torch.no_grad(), computing_in(actor.model, actor.compute_dtype):
            for rows in micro_batches(batch, rule, trim):
                part = batch.rows(rows).to(actor.device)
                response_logprobs(actor.model, part, trim, actor.compiled)
        sync()
        return time.perf_counter() - start

    warm = [update()[0] for _ in range(2)]
    timed = [update() for _ in range(4)]
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        wall, stats = update()
    kernels = _table(prof, "self_device_time_total", 25, gpu=True)
    actor.model.eval()
    logprob_s = [logprobs() for _ in range(4)][1:]  # the first compiles the no-grad graphs
    real = int(batch.attention_mask.sum())
    gpu_ms = sum(e.self_device_time_total for e in prof.key_averages() if _on_gpu(e)) / 1000
    out = {
        "shape": vars(args),
        "minibatches": len(shards),
        "fsdp_wrapped": actor.wrapped,
        "warm_up_s": warm,
        "update_s": [t for t, _ in timed],
        # Each timed update's minibatch gradient norms: a NaN here is a broken update (the
        # optimiser skips it), whatever the seconds say.
        "grad_norms": [[m["grad_norm"] for m in s.minibatches] for _, s in timed],
        "profiled_update_s": wall,
        "forward_backward_s": stats.forward_backward_seconds,
        "optimizer_s": stats.optimizer_seconds,
        "real_tokens": real,
        "padded_tokens": args.rows * args.seq,
        "logprob_forward_s": logprob_s,
        "gpu_kernel_ms": round(gpu_ms, 1),
        "gpu_busy_share": round(gpu_ms / 1000 / wall, 3),
        "kernels": kernels,
        "host_ops": _table(prof, "self_cpu_time_total", 30, gpu=False),
    }
    if cuda:  # what the update holds at its peak: the figure a memory-plan change must keep
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    # Last, after the peaks above are read: each further cut measures its own peak.
    out["also_cuts"] = {}
    for cut in [int(c) for c in args.also_cuts.split(",") if c]:
        actor.settings = dataclasses.replace(
            actor.settings, micro_batch=cfg.micro_batch_rule(True, cut)
        )
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        update()  # compiles for the cut's shapes (train_step puts the model in train mode)
        also = {"update_s": [update()[0] for _ in range(3)]}
        if cuda:
            also["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["also_cuts"][cut] = also
    print(json.dumps(out, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""GPU benchmark suite: one command, JSON out, a table last.

    python -m benchmarks gpu [--quick]     (or: python benchmarks/bench_gpu.py [--out FILE] ...)

Sections (each a median of several timed runs after warm-up, CUDA-synchronised):
  rollout    decode tokens/s of transformers' generate vs the library's static sampler
  inference  log-prob recompute tokens/s (bf16, micro-batched)
  actor      FSDP2 training tokens/s and MFU (bf16 params, fp32 reduce, fused AdamW)
  weight_sync  the library's bucketed NCCL broadcast between two GPUs (two processes)
  grpo_step  full colocated GRPO steps of the starting config through run_grpo_two_worker
  grpo_step_2gpu  the same on two one-GPU Ray nodes (actor + inference | rollout + reward)
  grpo_step_trim  grpo_step with runner.trim_padding_multiple=128 (not in the default list)
  trl        TRL's GRPOTrainer on the same model, prompts and lengths (bench_trl.py, own process)
  startup    time to result: the tutorial's 2-step job with the library's defaults, on a cold
             and then a warm shared compile cache, each on a fresh local compile cache; start-up
             phases, call to step 1, call to verification.json (not in the default list)
  scaling    rollout cost as the work grows: 8/32/128 prompts x 8 answers at 1k/4k/8k tokens,
             continuous batching vs one static batch, time-limited (bench_scaling.py; not in
             the default list; --scaling-cases picks cases)
  scale      whole GRPO steps at real batch sizes, colocated on one GPU (--scale-topology 2gpu:
             2 nodes x 1 GPU, pipelined): 32x8 and 64x8 prompts x answers at
             2048 tokens, 8x8 at 8192, the tutorial job under cluster.max_gpu_memory_gb=40
             (memory40) and as it is (tutorial); stage seconds, generated tokens/s, actor and
             inference MFU, each process's nvidia-smi peak beside its memory plan; --scale-cases,
             --scale-steps, --scale-cold (each case on empty caches of its own),
             --scale-endurance-steps N (32x8@2048 runs N steps: does memory
             grow after step 3?) (bench_scale.py; not in the default list)
  pipelining pipelined vs sequential GRPO steps on two one-GPU nodes, answers of varied length
             (bench_pipeline.py; not in the default list)
  qwen3      the Qwen3-0.6B shape on the static engine: greedy tokens against generate's (fp32),
             decode tokens/s against generate (bf16) (probe_qwen3.py; not in the default list)
The model is the DeepSeek-R1-Distill-Qwen-1.5B shape (Qwen2, random weights) saved to a local
directory, so the library's real loading code runs. Timing lives here, never in tests. The
results go to benchmarks/results/<section>-<configuration>-<hardware>.json (record.py) unless
--out names a file, with the commit ($RLINF_COMMIT, else git's, else 'unknown'), the command,
the versions and the GPU.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from record import hardware_tag, provenance, write_result  # benchmarks/ is the script's path
from shapes import QWEN_1P5B  # benchmarks/ is the script's path


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    t = statistics.median(timed(lambda: a @ b, 10))
    return 2 * 8192**3 / t / 1e12


def make_model_dir(root: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlinf_twoworker.api.demo import build_tokenizer
    from rlinf_twoworker.storage.manifest import write_manifest

    path = root / "qwen2-1.5b-random"
    if (path / "SHA256SUMS").exists():
        return path
    tokenizer = build_tokenizer()
    cfg = Qwen2Config(
        **QWEN_1P5B,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    write_manifest(path)
    # This driver process would otherwise keep ~10 GiB of freed blocks cached on the GPU for
    # the whole benchmark (the fp32 build and its bf16 copy), in every nvidia-smi figure.
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return path


def bench_rollout(model_dir: Path, quick: bool) -> dict:
    from rlinf_twoworker.engines.models import load_causal_lm
    from rlinf_twoworker.engines.static import SamplingSettings, StaticSampler

    model = load_causal_lm(model_dir, torch.bfloat16, torch.device("cuda")).eval()
    prompt, new = 256, 128 if quick else 512
    out = {"prompt_tokens": prompt, "new_tokens": new}
    eos = [10**9]  # never stops early: every row decodes `new` tokens
    for batch in (64, 256):
        ids = torch.randint(100, 150000, (batch, prompt), device="cuda")
        mask = torch.ones_like(ids)
        sampler = StaticSampler(model, batch, prompt + new)
        settings = SamplingSettings(do_sample=True, temperature=1.0)
        run = functools.partial(sampler.generate, ids, mask, new, eos, 0, settings)
        run()  # capture the graph
        t_static = statistics.median(timed(run, 3))
        gen = functools.partial(
            model.generate, input_ids=ids, attention_mask=mask, do_sample=True, pad_token_id=0
        )
        gen(max_new_tokens=8, min_new_tokens=8)
        t_hf = statistics.median(
            timed(functools.partial(gen, max_new_tokens=new, min_new_tokens=new), 1)
        )
        eager = StaticSampler(model, batch, prompt + new)
        eager._set_kernels(False)  # the same sampler without the fused elementwise kernels
        run_eager = functools.partial(eager.generate, ids, mask, new, eos, 0, settings)
        run_eager()
        t_eager = statistics.median(timed(run_eager, 2))
        del eager
        out[f"batch_{batch}"] = {
            "static_unfused_tokens_per_s": batch * new / t_eager,
            "static_tokens_per_s": batch * new / t_static,
            "generate_tokens_per_s": batch * new / t_hf,
            "speedup": t_hf / t_static,
            "static_s": t_static,
            "generate_s": t_hf,
        }
    # Greedy agreement with generate (bf16: kernels differ, so report the matching prefix).
    ids = torch.randint(100, 150000, (8, 64), device="cuda")
    mask = torch.ones_like(ids)
    mine = StaticSampler(model, 8, 64 + 32).generate(
        ids, mask, 32, eos, 0, SamplingSettings(do_sample=False)
    )
    ref = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=32,
        min_new_tokens=32,
        pad_token_id=0,
    )[:, 64:].cpu()
    same = (mine == ref).cumprod(-1).sum(-1).float()
    out["greedy_matching_prefix_mean"] = float(same.mean())
    return out


def bench_inference(model_dir: Path) -> dict:
    from rlinf_twoworker.engines.models import load_causal_lm

    model = load_causal_lm(model_dir, torch.bfloat16, torch.device("cuda")).eval()
    out = {}
    for micro in (4, 16):
        ids = torch.randint(100, 150000, (micro, 1024), device="cuda")
        for fused in (False, True):  # eager log-softmax / the compiled kernel (the default)
            run = functools.partial(_logprob_pass, model, ids, fused)
            run()
            t = statistics.median(timed(run, 5))
            out[f"micro_{micro}_{'fused' if fused else 'eager'}_tokens_per_s"] = micro * 1024 / t
    return out


@torch.no_grad()
def _logprob_pass(model: torch.nn.Module, ids: torch.Tensor, fused: bool) -> None:
    from rlinf_twoworker.algorithm import token_logprobs

    logits = model(input_ids=ids, use_cache=False).logits
    token_logprobs(logits[:, 255:-1], ids[:, 256:], fused=fused)


def _train_step(
    model: torch.nn.Module, optim: torch.optim.Optimizer, ids: torch.Tensor, fused: bool
) -> None:
    from rlinf_twoworker.algorithm import token_logprobs

    logits = model(input_ids=ids).logits
    loss = -token_logprobs(logits[:, :-1], ids[:, 1:], fused=fused).mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def fsdp_model(model_dir: Path, activation_checkpointing: bool, compiled: bool) -> torch.nn.Module:
    """The actor's FSDP2 setup on one GPU through the library's own `prepare_for_training`:
    fp32 master weights, FSDP2 with bf16 params and fp32 gradient reduction (a one-rank
    group). This is each rank's setup with two ranks, or one rank's with
    actor.fsdp_at_one_rank=true; a one-rank run trains unwrapped by default (the actor_step
    section measures both)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rlinf_twoworker.config import MixedPrecision
    from rlinf_twoworker.engines.models import load_causal_lm
    from rlinf_twoworker.workers.actor import prepare_for_training

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    model = load_causal_lm(model_dir, torch.float32, torch.device("cuda"))
    return prepare_for_training(
        model,
        init_device_mesh("cuda", (1,)),
        precision=MixedPrecision(),  # the library's default: bf16 compute, fp32 reduction
        activation_checkpointing=activation_checkpointing,
        compiled=compiled,
    )


ACTOR_VARIANTS = {
    # name: (compiled layers and log-softmax kernel, activation checkpointing)
    "eager": (False, False),
    "default": (True, False),  # the library's default on GPUs
    "checkpointing": (True, True),
}


def kernel_breakdown(step) -> dict[str, float]:
    """GPU time of one call of `step` by kernel family, in ms (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    families = {
        "gemm": ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas"),
        "attention": ("flash", "fmha", "attention", "efficient"),
        "triton (compiled elementwise)": ("triton",),
        "optimizer": ("adam", "multi_tensor"),
        "copy/cast": ("copy", "cast", "memcpy", "fill"),
    }
    out: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0)
        if not us or event.key.startswith(("ProfilerStep", "aten::")):
            continue
        name = event.key.lower()
        family = next((f for f, keys in families.items() if any(k in name for k in keys)), "other")
        out[family] = out.get(family, 0.0) + us / 1000
    return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def _or_error(fn, *args):
    """A diagnostic that must not cost the section its measurements."""
    try:
        return fn(*args)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


H200_BF16_DENSE = 989e12
"""The H200's dense bf16 tensor-core rate (NVIDIA's datasheet), the usual MFU denominator."""


def _usual_flops_per_token(model_dir: Path, seq: int) -> float:
    """Training FLOPs per token, the usual count: 6 x non-embedding parameters (the input
    embedding and the LM head excluded) + 12 x layers x hidden x sequence (attention scores and
    their application, forward and backward)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head_dim = c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    attn = c.hidden_size * (c.hidden_size + 2 * kv) + 2 * kv + c.hidden_size  # q,k,v (+bias)
    attn += c.hidden_size * c.hidden_size  # o
    mlp = 3 * c.hidden_size * c.intermediate_size
    layer = attn + mlp + 2 * c.hidden_size  # two RMSNorms
    non_embedding = c.num_hidden_layers * layer + c.hidden_size  # final norm
    return 6 * non_embedding + 12 * c.num_hidden_layers * c.hidden_size * seq


def bench_actor(model_dir: Path, peak_tflops: float, quick: bool) -> dict:
    """Training tokens/s and MFU: eager, the library's default (compiled decoder layers and
    log-softmax kernel), and the default with activation checkpointing (one more forward)."""
    import torch.distributed as dist

    out: dict = {}
    batch, seq = (4, 1024) if quick else (8, 2048)
    for name, (compiled, checkpointing) in ACTOR_VARIANTS.items():
        model = fsdp_model(model_dir, checkpointing, compiled)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
        n_params = sum(p.numel() for p in model.parameters())
        ids = torch.randint(100, 150000, (batch, seq), device="cuda")
        step = functools.partial(_train_step, model, optim, ids, compiled)
        warmup = time.perf_counter()
        step()
        step()
        warmup = time.perf_counter() - warmup
        t = statistics.median(timed(step, 5))
        tokens_s = batch * seq / t
        hardware_flops = (8 if checkpointing else 6) * n_params * tokens_s
        out["params"] = n_params
        out[f"b{batch}_s{seq}_{name}"] = {
            "compiled": compiled,
            "activation_checkpointing": checkpointing,
            "tokens_per_s": tokens_s,
            "step_s": t,
            "warmup_two_steps_s": warmup,
            "mfu_6N_vs_measured_peak": 6 * n_params * tokens_s / (peak_tflops * 1e12),
            # The usual definition (PaLM, Megatron): 6 x non-embedding parameters plus the
            # attention's 12 x layers x hidden x sequence per token, against the H200's
            # 989 TFLOP/s dense bf16 datasheet rate.
            "mfu_usual_vs_989": _usual_flops_per_token(model_dir, seq) * tokens_s / H200_BF16_DENSE,
            "hardware_flops_utilisation": hardware_flops / (peak_tflops * 1e12),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            "kernel_ms_by_family": _or_error(kernel_breakdown, step),
        }
        del model, optim, step
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    dist.destroy_process_group()
    return out


def _sync_worker(rank: int, model_dir: str, port: int, out_dir: str, repeats: int) -> None:
    """One process per GPU: rank 0 is the actor side, rank 1 a consumer (gloo on CPU, where
    only the script itself is being checked)."""
    import torch.distributed as dist

    from rlinf_twoworker.engines.models import load_causal_lm
    from rlinf_twoworker.engines.weight_sync import (
        new_sync_groups,
        receive_weights,
        send_weights,
        weights_digest,
    )

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
    )
    device = torch.device("cuda" if cuda else "cpu")
    model = load_causal_lm(Path(model_dir), torch.bfloat16, device).eval()
    if rank == 1:
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()  # the consumer must end up with the source's weights
    groups = new_sync_groups([0], [1])
    move = send_weights if rank == 0 else receive_weights
    nbytes = move(model, groups, torch.bfloat16)  # warm-up: communicator set-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        sync()
        start = time.perf_counter()
        move(model, groups, torch.bfloat16)
        sync()
        times.append(time.perf_counter() - start)
    result = {"bytes": nbytes, "times_s": times, "digest": weights_digest(model, torch.bfloat16)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def bench_weight_sync(model_dir: Path) -> dict:
    import torch.multiprocessing as mp

    from rlinf_twoworker.workers.base import free_port

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 GPUs, this machine has {torch.cuda.device_count()}"}
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port("127.0.0.1")
        mp.start_processes(
            _sync_worker, args=(str(model_dir), port, tmp, 5), nprocs=2, start_method="spawn"
        )
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    t = statistics.median(ranks[1]["times_s"])
    return {
        "path": "bucketed broadcast, GPU 0 -> GPU 1 (library send_weights/receive_weights)",
        "bytes": ranks[1]["bytes"],
        "median_s": t,
        "gb_per_s": ranks[1]["bytes"] / t / 1e9,
        "times_s": ranks[1]["times_s"],
        "weights_identical_after_sync": ranks[0]["digest"] == ranks[1]["digest"],
    }


def bench_trl(model_dir: Path, root: Path, checkpointing: bool = True) -> dict:
    """TRL's GRPOTrainer on the same workload (bench_trl.py), with its default gradient
    checkpointing or without it."""
    from rlinf_twoworker.api.demo import make_inputs

    data = make_inputs(root / "inputs").data_path
    out = root / f"trl-{'ckpt' if checkpointing else 'no-ckpt'}.json"
    script = Path(__file__).with_name("bench_trl.py")
    cmd = [sys.executable, str(script), "--model", str(model_dir), "--data", str(data)]
    if not checkpointing:
        cmd.append("--no-checkpointing")
    proc = subprocess.run(
        [*cmd, "--out", str(out), "--workdir", str(root / "trl")],
        capture_output=True,
        text=True,
        timeout=900,
        # One GPU, as a single-GPU user runs it (the Trainer would wrap the model in
        # DataParallel if it saw several).
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
    )
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line]
        return {"error": f"bench_trl.py exited {proc.returncode}", "errors": errors[-5:]}
    return json.loads(out.read_text())


# How long the preloaded cluster runs before the call: its 8 idle workers import the library
# (~10 s each, at once, on the H200 host's 16 cores) as on a cluster that was up before the job.
PRELOAD_IDLE_S = 30.0

TOPOLOGIES = {
    # name: (nodes, GPUs per node, component placement)
    "colocated": (1, 1, "{rollout:0,inference:0,actor:0,reward:0}"),
    "2gpu": (2, 1, "{rollout:0,reward:0,inference:1,actor:1}"),
}


def job_overrides(
    model_dir: Path,
    data: Path,
    root: Path,
    run_id: str,
    steps: int,
    topology: str = "colocated",
    compile_cache: Path | None = None,
) -> list[str]:
    """A benchmark job's run overrides: the topology, the model at `model_dir` for every
    component, the data file, runs under `root`/runs as `run_id`, `steps` steps and a
    checkpoint at the last, and the shared compile cache where one is given."""
    nodes, gpus, placement = TOPOLOGIES[topology]
    cache = [] if compile_cache is None else [f"runner.compile_cache_dir={compile_cache}"]
    return [
        f"cluster.num_nodes={nodes}",
        f"cluster.num_gpus_per_node={gpus}",
        f"cluster.component_placement={placement}",
        *(f"{c}.model.model_path={model_dir}" for c in ("actor", "rollout", "inference")),
        f"data.train_data_paths=[{data}]",
        f"runner.output_dir={root / 'runs'}",
        f"runner.experiment_name={run_id}",
        *cache,
        f"runner.max_steps={steps}",
        f"runner.save_interval={steps}",
    ]


def bench_grpo_step(
    model_dir: Path, root: Path, steps: int, topology: str = "colocated", extra: tuple = ()
) -> dict:
    import ray

    from rlinf_twoworker.api.demo import make_inputs
    from rlinf_twoworker.api.handle import run_grpo_two_worker
    from rlinf_twoworker.cluster.local import LocalCluster
    from rlinf_twoworker.config import load_config

    nodes, gpus, placement = TOPOLOGIES[topology]
    if torch.cuda.device_count() < nodes * gpus:
        return {"skipped": f"needs {nodes * gpus} GPUs, found {torch.cuda.device_count()}"}
    data = make_inputs(root / "inputs").data_path
    overrides = [
        *job_overrides(model_dir, data, root, f"bench-{int(time.time())}", steps, topology),
        "rollout.validate_weight=false",
        "algorithm.logprob_forward_micro_batch_size=16",
        "runner.enable_dynamic_batch_size=true",
        "runner.max_tokens_per_mbs=4096",
        *extra,
    ]
    cfg = load_config(overrides=overrides)
    t0 = time.perf_counter()
    with LocalCluster(num_nodes=nodes, gpus_per_node=gpus):
        handle = run_grpo_two_worker(cfg)
        first = ray.get(handle.step(1), timeout=900)
        startup_and_first = time.perf_counter() - t0
        results = [first] + [ray.get(handle.step(n), timeout=900) for n in range(2, steps + 1)]
        report = handle.result(timeout=900)
    later = results[1:] or results
    stages = {k: statistics.median(r.timings[k] for r in later) for k in later[0].timings}
    return {
        "topology": f"{nodes} node(s) x {gpus} GPU(s), component_placement={placement}",
        "extra_overrides": list(extra),
        "steps": steps,
        "verification_passed": report.passed,
        "verification_errors": report.errors[:5],
        "median_stage_s": stages,
        "startup_plus_first_step_s": startup_and_first,
        "first_step_s": first.timings["time/step"],
        "startup_s": startup_and_first - first.timings["time/step"],
        "metrics_last": results[-1].metrics,
    }


def _pipelining(root: Path) -> dict:
    from bench_pipeline import bench_pipeline  # benchmarks/ is the script's path

    return bench_pipeline(root / "pipelining")


TARGETS = {  # issue "time to result", one H200, the 1.5B shape
    "call_to_step1_cold_s": 60.0,
    "call_to_step1_warm_s": 25.0,
    "job_to_verification_warm_s": 35.0,
    "later_step_defaults_s": 3.0,
}


class GpuMemorySampler:
    """nvidia-smi's used memory of GPU 0 every 0.5 s in a thread: what every process holds,
    CUDA contexts included (PyTorch's own peaks leave those out)."""

    def __enter__(self) -> GpuMemorySampler:
        import threading

        self.samples: list[float] = []
        self.baseline = self._used()  # before the run: the driver, other processes
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    @staticmethod
    def _used() -> float | None:
        argv = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        if done.returncode == 0 and done.stdout.strip():
            return float(done.stdout.split()[0]) / 1024  # MiB -> GiB
        return None

    def _sample(self) -> None:
        while not self.stop.wait(0.5):
            used = self._used()
            if used is not None:
                self.samples.append(used)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)

    def peak_gib(self) -> float | None:
        return max(self.samples) if self.samples else None


def plan_vs_measured(run_dir: Path, results: list) -> list[dict]:
    """Each component process's memory plan estimate (memory_plan.json) beside its measured
    peaks over the steps (memory/<component>/<rank>/... metrics). The plan's CUDA context is
    outside PyTorch's allocator, so the estimate to compare with the reserved peak leaves it
    out."""
    plan = json.loads((run_dir / "memory_plan.json").read_text())
    rows = []
    for gpu in plan["gpus"]:
        for p in gpu["processes"]:
            key = f"memory/{p['component']}/{p['rank']}"
            allocated = max(r.metrics.get(f"{key}/gpu_peak_allocated_gib", 0.0) for r in results)
            reserved = max(r.metrics.get(f"{key}/gpu_peak_reserved_gib", 0.0) for r in results)
            in_allocator = p["estimate_gib"] - p["parts_gib"].get("cuda_context", 0.0)
            rows.append(
                {
                    "process": f"{p['component']}:{p['rank']}",
                    "estimate_gib": p["estimate_gib"],
                    "estimate_in_allocator_gib": round(in_allocator, 3),
                    "parts_gib": p["parts_gib"],
                    "measured_peak_allocated_gib": allocated,
                    "measured_peak_reserved_gib": reserved,
                    "estimate_over_reserved": round(in_allocator / reserved, 3)
                    if reserved
                    else None,
                }
            )
    return rows


def memory_table(results: dict) -> str:
    """The memory plan against the measured peaks of the startup section's warm run."""
    rows = results.get("startup", {}).get("warm", {}).get("memory_plan_vs_measured") or []
    lines = [
        "| process | plan estimate (GiB, w/o CUDA context) | measured peak reserved | allocated | estimate / reserved |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['process']} | {r['estimate_in_allocator_gib']:.2f} | "
            f"{r['measured_peak_reserved_gib']:.2f} | {r['measured_peak_allocated_gib']:.2f} | "
            f"{r['estimate_over_reserved']} |"
        )
    return "\n".join(lines)


def _tutorial_job(
    model_dir: Path,
    root: Path,
    run_id: str,
    cache: Path,
    inductor: Path,
    extra: tuple = (),
    steps: int = 2,
    preload_idle_s: float | None = None,
) -> dict:
    """The tutorial's job as a user runs it: the library's defaults, 2 steps, a checkpoint at
    the last step, colocated on this GPU; `inductor` is this "node"'s local compile cache
    (fresh: a new node), `cache` the shared one on storage; `extra` overrides, `steps` steps.
    `preload_idle_s`: on a cluster whose idle workers preload the library
    (rlinf_twoworker.preload, 8 CPUs so 8 such workers), called that long after its start."""
    import ray

    from rlinf_twoworker.api.demo import make_inputs
    from rlinf_twoworker.api.handle import run_grpo_two_worker
    from rlinf_twoworker.cluster.local import LocalCluster
    from rlinf_twoworker.config import load_config

    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        os.environ[var] = str(inductor / sub)  # inherited by the cluster's workers
    data = make_inputs(root / "inputs").data_path
    nodes, gpus, _ = TOPOLOGIES["colocated"]
    cfg = load_config(
        overrides=[
            *job_overrides(model_dir, data, root, run_id, steps, compile_cache=cache),
            *extra,
        ]
    )
    preload = preload_idle_s is not None
    cluster = LocalCluster(
        num_nodes=nodes, gpus_per_node=gpus, preload=preload, cpus_per_node=8 if preload else 4
    )
    with cluster, GpuMemorySampler() as gpu_used:
        if preload_idle_s:
            time.sleep(preload_idle_s)  # a running cluster: its idle workers have imported
        called = time.perf_counter()
        handle = run_grpo_two_worker(cfg)
        first = ray.get(handle.step(1), timeout=900)
        to_step1 = time.perf_counter() - called
        later = [ray.get(handle.step(n), timeout=900) for n in range(2, steps + 1)]
        saved = ray.get(handle.checkpoint(steps), timeout=900)
        report = handle.result(timeout=900)
        to_verification = time.perf_counter() - called
        verified_at = time.time()
    second = later[0]
    # ~21 GB of DCP files a run at this shape: the suite's runs would fill a 64 GiB disk.
    shutil.rmtree(root / "runs" / run_id / "checkpoints", ignore_errors=True)
    main_log = (root / "runs" / run_id / "log" / "main.log").read_text()
    return {
        "overrides": list(extra),
        "preloaded_cluster_idle_s": preload_idle_s,
        "steps_s": [r.timings["time/step"] for r in [first, *later]],
        "median_later_step_s": statistics.median(
            r.timings["time/step"] for r in later[1:] or later
        ),
        "offload_s": [r.timings.get("time/actor/offload") for r in [first, *later]],
        "per_step_gpu_memory_gib": [
            {
                k.removeprefix("memory/"): round(v, 2)
                for k, v in r.metrics.items()
                if k.startswith("memory/") and "gpu_" in k
            }
            for r in [first, *later]
        ],
        "response_length_max": [
            r.metrics.get("rollout/response_length_max") for r in [first, *later]
        ],
        # The job's tail: the last step's end to its checkpoint on storage, then to the report.
        "checkpoint_s": saved.finished_at - later[-1].finished_at,
        "checkpoint_to_verification_s": verified_at - saved.finished_at,
        "memory_plan_lines": [
            line.split("MEMORY_PLAN", 1)[1].strip()
            for line in main_log.splitlines()
            if "MEMORY_PLAN" in line
        ],
        "call_to_step1_s": to_step1,
        "job_to_verification_s": to_verification,
        "startup_phases_s": first.startup,
        "step1_stages_s": first.timings,
        "step2_s": second.timings["time/step"],
        "step2_stages_s": second.timings,
        # The actor stage's rate inside the real step (answer tokens only; prompts are short).
        "actor_answer_tokens_per_s_step2": (
            second.metrics["rollout/response_length"]
            * cfg.data.rollout_batch_size
            * cfg.algorithm.group_size
            / second.timings["time/actor/training"]
        ),
        # On-policy check at the 1.5B shape: actor vs inference log-probs, first minibatch.
        "logprob_diff_max": [
            r.metrics.get("actor/training/actor/logprob_diff_max") for r in (first, second)
        ],
        "verification_passed": report.passed,
        "verification_errors": report.errors[:5],
        "memory_plan_vs_measured": plan_vs_measured(root / "runs" / run_id, [first, *later]),
        "gpu_used_peak_gib_nvidia_smi": gpu_used.peak_gib(),
        "gpu_used_before_run_gib_nvidia_smi": gpu_used.baseline,
        "checkpoint_write_lines": [
            line.split("CHECKPOINT_WRITE", 1)[1].strip()
            for line in main_log.splitlines()
            if "CHECKPOINT_WRITE" in line
        ],
        "compile_cache_lines": [
            line.split("COMPILE_CACHE", 1)[1].strip()
            for line in main_log.splitlines()
            if "COMPILE_CACHE" in line
        ],
    }


NO_WARM_UP = ("runner.compile_warm_up=false",)
STARTUP_RUNS = {
    # name: (compile cache: "a" filled by cold, "b" filled by cold_no_warm_up;
    #        the preloading cluster's idle seconds before the call, None: no preload; extra)
    "cold": ("a", None, ()),
    "warm": ("a", None, ()),
    "warm_again": ("a", None, ()),
    "warm_preload_at_call": ("a", 0.0, ()),
    "warm_preloaded": ("a", PRELOAD_IDLE_S, ()),
    "cold_no_warm_up": ("b", None, NO_WARM_UP),
    "warm_no_warm_up": ("a", None, NO_WARM_UP),
    "warm_preloaded_no_warm_up": ("a", PRELOAD_IDLE_S, NO_WARM_UP),
}
"""The startup section's runs. Each runs on a fresh local compile cache (its own node
directory) and a cluster started for it; the shared cache "a" is empty for `cold` and filled
by it, "b" likewise for `cold_no_warm_up`. warm_again: `warm` once more (two samples of the
plain cluster's figures on one host). warm_preload_at_call: the cluster preloads the
library and is called as soon as it is up, so its idle workers import while the run
connects, places and runs its preflight; warm_preloaded: called
PRELOAD_IDLE_S after its start, as a cluster that was up before the job. The *_no_warm_up runs
turn runner.compile_warm_up off: the same job with step 1 compiling stage by stage, for the
warm-up's effect."""


def bench_startup(
    model_dir: Path, root: Path, runs: tuple[str, ...] = ("cold", "warm", "warm_preloaded")
) -> dict:
    """Time to result: the tutorial's job with an empty shared compile cache (cold), then with
    the one the first run filled (warm), then warm on a cluster whose idle workers preloaded
    the library; `runs` picks from STARTUP_RUNS, in that order (cold always runs first: it
    fills the cache the warm runs read)."""
    unknown = set(runs) - set(STARTUP_RUNS)
    if unknown:
        raise SystemExit(f"--startup-runs: unknown {sorted(unknown)}; known {list(STARTUP_RUNS)}")
    stamp = int(time.time())
    out: dict = {"targets": TARGETS}
    for name in ["cold", *[r for r in STARTUP_RUNS if r in runs and r != "cold"]]:
        cache, idle_s, extra = STARTUP_RUNS[name]
        out[name] = _tutorial_job(
            model_dir,
            root,
            f"startup-{name.replace('_', '-')}-{stamp}",
            root / f"compile-cache-{cache}-{stamp}",
            root / f"node-{name}-{stamp}",
            extra,
            preload_idle_s=idle_s,
        )
    return out


def step1_table(results: dict) -> str:
    """Step 1 of every startup run, stage by stage, with the compile warm-up's seconds: where
    the first step's extra time goes, with and without the warm-up."""
    lines = [
        "| run | call to step 1 | step 1 | rollout | inference | actor | warm-up by component "
        "| step 2 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in STARTUP_RUNS:
        run = results.get("startup", {}).get(name)
        if not run:
            continue
        stages, phases = run["step1_stages_s"], run["startup_phases_s"]
        warm = [  # each component's warm-up, named: inference:0 2.4 / actor:0 3.2
            f"{k.removeprefix('warm_up/')} {v:.1f}"
            for k, v in sorted(phases.items())
            if k.startswith("warm_up/")
        ]
        lines.append(
            f"| {name} | {run['call_to_step1_s']:.1f} | {stages['time/step']:.1f} "
            f"| {stages['time/rollout']:.1f} | {stages['time/inference']:.1f} "
            f"| {stages['time/actor/training']:.1f} | {' / '.join(warm) or '-'} "
            f"| {run['step2_s']:.2f} |"
        )
    return "\n".join(lines)


def bench_memory(model_dir: Path, root: Path, steps: int = 5, only: tuple[str, ...] = ()) -> dict:
    """Fit a 40 GB card: the tutorial's job colocated on this GPU with the defaults, then with
    cluster.max_gpu_memory_gb=40 (the plan turns on what it needs: activation recompute, the
    actor's offload and the copies' memory given back), both on one warm compile cache; the
    nvidia-smi peak of each and the step time with and without the savings."""
    stamp = int(time.time())
    cache = root / f"compile-cache-mem-{stamp}"
    node = root / f"node-mem-{stamp}"
    runs = {}
    budget = "cluster.max_gpu_memory_gb=40"
    for name, extra, n in (
        ("defaults", (), steps),
        ("budget_40gb", (budget,), steps),
    ):
        if only and name not in only:
            continue
        try:
            runs[name] = _tutorial_job(
                model_dir, root, f"memory-{name}-{stamp}", cache, node, extra, n
            )
        except Exception as exc:  # keep the other run's figures
            runs[name] = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
        print(f"[memory/{name}] {json.dumps(runs[name], default=str)[:2500]}", flush=True)
    return {"runs": runs, "steps": steps}


def memory_budget_table(results: dict) -> str:
    runs = results.get("memory", {}).get("runs", {})
    lines = [
        "| run | nvidia-smi peak (GiB) | median step 3-5 (s) | offload a step (s) | plan |",
        "|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        plan_lines = r.get("memory_plan_lines", [])
        plan = next((x for x in plan_lines if x.startswith("node ") and "rank 0" in x), "")
        offload = [x for x in r.get("offload_s", []) if x is not None]
        peak = r.get("gpu_used_peak_gib_nvidia_smi")
        lines.append(
            f"| {name} | {'-' if peak is None else f'{peak:.1f}'} | "
            f"{r.get('median_later_step_s', float('nan')):.2f} | "
            f"{f'{statistics.median(offload):.2f}' if offload else '-'} | {plan} |"
        )
    return "\n".join(lines)


def _trl_cells(trl: dict) -> dict[str, float | None]:
    """A TRL run's figures in the table's rows: from its process's start (imports included) to
    its first and second step, and its later steps."""
    return {
        "call_to_step1_cold_s": trl.get("process_to_step1_s"),
        "job_to_verification_warm_s": trl.get("process_to_step2_s"),
        "later_step_defaults_s": trl.get("median_step_s"),
    }


def time_to_result_table(results: dict) -> str:
    """One table: this run against the targets and TRL, with and without its gradient
    checkpointing (when those sections ran)."""
    startup = results.get("startup", {})
    cold = startup.get("cold", {})
    warm_runs = [  # (run, how its cluster was started) for the warm rows
        ("warm", "cluster started with the call"),
        ("warm_again", "cluster started with the call, again"),
        ("warm_preload_at_call", "preloading cluster started with the call"),
        ("warm_preloaded", "preloaded cluster (up 30 s before the call)"),
    ]
    rows = [("call to step 1, cold cache", cold.get("call_to_step1_s"), "call_to_step1_cold_s")]
    for key, label, target in (
        ("call_to_step1_s", "call to step 1, warm cache", "call_to_step1_warm_s"),
        ("job_to_verification_s", "2-step job to verification, warm", "job_to_verification_warm_s"),
    ):
        for name, how in warm_runs:
            if name in startup:
                rows.append((f"{label}, {how}", startup[name].get(key), target))
    later = next(
        (startup[n]["step2_s"] for n, _ in warm_runs if "step2_s" in startup.get(n, {})), None
    )
    rows.append(("later step, defaults", later, "later_step_defaults_s"))
    trl = _trl_cells(results.get("trl", {}))
    trl_bare = _trl_cells(results.get("trl_no_ckpt", {}))

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [
        "| measured | this run (s) | target (s) | TRL, grad. checkpointing (s) | TRL, without (s) |",
        "|---|---|---|---|---|",
    ]
    for label, value, key in rows:
        lines.append(
            f"| {label} | {cell(value)} | <= {TARGETS[key]:g} | {cell(trl.get(key))} "
            f"| {cell(trl_bare.get(key))} |"
        )
    return "\n".join(lines)


def _qwen3() -> dict:
    """The Qwen3-0.6B shape on the static engine: greedy tokens against generate's (fp32) and
    decode tokens/s against generate (bf16); probe_qwen3.py is the same as a script."""
    from probe_qwen3 import exactness, speed  # benchmarks/ is the script's path

    return {"exactness": exactness(), "speed": speed()}


def _scaling(model_dir: Path, args: argparse.Namespace) -> dict:
    from bench_scaling import bench_scaling, scaling_table  # benchmarks/ is the script's path

    out = bench_scaling(
        model_dir,
        args.scaling_cases,
        args.scaling_budget_s,
        args.scaling_case_limit_s,
        args.scaling_max_batch,
    )
    out["table"] = scaling_table(out)
    print(out["table"], flush=True)
    return out


def _scale(
    model_dir: Path, root: Path, args: argparse.Namespace, results: dict, key: tuple[str, str, str]
) -> dict:
    from bench_scale import bench_scale, scale_table  # benchmarks/ is the script's path

    nodes, gpus, _ = TOPOLOGIES[args.scale_topology]
    if torch.cuda.device_count() < nodes * gpus:
        return {
            "skipped": f"--scale-topology {args.scale_topology} needs {nodes * gpus} GPUs, "
            f"found {torch.cuda.device_count()}"
        }

    def save(section: dict) -> None:  # each case's figures on disk as soon as it ends
        results["scale"] = section
        write_result(*key, results, args.out)

    out = bench_scale(
        model_dir,
        root,
        args.scale_cases,
        args.scale_steps,
        args.scale_endurance_steps,
        args.scale_case_limit_s,
        results["bf16_matmul_tflops"],
        tuple(args.scale_override),
        save,
        args.scale_cold,
        args.scale_topology,
    )
    out["table"] = scale_table({"scale": out})
    print(out["table"], flush=True)
    return out


def result_key(args: argparse.Namespace) -> tuple[str, str]:
    """The results file's section and configuration (record.result_name): a lone section that
    `python -m benchmarks` names is its own section, configured by its options; any other list
    of sections is the `gpu` section, configured by that list."""
    sections = args.sections.split(",")
    if sections[0] == "startup":
        return "startup", "+".join([*args.startup_runs.split(","), *sections[1:]])
    if sections == ["scale"]:
        from bench_scale import parse_cases  # benchmarks/ is the script's path

        topology = "" if args.scale_topology == "colocated" else f"-{args.scale_topology}"
        return "scale", "+".join(parse_cases(args.scale_cases)) + topology
    if sections == ["memory"]:
        return "memory", args.memory_runs or "all"
    if sections == ["scaling"]:
        return "scaling", args.scaling_cases
    if sections in (["qwen3"], ["pipelining"]):
        return sections[0].replace("pipelining", "pipeline"), "default"
    return "gpu", "+".join(sections)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out",
        default=None,
        help="the results file (default: benchmarks/results/<section>-<configuration>-"
        "<hardware>.json, record.py's name; a newer run of the configuration replaces it)",
    )
    parser.add_argument("--root", default="/tmp/rlinf-bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--sections",
        default="rollout,inference,actor,weight_sync,grpo_step,grpo_step_2gpu,trl,trl_no_ckpt",
    )
    parser.add_argument(
        "--scaling-cases", default="all", help="PROMPTSxSEQ,... (e.g. 128x8192,8x1024) or all"
    )
    parser.add_argument(
        "--memory-runs", default="", help="the memory section's runs (defaults,budget_40gb); all"
    )
    parser.add_argument(
        "--startup-runs",
        default="cold,warm,warm_preloaded",
        help=f"the startup section's runs, of {','.join(STARTUP_RUNS)}",
    )
    parser.add_argument("--scaling-budget-s", type=float, default=360.0)
    parser.add_argument("--scaling-case-limit-s", type=float, default=150.0)
    parser.add_argument("--scaling-max-batch", type=int, default=256)
    parser.add_argument(
        "--scale-cases",
        default="all",
        help="the scale section's cases: PROMPTSxGROUP@SEQ, memory40, tutorial, comma-separated "
        "(default all: 32x8@2048,64x8@2048,8x8@8192,memory40,tutorial)",
    )
    parser.add_argument(
        "--scale-steps", type=int, default=3, help="steps of each scale case (default 3)"
    )
    parser.add_argument(
        "--scale-endurance-steps",
        type=int,
        default=0,
        help="N > 0: the 32x8@2048 case runs N steps and reports each process's host RSS and "
        "GPU memory after each step, and whether they grew after step 3 (default 0: off)",
    )
    parser.add_argument(
        "--scale-case-limit-s",
        type=float,
        default=None,
        help="time limit of each scale case, start-up to verification (default 300 + 150 per step)",
    )
    parser.add_argument(
        "--scale-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for every scale case (repeatable), e.g. runner.micro_batch_tokens=16384",
    )
    parser.add_argument(
        "--scale-cold",
        action="store_true",
        help="every scale case compiles on empty Inductor, Triton and compile caches of its own "
        "(step 1 then compares across cases and calls; default: the caches are shared)",
    )
    parser.add_argument(
        "--scale-topology",
        choices=sorted(TOPOLOGIES),
        default="colocated",
        help="the scale cases' nodes and GPUs (TOPOLOGIES): colocated, every component on one "
        "GPU (default); 2gpu, 2 nodes x 1 GPU, the rollout and reward on one, inference and the "
        "actor on the other, the stages pipelined",
    )
    args = parser.parse_args(argv)
    if args.scale_steps < 1:
        parser.error("--scale-steps must be >= 1")
    if args.scale_endurance_steps < 0:
        parser.error("--scale-endurance-steps must be >= 0")
    if "scale" in args.sections.split(","):  # a bad case name fails now, not after the set-up
        from bench_scale import parse_cases  # benchmarks/ is the script's path

        try:
            parse_cases(args.scale_cases)
        except SystemExit as exc:
            parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import transformers

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    command = sys.argv if argv is None else ["bench_gpu.py", *argv]
    section, configuration = result_key(args)
    hardware = hardware_tag(
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    )
    results: dict = {
        **provenance(command),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    results["bf16_matmul_tflops"] = matmul_tflops()
    torch.cuda.empty_cache()  # its matrices' blocks, cached in this driver process
    model_dir = make_model_dir(root)
    sections = {
        "rollout": lambda: bench_rollout(model_dir, args.quick),
        "inference": lambda: bench_inference(model_dir),
        "actor": lambda: bench_actor(model_dir, results["bf16_matmul_tflops"], args.quick),
        "weight_sync": lambda: bench_weight_sync(model_dir),
        "grpo_step": lambda: bench_grpo_step(model_dir, root, 3),
        "grpo_step_2gpu": lambda: bench_grpo_step(model_dir, root, 3, "2gpu"),
        "grpo_step_trim": lambda: bench_grpo_step(
            model_dir, root, 3, extra=("runner.trim_padding_multiple=128",)
        ),
        "trl": lambda: bench_trl(model_dir, root),
        "trl_no_ckpt": lambda: bench_trl(model_dir, root, checkpointing=False),
        "startup": lambda: bench_startup(model_dir, root, tuple(args.startup_runs.split(","))),
        "memory": lambda: bench_memory(
            model_dir, root, only=tuple(filter(None, args.memory_runs.split(",")))
        ),
        "scaling": lambda: _scaling(model_dir, args),
        "scale": lambda: _scale(model_dir, root, args, results, (section, configuration, hardware)),
        "pipelining": lambda: _pipelining(root),
        "qwen3": _qwen3,
    }
    for name in args.sections.split(","):
        start = time.perf_counter()
        try:
            results[name] = sections[name]()
        except Exception as exc:
            results[name] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-3000:],
            }
        results[name]["section_s"] = time.perf_counter() - start
        gc.collect()  # FSDP modules hold reference cycles: free each section's GPU memory
        torch.cuda.empty_cache()
        out = write_result(section, configuration, hardware, results, args.out, command)
        print(f"[{name}] {json.dumps(results[name], default=str)[:1500]}", flush=True)
    print(json.dumps(results, indent=2, default=str))
    print(f"results: {out}")
    if "startup" in results:
        print(time_to_result_table(results))
        print(step1_table(results))
    if "memory" in results:
        print(memory_budget_table(results))
    if "table" in results.get("scaling", {}):
        print(results["scaling"]["table"])
        print(memory_table(results))
    if "cases" in results.get("scale", {}):
        from bench_scale import scale_table  # benchmarks/ is the script's path

        print(scale_table(results))


if __name__ == "__main__":
    sys.exit(main())

"""Pipelined vs sequential GRPO steps on two one-GPU Ray nodes, with answers of varied length.

    python -m benchmarks pipeline [--out pipeline.json] [--steps 5] [--mean-answer 200]
    python benchmarks/bench_gpu.py --sections pipelining          # the same, as a section

Topology: a LocalCluster of 2 nodes x 1 GPU, `component_placement={rollout:0, reward:0,
inference:1, actor:1}`: rollout and reward on node 0's GPU, inference and the actor on node
1's. The rollout shares no GPU with the actor, so `runner.pipeline=auto` pipelines it. Three
runs of `run_grpo_two_worker` in one cluster (the later ones find the first's compile cache):
  pipelined             runner.pipeline=auto (runner.rollout_chunks: its default, or --chunks)
  sequential_same_plan  runner.pipeline=sequential with the same rollout_chunks: the same
                        update (same seeds, same minibatches); only the schedule differs
  sequential_default    runner.pipeline=sequential as it comes: one rollout call a step
The median step time is over steps 2..N (step 1 compiles).

The model: the DeepSeek-R1-Distill-Qwen-1.5B shape (shapes.QWEN_1P5B) with random weights,
whose EOS fires at varied lengths. Random weights alone never pick EOS among 151,936 near-equal
logits, so the model gets a bias on the EOS logit (`add_eos_bias`): residual coordinate 0 is a
constant 1 in every embedding that no layer reads or writes, so after the final norm it is
about the same at every position, and only lm_head's EOS row reads it. Its weight is calibrated
on the GPU (`calibrate_eos_bias`: a forward over random prompts, the log partition sum of the
other tokens' logits) for P(EOS) of about 1 / mean_answer a token: answer lengths are roughly
geometric around that mean (a CPU check of a small shape at 60 gave 16..254 tokens, mean 93),
cut at max_new_tokens (768 in the starting config). Each run reports its steps'
`rollout/response_length` (mean) and `rollout/response_length_max`.

Target (issue 15): the pipelined median step <= 0.8 x the sequential one (`target_met` is
judged against sequential_default, what a user gets otherwise).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

PLACEMENT = "{rollout:0,reward:0,inference:1,actor:1}"
TARGET_RATIO = 0.8
EOS_AXIS = 0
"""The residual-stream coordinate that carries the EOS bias."""


def add_eos_bias(model, eos_id: int) -> None:
    """Make residual coordinate EOS_AXIS a constant 1 that no layer reads or writes: every
    embedding is 1 there; every projection that reads the stream (q/k/v, gate/up) ignores it and
    every projection that writes it (o, down) leaves it alone. After the final norm it is
    1 / rms of the stream, the same at every position up to a few percent, and lm_head reads it
    for EOS alone (calibrate_eos_bias sets how strongly). The rest is the random model."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, EOS_AXIS] = 1.0
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for reads in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                reads.weight[:, EOS_AXIS] = 0.0
            for writes in (attn.o_proj, mlp.down_proj):
                writes.weight[EOS_AXIS, :] = 0.0
        model.lm_head.weight[:, EOS_AXIS] = 0.0


def calibrate_eos_bias(model, eos_id: int, mean_answer: float, prompts: int = 8) -> dict:
    """Set lm_head's EOS weight on EOS_AXIS so that P(EOS) is about 1 / mean_answer at every
    token (a forward over random prompts: the log partition sum of the other tokens' logits);
    returns what was measured. After add_eos_bias."""
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (prompts, 256), generator=gen).to(device)
    head = model.lm_head.weight
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state  # after the final norm
        h = hidden[..., EOS_AXIS].float()
        logits = model.lm_head(hidden).float()
        others = logits.clone()
        others[..., eos_id] = -math.inf
        # P(EOS) = 1 / mean  <=>  EOS logit = log(sum of the others' exp) - log(mean - 1)
        wanted = torch.logsumexp(others, -1) - math.log(max(mean_answer - 1.0, 1.0))
        head[eos_id, EOS_AXIS] = float(((wanted - logits[..., eos_id]) / h).mean())
        p_eos = torch.softmax(model.lm_head(hidden).float(), -1)[..., eos_id]
    return {
        "hidden_axis_mean": float(h.mean()),
        "hidden_axis_rel_std": float(h.std() / h.mean()),
        "eos_weight": float(head[eos_id, EOS_AXIS]),
        "p_eos_mean": float(p_eos.mean()),
        "p_eos_p10_p90": [float(p_eos.quantile(0.1)), float(p_eos.quantile(0.9))],
        "expected_mean_answer": float(1.0 / p_eos.mean()),
    }


def make_varied_length_model(
    root: Path, mean_answer: float, shape: dict | None = None, device: str = "cuda"
) -> tuple[Path, dict]:
    """The 1.5B shape (or `shape`), random weights, the EOS bias calibrated on `device`; saved
    once per mean_answer under root."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlinf_twoworker.api.demo import build_tokenizer
    from rlinf_twoworker.storage.manifest import write_manifest

    if shape is None:
        from shapes import QWEN_1P5B as shape  # benchmarks/ is the script's path
    path = root / f"qwen2-h{shape['hidden_size']}-eos{int(mean_answer)}"
    info_file = path / "eos_calibration.json"
    if (path / "SHA256SUMS").exists() and info_file.exists():
        return path, json.loads(info_file.read_text())
    tokenizer = build_tokenizer()
    cfg = Qwen2Config(
        **shape,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32)
    add_eos_bias(model, tokenizer.eos_token_id)
    info = calibrate_eos_bias(model, tokenizer.eos_token_id, mean_answer)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    info_file.write_text(json.dumps(info, indent=2))
    write_manifest(path)
    return path, info


def _overrides(model: Path, data: Path, root: Path, run_id: str, steps: int) -> list[str]:
    """bench_gpu's GRPO-step settings (the starting config, dynamic micro-batches) on 2 x 1."""
    return [
        "cluster.num_nodes=2",
        "cluster.num_gpus_per_node=1",
        f"cluster.component_placement={PLACEMENT}",
        f"actor.model.model_path={model}",
        f"rollout.model.model_path={model}",
        f"inference.model.model_path={model}",
        f"data.train_data_paths=[{data}]",
        f"runner.output_dir={root / 'runs'}",
        f"runner.experiment_name={run_id}",
        f"runner.max_steps={steps}",
        "runner.save_interval=-1",
        "rollout.validate_weight=false",
        "algorithm.logprob_forward_micro_batch_size=16",
        "runner.enable_dynamic_batch_size=true",
        "runner.max_tokens_per_mbs=4096",
    ]


def _summary(results: list) -> dict:
    """Medians over steps 2..N (step 1 compiles) of every timing, and the answer lengths."""
    later = results[1:] or results
    timings = {k: statistics.median(r.timings[k] for r in later) for k in later[0].timings}
    return {
        "median_step_s": timings["time/step"],
        "median_timings_s": timings,
        "step_s": [r.timings["time/step"] for r in results],
        "response_length_mean": [r.metrics["rollout/response_length"] for r in results],
        "response_length_max": [r.metrics["rollout/response_length_max"] for r in results],
        "final_loss": [r.metrics["actor/training/actor/final_loss"] for r in results],
        "rollout_chunks": results[0].metrics["pipeline/rollout_chunks"],
        "pipelined": results[0].metrics["pipeline/pipelined"],
    }


def bench_pipeline(
    root: Path, steps: int = 5, mean_answer: float = 200.0, chunks: int | None = None
) -> dict:
    """`steps` GRPO steps pipelined, then sequentially with the same plan, then sequentially
    with its default of one rollout call, on 2 one-GPU nodes: the median step times and the
    ratios. Needs 2 GPUs."""
    import ray

    from rlinf_twoworker.api.demo import make_inputs
    from rlinf_twoworker.api.handle import run_grpo_two_worker
    from rlinf_twoworker.cluster.local import LocalCluster
    from rlinf_twoworker.config import load_config, to_typed

    if torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 GPUs, found {torch.cuda.device_count()}"}
    root.mkdir(parents=True, exist_ok=True)
    model, calibration = make_varied_length_model(root, mean_answer)
    data = make_inputs(root / "inputs").data_path
    stamp = int(time.time())
    base = _overrides(model, data, root, f"pipe-{stamp}", steps)
    if chunks is None:  # the pipelined default's plan
        chunks = to_typed(load_config(overrides=base)).rollout_chunks
    runs = {
        "pipelined": ["runner.pipeline=auto", f"runner.rollout_chunks={chunks}"],
        # The same plan (chunks, seeds, minibatches): the same update, only the schedule differs.
        "sequential_same_plan": ["runner.pipeline=sequential", f"runner.rollout_chunks={chunks}"],
        # What runner.pipeline=sequential gives by default: one rollout call for the step.
        "sequential_default": ["runner.pipeline=sequential"],
    }
    out: dict = {"placement": PLACEMENT, "eos_calibration": calibration, "steps": steps}
    with LocalCluster(num_nodes=2, gpus_per_node=1):
        for name, settings in runs.items():
            run_id = f"runner.experiment_name=pipe-{name.replace('_', '-')}-{stamp}"
            handle = run_grpo_two_worker(load_config(overrides=[*base, run_id, *settings]))
            results = [ray.get(handle.step(n), timeout=900) for n in range(1, steps + 1)]
            report = handle.result(timeout=900)
            out[name] = {**_summary(results), "verification_passed": report.passed}
    piped = out["pipelined"]["median_step_s"]
    for name in ("sequential_same_plan", "sequential_default"):
        out[f"ratio_to_{name}"] = piped / out[name]["median_step_s"]
    # The target is against what a user gets otherwise: the sequential default.
    out.update(
        target_ratio=TARGET_RATIO, target_met=out["ratio_to_sequential_default"] <= TARGET_RATIO
    )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=None, help="default: benchmarks/results/pipeline-<config>-<hardware>.json"
    )
    parser.add_argument("--root", default="/tmp/rlinf-bench")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mean-answer", type=float, default=200.0)
    parser.add_argument("--chunks", type=int, default=None, help="runner.rollout_chunks")
    args = parser.parse_args(argv)
    from record import write_result  # benchmarks/ is the script's path

    out = bench_pipeline(Path(args.root), args.steps, args.mean_answer, args.chunks)
    configuration = f"answer{args.mean_answer:g}" + (f"-chunks{args.chunks}" if args.chunks else "")
    if args.mean_answer == 200.0 and args.chunks is None:
        configuration = "default"  # as bench_gpu.py's pipelining section names it
    path = write_result("pipeline", configuration, None, out, args.out)
    print(json.dumps(out, indent=2, default=str))
    print(f"results: {path}")


if __name__ == "__main__":
    sys.exit(main())

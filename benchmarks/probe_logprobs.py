"""The log-softmax kernel at the engine's micro-batch sizes: eager vs the compiled one.

python benchmarks/probe_logprobs.py [MODEL_DIR]     (default: bench_gpu.py's 1.5B-shape model)

Inference (no grad) at 1, 4 and 16 rows of 1024 tokens (768 answer tokens), each compiled
measurement in a fresh torch.compile state; then the actor's forward+backward through
`response_logprobs` and the PPO loss at 1 and 4 rows, compiled decoder layers, head eager / fused.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
from pathlib import Path

import torch


def main(model_dir: str | None) -> None:
    from bench_gpu import fsdp_model, make_model_dir, timed

    from rlinf_twoworker.algorithm import PolicyLoss, loss_weights, ppo_loss
    from rlinf_twoworker.engines.models import SequenceBatch, load_causal_lm, response_logprobs

    def batch(rows: int) -> SequenceBatch:
        ids = torch.randint(100, 150000, (rows, 1024), device="cuda")
        mask = torch.ones_like(ids)
        mask[:, :200] = 0  # left prompt padding, as the rollout writes it
        return SequenceBatch(ids, mask, torch.ones(rows, 768, device="cuda", dtype=torch.long), 256)

    out: dict = {"inference_tokens_per_s": {}, "actor_tokens_per_s": {}}

    def record(table: str, rows: int, fused: bool, run) -> None:
        run()  # two warm-up calls: compilation, then autotuned kernels
        run()
        t = statistics.median(timed(run, 7))
        out[table][f"rows{rows}_{'fused' if fused else 'eager'}"] = rows * 1024 / t

    model_dir = model_dir or str(make_model_dir(Path("/tmp/rlinf-bench")))
    model = load_causal_lm(Path(model_dir), torch.bfloat16, torch.device("cuda")).eval()
    for rows in (1, 4, 16):
        data = batch(rows)
        for fused in (False, True):
            torch._dynamo.reset()
            run = torch.no_grad()(functools.partial(response_logprobs, model, data, 0, fused))
            record("inference_tokens_per_s", rows, fused, run)
        print(json.dumps(out["inference_tokens_per_s"]), flush=True)
    del model
    torch.cuda.empty_cache()

    model = fsdp_model(Path(model_dir), activation_checkpointing=False, compiled=True)
    for rows in (1, 4):
        data = batch(rows)
        adv = torch.ones(rows, device="cuda")
        for fused in (False, True):

            def step(data=data, adv=adv, fused=fused) -> None:
                lp = response_logprobs(model, data, 0, fused)
                w = loss_weights(data.response_mask, [[slice(0, len(data))]], "token-mean")
                loss, _ = ppo_loss(lp, lp.detach(), adv, w, w, PolicyLoss())
                loss.backward()

            record("actor_tokens_per_s", rows, fused, step)
        print(json.dumps(out["actor_tokens_per_s"]), flush=True)
    print("RESULT=" + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)

"""Where the actor's time goes: one FSDP2 rank, fwd+bwd of the engine's micro-batches.

python benchmarks/probe_actor.py MODEL_DIR
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch


def main(model_dir: str) -> None:
    from bench_gpu import fsdp_model

    from rlinf_twoworker.algorithm import PolicyLoss, loss_weights, ppo_loss
    from rlinf_twoworker.engines.models import SequenceBatch, response_logprobs

    model = fsdp_model(Path(model_dir), activation_checkpointing=False, compiled=True)

    def run(rows: int, with_mask: bool, engine_loss: bool) -> float:
        ids = torch.randint(100, 150000, (rows, 1024), device="cuda")
        mask = torch.ones_like(ids)
        mask[:, :200] = 0  # left padding, as the rollout writes it
        batch = SequenceBatch(
            ids,
            mask if with_mask else torch.ones_like(ids),
            torch.ones(rows, 768, dtype=torch.long, device="cuda"),
            256,
        )

        def step() -> None:
            if engine_loss:
                lp = response_logprobs(model, batch, fused=True)
                w = loss_weights(batch.response_mask, [[slice(0, rows)]], "token-mean")
                adv = torch.ones(rows, device="cuda")
                loss, _ = ppo_loss(lp, lp.detach(), adv, w, w, PolicyLoss())
            else:
                loss = model(input_ids=ids).logits.float().mean()
            loss.backward()

        step()
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    for rows, with_mask, engine_loss in [
        (1, False, False),
        (1, True, False),
        (1, False, True),
        (1, True, True),
        (4, True, True),
    ]:
        t = run(rows, with_mask, engine_loss)
        print(
            f"rows={rows} mask={with_mask} engine_loss={engine_loss}: {t * 1000:.1f} ms "
            f"({rows * 1024 / t:.0f} tokens/s)",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1])

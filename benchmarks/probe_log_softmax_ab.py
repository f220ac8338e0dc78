"""A/B of algorithm.token_logprobs' forward and backward on a GPU: an older algorithm.py (its
path the one argument; 85644c5's differentiated a compiled kernel with autograd) against this
checkout's (its own backward). Time (median of 5 after 2 warm-ups), the peak allocated above
the logits per (token, vocabulary entry), and the largest differences of the values and the
gradient. benchmarks/results/log_softmax-ab-h100.txt.

    git show 85644c5:rlinf_twoworker/algorithm.py > /tmp/algorithm_old.py
    python benchmarks/probe_log_softmax_ab.py /tmp/algorithm_old.py
"""

import importlib.util
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from rlinf_twoworker import algorithm as new  # noqa: E402

spec = importlib.util.spec_from_file_location("algo_old", sys.argv[1])
assert spec is not None and spec.loader is not None, sys.argv[1]
old = importlib.util.module_from_spec(spec)
sys.modules["algo_old"] = old
spec.loader.exec_module(old)
V = 151936


def measure(mod, logits: torch.Tensor, labels: torch.Tensor) -> dict:
    """Median ms of a forward and backward, and the peak allocated above the logits per entry."""

    def step() -> None:
        lp, ent = mod.token_logprobs(
            logits, labels, fused=True, temperature=0.9, with_entropy=True, many_shapes=True
        )
        (lp.sum() + 0.01 * ent.sum()).backward()
        logits.grad = None

    base = torch.cuda.memory_allocated()
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base
    return {
        "ms": round(statistics.median(times) * 1e3, 2),
        "peak_over_logits_bytes_per_entry": round(peak / logits.numel(), 3),
    }


def values_and_grad(mod, logits: torch.Tensor, labels: torch.Tensor):
    lp, ent = mod.token_logprobs(logits, labels, fused=True, temperature=0.9, with_entropy=True)
    (grad,) = torch.autograd.grad(lp.sum() + 0.01 * ent.sum(), logits)
    return lp.detach(), ent.detach(), grad.float()


for rows, width in [(2, 2048), (4, 2048), (1, 8192), (3, 8192)]:
    torch.manual_seed(0)
    logits = (torch.randn(rows, width, V, device="cuda") * 2).bfloat16().requires_grad_(True)
    labels = torch.randint(0, V, (rows, width), device="cuda")
    res: dict = {"old": measure(old, logits, labels), "new": measure(new, logits, labels)}
    lp_o, en_o, g_o = values_and_grad(old, logits, labels)
    lp_n, en_n, g_n = values_and_grad(new, logits, labels)
    res["max_abs_diff_logprobs"] = float((lp_o - lp_n).abs().max())
    res["max_abs_diff_entropy"] = float((en_o - en_n).abs().max())
    res["max_abs_diff_grad"] = float((g_o - g_n).abs().max())
    res["grad_max"] = float(g_o.abs().max())
    print(f"{rows}x{width}", json.dumps(res), flush=True)
    del logits, labels, lp_o, en_o, g_o, lp_n, en_n, g_n
    torch.cuda.empty_cache()

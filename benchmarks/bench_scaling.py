"""bench_gpu.py's `scaling` section: the rollout's cost as the work grows (issue 15, item 3).

    python benchmarks/bench_gpu.py --sections scaling [--scaling-cases 128x8192,8x1024]

For 8, 32 and 128 prompts x 8 answers at runner.seq_length 1024, 4096 and 8192 (prompts of 256
tokens, the rest answer budget), on one GPU, the 1.5B shape (random bf16 weights) through the
static engine: rollout seconds, generated tokens/s, decode slots, peak memory (PyTorch's
allocated and reserved). Two modes: `continuous`, the library's default (at most
rollout.max_batch_size slots, fewer where memory is short, a slot refilled as its answer ends),
and `static`, one batch with a slot per row, decoded until its longest answer ends ("does not
fit" where those slots exceed the free memory; the same run as continuous where that one has a
slot per row already).

Answers of varied length: a random model's next-token distribution is nearly flat (its logits'
standard deviation is about 0.8 over 151936 tokens), so with one token id in MEAN_ANSWER declared
an EOS, each sampled token ends its answer with probability about 1 / MEAN_ANSWER: lengths are
close to geometric with that mean, capped by the answer budget (the longest of 1024 answers is
about 7.5 times the mean). The measured mean and longest are reported.

Time: each (case, mode) first warms up (kernels compiled, graph captured), then times a prefill
and 16 decode steps of its shape; the full run is predicted from those and the expected lengths
and skipped (reported with the prediction) if it would pass the per-case limit or the section's
budget. Cases run in the order given; the default starts with the issue's target (128 x 8k).
"""

from __future__ import annotations

import gc
import math
import time
from pathlib import Path
from typing import Any

import torch

GROUP = 8
PROMPT_TOKENS = 256
MEAN_ANSWER = 512
CASES = ((128, 8192), (8, 1024), (8, 4096), (8, 8192), (32, 1024), (32, 4096), (32, 8192))
CASES += ((128, 1024), (128, 4096))
ANCHOR = "RLinf and verl: 3.4-3.5k generated tokens/s per H100 for this model at 28k context"


def parse_cases(text: str) -> list[tuple[int, int]]:
    """'all' or 'PROMPTSxSEQ,...' (e.g. '128x8192,8x1024') -> [(prompts, seq_length)]."""
    if text == "all":
        return list(CASES)
    return [(int(p), int(s)) for p, s in (c.lower().split("x") for c in text.split(","))]


def eos_ids(vocab: int) -> list[int]:
    """One token id in MEAN_ANSWER: the EOS set of the module docstring."""
    return list(range(7, vocab, MEAN_ANSWER))


def expected_steps(rows: int, slots: int, max_new: int, p_end: float) -> float:
    """Decode steps for `rows` geometric(p_end) answers capped at max_new in `slots` slots:
    the rows' total length shared by the slots, plus the tail, the expected longest of the
    last wave (harmonic number / p_end)."""
    mean = (1 - (1 - p_end) ** max_new) / p_end
    tail = min(max_new, (math.log(min(rows, slots)) + 0.5772) / p_end)
    return tail if slots >= rows else rows * mean / slots + tail


def _seconds(run) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _lengths(answers: torch.Tensor, eos: list[int]) -> torch.Tensor:
    is_eos = torch.isin(answers, torch.tensor(eos))
    return torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, answers.shape[1])


def _predict(sampler: Any, ids: torch.Tensor, mask: torch.Tensor, max_new: int) -> dict:
    """Warm the sampler up (compile, capture), time a prefill of one wave and 16 decode steps,
    and predict the full run's seconds (module docstring)."""
    from rlinf_twoworker.engines.static import SamplingSettings

    settings = SamplingSettings(do_sample=True, temperature=1.0)
    rows, slots = ids.shape[0], sampler.batch
    wave = (ids[:slots], mask[:slots])
    never = [sampler.model.config.vocab_size]  # no answer ends: fixed step counts
    start = time.perf_counter()
    sampler.generate(*wave, 2, never, 0, settings)
    warmup = time.perf_counter() - start
    prefill = _seconds(lambda: sampler.generate(*wave, 1, never, 0, settings))
    step = max(0.0, _seconds(lambda: sampler.generate(*wave, 17, never, 0, settings)) - prefill)
    step /= 16
    p_end = len(eos_ids(sampler.model.config.vocab_size)) / sampler.model.config.vocab_size
    steps = expected_steps(rows, slots, max_new, p_end)
    return {
        "warmup_s": warmup,
        "wave_prefill_s": prefill,
        "decode_step_s": step,
        "predicted_s": prefill * math.ceil(rows / slots) + steps * step,
    }


def _timed_run(engine: Any, ids: torch.Tensor, mask: torch.Tensor, max_new: int) -> dict:
    from rlinf_twoworker.engines.static import SamplingSettings

    eos = eos_ids(engine.model.config.vocab_size)
    settings = SamplingSettings(do_sample=True, temperature=1.0)
    engine.sampler_for(*ids.shape, ids.shape[1] + max_new).generate(
        ids[:1], mask[:1], 2, eos, 0, settings
    )  # the graph for this EOS set
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    answers: list[torch.Tensor] = []
    seconds = _seconds(
        lambda: answers.append(engine.generate(ids, mask, max_new, eos, 0, settings))
    )
    lengths = _lengths(answers[0], eos)
    run = engine.last_run
    return {
        "slots": run.slots,
        "rollout_s": seconds,
        "generated_tokens": int(lengths.sum()),
        "tokens_per_s_per_gpu": float(lengths.sum()) / seconds,
        "mean_answer": float(lengths.float().mean()),
        "longest_answer": int(lengths.max()),
        "slot_use": float(lengths.sum()) / max(1, run.decode_steps * run.slots),
        "decode_steps": run.decode_steps,
        "prefills": run.prefills,
        "refilled_rows": run.refilled_rows,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }


def _mode(model: Any, ids: torch.Tensor, max_new: int, mode: str, opts: dict) -> dict:
    """One (case, mode): 'does not fit', skipped by time, or measured."""
    from rlinf_twoworker.engines.static import StaticEngine
    from rlinf_twoworker.errors import TwoWorkerError

    rows, width = ids.shape
    mask = torch.ones_like(ids)
    cap = opts["max_batch"] if mode == "continuous" else None
    engine = StaticEngine(model, max_batch_size=cap, where="bench_gpu scaling")
    try:
        slots = engine.slots_for(min(rows, cap or rows), width, width + max_new)
    except TwoWorkerError as exc:
        return {"result": "does not fit", "why": str(exc)}
    if mode == "static" and slots < rows:
        return {"result": "does not fit", "slots_that_fit": slots, "slots_needed": rows}
    if mode == "static" and opts["continuous_slots"] == rows:
        return {"result": "same run as continuous (a slot per row)"}
    sampler = engine.sampler_for(rows, width, width + max_new)
    out = _predict(sampler, ids, mask, max_new)
    left = opts["deadline"] - time.perf_counter()
    if out["predicted_s"] > min(opts["case_limit_s"], left):
        limit = "the per-case limit" if opts["case_limit_s"] <= left else "the section's budget"
        return {"result": f"skipped: predicted {out['predicted_s']:.0f} s passes {limit}", **out}
    return {"result": "measured", **out, **_timed_run(engine, ids, mask, max_new)}


def bench_scaling(
    model_dir: Path, cases: str, budget_s: float, case_limit_s: float, max_batch: int
) -> dict:
    from rlinf_twoworker.engines.models import load_causal_lm

    deadline = time.perf_counter() + budget_s
    for name in ("recompile_limit", "cache_size_limit"):  # one compiled kernel per shape
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    model = load_causal_lm(model_dir, torch.bfloat16, torch.device("cuda")).eval()
    vocab = model.config.vocab_size
    out: dict = {"anchor": ANCHOR, "mean_answer_target": MEAN_ANSWER, "cases": {}}
    out["eos_ids"] = f"{len(eos_ids(vocab))} ids: range(7, {vocab}, {MEAN_ANSWER})"
    for prompts, seq in parse_cases(cases):
        rows, max_new = prompts * GROUP, seq - PROMPT_TOKENS
        case: dict[str, Any] = {"prompts": prompts, "rows": rows, "seq_length": seq}
        out["cases"][f"{prompts}x{GROUP}@{seq}"] = case
        if time.perf_counter() > deadline:
            case["result"] = "skipped: the section's budget is spent"
            continue
        ids = torch.randint(100, vocab, (rows, PROMPT_TOKENS), device="cuda")
        opts = {"max_batch": max_batch, "deadline": deadline, "case_limit_s": case_limit_s}
        for mode in ("continuous", "static"):
            opts["continuous_slots"] = case.get("continuous", {}).get("slots")
            try:
                case[mode] = _mode(model, ids, max_new, mode, opts)
            except torch.OutOfMemoryError as exc:
                case[mode] = {"result": "out of memory", "error": str(exc)[:500]}
            gc.collect()
            torch.cuda.empty_cache()
        print(f"[scaling] {prompts}x{GROUP}@{seq}: {case}", flush=True)
    return out


def scaling_table(section: dict) -> str:
    lines = [
        "| prompts x 8 @ seq | mode | slots | rollout s | generated tok/s/GPU | mean / longest "
        "answer | peak alloc / reserved GiB | refilled rows |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, case in section.get("cases", {}).items():
        for mode in ("continuous", "static"):
            r = case.get(mode) or {"result": case.get("result", "-")}
            if r.get("result") != "measured":
                lines.append(f"| {name} | {mode} | | {r.get('result')} | | | | |")
                continue
            lines.append(
                f"| {name} | {mode} | {r['slots']} | {r['rollout_s']:.1f} | "
                f"{r['tokens_per_s_per_gpu']:.0f} | {r['mean_answer']:.0f} / "
                f"{r['longest_answer']} | {r['peak_allocated_gib']:.1f} / "
                f"{r['peak_reserved_gib']:.1f} | {r['refilled_rows']} |"
            )
    return "\n".join([*lines, f"Anchor: {ANCHOR}."])

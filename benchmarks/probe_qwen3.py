"""The static engine on a Qwen3-0.6B-shaped model (random weights) on one GPU.

    python benchmarks/probe_qwen3.py --out results/qwen3.json

1. Exactness at the real shape: greedy tokens of the static sampler against transformers'
   `generate`, in float32 (4 prompts, 48 new tokens); the output layer is scaled so random
   weights do not leave near-ties that any change of summation order would flip.
2. Speed: decode tokens/s of both engines in bf16 (batch 64, prompt 128, 256 new tokens, no
   early stop), the second call of each timed (the first compiles and captures).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from rlinf_twoworker.engines.static import SamplingSettings, StaticSampler
from rlinf_twoworker.workers.rollout import left_pad

QWEN3_0P6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,  # 16 x 128 = 2048 != hidden 1024
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def model(dtype: torch.dtype) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    m = Qwen3ForCausalLM(Qwen3Config(**QWEN3_0P6B)).to("cuda", dtype).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # tied: the embedding scales too, harmless for this check
    return m


def exactness() -> dict:
    m = model(torch.float32)
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15], [16]], pad_id=0, width=8)
    ref = m.generate(
        input_ids=ids.cuda(),
        attention_mask=mask.cuda(),
        do_sample=False,
        max_new_tokens=48,
        min_new_tokens=48,
        pad_token_id=0,
    )[:, 8:].cpu()
    out = StaticSampler(m, 4, 8 + 48).generate(
        ids, mask, 48, [-1], 0, SamplingSettings(do_sample=False)
    )
    same = (out == ref).all(0)
    first_diff = int((~same).nonzero()[0]) if not bool(same.all()) else None
    return {"equal": bool(torch.equal(out, ref)), "first_differing_column": first_diff}


def speed() -> dict:
    m = model(torch.bfloat16)
    batch, prompt, new = 64, 128, 256
    ids = torch.randint(100, 150000, (batch, prompt))
    mask = torch.ones_like(ids)
    greedy = SamplingSettings(do_sample=False)
    sampler = StaticSampler(m, batch, prompt + new)

    def static() -> None:
        sampler.generate(ids, mask, new, [-1], 0, greedy)

    def hf() -> None:
        m.generate(
            input_ids=ids.cuda(),
            attention_mask=mask.cuda(),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
        )

    out = {}
    for name, fn in (("static", static), ("generate", hf)):
        first = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        first = time.perf_counter() - first
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        took = time.perf_counter() - start
        out[name] = {"tokens_per_s": batch * new / took, "seconds": took, "first_call_s": first}
    out["speedup"] = out["static"]["tokens_per_s"] / out["generate"]["tokens_per_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="qwen3.json")
    args = parser.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["exactness_fp32"] = exactness()
    torch.cuda.empty_cache()
    result["speed_bf16"] = speed()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

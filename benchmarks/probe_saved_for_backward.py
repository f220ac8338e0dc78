"""What the update's forward keeps for its backward, masked against packed rows, by row width.

    python benchmarks/probe_saved_for_backward.py [--device cpu] [--layers 4] [--tokens 4096]

The log-prob forward of `engines/models.response_logprobs` on a small Qwen2 model (random
weights, float32 on CPU, bfloat16 on CUDA) at the same tokens a micro-batch and widths of 128 to
1024 columns (fewer rows at wider ones), left-padded prompts a quarter of the width: the bytes of
the distinct storages autograd saves for the backward (a saved_tensors_hooks count), with
RLINF_PACK_LEFT=0 (the masked form: a [rows, 1, W, W] boolean mask that PyTorch's SDPA turns into
a float bias for each layer's call, and keeps for that layer's backward) and =1 (packed: no
mask). At a fixed token count the masked form's excess grows with the width, about one
rows x W x W bias of the model's dtype per layer; the packed form's stays the same. Prints one
line per width.
"""

from __future__ import annotations

import argparse
import os

import torch


def _batch(rows: int, width: int, device: torch.device):
    from rlinf_twoworker.engines.models import SequenceBatch
    from rlinf_twoworker.workers.rollout import left_pad

    prompt = width // 4
    generator = torch.Generator().manual_seed(rows)
    prompts = [
        torch.randint(3, 60, (max(1, prompt - 3 * i),), generator=generator).tolist()
        for i in range(rows)
    ]
    ids, mask = left_pad(prompts, 0, width=prompt)
    answers = torch.randint(3, 60, (rows, width - prompt), generator=generator)
    response_mask = torch.ones_like(answers)
    return SequenceBatch(
        torch.cat([ids, answers], 1).to(device),
        torch.cat([mask, response_mask], 1).to(device),
        response_mask.to(device),
        prompt,
    )


def saved_bytes(model, batch, packed: str) -> int:
    """Bytes of the distinct storages the forward saves for its backward, RLINF_PACK_LEFT=packed."""
    from rlinf_twoworker.engines.models import response_logprobs

    os.environ["RLINF_PACK_LEFT"] = packed
    storages: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        out = response_logprobs(model, batch)
    out.sum().backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    import transformers

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(device, dtype).train()
    element = torch.finfo(dtype).bits // 8
    print(f"# {device}, {dtype}, {args.layers} layers, {args.tokens} tokens a micro-batch")
    for width in (128, 256, 512, 1024):
        rows = args.tokens // width
        batch = _batch(rows, width, device)
        masked, packed = saved_bytes(model, batch, "0"), saved_bytes(model, batch, "1")
        bias = args.layers * rows * width * width * element
        print(
            f"width {width:5d}, {rows:3d} rows: saved for the backward {masked / 2**20:8.2f} MiB "
            f"masked, {packed / 2**20:8.2f} packed; the difference {(masked - packed) / 2**20:7.2f}"
            f" MiB = {(masked - packed) / bias:.2f} x (layers x rows x W^2 x {element} bytes)"
        )


if __name__ == "__main__":
    main()

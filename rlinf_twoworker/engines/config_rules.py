"""What a model's config and the process's environment alone say about how the engines run it:
whether the static rollout engine runs it, whether its attention slides a window, and so
whether the log-prob and update forwards pack their rows or keep the masked form, and how
many positions the eager log-softmax computes at a time.

These rules have no torch in them, so the memory plan (cluster/memory_parts.py) asks them of a
model directory's config.json before any model loads, and the engines (engines/static.py,
engines/models.py) ask them of the loaded model's config: the same answer either way.
"""

from __future__ import annotations

import os
from typing import Any

SUPPORTED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")
QWEN_WINDOWS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
"""Architectures that slide a window only with use_sliding_window, from max_window_layers on."""
CAUSAL_LM_OF_TYPE = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
}
"""The causal-LM class transformers' AutoModelForCausalLM builds for a config's model_type (the
supported ones; any other model_type loads as a class the engine does not run)."""


def window_of(architecture: str, config: Any) -> int | None:
    """The attention window the model's own forward applies in some layer (None: none), from
    its config (an object with the config's keys as attributes). Mistral slides in every layer
    when `sliding_window` is set; Qwen2 and Qwen3 only with `use_sliding_window`, in the layers
    from `max_window_layers` on (or as their `layer_types` list says)."""
    window: int | None = getattr(config, "sliding_window", None)
    if window is None or architecture not in QWEN_WINDOWS:
        return window
    if not getattr(config, "use_sliding_window", False):
        return None
    layer_types = getattr(config, "layer_types", None) or [
        "sliding_attention" if i >= config.max_window_layers else "full_attention"
        for i in range(config.num_hidden_layers)
    ]
    return window if "sliding_attention" in layer_types else None


def unsupported_reason_of(architecture: str, config: Any, max_len: int) -> str | None:
    """Why the static sampler cannot run a model of `architecture` and `config` over `max_len`
    tokens (prompt + answer), or None when it can."""
    if architecture not in SUPPORTED:
        return f"{architecture} is not one of the static sampler's architectures {SUPPORTED}"
    window = window_of(architecture, config)
    if window is not None and window < max_len:
        # The sampler attends over the whole cache; the model would not, past the window.
        return (
            f"{architecture} attends through a sliding window of {window} tokens (config "
            f"sliding_window), shorter than the {max_len} prompt + answer tokens, and the "
            "static sampler implements full attention only"
        )
    return None


def windows_attention_of(architecture: str, config: Any) -> bool:
    """Whether some layer of a model of `architecture` and `config` attends within a sliding
    window (Mistral's sliding_window, Qwen2's use_sliding_window): transformers then makes a
    windowed mask from the 2-D padding mask, which a ready 4-D mask (or none) would replace,
    so the forwards keep the masked rows (engines/models._logprobs)."""
    return window_of(architecture, config) is not None or "sliding_attention" in (
        getattr(config, "layer_types", None) or ()
    )


PACK_ENV = "RLINF_PACK_LEFT"


def packs_left() -> bool:
    """Whether the log-prob and update forwards move each row's padding after its real tokens
    and attend causally with no mask (engines/models._packed_logprobs): the default; PACK_ENV=0
    in the actor's and inference's environment keeps the masked, left-padded rows. Measured on
    one H100 at 025fbbb, the scale benchmark's 32 x 8 @ 2048 step, alternated 0, 1, 1, 0 on one
    machine: 29.8 and 31.4 s packed against 33.4 and 32.9 s masked (inference 3.29-3.31
    against 3.76-3.78 s, the actor's update 16.9-18.5 against 19.6-20.1 s)."""
    value = os.environ.get(PACK_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(
            f"{PACK_ENV}={value!r} in the environment of process {os.getpid()}: it takes 1 (pack"
            " each row's padding after its tokens: the default) or 0 (masked, left-padded"
            " rows); set one of them or unset it"
        )
    return value == "1"


def packs_rows(architecture: str, config: Any) -> bool:
    """Whether the log-prob and update forwards of a model of `architecture` and `config` pack
    its rows (engines/models._logprobs) rather than keep them masked and left-padded: unless
    PACK_ENV=0 (packs_left) or the model windows its attention (windows_attention_of). The
    engine asks it of the loaded model, the memory plan of the config it reads
    (cluster/memory_parts.masked_rows), so the two cannot disagree."""
    return packs_left() and not windows_attention_of(architecture, config)


EAGER_CHUNK_TOKENS = 512
"""The positions algorithm.token_logprobs computes at a time when it runs eagerly (not
compiled): its float32 copies (EAGER_CHUNK_BYTES a vocabulary entry at most) are this many
positions' (0.3 GiB each at a 152k vocabulary), which the memory plan counts."""
EAGER_CHUNK_BYTES = 24
"""Float32 copies the eager arithmetic holds at once, in bytes per (position, vocabulary
entry), counted op by op (torch.profiler lists each allocation): the forward holds the scaled
logits, the softmax's numerator and their product (12); the backward's entropy term holds the
scaled logits, the probabilities, the gradient so far and three products (24), the most."""

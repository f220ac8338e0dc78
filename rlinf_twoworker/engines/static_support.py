"""Which models the static rollout engine runs, decided from a model's config alone.

The rule has no torch in it, so the memory plan (cluster/memory_parts.py) can ask it of a
model directory's config.json before any model loads, and the engine (engines/static.py) asks
it of the loaded model: the same answer either way.
"""

from __future__ import annotations

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

"""What one component process needs on its GPU, part by part, before any model is loaded.

The model's shape comes from its directory: for the decoder-only families the engines know,
the config and the safetensors files' headers (every stored tensor's shape, no weights read,
no transformers import: the run's controller plans memory while the preflight runs); for any
other model, parameters counted on the meta device by transformers. The shape keeps the
model's config, which says whether the static engine runs it and whether its attention
windows (engines/config_rules). With the batch, `runner.seq_length` and the settings
(precision, FSDP sharding, the optimiser's state, the rollout's KV cache, activations with or
without recompute, packed or masked rows) each process gets an estimate by part.
cluster/memory_plan.py adds up the processes of each GPU and holds them against its budget.

The activation, logit and slack coefficients are calibrated on H100s and H200s at the 1.5B
shape (the scale benchmark's records in benchmarks/results, which
tests/integration/test_memory_plan.py holds the plan to); everything else is exact arithmetic
on sizes.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlinf_twoworker import components
from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.engines.config_rules import (
    CAUSAL_LM_OF_TYPE,
    EAGER_CHUNK_BYTES,
    EAGER_CHUNK_TOKENS,
    packs_rows,
    unsupported_reason_of,
)
from rlinf_twoworker.engines.kv_memory import PREFILL_TOKENS  # the static engine's prefill cut
from rlinf_twoworker.engines.sampling import race_compiled

GIB = 1024**3
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CUDA_CONTEXT = int(0.6 * GIB)
"""A CUDA process's context and kernels, outside PyTorch's allocator (about 0.5 GiB on H200s)."""
SLACK = 0.10
"""The caching allocator's fragmentation and library workspaces, on top of the parts..."""
EXACT_PARTS = ("kv_cache",)
"""Parts allocated once at their exact size, outside the allocator's churn: the rollout's KV
cache is two tensors (keys, values) made when the engine meets its shape, which the caching
allocator rounds to 2 MiB and never splits. The slack is not taken on them. Counted on them, it
put the rollout's plan 5-10% above its nvidia-smi peak wherever the cache is most of it (14 of
20.8 GiB at 32x8@2048 and 8x8@8192, H100 and H200 records); without, every record is within 4%."""
SLACK_TRAINING = 0.10
"""...and the same for the actor (on an H200, 1.5B shape, colocated, measured with the weight
sync's leak fixed: reserved 9.8% above this plan's other parts without recompute and 9.5% with
it; the 0.20 of the first calibration had absorbed one leaked copy of the weights)."""
ACTIVATIONS_COMPILED = (9, 3)
"""(a, b): a decoder layer keeps about a x hidden + b x intermediate values per token for its
backward when its forward is compiled (fused norms and SwiGLU: the gate's and the up
projection's outputs and their product are the 3 x intermediate). Fitted together with
LOGIT_BYTES_TRAIN to the actor's nvidia-smi peaks of the scale benchmark's records (H100 and
H200, 1.5B shape, 2048 to 8192 tokens a row, with and without recompute; the parametrized
test_the_plan_is_within_10_percent_of_each_recorded_peak holds the plan to them, the logits
at the 8 bytes of the log-softmax before aa6a919 where a record is older): every one within
-7%..-1%. The (9, 4) before it had absorbed three of the logits' eight bytes a
(token, vocabulary entry), which left the plan short where recompute makes the activations
small and the logits the largest part (8x8@8192 on an H100, 32768-token cuts: out of memory
at step 1)..."""
ACTIVATIONS_EAGER = (16, 6)
"""...and about this many when it runs eagerly (float32 norm copies, unfused SwiGLU)."""
LOGIT_BYTES_TRAIN = 4
"""Bytes per (token, vocabulary entry) that the actor's output head and log-softmax hold at
once, at the start of the backward: the logits (2, bf16, kept for the backward) and the
gradient that algorithm.token_logprobs' backward writes from them (2); it computes in float32
a value at a time, with no float32 tensor the size of the logits (the compiled kernel that
autograd differentiated held one, 8 bytes in all: on an H100 at 8x8@8192 with 32768-token
cuts that ran out of memory, 190361f). Counted over every token of a micro-batch: an upper
bound, since the output head makes logits only at the positions that predict answer tokens
(engines/models.response_logprobs), and a micro-batch's prompt columns can be as few as one
(a batch's prompts pad to its longest)."""
LOGIT_BYTES_FORWARD = 2
"""The same for a forward without gradients: the bf16 logits (the log-softmax keeps four
float32 values a position of them)."""


@dataclass(frozen=True)
class ModelShape:
    params: int
    embedding_params: int
    """The input embedding and an untied output head (kept gathered by FSDP's root unit)."""
    layer_params: int
    """The largest decoder layer."""
    layers: int
    hidden: int
    intermediate: int
    kv_heads: int
    head_dim: int
    vocab: int
    architecture: str = ""
    """The causal-LM class transformers builds for the model (AutoModelForCausalLM's pick for
    its model_type)."""
    config: Any = field(default=None, compare=False, repr=False)
    """The model's config, its keys as attributes, read with the shape (the directory once):
    what engines/config_rules asks of it. None where not known (a shape made by hand): the
    plan then takes the larger estimate."""

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token over every layer, per byte of the cache's dtype."""
        return 2 * self.layers * self.kv_heads * self.head_dim


def model_shape(model_dir: str | Path) -> ModelShape:
    """The shape of the causal LM in `model_dir`: from its config and checkpoint headers where
    they say it all (`shape_from_checkpoint`), else counted on the meta device."""
    return shape_from_checkpoint(model_dir) or shape_on_meta(model_dir)


HEADER_FAMILIES = {"qwen2", "qwen3", "llama", "mistral"}
"""Model types whose stored tensors are exactly their parameters, named model.embed_tokens,
model.layers.<i>.*, model.norm and lm_head (an older checkpoint's rotary inv_freq buffers
aside)."""
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def shape_from_checkpoint(model_dir: str | Path) -> ModelShape | None:
    """The shape read from config.json and the *.safetensors headers (safetensors reads only
    each file's header), or None where they do not say it all (another model family, no
    safetensors files, a layer count that disagrees with the config): the caller counts on
    the meta device then. Tied embeddings count once, as transformers ties them."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        if config.get("model_type") not in HEADER_FAMILIES:
            return None
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        layers, vocab = int(config["num_hidden_layers"]), int(config["vocab_size"])
        intermediate = int(config["intermediate_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    sizes: dict[str, int] = {}
    try:
        for file in files:
            with safe_open(str(file), framework="numpy") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    sizes[name] = math.prod(handle.get_slice(name).get_shape())
    except Exception:  # not a file safetensors reads: transformers will say what is wrong
        return None
    sizes = {k: v for k, v in sizes.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.get("tie_word_embeddings", False):
        sizes.pop("lm_head.weight", None)  # stored by some writers, one tensor once loaded
    per_layer: dict[int, int] = {}
    for name, size in sizes.items():
        found = _LAYER.match(name)
        if found:
            index = int(found.group(1))
            per_layer[index] = per_layer.get(index, 0) + size
    if len(per_layer) != layers or "model.embed_tokens.weight" not in sizes:
        return None
    return ModelShape(
        params=sum(sizes.values()),
        embedding_params=sizes["model.embed_tokens.weight"] + sizes.get("lm_head.weight", 0),
        layer_params=max(per_layer.values()),
        layers=layers,
        hidden=hidden,
        intermediate=intermediate,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        vocab=vocab,
        architecture=CAUSAL_LM_OF_TYPE[config["model_type"]],  # HEADER_FAMILIES are all there
        config=SimpleNamespace(**config),
    )


def shape_on_meta(model_dir: str | Path) -> ModelShape:
    """The shape of the causal LM in `model_dir`, its parameters counted on the meta device
    (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    embedding = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    if head is not None and head.weight is not model.get_input_embeddings().weight:
        embedding += head.weight.numel()
    decoder = model.base_model.layers
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    return ModelShape(
        params=params,
        embedding_params=embedding,
        layer_params=max(sum(p.numel() for p in layer.parameters()) for layer in decoder),
        layers=len(decoder),
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab=text.vocab_size,
        architecture=type(model).__name__,
        config=config,
    )


def micro_batch_tokens(
    cfg: GRPOConfig, ranks: int, training: bool, cut: int | None = None, whole_rows: bool = False
) -> int:
    """Most tokens one micro-batch of the actor's update (`training`, per rank) or of the
    log-prob forward holds: a `cut` of tokens (None: the config's settled cut; 0: RLinf's row
    count alone) holds at least the RLinf key's rows of full width and never more than all the
    rows; under dynamic batch size runner.max_tokens_per_mbs cuts, at least one row.
    `whole_rows` rounds a cut down to whole full-width rows (what a batch of full-length
    answers really gets); without it the cut is the bound the estimate must hold."""
    runner, algo = cfg.runner, cfg.algorithm
    seq = runner.seq_length
    if training:
        rows = cfg.minibatch_rows // ranks
        if runner.enable_dynamic_batch_size:
            return min(rows * seq, max(runner.max_tokens_per_mbs, seq))
        least = algo.training_batch_size_per_gpu
        tokens = runner.actor_cut_tokens if cut is None else cut
    else:
        rows = cfg.data.rollout_batch_size * algo.group_size
        least = algo.logprob_forward_micro_batch_size
        tokens = runner.logprob_cut_tokens if cut is None else cut
    if whole_rows or not tokens:  # the rows the workers cut (GRPOConfig.micro_batch_rows)
        return max(1, min(rows, cfg.micro_batch_rows(training, seq, cut))) * seq
    return min(rows * seq, max(tokens, least * seq))


def actor_parts(cfg: GRPOConfig, shape: ModelShape, ranks: int, recompute: bool) -> dict[str, int]:
    """One FSDP actor rank: its shard of the master weights, gradients and Adam's two moments,
    the layers gathered for compute (all of them with actor.fsdp_config.reshard_after_forward
    false, or cast without the wrapper at one rank), one micro-batch's activations and
    logits. The layers are
    gathered and computed in mixed_precision.param_dtype (the master weights' dtype when null);
    the gradient shards keep the master weights' dtype (FSDP2 casts the reduced gradients back
    to it, whatever reduce_dtype); the loss scaler's state is a few scalars."""
    gpu = cfg.cluster.accelerator == "cuda"
    master = BYTES[cfg.actor.model.precision] if gpu else 4
    param_dtype = cfg.actor.fsdp_config.mixed_precision.param_dtype
    compute = BYTES[param_dtype] if gpu and param_dtype else master
    tokens = micro_batch_tokens(cfg, ranks, training=True)
    compiled = gpu and cfg.actor.compile
    a, b = ACTIVATIONS_COMPILED if compiled else ACTIVATIONS_EAGER
    per_layer = compute * (a * shape.hidden + b * shape.intermediate)
    if recompute:  # every layer's input kept, one layer's activations at a time
        activations = tokens * (shape.layers * compute * shape.hidden + per_layer)
    else:
        activations = tokens * shape.layers * per_layer
    shard = -(-shape.params // ranks)
    # Gathered layers: the one computing and the next one prefetched, or, with
    # reshard_after_forward=false, every layer from its forward to its backward. Without the
    # wrapper (one rank): every layer's cast, held over the optimiser step's micro-batches
    # (actor.computing_in), none when the master weights compute themselves.
    wraps = cfg.actor.fsdp_wraps(ranks, gpu)
    if wraps:
        kept_layers = 2 if cfg.actor.fsdp_config.reshard_after_forward else shape.layers
        gathered = (shape.embedding_params + kept_layers * shape.layer_params) * compute
    else:
        gathered = 0 if compute == master else shape.params * compute
    parts = {
        "weights": shard * master,
        "gradients": shard * master,
        "optimizer": shard * 2 * 4,  # Adam's moments in float32
        "gathered": gathered,
        "activations": activations,
        "logits": tokens * shape.vocab * LOGIT_BYTES_TRAIN,
    }
    if not compiled:  # the eager log-softmax's float32 copies of a chunk
        parts["logits"] += min(tokens, EAGER_CHUNK_TOKENS) * shape.vocab * EAGER_CHUNK_BYTES
    if masked_rows(shape):
        # The 4-D mask and every layer's bias, kept for the backward; with recompute the
        # mask and the one layer recomputed at a time.
        copies = 2 if recompute else shape.layers + 1
        parts["attention_mask"] = mask_bytes(cfg, tokens, compute, copies)
    if not wraps and _one_micro_batch(cfg, ranks):
        # Each minibatch starts with no gradients (zero_grad(set_to_none=True)). In one
        # micro-batch, autograd makes them in its backward as it frees the forward's
        # activations and logits, so the pass holds the larger of the two, not both (on an
        # H100, 1.5B shape: the tutorial's actor peaked at 35.6 GiB allocated where the sum
        # with its slack said 47.6). The wrapped rank keeps the sum: FSDP2's unsharded
        # gradients and reduce-scatter buffers come with its sharded ones.
        forward = parts["activations"] + parts["logits"] + parts.get("attention_mask", 0)
        parts["gradients_beyond_activations"] = max(0, parts.pop("gradients") - forward)
    return parts


def _one_micro_batch(cfg: GRPOConfig, ranks: int) -> bool:
    """Whether the actor's update computes a rank's whole minibatch in one micro-batch at full
    width (then at any width: shorter rows fit more of them). Under dynamic batch size the
    rows per micro-batch follow the answers' lengths: not known ahead."""
    if cfg.runner.enable_dynamic_batch_size:
        return False
    return cfg.micro_batch_rows(True, cfg.runner.seq_length) >= cfg.minibatch_rows // ranks


def prompt_width_fixed(cfg: GRPOConfig, rollout: ModelShape) -> bool:
    """Whether every batch's prompts come padded to data.max_prompt_length: the static
    engine's batches (rollout.engine static, or auto where the static engine runs `rollout`,
    the rollout's model, as its config says: engines/config_rules). The hf engine pads a
    batch's prompts to its longest; a config not known counts as not fixed."""
    engine = cfg.rollout.engine
    if engine != "auto":
        return engine == "static"
    if rollout.config is None:
        return False
    max_len = cfg.data.max_prompt_length + cfg.max_new_tokens
    try:
        return unsupported_reason_of(rollout.architecture, rollout.config, max_len) is None
    except (TypeError, AttributeError):  # keys the rule reads are missing or malformed
        return False


def masked_rows(shape: ModelShape) -> bool:
    """Whether the log-prob and update forwards of the model of `shape` keep the masked,
    left-padded rows (engines/models._logprobs) instead of packing them: RLINF_PACK_LEFT=0 in
    this process's environment (the job's, which the components share), or a model whose
    attention slides a window: config_rules.packs_rows, the engine's own rule, asked of its
    config (one not known counts as masked, the larger estimate)."""
    if shape.config is None:
        return True
    try:
        return not packs_rows(shape.architecture, shape.config)
    except (TypeError, AttributeError):
        return True


def mask_bytes(cfg: GRPOConfig, tokens: int, size: int, copies: int) -> int:
    """`copies` [rows, 1, W, W] masks of `size`-byte values for a micro-batch of `tokens`
    tokens (rows x W^2 = tokens x W, at most tokens x runner.seq_length). Masked rows hold the
    4-D mask for the whole forward, and SDPA makes each layer's additive bias from it, which
    the memory-efficient kernel keeps for its backward: benchmarks/probe_saved_for_backward.py
    found the masked update's saved tensors larger than the packed one's by 1.05-1.4 x
    layers x rows x W^2 values, and on an H200 the masked actor's nvidia-smi peak at 8 x 8 @
    8192 lay 9.9% over a plan without this term (45f9970)."""
    return tokens * cfg.runner.seq_length * size * copies


def answer_share(cfg: GRPOConfig, rollout: ModelShape) -> float:
    """The most of a log-prob micro-batch's tokens at which the output head makes logits: it
    makes them only at the positions that predict answer tokens (engines/models.
    response_logprobs), and a micro-batch holds tokens // width rows of prompt + answer
    columns. With prompts padded to data.max_prompt_length P and answers of at most A tokens
    that is (A + 1) / (P + A) of its tokens (packed rows give the head A positions a row,
    masked ones A + 1: transformers' logits_to_keep); where the prompt columns can be fewer
    (the hf engine's batches, or the length-aware cut, runner.trim_padding_multiple, which
    drops columns that are padding in every row) the bound is all of them."""
    if cfg.runner.trim_padding_multiple >= 1 or not prompt_width_fixed(cfg, rollout):
        return 1.0
    answer = cfg.max_new_tokens
    return min(1.0, (answer + 1) / (cfg.data.max_prompt_length + answer))


def logprob_parts(
    cfg: GRPOConfig, shape: ModelShape, precision: str, rollout: ModelShape
) -> dict[str, int]:
    """The inference (or reference) copy of `shape`: its weights and one log-prob
    micro-batch, its logits only where the output head makes them (answer_share: the batches
    come from the rollout's model, `rollout`). The layers' activations and the
    logits are not held at once (the logits come after the last layer), but the sum stays
    within 10% of the measured nvidia-smi peaks where the larger of the two alone falls short
    with masked rows (RLINF_PACK_LEFT=0): on an H100, packed, 8.29 GiB at the tutorial's shape
    and 9.10 at 32 x 8 @ 2048 against this 9.18 and 9.82; masked on an H200, 9.83 and 9.9."""
    gpu = cfg.cluster.accelerator == "cuda"
    size = BYTES[precision] if gpu else 4
    tokens = micro_batch_tokens(cfg, 1, training=False)
    parts = {
        "weights": shape.params * size,
        "activations": tokens * size * (4 * shape.hidden + 3 * shape.intermediate),
        "logits": int(tokens * answer_share(cfg, rollout)) * shape.vocab * LOGIT_BYTES_FORWARD,
    }
    if masked_rows(shape):
        parts["attention_mask"] = mask_bytes(cfg, tokens, size, 2)  # the mask, a layer's bias
    return parts


def rollout_parts(cfg: GRPOConfig, shape: ModelShape) -> dict[str, int]:
    """The rollout copy: its weights, the KV cache of the rows decoded together, the prefill's
    activations and the decode step's logits: with the compiled sampling race (enough slots,
    engines/sampling.race_compiled) the logits alone, one pass that draws its noise as it
    goes; below that, the eager race's float32 copies."""
    gpu = cfg.cluster.accelerator == "cuda"
    size = BYTES[cfg.rollout.model.precision] if gpu else 4
    rows = cfg.data.rollout_batch_size * cfg.algorithm.group_size
    slots = min(rows, cfg.rollout.max_batch_size)
    seq, prompt = cfg.runner.seq_length, cfg.data.max_prompt_length
    return {
        "weights": shape.params * size,
        "kv_cache": slots * seq * shape.kv_bytes_per_token * size,
        "activations": min(slots * prompt, PREFILL_TOKENS)
        * size
        * (4 * shape.hidden + 3 * shape.intermediate),
        "logits": slots * shape.vocab * (size if gpu and race_compiled(slots, shape.vocab) else 12),
    }


def actor_memory(
    cfg: GRPOConfig, shapes: Mapping[str, ModelShape], ranks: int, recompute: bool
) -> dict[str, int]:
    """The actor's row of the component table: one FSDP rank (actor_parts)."""
    return actor_parts(cfg, shapes["actor"], ranks, recompute)


def inference_memory(
    cfg: GRPOConfig, shapes: Mapping[str, ModelShape], ranks: int, recompute: bool
) -> dict[str, int]:
    """The inference's row: its copy of the policy and one log-prob micro-batch."""
    precision = cfg.inference.model.precision
    return logprob_parts(cfg, shapes["inference"], precision, shapes["rollout"])


def reference_memory(
    cfg: GRPOConfig, shapes: Mapping[str, ModelShape], ranks: int, recompute: bool
) -> dict[str, int]:
    """The reference's row: the actor's initial weights at inference's precision."""
    return logprob_parts(cfg, shapes["actor"], cfg.inference.model.precision, shapes["rollout"])


def rollout_memory(
    cfg: GRPOConfig, shapes: Mapping[str, ModelShape], ranks: int, recompute: bool
) -> dict[str, int]:
    """The rollout's row (rollout_parts)."""
    return rollout_parts(cfg, shapes["rollout"])


def no_gpu_memory(
    cfg: GRPOConfig, shapes: Mapping[str, ModelShape], ranks: int, recompute: bool
) -> dict[str, int]:
    """A component that holds nothing on a GPU (the reward grades on CPUs)."""
    return {}


def process_parts(
    cfg: GRPOConfig, component: str, shapes: Mapping[str, ModelShape], ranks: int, recompute: bool
) -> dict[str, int]:
    """A component process's estimate by part: its row's `memory` function (components.py),
    with the allocator's slack and, on GPUs, the CUDA context; nothing where it holds nothing."""
    row = components.by_name(component)
    parts = row.memory_estimate()(cfg, shapes, ranks, recompute)
    if not parts:
        return {}
    slack = SLACK_TRAINING if row.trains else SLACK
    churned = sum(v for k, v in parts.items() if k not in EXACT_PARTS)
    parts["allocator_slack"] = int(slack * churned)
    if cfg.cluster.accelerator == "cuda":
        parts["cuda_context"] = CUDA_CONTEXT
    return parts


def model_shapes(cfg: GRPOConfig) -> dict[str, ModelShape]:
    """The shape of each model section's model, each directory read once."""
    by_dir: dict[str, ModelShape] = {}
    shapes = {}
    for key, path in components.model_paths(cfg):
        if path not in by_dir:
            by_dir[path] = model_shape(path)
        shapes[key.split(".")[0]] = by_dir[path]
    return shapes

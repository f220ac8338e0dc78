"""Loading models and tokenizers from a local directory, and the tensor layout of a batch.

Every component loads through `transformers` (AutoModelForCausalLM / AutoTokenizer) from the
configured directory, with no hub access: a wrong path fails here with a clear message.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from rlinf_twoworker.config.schema import MicroBatchRule
from rlinf_twoworker.engines.config_rules import packs_rows, windows_attention_of
from rlinf_twoworker.errors import TwoWorkerError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def device_for(accelerator: str) -> torch.device:
    """The device of this process: the GPU Ray assigned (cuda:0 after CUDA_VISIBLE_DEVICES)."""
    if accelerator == "cuda":
        if not torch.cuda.is_available():
            raise TwoWorkerError(
                "cluster.accelerator is 'cuda' but CUDA is not available in "
                "this process; set cluster.accelerator=cpu or fix the GPU setup"
            )
        return torch.device("cuda", 0)
    return torch.device("cpu")


def dtype_for(precision: str, device: torch.device) -> torch.dtype:
    # Half precision on a CPU is slow and lossy for no gain: the CPU path always uses fp32.
    return DTYPES[precision] if device.type == "cuda" else torch.float32


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    _offline()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise TwoWorkerError(
            f"cannot load a tokenizer from {path}: {exc}; the directory needs "
            "tokenizer_config.json and tokenizer files"
        ) from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_dir_problem(path: str | Path) -> str | None:
    """What is wrong with `path` as a model directory (missing, a file, no config.json), or
    None."""
    path = Path(path)
    if not path.exists():
        return f"model directory {path} does not exist"
    if not path.is_dir():
        return f"model path {path} is a file, not a directory"
    if not (path / "config.json").is_file():
        return f"model directory {path} has no config.json"
    return None


def preimport_model(path: str | Path) -> list[str]:
    """Import what loading the causal LM in `path` will import (transformers' auto classes,
    the model family's module), without reading any weight: a component does
    this while the preflight runs, so its model load after the memory plan only loads.
    Returns the modules it could not import (the load reports them as errors)."""
    import importlib
    import json

    missing = []
    try:
        importlib.import_module("transformers")
    except Exception:  # the real import, later, raises with its context
        missing.append("transformers")
    try:
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
        class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(config.get("model_type")))
        if class_name:
            getattr(transformers, class_name)  # transformers imports the family's module
    except Exception:  # no such directory or family: load_causal_lm says what is wrong
        missing.append(f"model class of {path}")
    return missing


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """transformers' progress bars off inside ("Loading weights", "Writing model shards"):
    redrawn bars are noise in log files and in output that is not a terminal, and a load or a
    save takes seconds. The caller's setting comes back after."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_causal_lm(path: str | Path, dtype: torch.dtype, device: torch.device) -> Any:
    """AutoModelForCausalLM from a local directory, with an error that says what is wrong.
    Typed Any: a transformers model's submodules (`.model.layers`, `.lm_head`) and config are
    dynamic attributes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _offline()
    path = Path(path)
    problem = model_dir_problem(path)
    if problem:
        raise TwoWorkerError(
            f"{problem}; point *.model.model_path at a Hugging Face model directory"
        )
    config = AutoConfig.from_pretrained(str(path))
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        raise TwoWorkerError(f"model in {path} is {archs}, not a causal LM (…ForCausalLM)")
    # On GPUs the weights go from the files straight to the device (accelerate's device map):
    # no full copy in host memory, no random initialisation of weights that are overwritten.
    placement = {"device_map": {"": device}} if device.type == "cuda" else {}
    try:
        with quiet_progress():
            model: Any = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=dtype, attn_implementation="sdpa", **placement
            )
    except ValueError as exc:
        raise TwoWorkerError(f"model in {path} cannot be loaded as a causal LM: {exc}") from exc
    return model.to(device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, a CPU tensor copied to a GPU without the host waiting for it: a
    plain copy from pageable memory synchronises the stream first, so each micro-batch's
    inputs drained the GPU before its forward was launched. Pinned first (PyTorch's caching
    host allocator, which keeps the pinned block until the copy has run), the copy is queued
    on the stream ahead of the kernels that read it."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class SequenceBatch:
    """Prompt (left-padded to P) followed by the response (right-padded to R), per row.

    Rows of one prompt's group are contiguous. `response_mask` marks real response tokens
    (up to and including EOS).
    """

    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R]
    response_mask: torch.Tensor  # [B, R]
    prompt_length: int

    @property
    def position_ids(self) -> torch.Tensor:
        return (self.attention_mask.long().cumsum(-1) - 1).clamp(min=0)

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_length :]

    def rows(self, index: slice | torch.Tensor) -> SequenceBatch:
        return SequenceBatch(
            self.input_ids[index],
            self.attention_mask[index],
            self.response_mask[index],
            self.prompt_length,
        )

    def to(self, device: torch.device) -> SequenceBatch:
        return SequenceBatch(
            to_device(self.input_ids, device),
            to_device(self.attention_mask, device),
            to_device(self.response_mask, device),
            self.prompt_length,
        )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def model_attention_mask(self, compiled: bool = False) -> torch.Tensor:
        """The attention mask the log-prob and update forwards give the model in the masked
        form (RLINF_PACK_LEFT=0: packs_left; packed rows get none). Where a row
        begins with padding, its padding positions attend to no key (every key before them
        is padding too): fully masked query rows, whose attention gradient PyTorch's
        memory-efficient SDPA kernel can make NaN on GPUs for some mask layouts (seen on an
        H100: every gradient NaN at the tutorial's shape with a batch trimmed to 64-column
        multiples). Such a batch gets a 4-D boolean mask [B, 1, W, W], transformers' own
        (causal, over real keys) with each position also seeing itself: the same attention
        for every real position, and no fully masked row. A batch without left padding
        keeps the 2-D mask (transformers then picks its kernels as before), except, for
        `compiled` decoder layers, a batch with no padding at all: from its 2-D mask
        transformers passes the layers no mask (plain causal attention), a call torch.compile
        compiles again (the warm-up's and most batches' masks are tensors), so it gets the
        4-D mask, the same causal attention. The caller gives a model that windows its
        attention the 2-D mask instead (windows_attention)."""
        mask = self.attention_mask
        if bool(mask[:, 0].all()) and not (compiled and bool(mask.all())):
            return mask
        return causal_self_mask(mask)

    def trimmed(self, multiple: int) -> tuple[SequenceBatch, int]:
        """The same rows without the columns that are padding in every row: leading prompt
        padding and the columns after the longest answer, the kept width rounded up to
        `multiple` (few distinct shapes). Returns the batch and how many response columns it
        keeps. Exact: dropped columns are masked out of attention, and positions count real
        tokens only."""
        p, width = self.prompt_length, self.input_ids.shape[1]
        real = self.attention_mask.bool().any(0)
        first = int(real.long().argmax()) if bool(real.any()) else p - 1
        last = width - int(real.flip(0).long().argmax())  # one past the last real column
        begin, end = kept_columns(first, last, p, width, multiple)
        part = SequenceBatch(
            self.input_ids[:, begin:end],
            self.attention_mask[:, begin:end],
            self.response_mask[:, : end - p],
            p - begin,
        )
        return part, end - p

    def spans(self) -> tuple[list[int], list[int]]:
        """Each row's real columns: the first one and one past the last (a row with none
        counts as the one column before its answer)."""
        p, width = self.prompt_length, self.input_ids.shape[1]
        mask = self.attention_mask.bool()
        real = mask.any(1)
        first = torch.where(real, mask.long().argmax(1), p - 1)
        last = torch.where(real, width - mask.flip(1).long().argmax(1), p)
        return first.tolist(), last.tolist()


def causal_self_mask(mask: torch.Tensor) -> torch.Tensor:
    """A padding mask [B, W] -> the boolean attention mask [B, 1, W, W] (True: attend) in
    which each position sees the real keys up to itself, and itself: a padding position
    that no real key precedes is not fully masked (an all-masked row can turn into NaN in
    attention kernels). Real positions attend as under the plain causal padding mask."""
    column = torch.arange(mask.shape[1], device=mask.device)
    attend = (column[None, :] <= column[:, None]) & mask.bool()[:, None, None, :]
    attend.diagonal(dim1=-2, dim2=-1).fill_(True)  # in place: no second [W, W] temporary
    return attend


def kept_columns(first: int, last: int, p: int, width: int, multiple: int) -> tuple[int, int]:
    """The columns [begin, end) that a micro-batch trimmed to `multiple` keeps when its real
    columns span [first, last): at least the last prompt column and the first answer column,
    a width that is a multiple of `multiple` (or the whole width), widened to the left."""
    begin = min(first, p - 1)
    end = max(last, p + 1)
    size = min(-(-(end - begin) // multiple) * multiple, width)
    begin = min(begin, width - size)
    return begin, begin + size


def micro_batches(
    batch: SequenceBatch, cut: MicroBatchRule, multiple: int
) -> list[slice | torch.Tensor]:
    """The rows of each compute micro-batch of a forward over `batch`.

    `multiple` 0 (no trimming, every micro-batch runs at the batch's whole width): the rule's
    row slices, in order. `multiple` >= 1 (each micro-batch is trimmed to its own real
    columns): the rows ordered by where their answers end, longest first, and each micro-batch
    as many as fit in `cut.tokens` at the width it trims to (`kept_columns`), at least
    `cut.least`. Rows of like length then share a micro-batch, so a short answer is not padded
    to a long one's length: with answers of varied length the forward computes about the
    real tokens instead of rows x the longest answer. The largest micro-batch comes first, so
    later ones fit in the memory it leaves cached. Any cut and order give the same sums (the
    loss weights do not depend on the cut)."""
    rows, width = batch.input_ids.shape
    if multiple < 1 or rows <= 1:
        return list(cut.slices(rows, width))
    p = batch.prompt_length
    first, last = batch.spans()
    order = sorted(range(rows), key=lambda i: (-last[i], first[i]))
    groups: list[list[int]] = []
    low = 0
    for i in order:
        if groups:
            group = groups[-1]
            begin, end = kept_columns(min(low, first[i]), last[group[0]], p, width, multiple)
            fits = cut.tokens and (len(group) + 1) * (end - begin) <= cut.tokens
            if len(group) < cut.least or fits:
                group.append(i)
                low = min(low, first[i])
                continue
        groups.append([i])
        low = first[i]
    _no_lone_last_row(groups, cut, first, last, p, width, multiple)
    return [torch.tensor(sorted(group)) for group in groups]


def _no_lone_last_row(
    groups: list[list[int]],
    cut: MicroBatchRule,
    first: list[int],
    last: list[int],
    p: int,
    width: int,
    multiple: int,
) -> None:
    """Where the last micro-batch is one row left over and the one before has rows to
    spare, move that one's shortest row into the last, if the two fit the token budget. A
    one-row batch is a shape of its own to compiled code (torch.compile specializes sizes of
    1 even where rows are marked dynamic), so a step whose rows leave one over would compile
    again, for seconds on a GPU, where the warm-up's full-length rows did not."""
    if len(groups) < 2 or len(groups[-1]) != 1 or len(groups[-2]) <= max(2, cut.least):
        return
    pair = [groups[-2][-1], groups[-1][0]]
    begin, end = kept_columns(
        min(first[i] for i in pair), max(last[i] for i in pair), p, width, multiple
    )
    if cut.tokens and 2 * (end - begin) <= cut.tokens:
        groups[-1].insert(0, groups[-2].pop())


def compiler_failed(exc: BaseException) -> bool:
    """Whether `exc` comes from torch.compile (Dynamo, Inductor, Triton) rather than the model."""
    import torch._dynamo.exc

    module = type(exc).__module__ or ""
    return isinstance(exc, torch._dynamo.exc.TorchDynamoException) or module.startswith(
        ("triton", "torch._inductor")
    )


def many_shapes_options() -> dict[str, Any]:
    """Inductor options for layers compiled for many shapes: no fusion decision that depends
    on a dynamic size. Inductor's mix-order reduction (on GPUs: an RMSNorm backward's two
    reductions in one kernel) fuses only at 4096 or more rows (tokens) and 5 Mi elements,
    checks that on a symbolic size add as guards, so a graph compiled on a micro-batch of one
    side compiled again on the first micro-batch of the other (seen on an H100: the tutorial's
    warm-up at >= 4096 tokens, then step 1's update at fewer, 6 s of compiling). Its
    non-strict mode skips these size checks (PyTorch's documented remedy for such
    recompiles); a PyTorch with the fusion but not that mode compiles these layers without
    the fusion, and one with neither gets no option."""
    import torch._inductor.config as inductor

    if hasattr(inductor.triton, "mix_order_reduction_non_strict_mode"):
        return {"triton.mix_order_reduction_non_strict_mode": True}
    if hasattr(inductor.triton, "mix_order_reduction"):
        return {"triton.mix_order_reduction": False}
    return {}


def compile_layers(model: Any, on: bool, many_shapes: bool = False) -> None:
    """Compile each decoder layer's forward in place (nn.Module.compile: parameter names,
    state dicts and FSDP hooks are unchanged), or with on=False undo it. `many_shapes`: its
    rows and width are dynamic from the first compile (mark_dynamic_layers), with no fusion
    decision that depends on them (many_shapes_options)."""
    options = many_shapes_options() if many_shapes else {}
    for layer in model.model.layers:
        if on:
            layer.compile(**({"options": options} if options else {}))
        else:
            layer._compiled_call_impl = None  # what nn.Module.compile() set
    if on and many_shapes and marks_on():
        mark_dynamic_layers(model)


def layers_compiled(model: Any) -> bool:
    """Whether compile_layers(model, True) compiled the decoder layers."""
    return any(layer._compiled_call_impl is not None for layer in model.model.layers)


def marks_on() -> bool:
    """Whether the dynamic marks are on: RLINF_MARK_DYNAMIC=0 turns them off, for the
    benchmarks' A/B against torch.compile's own dynamic shapes."""
    return os.environ.get("RLINF_MARK_DYNAMIC", "1") != "0"


def mark_dynamic_layers(model: Any) -> None:
    """Before each call of a compiled decoder layer, mark its inputs' rows and width (the
    dimensions of the sizes of hidden_states' first two) as dynamic, so the first compile
    makes a graph for any rows and width instead of one per shape until torch.compile makes
    them symbolic itself (the length-aware cut meets many shapes). Sizes of 1 still
    specialize, and the last dimension of a 3-D input (hidden_states' hidden size, the rotary
    tables' head_dim) never is marked, even where a batch's rows or width equal it: a
    symbolic feature size would make every norm a looped reduction. Call after
    compile_layers(model, True); layers that FSDP2 wraps also need mark_dynamic_after_fsdp."""
    for layer in model.model.layers:
        compiled = layer._compiled_call_impl
        if compiled is None:
            continue

        def call(*args: Any, _compiled: Any = compiled, **kwargs: Any) -> Any:
            _mark_rows_and_width(args, kwargs)
            return _compiled(*args, **kwargs)

        layer._compiled_call_impl = call


def mark_dynamic_after_fsdp(model: Any) -> None:
    """mark_dynamic_layers for layers that FSDP2 wraps (fully_shard, after it): FSDP2's
    pre-forward hook passes a layer's inputs that need gradients through an autograd function
    (its post-backward hook), so the layer's forward, which torch.compile compiles after that
    hook, gets new hidden states without their marks, and the first compile fixes the width
    (one more compile at the next width). A pre-forward hook after FSDP2's (which it
    prepends) marks them again."""
    # Run as Python, not traced: torch.compile traces the compiled layer's hooks, and marks
    # cannot be made inside a graph (FSDP2's own hook already breaks the graph there).
    hook = torch._dynamo.disable(_marks_hook)
    for layer in model.model.layers:
        if layer._compiled_call_impl is not None:
            layer.register_forward_pre_hook(hook, with_kwargs=True)


def _marks_hook(module: Any, args: tuple, kwargs: dict) -> None:
    _mark_rows_and_width(args, kwargs)


def _mark_rows_and_width(args: tuple, kwargs: dict) -> None:
    """Mark the rows and width of a decoder layer's inputs as dynamic (mark_dynamic_layers)."""
    hidden = args[0] if args else kwargs["hidden_states"]
    sizes = {int(hidden.shape[0]), int(hidden.shape[1])}
    for value in (*args, *kwargs.values()):
        for tensor in value if isinstance(value, tuple) else (value,):
            if isinstance(tensor, torch.Tensor):
                features = tensor.dim() - 1 if tensor.dim() == 3 else None
                for dim, size in enumerate(tensor.shape):
                    if size > 1 and size in sizes and dim != features:
                        torch._dynamo.maybe_mark_dynamic(tensor, dim)


T = TypeVar("T")


def run_or_eager(
    run: Callable[[], T],
    compiled: bool,
    go_eager: Callable[[], None],
    what: str,
    then: str,
    failed: Callable[[BaseException], bool] = compiler_failed,
) -> T:
    """`run()`; if it has compiled code (`compiled`) and the compiler fails in it (`failed`),
    warn "<what> failed (<error>); <then>", call `go_eager` and run it once more. Other
    errors, and any error of an eager run, propagate. `run` must be safe to repeat after a
    failure."""
    try:
        return run()
    except Exception as exc:
        if not (compiled and failed(exc)):
            raise
        warnings.warn(f"{what} failed ({type(exc).__name__}: {exc}); {then}", stacklevel=2)
        go_eager()
        return run()


def windows_attention(model: Any) -> bool:
    """Whether some layer of `model` attends within a sliding window
    (config_rules.windows_attention_of, asked of the loaded model's config)."""
    return windows_attention_of(type(model).__name__, model.config)


def keeps_logits(model: Any) -> bool:
    """Whether `model`'s forward takes transformers' `logits_to_keep` (the output head runs on
    the last N positions only); every causal LM family of transformers 5 does."""
    cls: Any = type(model)  # a class is hashable, whatever typeshed says of type[Any]
    return _forward_takes_logits_to_keep(cls)


@functools.cache
def _forward_takes_logits_to_keep(cls: Any) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def response_logprobs(
    model: Any,
    batch: SequenceBatch,
    trim_multiple: int = 0,
    fused: bool = False,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> Any:
    """Log-probabilities of each response token under `model` with its logits divided by the
    sampling temperature (as RLinf's actor and inference compute them), shape [B, R] float32;
    with `with_entropy`, a pair (log-probs, entropy of each position's distribution).

    With `trim_multiple` >= 1 the forward runs on `batch.trimmed(trim_multiple)`; response
    columns it drops (padding in every row) come back as 0. `fused`: the log-softmax runs as
    a compiled kernel (`token_logprobs`; trimmed, its rows and width dynamic from the first
    compile, as the layers' under compile_layers(many_shapes=True))."""
    if trim_multiple >= 1:
        part, kept = batch.trimmed(trim_multiple)
        out = _logprobs(model, part, fused, temperature, with_entropy, many_shapes=True)
        width = batch.responses.shape[1] - kept
        if with_entropy:
            return F.pad(out[0], (0, width)), F.pad(out[1], (0, width))
        return F.pad(out, (0, width))
    return _logprobs(model, batch, fused, temperature, with_entropy, many_shapes=False)


def _packed_logprobs(
    model: Any,
    head: Any,
    batch: SequenceBatch,
    fused: bool,
    temperature: float,
    with_entropy: bool,
    many_shapes: bool,
) -> Any:
    """`_logprobs` with every row's tokens moved left by its prompt padding, so the padding
    follows the real tokens: plain causal attention then never lets a real token see
    padding, and the model gets no mask (SDPA's causal kernels, which skip the blocks above
    the diagonal, instead of a [B, 1, W, W] mask that every block reads). Positions count
    real tokens as before. The output head `head` gets, of each row, only the positions that
    predict its answer tokens (`_head_reads`), so the logits are [B, answer width, vocab] as
    the masked forward's, whatever the rows' padding, and the log-softmax runs on the same
    shapes."""
    from rlinf_twoworker.algorithm import token_logprobs

    p = batch.prompt_length
    rows, width = batch.input_ids.shape
    columns = torch.arange(width, device=batch.input_ids.device)
    lead = (batch.attention_mask[:, :p] == 0).sum(1)  # each row's left padding
    ids = batch.input_ids.gather(1, (columns[None, :] + lead[:, None]) % width)
    # Row i's answer token j now lies at column p - lead_i + j, predicted at the one before.
    answer = torch.arange(width - p, device=ids.device)
    where = (p - 1 - lead)[:, None] + answer[None, :]
    with _head_reads(head, where):
        logits = model(
            input_ids=ids,
            attention_mask=None,
            position_ids=columns.expand(rows, width),
            use_cache=False,
        ).logits
    return token_logprobs(
        logits,
        batch.input_ids[:, p:],
        fused=fused,
        temperature=temperature,
        with_entropy=with_entropy,
        many_shapes=many_shapes,
    )


@contextlib.contextmanager
def _head_reads(head: torch.nn.Module, where: torch.Tensor) -> Iterator[None]:
    """While open, `head` (a model's output embeddings) reads of its input [B, W, hidden] only
    the positions `where` [B, K] of each row: its output is [B, K, vocab], and the gradient
    flows back to those positions."""

    def pick(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        index = where[:, :, None].expand(-1, -1, hidden.shape[-1])
        return (hidden.gather(1, index), *args[1:])

    handle = head.register_forward_pre_hook(pick)
    try:
        yield
    finally:
        handle.remove()


def _logprobs(
    model: Any,
    batch: SequenceBatch,
    fused: bool,
    temperature: float,
    with_entropy: bool,
    many_shapes: bool,
) -> Any:
    from rlinf_twoworker.algorithm import token_logprobs

    # A model that windows its attention gets the 2-D mask: transformers builds its windowed
    # masks from it, and a 4-D one (or none, packed) would replace them.
    windowed = windows_attention(model)
    packed = packs_rows(type(model).__name__, model.config)
    head = model.get_output_embeddings() if packed else None
    if head is not None:
        return _packed_logprobs(model, head, batch, fused, temperature, with_entropy, many_shapes)
    p = batch.prompt_length
    if windowed:
        mask = batch.attention_mask
    else:
        mask = batch.model_attention_mask(compiled=layers_compiled(model))
    # Only the positions that predict an answer token (the last prompt position's and the
    # answer's but its last) go through the output head: the prompt's other positions would
    # make logits (a vocabulary each) that nothing reads.
    predicting = batch.input_ids.shape[1] - p + 1
    keep = {"logits_to_keep": predicting} if keeps_logits(model) else {}
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=mask,
        position_ids=batch.position_ids,
        use_cache=False,
        **keep,
    ).logits
    return token_logprobs(
        logits[:, -predicting:-1],
        batch.input_ids[:, p:],
        fused=fused,
        temperature=temperature,
        with_entropy=with_entropy,
        many_shapes=many_shapes,
    )

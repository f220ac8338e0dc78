"""Hydra's override syntax and RLinf's YAML files, on top of the config schema.

Overrides (`a.b=c`, `+a.b=c`, `a.b=[x,y]`, `a={k:v}`) are read with Hydra's scalar rules, so a
value means what it means on Hydra's command line. RLinf's files load unchanged: keys that have
no meaning here are dropped with a logged note; any other unknown key is an error.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlinf_twoworker.errors import ConfigError

logger = logging.getLogger("rlinf_twoworker.config")

# RLinf keys that exist in its YAML files but have no meaning here (other engines, Megatron
# knobs, Hydra plumbing). They are dropped from a loaded file with a note instead of an error,
# so RLinf's own config files load unchanged; any other unknown key is an error.
IGNORED_RLINF_KEYS = (
    "defaults",
    "hydra",
    "critic",
    "runner.task_type",
    "actor.tokenizer.use_fast",
    "actor.tokenizer.trust_remote_code",
    "actor.tokenizer.padding_side",
    "runner.logger",
    "runner.max_epochs",
    "runner.val_check_interval",
    "algorithm.rollout_batch_size_per_gpu",
    "algorithm.val_rollout_batch_size_per_gpu",
    "algorithm.shuffle_rollout",
    "algorithm.max_num_gen_batches",
    "algorithm.loss_type",
    "algorithm.entropy_bonus",
    "algorithm.calculate_entropy",
    "algorithm.clip_ratio_c",
    "algorithm.clip_ratio_low",
    "algorithm.clip_ratio_high",
    "algorithm.normalize_advantages",
    "algorithm.early_stop_imp_ratio",
    "algorithm.use_valid_token_scale",
    "algorithm.sampling_params.repetition_penalty",
    "algorithm.sampling_params.min_new_tokens",
    "inference.group_name",
    "inference.load_from_actor",
    "inference.tokenizer",
    "inference.fsdp_config",
    "rollout.group_name",
    "rollout.gpu_memory_utilization",
    "rollout.enforce_eager",
    "rollout.distributed_executor_backend",
    "rollout.disable_log_stats",
    "rollout.detokenize",
    "rollout.padding",
    "rollout.eos",
    "rollout.rollout_backend",
    "rollout.sglang",
    "rollout.vllm",
    "rollout.return_logprobs",
    "rollout.tensor_parallel_size",
    "rollout.pipeline_parallel_size",
    "rollout.validate_save_dir",
    "rollout.print_outputs",
    "rollout.sglang_decode_log_interval",
    "rollout.max_running_requests",
    "rollout.cuda_graph_max_bs",
    "rollout.use_torch_compile",
    "rollout.torch_compile_max_bs",
    "data.type",
    "data.dataset_name",
    "data.val_rollout_batch_size",
    "data.num_workers",
    "data.apply_chat_template",
    "data.validation_shuffle",
    "data.val_data_paths",
    "actor.group_name",
    "actor.training_backend",
    "actor.enable_offload",
    "actor.fsdp_config",
    "actor.model.model_type",
    "actor.model.add_bias_linear",
    "actor.model.is_lora",
    "actor.model.tensor_model_parallel_size",
    "actor.model.pipeline_model_parallel_size",
    "actor.model.activation",
    "actor.model.sequence_parallel",
    "actor.model.recompute_method",
    "actor.model.recompute_granularity",
    "actor.model.recompute_num_layers",
    "actor.model.seq_length",
    "actor.model.encoder_seq_length",
    "actor.model.normalization",
    "actor.model.position_embedding_type",
    "actor.model.apply_rope_fusion",
    "actor.model.bias_dropout_fusion",
    "actor.model.persist_layer_norm",
    "actor.model.bias_activation_fusion",
    "actor.model.attention_softmax_in_fp32",
    "actor.model.batch_p2p_comm",
    "actor.model.variable_seq_lengths",
    "actor.model.gradient_accumulation_fusion",
    "actor.model.moe_token_dispatcher_type",
    "actor.model.use_cpu_initialization",
    "actor.optim.bf16",
    "actor.optim.fp16",
    "actor.optim.min_lr",
    "actor.optim.use_distributed_optimizer",
    "actor.optim.overlap_grad_reduce",
    "actor.optim.overlap_param_gather",
    "actor.optim.optimizer_enable_pin",
    "actor.optim.overlap_param_gather_with_optimizer_step",
    "actor.optim.loss_scale",
    "actor.lr_sched.lr_warmup_fraction",
    "actor.lr_sched.max_lr",
    "actor.lr_sched.lr_decay_iters",
    "reward.group_name",
    "reward.use_reward_model",
    "reward.tokenizer",
    "rollout.model.model_type",
    "inference.model.model_type",
    "inference.model.is_lora",
)


def register_rlinf_resolvers() -> None:
    # RLinf's YAML files use these resolvers (max_new_tokens, return_logprobs).
    if not OmegaConf.has_resolver("subtract"):
        OmegaConf.register_resolver("subtract", lambda a, b: a - b)
    if not OmegaConf.has_resolver("not"):
        OmegaConf.register_resolver("not", lambda a: not a)


def _drop_ignored(raw: DictConfig) -> list[str]:
    dropped = []
    for dotted in IGNORED_RLINF_KEYS:
        parent_key, _, leaf = dotted.rpartition(".")
        parent = OmegaConf.select(raw, parent_key) if parent_key else raw
        if isinstance(parent, DictConfig) and leaf in parent:
            parent.pop(leaf)
            dropped.append(dotted)
    return dropped


class _HydraScalarLoader(yaml.SafeLoader):
    """YAML with Hydra's scalar rules, so a value means what it means on Hydra's command line.

    PyYAML follows YAML 1.1: `0123` is octal 83, `12:30` is 750, `no`/`on` are booleans and
    `2024-01-01` is a date. Hydra reads all of those as strings (a RUN_ID must not silently
    become another name), and only `true`/`false` as booleans.
    """


_REPLACED_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float", "timestamp")}
_HydraScalarLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _REPLACED_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_HydraScalarLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|false)$", re.IGNORECASE), list("tTfF")
)
_HydraScalarLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9](?:_?[0-9])*)$"), list("-+0123456789")
)
_HydraScalarLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9](?:_?[0-9])*\.[0-9]*(?:[eE][-+]?[0-9]+)?"
        r"|\.[0-9]+(?:[eE][-+]?[0-9]+)?"
        r"|[0-9](?:_?[0-9])*[eE][-+]?[0-9]+)$"
    ),
    list("-+0123456789."),
)


def _hydra_value_to_yaml(value: str) -> str:
    """Hydra writes flow maps without a space after ':' ({a:0,b:1}); YAML needs one.

    Only colons directly inside a flow map get the space: `${subtract:${a},${b}}` is an
    interpolation and stays as written.
    """
    out, quote, braces = [], "", []  # braces: True for a `${` interpolation, False for a map
    for i, ch in enumerate(value):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "{":
            braces.append(value[i - 1 : i] == "$")
        elif ch == "}" and braces:
            braces.pop()
        elif ch == ":" and braces and not braces[-1] and value[i + 1 : i + 2] not in (" ", ""):
            out.append(": ")
            continue
        out.append(ch)
    return "".join(out)


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse one Hydra override into (kind, key, value); kind is '', '+', '++' or '~'."""
    kind = "++" if text.startswith("++") else text[:1] if text[:1] in "+~" else ""
    body = text[len(kind) :]
    key, sep, raw = body.partition("=")
    key = key.strip()
    if not key or (not sep and kind != "~"):
        raise ConfigError(
            text, text, "an override must look like key=value, +key=value, ++key=value or ~key"
        )
    if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
        raise ConfigError(key, text, "an override key is dot-separated identifiers")
    if sep and not raw.strip():
        return kind, key, ""  # Hydra: `key=` sets the empty string
    try:
        value = yaml.load(_hydra_value_to_yaml(raw), Loader=_HydraScalarLoader) if sep else None
    except yaml.YAMLError as exc:
        raise ConfigError(key, raw, f"value is not valid YAML/Hydra syntax ({exc})") from exc
    return kind, key, value


def apply_override(cfg: DictConfig, text: str) -> None:
    kind, key, value = parse_override(text)
    exists = OmegaConf.select(cfg, key, default=_MISSING) is not _MISSING
    if kind == "~":
        raise ConfigError(key, text, "deleting keys is not supported: every key has a default")
    if kind == "+" and exists:
        raise ConfigError(key, value, "'+' adds a new key but this key exists; drop the '+'")
    if kind == "" and not exists:
        raise ConfigError(key, value, "unknown config key (see docs/config.md for every key)")
    try:
        OmegaConf.update(cfg, key, value, merge=False)
    except OmegaConfBaseException as exc:
        raise ConfigError(key, value, omegaconf_reason(exc)) from exc


_MISSING = object()


def omegaconf_reason(exc: OmegaConfBaseException) -> str:
    first = str(exc).splitlines()[0]
    if "not in struct" in first or "Key '" in first and "not in" in first:
        return "unknown config key (see docs/config.md for every key)"
    return first


def merge_file(cfg: DictConfig, path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError("--config", str(path), "the config file does not exist")
    try:
        raw = OmegaConf.load(path)
    except yaml.YAMLError as exc:
        raise ConfigError("--config", str(path), f"the file is not valid YAML ({exc})") from exc
    if not isinstance(raw, DictConfig):
        raise ConfigError("--config", str(path), "the file must hold a mapping (RLinf's layout)")
    dropped = _drop_ignored(raw)
    if dropped:
        logger.info(
            "%s: RLinf keys with no meaning here were dropped: %s", path, ", ".join(dropped)
        )
    # Section by section, so that an error OmegaConf reports without a key names its section.
    for section in list(raw.keys()):
        try:
            merged = OmegaConf.merge(cfg, OmegaConf.masked_copy(raw, [str(section)]))
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or str(section)
            value = getattr(exc, "value", None)
            if value is None:  # an unknown key's error carries no value
                value = OmegaConf.select(raw, key, default=None, throw_on_missing=False)
            raise ConfigError(f"{key} (in {path})", value, omegaconf_reason(exc)) from exc
        assert isinstance(merged, DictConfig)  # merging into a DictConfig keeps its type
        cfg = merged
    return cfg

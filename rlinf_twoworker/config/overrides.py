"""Hydra's override syntax and RLinf's YAML files, on top of the config schema.

Overrides (`a.b=c`, `+a.b=c`, `a.b=[x,y]`, `a={k:v}`) are read with Hydra's scalar rules, so a
value means what it means on Hydra's command line. Every key of RLinf's files is in the schema,
so they load unchanged (config/rlinf.py says how each key without a setting of its own is taken); a
key that is in neither is an error that names the closest known key.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from rlinf_twoworker.config.hydra_grammar import HydraSyntaxError, parse_value
from rlinf_twoworker.errors import ConfigError


def register_rlinf_resolvers() -> None:
    """RLinf's YAML files use these resolvers (max_new_tokens, return_logprobs). OmegaConf
    2.4's `register_resolver` passes resolved, typed arguments and takes nested interpolations
    (`${subtract:${runner.seq_length}, ${data.max_prompt_length}}`) without a warning. (2.3's
    grammar needs antlr4 4.9, which cannot sit beside the 4.11 of sympy's LaTeX parser that
    RLinf's grader uses: setup.cfg asks for omegaconf >= 2.4.)"""
    if not OmegaConf.has_resolver("subtract"):
        OmegaConf.register_resolver("subtract", lambda a, b: a - b)
    if not OmegaConf.has_resolver("not"):
        OmegaConf.register_resolver("not", lambda a: not a)


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse one Hydra override into (kind, key, value); kind is '', '+', '++' or '~'."""
    kind = "++" if text.startswith("++") else text[:1] if text[:1] in "+~" else ""
    body = text[len(kind) :]
    key, sep, raw = body.partition("=")
    key = key.strip()
    if not key or (not sep and kind != "~"):
        rule = "an override must look like key=value, +key=value, ++key=value or ~key"
        what = f"has no '=' (give {key}=<value>)" if key else "names no key"
        raise ConfigError(text, text, rule, f"override {text!r} {what}: {rule}")
    if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
        raise ConfigError(key, text, "an override key is dot-separated identifiers")
    if not sep:
        return kind, key, None
    try:
        return kind, key, parse_value(raw)  # Hydra's override grammar; `key=` is ""
    except HydraSyntaxError as exc:
        raise ConfigError(key, raw, str(exc)) from None


def apply_override(cfg: DictConfig, text: str, given: set[str] | None = None) -> None:
    """Apply one override. `given` holds the keys the user's file and earlier overrides set:
    as on Hydra's command line, `+key` adds a key and fails on one the user already gave; a
    key that only has its schema default may be added (RLinf's command lines add with `+`
    keys its YAML lacks, such as runner.per_worker_log)."""
    given = set() if given is None else given
    kind, key, value = parse_override(text)
    exists = OmegaConf.select(cfg, key, default=_MISSING) is not _MISSING
    if kind == "~":
        raise ConfigError(key, text, "deleting keys is not supported: every key has a default")
    if kind == "+" and key in given:
        raise ConfigError(
            key, value, "'+' adds a new key but this key was given already; drop the '+'"
        )
    if not exists and not _in_a_mapping(cfg, key):
        raise ConfigError(key, value, unknown_key_rule(cfg, key))
    try:
        with open_dict(cfg) if not exists else contextlib.nullcontext():
            OmegaConf.update(cfg, key, value, merge=False)
    except OmegaConfBaseException as exc:
        reason = omegaconf_reason(exc)
        if "could not be converted" in reason and exists:
            default = OmegaConf.select(cfg, key)
            reason += f"; give a value of the key's type, like its default: {key}={default}"
        raise ConfigError(key, value, reason) from exc
    given.add(key)


def _in_a_mapping(cfg: DictConfig, key: str) -> bool:
    """Whether `key` is a new entry of a mapping-valued key (cluster.component_placement.
    reference, say), which takes any entry; a schema section does not."""
    parent_key, _, _ = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key, default=None) if parent_key else None
    return isinstance(parent, DictConfig) and parent._metadata.object_type in (None, dict)


def schema_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the config (leaves and sections)."""
    keys = []
    for name in cfg:
        dotted = f"{prefix}{name!s}"
        keys.append(dotted)
        child = cfg._get_node(name)  # no interpolation is resolved here
        if isinstance(child, DictConfig):
            keys.extend(schema_keys(child, dotted + "."))
    return keys


def unknown_key_rule(cfg: DictConfig, key: str) -> str:
    """'unknown config key', with the closest known key when one is close."""
    close = difflib.get_close_matches(key, schema_keys(cfg), n=1, cutoff=0.8)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown config key{hint} (see docs/config.md for every key)"


_MISSING = object()


def omegaconf_reason(exc: OmegaConfBaseException) -> str:
    first = str(exc).splitlines()[0]
    if "not in struct" in first or "Key '" in first and "not in" in first:
        return "unknown config key (see docs/config.md for every key)"
    return first


def _searchpath_as_written(raw: DictConfig) -> None:
    """Keep each hydra.searchpath entry as the file writes it, unresolved. RLinf's YAML lists
    `file://${oc.env:REPO_PATH}/...`, an environment variable its launch scripts export; the
    library composes nothing from the search path (it is recorded only), so a YAML as RLinf
    ships it must load without that variable set."""
    paths = OmegaConf.select(raw, "hydra.searchpath", default=None)
    if not isinstance(paths, ListConfig):
        return
    written = OmegaConf.to_container(paths, resolve=False)
    assert isinstance(written, list)  # a ListConfig's container
    raw.hydra.searchpath = [str(entry).replace("${", "\\${") for entry in written]


def merge_file(cfg: DictConfig, path: Path, given: set[str] | None = None) -> DictConfig:
    """Merge an RLinf-layout YAML file into `cfg`; its keys are added to `given`."""
    if not path.is_file():
        raise ConfigError("--config", str(path), "the config file does not exist")
    try:
        raw = OmegaConf.load(path)
    except yaml.YAMLError as exc:
        raise ConfigError("--config", str(path), f"the file is not valid YAML ({exc})") from exc
    if not isinstance(raw, DictConfig):
        raise ConfigError("--config", str(path), "the file must hold a mapping (RLinf's layout)")
    _searchpath_as_written(raw)
    # Section by section, so that an error OmegaConf reports without a key names its section.
    for section in list(raw.keys()):
        try:
            merged = OmegaConf.merge(cfg, OmegaConf.masked_copy(raw, [str(section)]))
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or str(section)
            value = getattr(exc, "value", None)
            if value is None:  # an unknown key's error carries no value
                value = OmegaConf.select(raw, key, default=None, throw_on_missing=False)
            reason = omegaconf_reason(exc)
            if reason.startswith("unknown config key"):
                reason = unknown_key_rule(cfg, key)
            raise ConfigError(f"{key} (in {path})", value, reason) from exc
        assert isinstance(merged, DictConfig)  # merging into a DictConfig keeps its type
        cfg = merged
    if given is not None:
        given.update(schema_keys(raw))
    return cfg

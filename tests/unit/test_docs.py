"""The docs cannot fall behind the code: every config key and every CLI subcommand is documented."""

from __future__ import annotations

import argparse
import dataclasses
import re

from support import REPO

from rlinf_twoworker.api.cli import build_parser
from rlinf_twoworker.config import GRPOConfig

ROOT = REPO
DOCS = ROOT / "docs"


def schema_keys(node: object, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections included, walking the default instance (its
    defaults are what a section really holds, e.g. the actor's fp32 model config)."""
    keys = []
    for field in dataclasses.fields(node):  # type: ignore[arg-type]
        key = f"{prefix}{field.name}"
        keys.append(key)
        value = getattr(node, field.name)
        if dataclasses.is_dataclass(value):
            keys += schema_keys(value, f"{key}.")
    return keys


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert actions, "rlinf-twoworker has no subcommands"
    return dict(actions[0].choices)


def all_docs() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md")))


def test_schema_walk_finds_nested_keys():
    keys = schema_keys(GRPOConfig())
    assert "runner.max_steps" in keys and "cluster.preflight.check_collective" in keys
    assert "actor.model.precision" in keys and len(keys) > 90


def test_every_config_key_is_in_the_config_reference():
    text = (DOCS / "config.md").read_text(encoding="utf-8")
    missing = [k for k in schema_keys(GRPOConfig()) if f"`{k}`" not in text]
    assert missing == [], f"docs/config.md does not document: {missing}"


def test_every_rlinf_rule_is_in_the_config_reference():
    """Each RLinf key without a setting of its own (config.rlinf.RULES) is listed, so a user finds
    how the library takes it."""
    from rlinf_twoworker.config.rlinf import RULES

    text = (DOCS / "config.md").read_text(encoding="utf-8")
    missing = [r.key for r in RULES if f"`{r.key}`" not in text]
    assert missing == [], f"docs/config.md does not list these RLinf keys: {missing}"


def test_every_subcommand_is_in_the_docs():
    text = all_docs()
    missing = [name for name in subcommands() if f"rlinf-twoworker {name}" not in text]
    assert missing == [], f"docs/ never mention: {['rlinf-twoworker ' + m for m in missing]}"


def test_every_subcommand_option_is_in_the_docs():
    text = all_docs()
    missing = [
        f"rlinf-twoworker {name} {option}"
        for name, sub in subcommands().items()
        for action in sub._actions
        for option in action.option_strings
        if option.startswith("--")
        and option != "--help"
        and f"`{option}`" not in text
        and f"{option} " not in text
    ]
    assert missing == [], f"docs/ never mention these options: {missing}"


def _listed_files(text: str) -> set[str]:
    """Module lines of a tree listing: `  api/handle.py  what it is` (or `  errors.py  ...`)."""
    return set(re.findall(r"^ {2,}((?:\w+/)?\w+\.py) ", text, re.M))


def test_every_module_has_its_line_in_the_readme_and_the_architecture_doc():
    package = ROOT / "rlinf_twoworker"
    modules = {
        str(p.relative_to(package)) for p in package.rglob("*.py") if p.name != "__init__.py"
    }
    for doc in ("README.md", "docs/architecture.md"):
        listed = _listed_files((ROOT / doc).read_text())
        assert listed == modules, f"{doc}: missing {modules - listed}, stale {listed - modules}"


SECTIONS = ("cluster", "runner", "algorithm", "data", "actor", "rollout", "inference", "reward")


def test_every_config_key_the_docs_name_exists():
    """A key written in the docs (`runner.max_tokens_per_mbs`, `actor.optim.lr=...`) is a key
    of the schema, an entry of a mapping-valued key (`cluster.component_placement.actor`) or one
    a key inside an RLinf engine setting (`rollout.sglang.*`), so no page tells users to set
    something that is not there. Quoted error messages about unknown keys and file names are not keys."""
    known = set(schema_keys(GRPOConfig()))
    mappings = {k for k in known if isinstance(_default(k), dict)}
    sections = "|".join(SECTIONS)
    pattern = re.compile(rf"(?<![\w./-])((?:{sections})(?:\.\w+)+)")
    texts = {p.name: p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md"))}
    texts["README.md"] = (ROOT / "README.md").read_text(encoding="utf-8")
    unknown = set()
    for name, text in texts.items():
        text = re.sub(r"config key '[^']*'", "", text)
        for key in pattern.findall(text):
            if key.rpartition(".")[2] in FILE_SUFFIXES or key in known:
                continue
            if any(k.startswith(f"{key}.") for k in known):
                continue  # a section
            if any(key.startswith(f"{m}.") for m in mappings):
                continue
            unknown.add((name, key))
    assert unknown == set(), f"docs name keys the config does not have: {sorted(unknown)}"


FILE_SUFFIXES = {"py", "pt", "json", "yaml", "md", "log", "jsonl"}


def _default(key: str) -> object:
    node: object = GRPOConfig()
    for part in key.split("."):
        node = getattr(node, part, None)
    return node

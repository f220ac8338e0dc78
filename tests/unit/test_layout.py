"""The package's shape: no import circles (TYPE_CHECKING imports included), and the list of
components written once, in components.py."""

from __future__ import annotations

import ast
from pathlib import Path

from support import REPO

PACKAGE = REPO / "rlinf_twoworker"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at any depth of its code."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                # `from pkg import submodule` reads the submodule; `from pkg import name`, pkg
                targets = [t for t in subs if t in modules] or [node.module]
            # A package's parents are imported before it whatever it says: not an edge.
            graph[name] |= {
                t for t in targets if t in modules and t != name and not name.startswith(t + ".")
            }
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_finder_sees_a_circle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_of_the_package_is_in_an_import_circle():
    graph = import_graph()
    assert len(graph) > 40  # every module was read
    assert cycle(graph) is None


def test_the_components_are_listed_once():
    """A tuple, list or set of two or more component names written anywhere but the table
    (run.step names stages, which is its job, one name at a time)."""
    names = {"rollout", "reward", "inference", "actor", "reference"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "components.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                words = [e.value for e in node.elts if isinstance(e, ast.Constant)]
                if len(names & set(words)) >= 2:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []


def test_each_component_gets_its_own_settings_from_its_row():
    """A worker is built from its row's settings (config/settings.py), not the run's config:
    no settings object holds the config or a whole section other than its own; the model each
    names is the one its worker loads (the reference: the actor's initial weights, in the
    inference copy's precision; the reward: none); the cuts are the config's own rule."""
    import dataclasses
    import pickle

    from rlinf_twoworker import components
    from rlinf_twoworker.config import (
        ClusterConfig,
        DataConfig,
        GRPOConfig,
        InferenceConfig,
        RunnerConfig,
    )
    from rlinf_twoworker.config.settings import ProcessSettings

    cfg = GRPOConfig()
    settings = {row.name: row.settings_for(cfg) for row in components.TABLE}
    whole = (GRPOConfig, RunnerConfig, DataConfig, ClusterConfig, InferenceConfig)
    for name, made in settings.items():
        assert isinstance(made, ProcessSettings), name
        values = [getattr(made, f.name) for f in dataclasses.fields(made)]
        assert not [v for v in values if isinstance(v, whole)], name
        assert made.accelerator == cfg.cluster.accelerator and made.seed == cfg.actor.seed
        pickle.dumps(made)  # sent to the component's process
    assert settings["reward"].model is None and settings["reward"].reward is cfg.reward
    assert settings["rollout"].model is cfg.rollout.model
    assert settings["inference"].model is cfg.inference.model
    assert settings["actor"].model is cfg.actor.model
    reference = settings["reference"].model
    assert reference.model_path == cfg.actor.model.model_path
    assert reference.precision == cfg.inference.model.precision
    for width in (1, 100, 2048, 10**6):
        assert settings["actor"].micro_batch.rows(width) == cfg.micro_batch_rows(True, width)
        assert settings["inference"].micro_batch.rows(width) == cfg.micro_batch_rows(False, width)
    assert settings["rollout"].max_new_tokens == cfg.max_new_tokens
    assert settings["actor"].offloads == cfg.offloads

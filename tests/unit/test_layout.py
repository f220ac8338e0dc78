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


def test_the_model_section_of_each_component_comes_from_its_row():
    """components.model_section: the section whose model the component loads, from the table
    (the reference loads the actor's initial weights; the reward loads none), and None for a
    config that lacks the section, as the stand-in configs of the group's tests do."""
    from types import SimpleNamespace

    from rlinf_twoworker import components
    from rlinf_twoworker.config import GRPOConfig

    cfg = GRPOConfig()
    for component in components.TABLE:
        got = components.model_section(cfg, component.name)
        want = None if component.model_section is None else getattr(cfg, component.model_section)
        assert got is want, component.name
    assert components.model_section(cfg, "reward") is None
    assert components.model_section(cfg, "reference") is cfg.actor
    assert components.model_section(SimpleNamespace(), "rollout") is None
    assert components.model_section(cfg, "no-such-component") is None

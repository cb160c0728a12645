"""The packages' import graph has no cycle: every import counts (module level, in a function, under TYPE_CHECKING).

A method plug-in must not reach back into its trainer, the run loop must not reach into checkpoint internals that
import it, and so on: a cycle is where a narrow boundary has leaked. Read from the source with `ast`, so nothing
is imported here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flowgrpo", "pipelines", "reward_models")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the tree that `name` imports anywhere in its file (a package's face counts as the package)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `from pkg import name`: the module pkg.name, else pkg itself
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    graph = {m: _imports(m, p, known) for m, p in mods.items()}
    # a package's __init__ that only re-exports its submodules is how they are reached, not a dependency of theirs
    for m, p in mods.items():
        if p.name == "__init__.py":
            for sub in [s for s in graph if s.startswith(m + ".")]:
                graph[sub].discard(m)
    return graph


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_the_packages():
    graph = _graph()
    assert len(graph) > 100 and "flowgrpo.t2i.trainer" in graph["flowgrpo.t2i"]
    assert _cycles(graph) == []


def test_method_plugins_never_import_their_trainer():
    graph = _graph()
    plugins = [m for m in graph if m.rsplit(".", 1)[-1] in ("methods", "grpo", "nft", "adversarial")]
    assert len(plugins) >= 6
    for m in plugins:
        assert not {d for d in graph[m] if d.endswith(".trainer")}, m

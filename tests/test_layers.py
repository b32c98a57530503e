"""The package's import graph: pipeline -> stages -> transfer -> transfer.compat, no import pointing up, no circle.

Every import counts, module-level or inside a function (a lazy import is still a dependency).
The graph is read from the source with `ast`, so the test sees what a reader sees. No module is
exempt: the config-key helpers (stages/keys.py) sit in stages/, and transfer/ reads its recipe
section (stages/transfer_config.py) without importing it.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("transfer.compat", "transfer", "stages", "pipeline")    # bottom to top: each may import only those before it
PACKAGES = ("transfer", "stages", "pipeline")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import sub` names the submodule when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                dep = _resolve(t, modules)
                if dep is not None and dep != mod:
                    graph[mod].add(dep)
    return graph


def _layer(mod: str) -> int:
    """The layer of the longest layer name `mod` is or sits in (transfer.compat before transfer)."""
    return max((i for i, layer in enumerate(LAYERS) if mod == layer or mod.startswith(layer + ".")),
               key=lambda i: len(LAYERS[i]))


def test_no_import_points_up():
    graph = import_graph()
    up = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if _layer(d) > _layer(m))
    assert not up, "imports from a lower layer into a higher one:\n" + "\n".join(up)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_circle():
    found = cycles(import_graph())
    assert not found, "modules that import each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_can_fail():
    """The checker sees a circle and an upward edge when there is one."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    g = import_graph()
    assert "stages.schema" in g["stages.reward"]            # the graph is really read
    assert _layer("pipeline.controller") > _layer("stages.reward") > _layer("transfer.mesh") \
        > _layer("transfer.compat.torch_api")

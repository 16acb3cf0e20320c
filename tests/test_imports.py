"""The package's import graph has no cycle: module-level imports and the ones inside functions alike
(a function-level import only hides a cycle until that function runs)."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (REPO / "pipeline").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (``from a.b import c`` is a.b.c when c is a module)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in mods else node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_scan_finds_a_cycle_through_a_function_level_import():
    graph = import_graph()
    assert "pipeline.tokenization.bpe" in graph["pipeline.adapters.latex_ocr_junia"]  # it sees real imports
    graph["pipeline.tokenization.bpe"] = graph["pipeline.tokenization.bpe"] | {"pipeline.adapters.latex_ocr_junia"}
    assert any({"pipeline.adapters.latex_ocr_junia", "pipeline.tokenization.bpe"} <= set(c) for c in cycles(graph))


def test_tokenization_never_imports_a_model_adapter():
    """Tokenization is model-agnostic: the model's vocabulary reaches it through the adapter."""
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("pipeline.tokenization"):
            assert not [d for d in deps if d.startswith("pipeline.adapters")], name


def _script_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from pipeline... import name`` in a script (``import pipeline.x``: name "")."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pipeline":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "pipeline"]
    return found


def test_benchmark_scripts_use_the_public_library_layer_only():
    """benchmarks/ scripts read artifacts through the library, never a stage's module or a private name."""
    scripts = sorted((REPO / "benchmarks").glob("*.py"))
    assert scripts and any(_script_imports(p) for p in scripts)  # the scan sees their imports
    for path in scripts:
        for module, name in _script_imports(path):
            assert not module.startswith("pipeline.stages") and name != "stages", (path.name, module, name)
            assert not name.startswith("_") and not any(part.startswith("_") for part in module.split(".")), \
                (path.name, module, name)

"""The import graph of echo_jax/ and models/, read statically from the source (no import runs).

Every ``import`` / ``from ... import`` of an echo_jax.* or models.* module counts, at module level
and inside functions alike: a cycle hidden in a function body is still a cycle of the design. An
edge goes to the most specific module named (``from models import cli`` -> models.cli); a
package's ``__init__`` is the package's own module.

Checked: the library never imports the models; no module of models/ is on an import cycle; no
module of echo_jax/ is either (the transports sit below collective, p2p and p2p_cuda).
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("echo_jax", "models")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict:
    """{module name: source path} of every .py file in the packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            out[_module_name(path)] = path
    return out


def _imported(node, current: str, is_package: bool, modules) -> list:
    """The echo_jax / models modules an Import or ImportFrom node names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = current.split(".") if is_package else current.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            root = ".".join(base + ([node.module] if node.module else []))
        else:
            root = node.module or ""
        names = [f"{root}.{a.name}" if f"{root}.{a.name}" in modules else root
                 for a in node.names]
    out = []
    for name in names:
        if name.split(".")[0] not in PACKAGES:
            continue
        while name not in modules and "." in name:  # `import a.b.c` of a non-module attribute
            name = name.rsplit(".", 1)[0]
        if name in modules:
            out.append(name)
    return out


def import_graph() -> dict:
    """{module: set of echo_jax / models modules it imports anywhere in its source}."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_imported(node, name, path.name == "__init__.py", modules))
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert "models.model" in graph and "echo_jax.collective" in graph
    assert "models.config" in graph["models.model"]
    # A self-check of the parser on a known function-level import: a cycle that only appears
    # inside a function body must not be missed.
    tree = ast.parse("def f():\n    from models import cli\n    import echo_jax.tp\n")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(_imported(node, "models.x", False, _modules()))
    assert found == {"models.cli", "echo_jax.tp"}


def test_the_library_never_imports_the_models():
    graph = import_graph()
    bad = {m: sorted(e for e in edges if e.split(".")[0] == "models")
           for m, edges in graph.items() if m.split(".")[0] == "echo_jax"}
    assert not {m: e for m, e in bad.items() if e}


def test_no_import_cycle_involves_models():
    bad = [c for c in cycles(import_graph()) if any(m.split(".")[0] == "models" for m in c)]
    assert not bad


def test_no_import_cycle_inside_echo_jax():
    assert not cycles(import_graph())

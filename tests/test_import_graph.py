"""The import graph of echo_jax/, echo_jax_tools/ and models/, read statically (no import runs).

Every ``import`` / ``from ... import`` of an echo_jax.*, echo_jax_tools.* or models.* module
counts, at module level and inside functions alike: a cycle hidden in a function body is still a
cycle of the design. An edge goes to the most specific module named (``from models import cli``
-> models.cli); a package's ``__init__`` is the package's own module.

Checked: neither the library nor its tools import the models; no module of echo_jax/ imports
echo_jax_tools at import time (only a command's handler may, when it runs: `python -m echo_jax
demo`); no module is on an import cycle (the transports sit below collective, p2p and p2p_cuda;
the tools above the library).
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("echo_jax", "echo_jax_tools", "models")


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


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _import_time_nodes(tree):
    """The nodes of a module that run when it is imported: all but the bodies of functions."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _FUNCTIONS):
                # Decorators and default values run at import time; the body does not.
                todo.extend(child.decorator_list)
                if not isinstance(child, ast.Lambda):
                    todo.extend(d for d in child.args.defaults + child.args.kw_defaults if d)
                continue
            todo.append(child)


def import_graph(import_time_only: bool = False) -> dict:
    """{module: set of echo_jax / echo_jax_tools / models modules it imports in its source}.

    Args:
      import_time_only: count only the imports that run when the module is imported (not those
        inside a function body); by default every import anywhere counts.
    """
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = set()
        nodes = _import_time_nodes(tree) if import_time_only else ast.walk(tree)
        for node in nodes:
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


def test_the_graph_tells_import_time_imports_from_function_level_ones():
    tree = ast.parse("import echo_jax.tp\nif True:\n    from echo_jax import quant\n"
                     "def f(x=None):\n    from echo_jax_tools import demo\n"
                     "class C:\n    from echo_jax import rotation\n")
    found = set()
    for node in _import_time_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(_imported(node, "models.x", False, _modules()))
    assert found == {"echo_jax.tp", "echo_jax.quant", "echo_jax.rotation"}
    assert "echo_jax_tools.demo" in import_graph()["echo_jax.__main__"]
    assert "echo_jax_tools.demo" not in import_graph(import_time_only=True)["echo_jax.__main__"]


def test_neither_the_library_nor_its_tools_import_the_models():
    graph = import_graph()
    bad = {m: sorted(e for e in edges if e.split(".")[0] == "models")
           for m, edges in graph.items() if m.split(".")[0] in ("echo_jax", "echo_jax_tools")}
    assert not {m: e for m, e in bad.items() if e}


def test_the_library_never_imports_its_tools_at_import_time():
    graph = import_graph(import_time_only=True)
    assert "echo_jax_tools.bench" in graph and "echo_jax.collective" in graph["echo_jax_tools.demo"]
    bad = {m: sorted(e for e in edges if e.split(".")[0] == "echo_jax_tools")
           for m, edges in graph.items() if m.split(".")[0] == "echo_jax"}
    assert not {m: e for m, e in bad.items() if e}


def test_importing_the_library_loads_no_tool():
    """`import echo_jax` and every module of the library, in a fresh interpreter: no module of
    echo_jax_tools is loaded (what the static check above says, checked by running it)."""
    names = sorted(m for m in _modules() if m.split(".")[0] == "echo_jax")
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'echo_jax_tools'))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_no_import_cycle_involves_models():
    bad = [c for c in cycles(import_graph()) if any(m.split(".")[0] == "models" for m in c)]
    assert not bad


def test_no_import_cycle():
    assert not cycles(import_graph())


def test_the_p2p_modules_are_deprecated_aliases_of_the_transports(tmp_path):
    """echo_jax.p2p warns for every name it gave, naming its home; importing echo_jax.p2p_cuda warns, at the importing line, naming echo_jax.transports.cuda.
    A fresh interpreter: the warning of a module's import comes once per process."""
    code = """
import importlib, linecache, warnings
warnings.simplefilter("error")
from echo_jax import p2p
from echo_jax import transports
from echo_jax.transports import base, cpu
assert {"p2p_allreduce", "p2p_allreduce_compensated"} <= set(p2p.DEPRECATED)
for name, home in sorted(p2p.DEPRECATED.items()):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        value = getattr(p2p, name)
    (w,) = seen
    assert w.category is DeprecationWarning and f"use {home}." in str(w.message), (name, w)
    if name != "choose":
        assert value is getattr(importlib.import_module(home), name), name
try:
    p2p.no_such_name
except AttributeError:
    pass
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    from echo_jax import p2p_cuda  # the line that warns
(w,) = seen
assert w.category is DeprecationWarning and "echo_jax.transports.cuda" in str(w.message), w
assert w.filename == __file__, w.filename
assert "import p2p_cuda" in linecache.getline(w.filename, w.lineno), w.lineno
from echo_jax.transports import cuda
assert p2p_cuda.virtual_allreduce is cuda.virtual_allreduce
print("ok")
"""
    script = tmp_path / "old_names.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "ok", out.stdout

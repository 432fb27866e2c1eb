"""The package's import graph keeps its shape: no cycle, kernels below layers, switches read once.

The graph is read from the source with ast (nothing is imported): an edge for every absolute
`mimo_fn.` import, in-function ones included (a lazy import that hides a cycle is still the
cycle), and for relative imports. `from mimo_fn.a import b` points at the module mimo_fn.a.b
when that is a module, else at mimo_fn.a. A submodule's implicit import of its parent package
is not an edge.
"""

import ast
import pathlib
import re

import mimo_fn

ROOT = pathlib.Path(mimo_fn.__file__).parent
# What a kernel may import besides other kernels: the modules below every kernel.
BELOW_KERNELS = {"mimo_fn._types", "mimo_fn.options", "mimo_fn.quant"}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str, modules: dict) -> str | None:
    """The module a dotted import name lands in (mimo_fn.a.b.X -> mimo_fn.a.b), or None outside mimo_fn."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(mod: str, path: pathlib.Path, modules: dict) -> set[str]:
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] == "mimo_fn":
                r = _resolve(t, modules)
                if r is not None and r != mod:
                    out.add(r)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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


def test_the_checker_sees_in_function_and_relative_imports(tmp_path):
    # the rules below are only as good as the edges: check the reader on a made-up package
    pkg = tmp_path / "mimo_fn"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels" / "__init__.py").write_text("")
    (pkg / "kernels" / "a.py").write_text("def f():\n    from mimo_fn.kernels.b import g\n")
    (pkg / "kernels" / "b.py").write_text("from . import a\nfrom .a import f\nimport mimo_fn.kernels\n")
    modules = {_module_name_in(tmp_path, p): p for p in pkg.rglob("*.py")}
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert graph["mimo_fn.kernels.a"] == {"mimo_fn.kernels.b"}
    assert graph["mimo_fn.kernels.b"] == {"mimo_fn.kernels.a", "mimo_fn.kernels"}
    assert _cycles(graph) == [["mimo_fn.kernels.a", "mimo_fn.kernels.b"]]


def _module_name_in(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycle():
    assert _cycles(import_graph()) == []


def test_kernels_import_nothing_above_them():
    bad = sorted((m, t) for m, targets in import_graph().items() if m.startswith("mimo_fn.kernels")
                 for t in targets if not (t.startswith("mimo_fn.kernels") or t in BELOW_KERNELS))
    assert bad == [], f"kernels/ imports from layers/ or above: {bad}"


def test_model_reaches_kernels_through_layers():
    graph = import_graph()
    assert not [t for t in graph["mimo_fn.model"] if t.startswith("mimo_fn.kernels")]


def _environ_reads(tree: ast.AST) -> list[int]:
    """Lines with a string literal that is exactly a switch's name ('MIMO_FN_...'): what reading
    one from os.environ takes, however the mapping is spelled (os.environ, os.getenv, an alias).
    Prose that mentions a variable (docstrings, messages: 'MIMO_FN_X=0 turns ...') is not one."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and re.fullmatch(r"MIMO_FN_[A-Z0-9_]+", n.value)]


def test_environment_switches_are_read_in_options_only():
    found = {}
    for mod, path in _modules().items():
        if mod != "mimo_fn.options":
            lines = _environ_reads(ast.parse(path.read_text()))
            if lines:
                found[mod] = sorted(set(lines))
    assert found == {}, f"MIMO_FN_* environment reads outside mimo_fn/options.py: {found}"
    # and the reader finds the ones that are there
    assert _environ_reads(ast.parse((ROOT / "options.py").read_text()))


# Modules known to be over the size rule (none: a module that grows past it holds two ideas).
KNOWN_OVER_500_LINES: set[str] = set()


def test_modules_stay_under_500_lines():
    over = {mod for mod, path in _modules().items() if len(path.read_text().splitlines()) > 500}
    assert over <= KNOWN_OVER_500_LINES, f"modules over 500 lines: {sorted(over - KNOWN_OVER_500_LINES)}"

"""The package's shape, read from its source with `ast` (nothing is imported): no import cycle between its folders
or between its modules, no module over `MAX_LINES` lines and no function over `MAX_FUNCTION_LINES` lines of code
(issue 60).

Every import counts, wherever it is written: at module level, inside a function, under ``if TYPE_CHECKING``. A
folder is a subpackage of the package (`arrays`, `formats`, ...); a module at the top of the package is a folder
of its own (`checkpointer`, `cli`, ...).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

PACKAGE = "xla_tensorstore_ckpt"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
MAX_LINES = 400
MAX_FUNCTION_LINES = 60  # of code: its docstring, blank lines and comment lines not counted


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package under `root`, by dotted name (a package by its own name, for its `__init__`)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _target(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name of what `from <node.module> import ...` in `module` names, before its names."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in its source. `from p import x` names the module
    `p.x` if there is one, else `p`. (The parent packages Python runs first are not edges: a package's
    `__init__` importing its own modules would make every module of it a cycle.)"""
    known = modules(root)
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        is_package = path.name == "__init__.py"
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = _target(module, is_package, node)
                for alias in node.names:
                    found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
        graph[module] = {name for name in found if name in known and name != module}
    return graph


def folder(module: str) -> str:
    """The folder a module belongs to: its subpackage, or the top-level module itself (`__init__` for the
    package's own)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def folder_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """folder -> folder it imports -> the (importer, imported) module pairs that make the edge."""
    out: dict[str, dict[str, list[tuple[str, str]]]] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = folder(module), folder(target)
            if a != b:
                out.setdefault(a, {}).setdefault(b, []).append((module, target))
    return out


def cycles(graph: dict[str, set[str]] | dict[str, dict]) -> list[list[str]]:
    """The import cycles of `graph`, each a path that returns to its start: for every strongly connected
    component of more than one node (Tarjan's algorithm), shortest cycles through its nodes until each node is on
    one; sorted, so the message is stable."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    found = []
    for component in components:
        covered: set[str] = set()
        for node in sorted(component):
            if node not in covered:
                cycle = _one_cycle(graph, component, node)
                covered.update(cycle)
                found.append(cycle)
    return sorted(found)


def _one_cycle(graph: dict, component: set[str], start: str) -> list[str]:
    """A shortest cycle through `start` inside its strongly connected `component` (breadth first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ())):
                if nxt not in component:
                    continue
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if nxt not in parents:
                    parents[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"no cycle through {start}")  # a component of more than one node always has one


def _describe(cycle: list[str], edges: dict[str, dict[str, list[tuple[str, str]]]]) -> str:
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        pairs = edges[a][b]
        shown = ", ".join(f"{m} -> {t}" for m, t in sorted(pairs)[:3])
        more = f" (+{len(pairs) - 3} more)" if len(pairs) > 3 else ""
        steps.append(f"  {a}/ -> {b}/: {shown}{more}")
    return " -> ".join(cycle) + "\n" + "\n".join(steps)


def test_no_import_cycle_between_folders():
    edges = folder_graph(imports())
    found = cycles(edges)
    assert not found, "import cycles between folders:\n" + "\n".join(_describe(c, edges) for c in found)


def test_no_import_cycle_between_modules():
    graph = imports()
    found = cycles(graph)
    assert not found, "import cycles between modules:\n" + "\n".join(" -> ".join(c) for c in found)


# The folders in the order of the README's map (the modules at the top of the package where they fall): each
# imports only folders before it.
LAYERS = ("version", "core", "storage", "arrays", "formats", "targets", "multihost", "options", "incremental",
          "saves", "restores", "checkpointer", "checkpoint_manager", "tools", "views", "dcp_storage", "integrations",
          "cli", "__init__", "__main__")


def test_folders_import_only_the_folders_before_them():
    edges = folder_graph(imports())
    assert set(edges) | {b for targets in edges.values() for b in targets} <= set(LAYERS), "a new folder: add it"
    upward = [f"{a}/ -> {b}/: " + ", ".join(f"{m} -> {t}" for m, t in sorted(pairs)[:3])
              for a, targets in sorted(edges.items()) for b, pairs in sorted(targets.items())
              if LAYERS.index(b) > LAYERS.index(a)]
    assert not upward, "folders importing a folder after them in the README's order:\n" + "\n".join(upward)


def test_no_module_over_the_line_limit():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by idea): " + ", ".join(
        f"{name} ({n})" for name, n in sorted(long.items(), key=lambda kv: -kv[1]))


def code_lines(source: str) -> dict[str, int]:
    """Each function of `source` (by its dotted path in the module: ``Class.method``, ``outer.inner``) and its
    lines of code: from its first statement after the docstring to its end, blank and comment lines left out."""
    lines = source.splitlines()
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = child.body
                has_doc = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                           and isinstance(body[0].value.value, str))
                first = body[0].end_lineno + 1 if has_doc else body[0].lineno
                out[prefix + child.name] = sum(1 for line in lines[first - 1:child.end_lineno]
                                               if line.strip() and not line.strip().startswith("#"))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(source), "")
    return out


def test_no_function_over_the_line_limit():
    long = {f"{name}.{function}": n for name, path in modules().items()
            for function, n in code_lines(path.read_text()).items() if n > MAX_FUNCTION_LINES}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines of code (split them by step): " + ", ".join(
        f"{name} ({n})" for name, n in sorted(long.items(), key=lambda kv: -kv[1]))


def test_the_function_count_skips_docstrings_and_comments():
    source = textwrap.dedent('''\
        def f():
            """Doc.

            More."""
            # why
            a = 1

            return a


        class C:
            def m(self):
                def inner():
                    return 2
                return inner()
        ''')
    assert code_lines(source) == {"f": 2, "C.m": 3, "C.m.inner": 1}


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The checks above are only as good as the graph: a cycle made by a function-level import, a relative
    `from . import x`, a `from ..pkg.mod import name` and an import under TYPE_CHECKING is found."""
    pkg = tmp_path / PACKAGE
    for folder_name in ("a", "b", "c"):
        (pkg / folder_name).mkdir(parents=True)
        (pkg / folder_name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "one.py").write_text("from ..b.two import f\n")
    (pkg / "b" / "two.py").write_text("def f():\n    from ..c import three\n    return three\n")
    (pkg / "c" / "three.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n")
    (pkg / "a" / "__init__.py").write_text("from . import one\n")
    graph = imports(pkg)
    assert graph[f"{PACKAGE}.a"] == {f"{PACKAGE}.a.one"}
    assert graph[f"{PACKAGE}.a.one"] == {f"{PACKAGE}.b.two"}
    assert graph[f"{PACKAGE}.b.two"] == {f"{PACKAGE}.c.three"}
    assert cycles(folder_graph(graph)) == [["a", "b", "c", "a"]]
    (pkg / "c" / "three.py").write_text("")
    assert cycles(folder_graph(imports(pkg))) == []


# Folders whose `__init__` docstring does not yet name every module (issue 60, left): checked for a docstring only.
UNNAMED_MODULES_ALLOWED = {"storage", "dcp_storage", "integrations", "views"}


@pytest.mark.parametrize("package", sorted(
    str(p.parent.relative_to(ROOT)) for p in ROOT.rglob("__init__.py") if p.parent != ROOT))
def test_every_folder_says_what_it_owns(package):
    """Each folder's `__init__` docstring says what it owns, naming each of its modules and subfolders."""
    folder_path = ROOT / package
    doc = ast.get_docstring(ast.parse((folder_path / "__init__.py").read_text())) or ""
    assert len(doc) > 80, f"{package}/__init__.py: its docstring says what the folder owns"
    if package in UNNAMED_MODULES_ALLOWED:
        return
    parts = [p.stem for p in folder_path.glob("*.py") if p.stem != "__init__"]
    parts += [p.name for p in folder_path.iterdir() if (p / "__init__.py").exists()]
    unnamed = sorted(m for m in parts if f"`{m}" not in doc)
    assert not unnamed, f"{package}/__init__.py does not name its modules {unnamed}"


def test_thread_pools_are_sized_in_one_place():
    """Every thread pool of the package gets its size from `core.threads` (a pool of it, or a count it gave):
    no module writes a thread count of its own."""
    sized_here = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "core" / "threads.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == \
                    "ThreadPoolExecutor":
                sizes = [*node.args[:1], *(k.value for k in node.keywords if k.arg == "max_workers")]
                if not sizes or any(isinstance(n, ast.Constant) or "threads.count" not in ast.unparse(n)
                                    and not isinstance(n, ast.Name) for n in sizes):
                    sized_here.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not sized_here, "\n".join(sized_here)


_ALLOCATIONS = {"empty", "empty_like", "bytearray", "mmap"}  # uninitialised memory: what is made to be written into


def _kept_allocations(tree: ast.Module) -> list[ast.AST]:
    """The nodes of `tree` that keep a reusable buffer of their own: a `threading.local`, or an uninitialised
    allocation (`np.empty`, `bytearray`, `mmap.mmap`) stored where it outlives the call: in an attribute
    (``self.x = np.empty(...)``, ``self.x[k] = ...``) or at the module's top level."""
    kept = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "local" and getattr(node.value, "id", "") == "threading":
            kept.append(node)
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        allocates = any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", "")) in _ALLOCATIONS
                        for n in ast.walk(node.value))
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if allocates and (node in tree.body or any(isinstance(n, ast.Attribute) for t in targets for n in ast.walk(t))):
            kept.append(node)
    return kept


def test_reusable_buffers_live_in_one_pool():
    """Memory written again and again is made, sized and kept by `core.buffers` (`of_thread`, `take`/`give`,
    `Carved`): no other module keeps a buffer of its own for reuse (a per-thread one, or an uninitialised
    allocation stored beyond the call that made it)."""
    kept = [f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:100]}" for path in sorted(ROOT.rglob("*.py"))
            if path != ROOT / "core" / "buffers.py" for node in _kept_allocations(ast.parse(path.read_text()))]
    assert not kept, "\n".join(kept)


@pytest.mark.parametrize("source", [
    "import threading\nclass _Held(threading.local):\n    pass\n",
    "import numpy as np\nclass A:\n    def grow(self, n):\n        self._buffer = np.empty(n, np.uint8)\n",
    "import numpy as np\nclass A:\n    def take(self, name, n):\n        held = self.buffers[name] = np.empty(n)\n",
    "import mmap\n_WINDOW = memoryview(mmap.mmap(-1, 4096))\n",
])
def test_the_pool_check_sees_a_kept_buffer(source):
    assert _kept_allocations(ast.parse(source))


def test_the_pool_check_lets_a_call_own_its_memory():
    source = "import numpy as np\ndef f(n):\n    out = np.empty(n)\n    parts = {}\n    parts[0] = np.empty(n)\n"
    assert not _kept_allocations(ast.parse(source))

"""No import cycles between the package's files, counting imports inside functions too (they tie
the files together just the same), and the layer contracts hold."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "batcher"


def module_graph(package: Path) -> dict[str, set[str]]:
    """module -> modules of the same package it imports (anywhere in the file)."""
    mods: dict[str, Path] = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    here = here[:len(here) - (node.level - 1)]
                    base = ".".join(here + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                # A module importing its own package's __init__ is not a tie between files.
                if name and name != mod and not mod.startswith(name + "."):
                    graph[mod].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root, imported in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(imported)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
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
                    found.append(sorted(comp))
    return found


def test_cycle_finder_finds_a_planted_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import b\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub.b import g\n")
    (pkg / "sub" / "b.py").write_text("from ..a import f\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    assert cycles(module_graph(pkg)) == [["pkg.a", "pkg.sub.b"]]


def test_no_import_cycles_between_files() -> None:
    assert cycles(module_graph(PACKAGE)) == []


def test_layer_contracts_hold() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe is not None, "import-linter is missing: ./scripts/setup installs the test extra"
    out = subprocess.run([exe, "--no-cache"], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE.parent, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]

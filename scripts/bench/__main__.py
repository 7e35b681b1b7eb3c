"""`python -m scripts.bench [SCENARIO [options]]`: run one benchmark scenario, or list them."""

from __future__ import annotations

import ast
import importlib
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = __spec__.parent if __spec__ is not None else "scripts.bench"


def scenarios() -> dict[str, Path]:
    """Every scenario by name: the modules and shell files here, helpers (`_*`) left out."""
    found = {p.stem: p for p in HERE.iterdir()
             if p.suffix in (".py", ".sh") and not p.name.startswith("_")}
    return dict(sorted(found.items()))


def summary(path: Path) -> str:
    """A scenario's one line: its docstring's first line, or a shell file's first
    comment (read, not imported: some import torch)."""
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""
    for line in path.read_text().splitlines()[1:]:
        if line.startswith("# "):
            return line[2:].strip()
    return ""


def usage() -> str:
    found = scenarios()
    width = max(map(len, found))
    lines = [f"usage: python -m {PACKAGE} SCENARIO [options]",
             "  (from the checkout's root; SCENARIO --help for its options)", "", "scenarios:"]
    lines += [f"  {name:<{width}}  {summary(path)}" for name, path in found.items()]
    lines += ["", "Most append a dated table to BENCHMARKS.md, under the command line that made it.",
              "`batcher bench --help`: the load generator several of them drive."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    path = scenarios().get(name)
    if path is None:
        print(f"unknown scenario {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if path.suffix == ".sh":
        os.execvp("bash", ["bash", str(path), *rest])
    code = importlib.import_module(f"{PACKAGE}.{name}").main(rest)
    return code or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

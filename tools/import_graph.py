"""The project's import graph from an AST walk, and its circles.

Every `import` and `from ... import` of a first-party module counts, at module level and inside
functions alike: a circle through a function-level import still ties the two modules together, it
only defers the failure. `from pkg import name` where `name` is a submodule counts as an import
of the submodule. `python tools/import_graph.py` prints the graph's size and each circle (exit 1
if there is one); `--edges` prints every edge.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOTS = ("components", "snapshot", "graphs")


def modules(root: Path, packages=ROOTS) -> dict[str, Path]:
    found = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(mod: str, node: ast.ImportFrom, is_package: bool) -> str | None:
    if not node.level:
        return node.module
    base = mod.split(".") if is_package else mod.split(".")[:-1]
    if node.level > 1:
        base = base[: -(node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mod: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The first-party modules `mod` imports, anywhere in its body."""
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node, path.name == "__init__.py")
            if target is None:
                continue
            # `from pkg import sub` imports pkg.sub when it is a module, pkg otherwise.
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for name in names:
            # `import a.b.c` binds a, but runs a.b.c: the edge is to the deepest known module.
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != mod and not mod.startswith(name + "."):
                out.add(name)
    return out


def graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {m: imports(m, p, known) for m, p in known.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan), as a sorted list."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
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

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--edges", action="store_true", help="print every edge")
    args = ap.parse_args(argv)
    g = graph(args.root)
    if args.edges:
        for m in sorted(g):
            for t in sorted(g[m]):
                print(f"{m} -> {t}")
    found = circles(g)
    edges = sum(len(v) for v in g.values())
    print(f"{len(g)} modules, {edges} imports (module and function level) over {', '.join(ROOTS)}")
    for c in found:
        print("circle: " + " <-> ".join(c))
    print("no circles" if not found else f"{len(found)} circle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

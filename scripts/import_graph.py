"""The project's import graph, imports inside functions included: prints its
circles (strongly connected components), function-level project imports,
underscore names imported across modules, and `noqa: F401` re-exports.
Exit status 1 when there is a circle. Usage: python scripts/import_graph.py [--all]"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mlx_dflash", "app")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def scan():
    mods = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            mods[module_name(p)] = p
    edges, inner, private, reexports = {m: set() for m in mods}, [], [], []
    for m, p in mods.items():
        src = p.read_text()
        tree = ast.parse(src)
        is_pkg = p.name == "__init__.py"
        funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        in_func = {id(x) for f in funcs for x in ast.walk(f)}
        lines = src.splitlines()
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = resolve(m, is_pkg, node)
                targets = [(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base, a.name) for a in node.names]
            for t, name in targets:
                if t.split(".")[0] not in PACKAGES:
                    continue
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t not in mods or t == m:
                    continue
                edges[m].add(t)
                if id(node) in in_func:
                    inner.append(f"{m}:{node.lineno} -> {t}")
                if name and name.startswith("_") and not name.startswith("__"):
                    private.append(f"{m}:{node.lineno} imports {t}.{name}")
                if "noqa: F401" in lines[node.lineno - 1] or "noqa: E402,F401" in lines[node.lineno - 1]:
                    reexports.append(f"{m}:{node.lineno}")
    return mods, edges, inner, private, reexports


def circles(edges):
    """Tarjan's strongly connected components with more than one module."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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

    for v in edges:
        if v not in index:
            visit(v)
    return out


def main() -> int:
    _, edges, inner, private, reexports = scan()
    cs = circles(edges)
    print(f"circles: {len(cs)}")
    for c in cs:
        print("  " + " <-> ".join(c))
    print(f"project imports inside functions: {len(inner)}")
    print(f"underscore names imported across modules: {len(private)}")
    print(f"noqa: F401 re-exports: {len(reexports)}")
    if "--all" in sys.argv:
        for title, xs in (("inside functions", inner), ("underscore", private), ("re-exports", reexports)):
            print(f"\n{title}:")
            for x in xs:
                print("  " + x)
    return 1 if cs else 0


if __name__ == "__main__":
    sys.exit(main())

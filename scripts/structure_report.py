"""How raysim's package is built, in numbers anyone can re-measure: files over 500 lines, the
line count of every algorithm module, import circles between files, imports that run against
the layer order below (a lower layer importing a higher one), and `getattr`/`hasattr` sites in
raysim/core and raysim/runtime (where the engine would be probing plug-ins).

    python scripts/structure_report.py            # a table
    python scripts/structure_report.py --json     # the same numbers as JSON

Every `import raysim...` / `from raysim... import` counts, at module level or inside a
function (a lazy import is still a dependency). The layers, lowest first: a module may import
its own layer and the ones below.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "raysim"

# Lowest first. A key is a module path relative to raysim/ (a folder: everything in it).
LAYERS = [
    # ground floor: no raysim imports but each other
    ["errors.py", "_version.py", "seeds.py", "progress.py", "interrupts.py", "losses.py",
     "process_memory.py",
     "metrics"],
    ["plugins.py", "registry.py"],
    ["config"],
    ["models", "index", "data"],
    ["core"],
    ["outputs"],
    ["algorithms", "attacks", "runtime"],
    ["assembly"],
    ["api.py", "tune.py", "tune_space.py", "tune_results.py", "compare.py", "compare_spec.py",
     "compare_report.py", "compare_reuse.py",
     "cli.py", "__init__.py"],
]  # fmt: skip


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(path: Path) -> int | None:
    relative = path.relative_to(PACKAGE).as_posix()
    best = None
    for index, keys in enumerate(LAYERS):
        for key in keys:  # "name" is the module name.py or the package name/
            if relative in (key, f"{key}.py") or relative.startswith(f"{key}/"):
                if best is None or len(key) > best[1]:
                    best = (index, len(key))
    return None if best is None else best[0]


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The raysim modules `path` imports (resolved to files that exist)."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith("raysim") and name in modules and name != "raysim":
                found.add(name)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, result = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path): path for path in files}
    lines = {module_name(p): len(p.read_text().splitlines()) for p in files}
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    # a package's __init__ importing its own modules is the package exposing its API
    for name in graph:
        if modules[name].name == "__init__.py":
            graph[name] = {other for other in graph[name] if not other.startswith(name + ".")}
    unlayered = sorted(n for n, p in modules.items() if layer_of(p) is None)
    against = sorted(
        (name, other)
        for name, others in graph.items()
        for other in others
        if layer_of(modules[name]) is not None
        and layer_of(modules[other]) is not None
        and layer_of(modules[other]) > layer_of(modules[name])
    )
    probe = re.compile(r"\b(getattr|hasattr)\(")
    probes = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for folder in ("core", "runtime")
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if probe.search(line)
    ]
    report = {
        "files": len(files),
        "lines": sum(lines.values()),
        "files_over_500_lines": {n: c for n, c in sorted(lines.items()) if c > 500},
        "algorithm_modules": {
            n: c for n, c in sorted(lines.items()) if n.startswith("raysim.algorithms.")
        },
        "import_circles": circles(graph),
        "imports_against_the_layers": [f"{a} -> {b}" for a, b in against],
        "modules_without_a_layer": unlayered,
        "getattr_hasattr_in_core_and_runtime": probes,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['files']} files, {report['lines']} lines in raysim/")
    over = report["files_over_500_lines"]
    print(f"files over 500 lines: {len(over)}")
    for name, count in over.items():
        print(f"  {count:5d}  {name}")
    print("algorithm modules:")
    for name, count in report["algorithm_modules"].items():
        print(f"  {count:5d}  {name}")
    print(f"import circles: {len(report['import_circles'])}")
    for circle in report["import_circles"]:
        print("  " + " <-> ".join(circle))
    print(f"imports against the layers: {len(against)}")
    for line in report["imports_against_the_layers"]:
        print(f"  {line}")
    if unlayered:
        print(f"modules without a layer (add them to LAYERS): {', '.join(unlayered)}")
    print(f"getattr/hasattr sites in raysim/core and raysim/runtime: {len(probes)}")
    for line in probes:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

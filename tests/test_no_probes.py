"""The core and the runtime meet their plug-ins through contracts, not probes: every
getattr/hasattr left in raysim/core and raysim/runtime is one of the contract checks made
once when a run starts, or generic reflection that asks nothing optional of a plug-in at run
time. A new call elsewhere fails here: give the behaviour a field, a required member or a base
class instead (docs/EXTENDING.md), or add it below with the reason it is not a probe."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

RAYSIM = Path(__file__).resolve().parents[1] / "raysim"

ALLOWED = {
    # a plug-in codec that does not subclass Codec, wrapped once (as_codec)
    ("core/codecs.py", "ForeignCodec.__init__"): 2,
    # the backend contract, checked before anything starts and right after `start`
    ("core/backend.py", "check_backend"): 2,
    ("core/backend.py", "check_started_backend"): 1,
    # the algorithm contract when a run starts, and its hooks read once into a frozen record
    ("core/algorithm.py", "check_algorithm"): 5,
    ("core/algorithm.py", "AlgorithmHooks.of"): 2,
    # pickling the run context: its own dataclass fields
    ("core/algorithm.py", "RunContext.__reduce__"): 1,
    # the run's totals: RoundStats fields named by the tally's own keys
    ("core/run_record.py", "RunTally.add"): 1,
}


def _calls(path: Path) -> Counter:
    found: Counter = Counter()

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                inner = (*scope, child.name)
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Name)
                and child.func.id in ("getattr", "hasattr")
            ):
                found[".".join(scope) or "<module>"] += 1
            visit(child, inner)

    visit(ast.parse(path.read_text()), ())
    return found


def test_core_and_runtime_probe_no_optional_behaviour():
    found = {}
    for folder in ("core", "runtime"):
        for path in sorted((RAYSIM / folder).rglob("*.py")):
            relative = path.relative_to(RAYSIM).as_posix()
            for scope, count in _calls(path).items():
                found[(relative, scope)] = count
    assert found == ALLOWED

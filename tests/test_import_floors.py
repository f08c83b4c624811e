"""The floors of the import graph (shared/DESIGN.md): every import of a project module, lazy and
TYPE_CHECKING ones included, points down (kernels < moe < engine < router, the workers, deploy
< cluster < tools, bench), and no modules import each other in a circle. Read from the source
with ast: nothing is imported."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {
    "kernels": 0,
    "moe": 1,
    "engine": 2,
    "router": 3,
    "prefill_workers": 3,
    "decode_workers": 3,
    "deploy": 3,
    "cluster": 4,
    "tools": 5,
    "bench": 5,
}


def modules() -> dict[str, Path]:
    """Dotted module name -> its file, for every package of FLOORS."""
    found = {}
    for top in FLOORS:
        for file in (ROOT / top).rglob("*.py"):
            rel = file.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            found[".".join(parts)] = file
    return found


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (`from a.b import c` names a.b.c when that is a
    module, else a.b; a package's own __init__ is not an edge from its submodules)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, file in mods.items():
        for node in ast.walk(ast.parse(file.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                target = resolve(name)
                if target is None or target == mod:
                    continue
                if mod.startswith(target + ".") and mods[target].name == "__init__.py":
                    continue
                graph[mod].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def floor(mod: str) -> int:
    return FLOORS[mod.split(".")[0]]


def test_no_import_runs_up_a_floor() -> None:
    graph = import_graph(modules())
    up = sorted((m, t) for m, targets in graph.items() for t in targets if floor(t) > floor(m))
    assert up == []


def test_no_import_circle() -> None:
    assert circles(import_graph(modules())) == []


def test_the_check_sees_an_arrow_up_and_a_circle() -> None:
    """The oracle on a hand-made graph: kernels.a -> moe.b runs up; x -> y -> z -> x is a circle."""
    graph = {
        "kernels.a": {"moe.b"},
        "moe.b": set(),
        "moe.x": {"moe.y"},
        "moe.y": {"moe.z"},
        "moe.z": {"moe.x", "kernels.a"},
    }
    assert [(m, t) for m, ts in graph.items() for t in ts if floor(t) > floor(m)] == [
        ("kernels.a", "moe.b")
    ]
    assert circles(graph) == [["moe.x", "moe.y", "moe.z"]]


def test_the_graph_reads_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    """The two ways the old arrow and circle hid: an import inside a function, and one under
    `if TYPE_CHECKING:`."""
    file = tmp_path / "m.py"
    file.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from moe.model import X\n"
        "def f():\n    from kernels.fp8 import BLOCK\n"
    )
    mods = {"engine.m": file, "moe.model": file, "kernels.fp8": file}
    assert import_graph(mods)["engine.m"] == {"moe.model", "kernels.fp8"}

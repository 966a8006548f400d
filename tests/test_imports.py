"""aotc's modules import one another without a cycle: each dependency goes one way, where
it belongs (the format reads the backends' registry, neuron is built on xla, the loader
reads the model contract and the registry, a Service is opened by its Session)."""

from __future__ import annotations

import grimp


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Each set of modules that import one another in a circle (Tarjan's strongly
    connected components, of more than one module), as the shortest circle through its
    first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while component[-1:] != [module]:
                component.append(stack.pop())
            if len(component) > 1:
                first = min(component)
                back = min((graph.find_shortest_chain(importer=m, imported=first) for m in graph.find_modules_directly_imported_by(first) if m in component), key=len)
                found.append([first, *back])

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_module_of_aotc_imports_itself_through_others():
    # Function-level imports count: a cycle hidden inside a function is still one. Imports
    # under `if TYPE_CHECKING:` do not: they never run, and give the types only.
    graph = grimp.build_graph("aotc", exclude_type_checking_imports=True, cache_dir=None)
    assert {"aotc.builder.plan", "aotc.models.loader", "aotc.backends.registry", "aotc.cli"} <= graph.modules  # aotc/builder/ included
    assert cycles(graph) == []


def test_cycles_finds_a_circle():
    graph = grimp.ImportGraph()
    for a, b in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.e", "p.d")]:
        graph.add_import(importer=a, imported=b)
    assert cycles(graph) == [["p.a", "p.b", "p.c", "p.a"]]

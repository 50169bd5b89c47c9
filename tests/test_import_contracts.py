"""The module-level cycle contract `make lint` runs (tests/import_contracts.py) finds cycles
of modules, however long, and nothing else: on grimp graphs built here, and on kubetrain's."""

from __future__ import annotations

import sys
from pathlib import Path

import grimp

sys.path.insert(0, str(Path(__file__).parent))
from import_contracts import cycles


def _graph(imports: list[tuple[str, str]]) -> grimp.ImportGraph:
    graph = grimp.ImportGraph()
    for importer, imported in imports:
        graph.add_import(importer=importer, imported=imported)
    return graph


def test_a_cycle_through_three_modules_is_found_and_its_way_in_is_not() -> None:
    graph = _graph([("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a"),
                    ("pkg.d", "pkg.a"), ("pkg.e", "pkg.d")])
    assert cycles(graph, set(graph.modules)) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_packages_that_import_each_other_without_a_module_cycle_are_no_cycle() -> None:
    # What import-linter's acyclic_siblings calls a cycle: api -> budget -> api.sections.
    graph = _graph([("k.api.spec", "k.budget"), ("k.budget", "k.api.sections"),
                    ("k.api.spec", "k.api.sections")])
    assert cycles(graph, set(graph.modules)) == []


def test_two_separate_cycles_are_both_found() -> None:
    graph = _graph([("x.a", "x.b"), ("x.b", "x.a"), ("x.c", "x.d"), ("x.d", "x.e"),
                    ("x.e", "x.c"), ("x.a", "x.c")])
    assert cycles(graph, set(graph.modules)) == [["x.a", "x.b"], ["x.c", "x.d", "x.e"]]


def test_kubetrain_has_no_import_cycle() -> None:
    graph = grimp.build_graph("kubetrain")
    assert cycles(graph, set(graph.modules)) == []

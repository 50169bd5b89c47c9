"""An import-linter contract type: no two modules import each other, however indirectly.

`make lint` runs it through pyproject.toml's [tool.importlinter] (`contract_types`), beside
the built-in layers and independence contracts. import-linter's own cycle contract,
`acyclic_siblings`, judges the children of each package as wholes: `kubetrain.api`
(whose spec validation sizes the memory tier) and `kubetrain.memory_budget` (which reads
the API's section models, never `kubetrain.api.trainingjob`) would be a cycle of two
packages although no module imports itself back. This one asks for the strongly connected
components of the module graph (Tarjan's algorithm over grimp's graph, imports under
`if TYPE_CHECKING:` included) and is broken by any component of more than one module,
each reported with the imports that close it.
"""

from __future__ import annotations

from typing import Any

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields


def cycles(graph: ImportGraph, modules: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module among `modules`, each
    sorted, in sorted order."""
    imports = {module: graph.find_modules_directly_imported_by(module) & modules
               for module in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(modules):
        if root in index:
            continue
        # Iterative Tarjan: frames of (module, the imports of it still to visit).
        work: list[tuple[str, list[str]]] = []
        entering: str | None = root
        while entering is not None or work:
            if entering is not None:
                index[entering] = low[entering] = len(index)
                stack.append(entering)
                on_stack.add(entering)
                work.append((entering, sorted(imports[entering])))
                entering = None
            module, pending = work[-1]
            if pending:
                target = pending.pop()
                if target not in index:
                    entering = target
                elif target in on_stack:
                    low[module] = min(low[module], index[target])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


class AcyclicModulesContract(Contract):
    """No import cycle among the modules of `containers` (and their descendants)."""

    type_name = "acyclic_modules"

    containers = fields.ListField(subfield=fields.StringField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        modules: set[str] = set()
        for container in self.containers:
            modules |= {container, *graph.find_descendants(container)}
        found = cycles(graph, modules)
        closing: dict[str, list[str]] = {}
        for component in found:
            members = set(component)
            closing[" ".join(component)] = [
                f"{importer} -> {imported} (l. {detail['line_number']})"
                for importer in component
                for imported in sorted(graph.find_modules_directly_imported_by(importer)
                                       & members)
                for detail in graph.get_import_details(importer=importer,
                                                       imported=imported)[:1]]
        return ContractCheck(kept=not found, metadata={"cycles": found, "closing": closing})

    def render_broken_contract(self, check: ContractCheck) -> None:
        metadata: dict[str, Any] = check.metadata
        for component in metadata["cycles"]:
            self._print(f"These modules import each other: {', '.join(component)}")
            for line in metadata["closing"][" ".join(component)]:
                self._print(f"  {line}")

    @staticmethod
    def _print(text: str) -> None:
        from importlinter import output

        output.print_error(text, bold=False)

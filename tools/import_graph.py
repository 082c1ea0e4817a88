"""The import graph of the ``megatron`` package: cycles, in-function imports, and the layering rules.

The architecture rule is that imports point down (entry scripts -> ``megatron.training`` ->
``megatron.core``) and that the Megatron-only compatibility rooms (``megatron/*/_compat/``) import working
code and are imported by none. ``tests/unit/test_import_graph.py`` enforces it with this module; run it
directly for a report:

    python tools/import_graph.py            # cycles, layering violations, in-function imports per file

Every import counts, the ones inside function bodies too (they still form a cycle, only a hidden one),
except those under ``if TYPE_CHECKING:``, which never run. An in-function import is allowed only with a
``# lazy: <reason>`` comment on its line that names a measured reason (import cost, an optional
dependency).
"""
import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Set

LAZY_MARK = "# lazy:"


@dataclass
class InFunctionImport:
    module: str
    line: int
    text: str

    @property
    def has_reason(self) -> bool:
        return LAZY_MARK in self.text


@dataclass
class ImportGraph:
    files: Dict[str, Path]
    edges: Dict[str, Set[str]] = field(default_factory=dict)
    in_function: List[InFunctionImport] = field(default_factory=list)
    lines: int = 0

    def cycles(self) -> List[List[str]]:
        """Strongly connected components of more than one module (Tarjan, iterative)."""
        index: Dict[str, int] = {}
        low: Dict[str, int] = {}
        stack: List[str] = []
        on_stack: Set[str] = set()
        found: List[List[str]] = []
        counter = 0
        for root in sorted(self.files):
            if root in index:
                continue
            work = [(root, iter(sorted(self.edges[root])))]
            index[root] = low[root] = counter
            counter += 1
            stack.append(root)
            on_stack.add(root)
            while work:
                node, children = work[-1]
                child = next(children, None)
                if child is not None:
                    if child not in index:
                        index[child] = low[child] = counter
                        counter += 1
                        stack.append(child)
                        on_stack.add(child)
                        work.append((child, iter(sorted(self.edges[child]))))
                    elif child in on_stack:
                        low[node] = min(low[node], index[child])
                    continue
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
        return found

    def layering_violations(self) -> List[str]:
        """Imports that point up: core -> training, or any working module -> a ``_compat`` room."""
        bad = []
        for src, targets in sorted(self.edges.items()):
            for dst in sorted(targets):
                if src.startswith("megatron.core") and dst.startswith("megatron.training"):
                    bad.append(f"{src} imports {dst} (core must not import training)")
                if _in_compat_room(dst) and not _in_compat_room(src):
                    bad.append(f"{src} imports {dst} (working code must not import a _compat room)")
        return bad


def _in_compat_room(module: str) -> bool:
    return "_compat" in module.split(".")


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> Set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                skipped.update(id(n) for n in ast.walk(sub))
    return skipped


def _function_nodes(tree: ast.AST) -> Set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(node) if n is not node)
    return inside


def build(root: Path, package: str = "megatron") -> ImportGraph:
    """Parse every module under ``root/package`` and record its imports of the package."""
    files = {_module_name(root, p): p for p in sorted((root / package).rglob("*.py"))}
    graph = ImportGraph(files=files, edges={m: set() for m in files})

    def resolve(name: str) -> Optional[str]:
        while name:
            if name in files:
                return name
            name = name.rpartition(".")[0]
        return None

    for module, path in files.items():
        source = path.read_text()
        source_lines = source.splitlines()
        graph.lines += len(source_lines)
        tree = ast.parse(source)
        skipped, in_function = _type_checking_nodes(tree), _function_nodes(tree)
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in skipped:
                continue
            if id(node) in in_function:
                graph.in_function.append(InFunctionImport(module, node.lineno, source_lines[node.lineno - 1]))
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                if target.split(".")[0] != package:
                    continue
                resolved = resolve(target)
                if resolved and resolved != module:
                    graph.edges[module].add(resolved)
    return graph


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--top", type=int, default=20, help="files listed by in-function import count")
    args = parser.parse_args(argv)
    graph = build(Path(args.root))
    cycles = graph.cycles()
    print(f"{len(graph.files)} modules, {graph.lines} lines")
    print(f"{len(cycles)} import cycles over {sum(map(len, cycles))} modules")
    for cycle in cycles:
        print(f"  {len(cycle)}: {' '.join(cycle)}")
    violations = graph.layering_violations()
    print(f"{len(violations)} layering violations")
    for line in violations:
        print(f"  {line}")
    unexplained = [i for i in graph.in_function if not i.has_reason]
    per_k = 1000 * len(graph.in_function) / max(graph.lines, 1)
    print(f"{len(graph.in_function)} in-function imports ({per_k:.2f} per 1,000 lines), "
          f"{len(unexplained)} without a '{LAZY_MARK}' reason")
    counts: Dict[str, int] = {}
    for item in unexplained:
        counts[item.module] = counts.get(item.module, 0) + 1
    for module, count in sorted(counts.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {count:3d} {module}")
    return 1 if cycles or violations else 0


if __name__ == "__main__":
    sys.exit(main())

"""Prints embckpt's internal import graph, its cycles and every breach of the layering rules.

    python scripts/import_graph.py [PACKAGE_DIR]

The rules are the ones docs/ARCHITECTURE.md states; tests/test_layout.py runs the same checks,
so they keep holding. Imports are read with ``ast`` (nothing is imported): module-level,
function-level and ``TYPE_CHECKING`` imports all count, for the rules and for cycles (between
modules, and between top-level packages such as codecs/ and storage/). ``from embckpt import
Name`` is resolved through the package's lazy export table to the module that defines it, and
each entry of that table counts as an import by the package's facade (``embckpt/__init__.py``),
which the rules about cli and examples/ bind like any other module.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = "embckpt"
CORE = (
    "config",
    "collective",
    "dense",
    "interval",
    "data",
    "mch",
    "sharding",
    "tracking",
    "policy",
)
UPPER = ("save", "read", "serve", "report", "checkpointer", "cli", "examples")
# The command line: cli.py (the parser and main) and the parts it is split into; the rules
# about cli bind them as one module.
CLI = ("cli", "cli_args", "cli_commands")


@dataclass(frozen=True)
class Import:
    """One import statement: who imports, the module it names, and the module it loads."""

    source: str  # importing module, e.g. "read.restore" (relative to the package)
    named: str  # the module the statement names, relative ("" for the package itself)
    target: str  # the module it loads (names from the lazy export table resolved)
    line: int


def _module_name(package: Path, path: Path) -> str:
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _lazy_exports(package: Path) -> dict[str, tuple[str, int]]:
    """The package's ``_EXPORTS`` table: public name -> (defining module (relative), line)."""
    tree = ast.parse((package / "__init__.py").read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Dict)
            and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)
        ):
            table = ast.literal_eval(node.value)
            lines = [key.lineno if key is not None else node.lineno for key in node.value.keys]
            return {
                name: (module.removeprefix(f"{ROOT}."), line)
                for (name, module), line in zip(table.items(), lines, strict=True)
            }
    return {}


def read_imports(package: Path) -> tuple[set[str], list[Import]]:
    """Every module of the package and every import of one of its modules."""
    modules = {_module_name(package, p) for p in package.rglob("*.py")}
    exports = _lazy_exports(package)
    lazy = {name: module for name, (module, _) in exports.items()}
    # The facade loads each module of its table when the name is first used.
    found = [Import("", module, module, line) for module, line in exports.values()]
    for path in sorted(package.rglob("*.py")):
        source = _module_name(package, path)
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == ROOT or alias.name.startswith(f"{ROOT}."):
                        named = alias.name.removeprefix(ROOT).lstrip(".")
                        found.append(Import(source, named, named, node.lineno))
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                module = node.module
                if node.level:
                    base = source.split(".") if is_package else source.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    module = ".".join([ROOT, *base, module])
                if module != ROOT and not module.startswith(f"{ROOT}."):
                    continue
                named = module.removeprefix(ROOT).lstrip(".")
                for alias in node.names:
                    sub = f"{named}.{alias.name}" if named else alias.name
                    if sub in modules:
                        target = sub
                    elif not named and alias.name in lazy:
                        target = lazy[alias.name]
                    else:
                        target = named
                    found.append(Import(source, named, target, node.lineno))
    return modules, found


def cycles(imports: list[Import], level: str = "module") -> list[list[str]]:
    """Groups of modules (``level="module"``) or of top-level packages (``"package"``: codecs,
    storage, save, ...) that import each other, directly or through others. Every import
    counts, ``TYPE_CHECKING`` ones too (a type-only import is still a dependency); the
    package's lazy facade (``embckpt/__init__.py``) imports nothing that runs."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        source, target = imp.source, imp.target
        if level == "package":
            source, target = _top(source), _top(target)
        if source != target and imp.source != "" and target != "":
            graph.setdefault(source, set()).add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the graph has ~60 nodes
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def _top(module: str) -> str:
    return module.split(".")[0]


def _within(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(f"{p}.") for p in prefixes)


# Rooms that run one way: a restore plans, then stages, then applies; a rows file's writer and
# reader share only the format module.
_BACKWARDS = {
    ("read.plan", "read.stage"): "read/: plan never imports stage or apply",
    ("read.plan", "read.apply"): "read/: plan never imports stage or apply",
    ("read.stage", "read.apply"): "read/: stage never imports apply",
    ("storage.rowfile_write", "storage.rowfile_read"): "rowfile_write and rowfile_read share "
    "only storage/rowfile.py",
    ("storage.rowfile_read", "storage.rowfile_write"): "rowfile_write and rowfile_read share "
    "only storage/rowfile.py",
}


def violations(imports: list[Import]) -> list[str]:
    """Every import that breaks a layering rule, as 'source:line -> target: rule'."""
    found = []
    for imp in imports:
        src, tgt = imp.source, imp.target
        # The package's facade ("") exports from every layer: of the rules below only the
        # ones about cli and examples/ bind it.
        rule = None
        if tgt in CLI and src not in CLI:
            rule = "nothing imports cli (cli.py, cli_args.py, cli_commands.py) from outside it"
        elif tgt == "cli_restore" and src not in CLI:
            rule = "only cli imports cli_restore (the text of `embckpt restore`)"
        elif _within(src, "errors", "dtypes", "units", "failpoints") and tgt not in ("errors",):
            rule = "errors, dtypes, units and failpoints import nothing of embckpt but errors"
        elif _within(src, "codecs") and not _within(tgt, "codecs", "errors", "dtypes"):
            rule = "codecs import only codecs, errors and dtypes"
        elif _within(src, "storage") and not (
            _within(tgt, "storage", "errors", "dtypes") or tgt in ("codecs.base",)
        ):
            rule = "storage imports only storage, codecs.base, errors and dtypes"
        elif _within(src, "policy", "sharding", "tracking") and _within(tgt, "storage", "codecs"):
            rule = "policy, sharding and tracking import neither storage nor codecs"
        elif _within(src, "policy") and _within(tgt, "tracking"):
            rule = "policy does not import tracking (save/saver.py maps a diff to a tracker view)"
        elif _within(src, *CORE) and _within(tgt, *UPPER):
            rule = "core modules never import save/, read/, serve/, report/, checkpointer, cli, "
            rule += "examples/"
        elif _within(src, "save", "read") and _within(tgt, "checkpointer", "cli", "examples"):
            rule = "save/ and read/ never import checkpointer, cli or examples/"
        elif _within(src, "read") and _within(tgt, "save"):
            rule = "read/ never imports save/"
        elif _within(src, "save") and _within(tgt, "read"):
            rule = "save/ never imports read/ (the checkpointer hands a restore's result over)"
        elif (src, tgt) in _BACKWARDS:
            rule = _BACKWARDS[(src, tgt)]
        elif _within(src, "serve") and not _within(
            tgt, "serve", "read", "storage", "blocks", "dense", "dtypes", "errors"
        ):
            rule = "serve/ imports only serve/, read/, storage/, blocks, dense, dtypes and errors"
        elif _within(src, "save", "read", "storage") and _within(tgt, "serve"):
            rule = "save/, read/ and storage/ never import serve/"
        elif _within(src, "report") and not _within(tgt, "report", "storage", "errors", "units"):
            rule = "report/ imports only report/, storage/, errors and units"
        elif _within(src, "examples") and not (
            imp.named in ("", "report") or _within(imp.named, "examples")
        ):
            rule = "examples/ use only the public API (embckpt, embckpt.report) and examples/"
        elif _within(tgt, "examples") and not (_within(src, "examples") or src in CLI):
            rule = "outside examples/, only cli imports examples/"
        if rule is not None:
            found.append(f"{src}:{imp.line} -> {tgt}: {rule}")
    return found


def main(argv: list[str]) -> int:
    package = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / ROOT
    modules, imports = read_imports(package)
    edges = sorted({(i.source or ROOT, i.target or ROOT) for i in imports if i.source != i.target})
    print(f"{len(modules)} modules, {len(edges)} internal import edges")
    for source in sorted({s for s, _ in edges}):
        targets = sorted(t for s, t in edges if s == source)
        print(f"  {source} -> {', '.join(targets)}")
    found_cycles = cycles(imports) + cycles(imports, "package")
    print(f"cycles (modules, then packages): {len(found_cycles)}")
    for group in found_cycles:
        print("  " + " <-> ".join(group))
    broken = violations(imports)
    print(f"rule violations: {len(broken)}")
    for line in broken:
        print(f"  {line}")
    return 1 if found_cycles or broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

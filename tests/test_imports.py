"""aftgen's modules import one another without a cycle and never from a lower layer up to a higher one, counting
every import: at module level, inside a function, or only for type checking."""

from __future__ import annotations

import ast
from pathlib import Path

import aftgen

PACKAGE = Path(aftgen.__file__).parent
# aftgen's layers, lowest first: a module imports from its own layer and those below, never from one above. A
# listed package holds its modules, unless one of them is listed itself; the root `aftgen` stands for its
# __init__ alone. A new module is listed here, where it belongs.
LAYERS = {
    "foundations": ["aftgen.errors", "aftgen.options", "aftgen.files", "aftgen.device", "aftgen.distributed",
                    "aftgen.cores", "aftgen.layers", "aftgen.mixers", "aftgen.tokenizer", "aftgen.compiled",
                    "aftgen.native"],
    "model": ["aftgen.model", "aftgen.checkpoint", "aftgen.hf", "aftgen.corpus", "aftgen.hub", "aftgen.api", "aftgen"],
    "compiled code": ["aftgen.compiled.step", "aftgen.compiled.functions"],
    "generation": ["aftgen.constraints", "aftgen.generation", "aftgen.state", "aftgen.chat", "aftgen.evaluate"],
    "run records": ["aftgen.record", "aftgen.curves", "aftgen.card"],
    "training": ["aftgen.training"],
    "serving": ["aftgen.serve"],
    "publishing": ["aftgen.publish"],
    "benchmarks": ["aftgen.bench"],
    "command line": ["aftgen.cli", "aftgen.__main__"],
}  # fmt: skip


def modules(package: Path) -> dict[str, Path]:
    """Every module of a package by dotted name (a package by its own name: its __init__.py)."""
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def enclosing(name: str, path: Path) -> set[str]:
    """The packages already being imported while module `name` runs: its parents, and itself if a package."""
    parts = name.split(".")
    own = len(parts) if path.name == "__init__.py" else len(parts) - 1
    return {".".join(parts[:i]) for i in range(1, own + 1)}


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the package that module `name` imports. Importing a.b.c runs the packages a and a.b
    first, unless they enclose the importer; `from a.b import c` imports the submodule a.b.c if there is
    one, else the package a.b (the name is then one the package defines)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    running = enclosing(name, path)
    edges = set()
    for target in targets:
        parts = target.split(".")
        edges |= {target} | ({".".join(parts[:i]) for i in range(1, len(parts))} - running)
    return {target for target in edges if target in known and target != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of names (its first name repeated last), or None."""
    done, path = set(), []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        path.append(node)
        for after in sorted(graph[node]):
            if cycle := visit(after):
                return cycle
        path.pop()
        done.add(node)
        return None

    return next((cycle for node in sorted(graph) if (cycle := visit(node))), None)


def import_graph(package: Path) -> dict[str, set[str]]:
    known = modules(package)
    return {name: imported(name, path, known) for name, path in known.items()}


def test_the_package_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and "aftgen.mixers" in graph["aftgen.model"]  # the walk found modules and imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def layer_of(module: str, layers: dict[str, list[str]]) -> int | None:
    """The index of the layer that holds `module` (its longest listed name), or None if no layer does."""
    root = module.split(".")[0]
    held = [(len(name), index) for index, names in enumerate(layers.values()) for name in names
            if module == name or (name != root and module.startswith(name + "."))]  # fmt: skip
    return max(held)[1] if held else None


def upward_imports(graph: dict[str, set[str]], layers: dict[str, list[str]]) -> list[str]:
    """Each import from a lower layer to a higher one, as 'importer (layer) -> imported (layer)'."""
    names = list(layers)
    found = []
    for module in sorted(graph):
        for target in sorted(graph[module]):
            low, high = layer_of(module, layers), layer_of(target, layers)
            if low < high:
                found.append(f"{module} ({names[low]}) -> {target} ({names[high]})")
    return found


def test_every_module_has_a_layer_and_no_import_runs_up_the_layers():
    graph = import_graph(PACKAGE)
    unplaced = sorted(name for name in graph if layer_of(name, LAYERS) is None)
    assert not unplaced, f"modules in no layer (list them in LAYERS): {unplaced}"
    upward = upward_imports(graph, LAYERS)
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_an_import_up_the_layers_is_found(tmp_path):
    files = {"__init__.py": "", "low.py": "def f():\n    from pkg.high import g\n", "high.py": "from pkg import low\n",
             "sub/__init__.py": "", "sub/deep.py": "import pkg.low\n"}  # fmt: skip
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    graph = import_graph(tmp_path / "pkg")
    layers = {"bottom": ["pkg.low", "pkg"], "top": ["pkg.high", "pkg.sub"]}
    assert layer_of("pkg.sub.deep", layers) == 1 and layer_of("pkg.other", layers) is None
    assert upward_imports(graph, layers) == ["pkg.low (bottom) -> pkg.high (top)"]


def test_a_cycle_through_a_package_or_a_function_is_found(tmp_path):
    files = {
        "__init__.py": "",
        "cli/__init__.py": "from pkg.cli import common\nfrom pkg.bench import commands\n",
        "cli/common.py": "",
        "bench/__init__.py": "",
        "bench/commands.py": "def run():\n    from pkg.cli.common import progress\n",
        "mixers/__init__.py": "from pkg.mixers.aft import AFT\n",
        "mixers/aft.py": "from . import protocol\nfrom pkg.mixers.protocol import Mixer\n",
        "mixers/protocol.py": "",
    }
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    graph = import_graph(tmp_path / "pkg")
    assert graph["pkg.mixers.aft"] == {"pkg.mixers.protocol"}  # its own package is already being imported
    assert graph["pkg.bench.commands"] == {"pkg.cli", "pkg.cli.common"}  # importing pkg.cli.common runs pkg.cli
    assert find_cycle(graph) == ["pkg.bench.commands", "pkg.cli", "pkg.bench.commands"]
    (tmp_path / "pkg" / "bench" / "commands.py").write_text("")
    (tmp_path / "pkg" / "mixers" / "protocol.py").write_text("from pkg.mixers import AFT\n")  # a name of __init__
    assert find_cycle(import_graph(tmp_path / "pkg")) == ["pkg.mixers", "pkg.mixers.aft", "pkg.mixers.protocol",
                                                          "pkg.mixers"]  # fmt: skip

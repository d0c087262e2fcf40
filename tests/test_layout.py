"""How the tests are laid out: what test modules share lives in helper modules and conftest.py, so no test
module imports another (importing one runs its module fixtures and tests where they do not belong)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules(source: str) -> set[str]:
    """The top-level names of the modules a Python source imports, wherever in it the import stands."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_import_reader_finds_imports_at_any_depth():
    source = "import a.b, c\nfrom d.e import f\nfrom . import g\ndef h():\n    from test_i import j\n"
    assert imported_modules(source) == {"a", "c", "d", "test_i"}


def test_no_test_module_imports_another():
    test_modules = sorted(TESTS.rglob("test_*.py"))
    names = {path.stem for path in test_modules}
    found = [
        f"{path.relative_to(TESTS)} imports {name}"
        for path in test_modules
        for name in sorted(imported_modules(path.read_text()) & names)
    ]
    assert not found, "move what test modules share into a helper module or conftest.py: " + "; ".join(found)

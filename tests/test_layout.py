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


AFTGEN = TESTS.parent / "aftgen"
LARGE = 100  # lines: a module this long has a test module of its own


def mirrored_test(module: Path) -> Path:
    """Where the tests of aftgen/<package path>/<module>.py live: tests/<package path>/test_<module>.py (a
    package's own __init__.py: test_<package>.py beside the package's folder of tests)."""
    relative = module.relative_to(AFTGEN)
    if relative.name == "__init__.py":
        return TESTS / relative.parent.parent / f"test_{relative.parent.name}.py"
    return TESTS / relative.parent / f"test_{relative.name}"


def test_every_large_module_has_a_test_module_of_its_name():
    modules = sorted(path for path in AFTGEN.rglob("*.py") if len(path.read_text().splitlines()) >= LARGE)
    assert len(modules) > 50  # the walk found the package's modules
    missing = [
        f"{mirrored_test(path).relative_to(TESTS.parent)} (for {path.relative_to(TESTS.parent)})"
        for path in modules
        if not mirrored_test(path).is_file()
    ]
    assert not missing, "a module of 100+ lines needs a test module of its name: " + "; ".join(missing)

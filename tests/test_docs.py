"""The map of the code in docs/architecture.md names every module the package has, so it cannot fall behind."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"[\w.]+\.(?:py|cpp|html)\b")
NAME_COLUMN = 20  # a line whose first word starts left of this names a file or folder; others continue a description


def layout_block(text: str) -> list[str]:
    """The lines of the fenced block under '## Layout'."""
    section = text.split("\n## Layout", 1)[1]
    return section.split("```", 2)[1].splitlines()


def mapped_files(lines: list[str]) -> set[str]:
    """Every file the tree names, as a path under the repository: a name in a folder's line or its indented lines
    is in that folder (`serve/  ... app.py (routes)` names aftgen/serve/app.py)."""
    folders: list[tuple[int, str]] = []  # (indent, path) of the folders the current line lies in
    here = ""  # where the names of a line's description lie
    named = set()
    for line in lines:
        stripped = line.lstrip()
        if not stripped:
            continue
        indent = len(line) - len(stripped)
        if indent < NAME_COLUMN:
            while folders and folders[-1][0] >= indent:
                folders.pop()
            parent = folders[-1][1] if folders else ""
            first, *_ = stripped.split(maxsplit=1)
            here = parent + first if first.endswith("/") else parent
            if first.endswith("/"):
                folders.append((indent, here))
            else:
                named.add(parent + first)
        named.update(here + name for name in NAME.findall(stripped))
    return named


def package_modules() -> set[str]:
    """aftgen's modules and native sources; a package's __init__.py counts where it holds more than a few lines."""
    found = set()
    for path in (ROOT / "aftgen").rglob("*"):
        if path.suffix not in (".py", ".cpp", ".html") or "__pycache__" in path.parts:
            continue
        if path.name in ("__init__.py", "__main__.py") and len(path.read_text().splitlines()) <= 30:
            continue
        found.add(path.relative_to(ROOT).as_posix())
    return found


def test_the_map_parses_nested_folders_and_descriptions():
    lines = ["aftgen/", "  a.py              x", "  sub/              one.py (y), two.py", "    three.py        z"]
    assert mapped_files(lines) == {"aftgen/a.py", "aftgen/sub/one.py", "aftgen/sub/two.py", "aftgen/sub/three.py"}


def test_every_module_is_on_the_map():
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = sorted(package_modules() - mapped_files(layout_block(text)))
    assert not missing, f"docs/architecture.md's Layout does not name: {', '.join(missing)}"


def test_the_readme_python_api_example_runs_as_written(tiny_run, tmp_path, monkeypatch):
    """README's Python block that imports aftgen, run unchanged (its runs/corpus is the tiny run): no import
    missing, and prefill and step work outside torch.no_grad(), as an inference API should."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    blocks = [block.split("```", 1)[0] for block in readme.split("```python\n")[1:]]
    code = next(block for block in blocks if "from aftgen import" in block)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "corpus").symlink_to(tiny_run)
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(compile(code, "README.md", "exec"), names)
    assert names["logits"].shape == (1, names["model"].config.vocab_size)
    assert not names["logits"].requires_grad

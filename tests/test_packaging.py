"""The wheel ships models/ as aftgen.models, so `aftgen sample` works with no --model after `pip install .`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aftgen.checkpoint import CARD, CHECKPOINT_FILES
from aftgen.cli import app

ROOT = Path(__file__).parent.parent
SAMPLE = ["--prompt", "KING:", "-n", "30", "--seed", "5"]


def pip(*args: str, cwd: Path) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    done = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_wheel_ships_the_default_model(tmp_path, tiny_run):
    pytest.importorskip("setuptools", reason="builds the wheel offline with the setuptools already installed")
    # A copy of the source tree whose shipped model is the tiny run (the real one may not be trained yet).
    source = tmp_path / "source"
    shutil.copytree(ROOT / "aftgen", source / "aftgen", ignore=shutil.ignore_patterns("__pycache__"))
    (source / "models" / "shakespeare").mkdir(parents=True)
    shutil.copy(ROOT / "models" / "__init__.py", source / "models")
    for name in (*CHECKPOINT_FILES, CARD):
        shutil.copy(tiny_run / name, source / "models" / "shakespeare")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)

    # Offline: no index, and the build uses this environment's setuptools instead of fetching one.
    pip(
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--wheel-dir",
        str(tmp_path / "dist"),
        ".",
        cwd=source,
    )
    (wheel,) = (tmp_path / "dist").glob("aftgen-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    assert {f"aftgen/models/shakespeare/{name}" for name in (*CHECKPOINT_FILES, CARD)} <= shipped
    assert not any(name.startswith("models/") for name in shipped)
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "aftgen").rglob("__init__.py")}
    assert {f"{package}/__init__.py" for package in packages} <= shipped  # every subpackage
    assert "aftgen/serve/playground.html" in shipped  # the page `aftgen serve` answers at /

    target = tmp_path / "installed"
    pip("install", "--no-deps", "--no-index", "--target", str(target), str(wheel), cwd=tmp_path)
    # The installed console script; dependencies come from this environment, aftgen only from the wheel.
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = "import aftgen.api as a; print(a.__file__); print(a.default_model_path())"
    where = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    paths = where.stdout.split()
    assert len(paths) == 2 and all(Path(p).is_relative_to(target) for p in paths), where.stdout + where.stderr
    done = subprocess.run(
        [str(target / "bin" / "aftgen"), "sample", *SAMPLE],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    expected = CliRunner().invoke(app, ["sample", "--model", str(tiny_run), *SAMPLE])
    assert done.stdout == expected.stdout and done.stdout.startswith("KING:")

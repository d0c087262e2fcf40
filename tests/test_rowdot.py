"""aftgen.rowdot, the batch-invariant product: a row's outputs are the same bits alone as among any other rows,
and close to x @ wᵀ; its library is built into aftgen's cache once and checked before it is loaded (a damaged
or planted file is built again, never loaded), and a compiler that fails is one clear error."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from aftgen import rowdot
from aftgen.compiled_cache import compiled_folder

WEIGHTS = {"float32": torch.float32, "bf16": torch.bfloat16}
SHAPES = [(576, 192), (192, 768), (33, 64), (17, 40), (1, 15)]  # (outputs, inputs): tiles, and tails of each


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_a_rows_product_alone_is_the_same_bits_as_among_other_rows(weights, shape):
    generator = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=generator).to(WEIGHTS[weights])
    x = torch.randn(33, shape[1], generator=generator)
    together = rowdot.rowdot(x, w)
    for rows in (1, 2, 5, 16, 17, 32):
        for start in (0, 1, 33 - rows):
            assert torch.equal(rowdot.rowdot(x[start : start + rows], w), together[start : start + rows]), (rows, start)
    inputs = x.bfloat16() if rowdot.kernel(w) == "amx" else x  # AMX multiplies bf16 by bf16
    expected = inputs.double() @ w.double().T
    torch.testing.assert_close(together.double(), expected, rtol=1e-5, atol=1e-5 * shape[1] ** 0.5)


@pytest.fixture(scope="module")
def one_build(tmp_path_factory):
    """The library built once, in a cache of this module's own: its folder."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AFTGEN_CACHE", str(cache))
        rowdot.library_path()
        return compiled_folder()


@pytest.fixture
def built(one_build, tmp_path, monkeypatch):
    """A cache of this test's own holding the library as built and recorded, and the builds after that (each
    a copy of the one build)."""
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path / "cache"))
    shutil.copytree(one_build, compiled_folder(), ignore=shutil.ignore_patterns("*.lock"))
    path, builds = next(compiled_folder().glob("rowdot-*.so")), []
    monkeypatch.setattr(
        rowdot, "_build", lambda target: builds.append(target) or shutil.copyfile(one_build / path.name, target)
    )
    return path, builds


DAMAGES = {
    "cut short": lambda path: path.write_bytes(path.read_bytes()[:50_000]),
    "garbage": lambda path: path.write_bytes(os.urandom(path.stat().st_size)),
    "empty": lambda path: path.write_bytes(b""),
    "a FIFO": lambda path: path.unlink() or os.mkfifo(path),
    "no record": lambda path: path.with_suffix(".json").unlink(),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_library_is_built_again_with_one_line_not_loaded(built, damage, capsys):
    path, builds = built
    capsys.readouterr()
    DAMAGES[damage](path)
    assert rowdot.library_path() == path and builds == [path]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "was damaged" in lines[0], lines
    assert rowdot.library_path() == path and builds == [path]  # what was built again is recorded


def test_a_link_planted_where_the_library_lies_is_replaced_and_its_target_left_alone(built, tmp_path):
    path, builds = built
    victim = tmp_path / "victim"
    victim.write_bytes(b"the user's own file")
    path.unlink()
    path.symlink_to(victim)
    assert rowdot.library_path() == path and builds == [path]
    assert victim.read_bytes() == b"the user's own file" and not path.is_symlink()


@pytest.mark.parametrize("compiler", ["false", "/no/such/compiler"])
def test_a_compiler_that_fails_is_one_clear_error(compiler, tmp_path, monkeypatch):
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(rowdot, "_compiler", lambda: compiler)
    with pytest.raises(rowdot.RowdotUnavailable, match="^cannot build the batch-invariant product") as error:
        rowdot.library_path()
    assert "\n" not in str(error.value)
    assert not list(compiled_folder().glob("rowdot-*.so")) and not list(compiled_folder().glob("tmp*"))

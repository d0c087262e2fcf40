"""The compiled step (aftgen.compiled.step.compile_step) is the eager step, faster: the same logits and states at every
batch size it serves, the model's own weights, and the eager step wherever it cannot serve."""

from __future__ import annotations

import copy
import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import no_compiler, on_device

import aftgen.compiled.step
from aftgen.compiled.cache import library_of
from aftgen.compiled.step import compile_step, loaded_runner, step_constants, step_package
from aftgen.layers import linear, written_products
from aftgen.model import AFTLM, AFTConfig, clone_state

MAX_BATCH = 32


def tiny_model() -> AFTLM:
    torch.manual_seed(0)
    model = on_device(AFTLM(AFTConfig(vocab_size=50, n_layer=2, n_embd=32, n_head=4, window=8, context_length=64)))
    with torch.no_grad():  # biases and decays away from their start, so the step's use of them shows
        for block in model.blocks:
            block.mixer.perturb_()
    return model.eval()


@pytest.fixture(scope="module")
def compiled():
    """The one compile of this file: a tiny model's step for 1 to 32 rows."""
    model = tiny_model()
    step, note = compile_step(model, MAX_BATCH)
    if note.startswith("eager"):
        no_compiler(note)
    return model, step


def read_prompts(model: AFTLM, rows: int, seed: int = 0):
    """A state after a random prompt per row (read in the parallel form, as generation starts), and the
    tokens that follow."""
    generator = torch.Generator().manual_seed(seed)
    prompt, following = torch.randint(0, 50, (2, rows, 20), generator=generator)
    _, state = model.prefill(on_device(prompt), last_only=True)
    return state, on_device(following)


def no_eager_fallback(*args):
    raise AssertionError("the compiled step stepped eagerly")


def assert_states_close(state, expected) -> None:
    for layer, expected_layer in zip(state, expected, strict=True):
        assert layer.keys() == expected_layer.keys()
        for name in layer:
            torch.testing.assert_close(layer[name], expected_layer[name], rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("rows", [1, 3, MAX_BATCH])
def test_compiled_step_gives_the_eager_logits_and_a_state_that_continues_alike(compiled, rows, monkeypatch):
    model, step = compiled
    eager = model.step
    monkeypatch.setattr(model, "step", no_eager_fallback)  # every step below is the compiled one's own
    state, following = read_prompts(model, rows, seed=rows)
    fast, slow = clone_state(state), clone_state(state)
    with torch.inference_mode():
        for t in range(10):
            fast_logits, _ = step(following[:, t], fast)
            slow_logits, _ = eager(following[:, t], slow)
            assert fast_logits.shape == (rows, 50)
            torch.testing.assert_close(fast_logits, slow_logits, rtol=1e-4, atol=1e-4)
        assert_states_close(fast, slow)
        for t in range(10, 20):  # the compiled step's state read on by the eager step, and the other way round
            torch.testing.assert_close(
                eager(following[:, t], fast)[0], step(following[:, t], slow)[0], rtol=1e-4, atol=1e-4
            )
    assert_states_close(fast, slow)


def test_written_products_give_what_the_matrix_kernels_give():
    """Written out for a compiler (layers.written_products), a product with bf16 weights still multiplies x
    rounded to bf16, as the matrix kernels do: only the order of the float32 sum may differ."""
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(1, 96, generator=generator), torch.randn(40, 96, generator=generator), torch.randn(40)
    weight = weight.bfloat16()
    with written_products():
        written_out = linear(x, weight, bias)
    by_the_kernels = linear(x, weight, bias)
    assert written_out.dtype == torch.float32
    torch.testing.assert_close(written_out, by_the_kernels, rtol=2**-7, atol=1e-5)  # one bf16 step at most
    # and rarely even that: x left in float32 would move about a third of them
    assert (written_out != by_the_kernels).float().mean() < 0.1


@pytest.mark.parametrize("rows", [1, 3])
def test_bf16_weights_step_through_their_own_one_row_package_with_the_eager_logits(rows, monkeypatch):
    """With weights stored in bf16 a single row has a package of its own (layers.written_products), and
    every row count still gives the eager step's logits, as closely as a sum in another order rounded to bf16
    allows."""
    model = tiny_model().lower_weights(torch.bfloat16)
    step, note = compile_step(model, 4)
    if note.startswith("eager"):
        no_compiler(note)
    assert step.one_row is not step.rows
    eager = model.step
    monkeypatch.setattr(model, "step", no_eager_fallback)
    state, following = read_prompts(model, rows)
    fast, slow = clone_state(state), clone_state(state)
    with torch.inference_mode():
        for t in range(5):
            torch.testing.assert_close(
                step(following[:, t], fast)[0], eager(following[:, t], slow)[0], rtol=1e-2, atol=1e-2
            )


def test_a_second_compile_loads_the_cached_step_and_reads_the_models_own_weights(compiled, monkeypatch):
    model, _ = compiled
    other = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(1.5)
    step, note = compile_step(other, MAX_BATCH)  # the same architecture: the package from the fixture's compile
    assert note.startswith("compiled (from the cache)"), note
    eager = other.step
    monkeypatch.setattr(other, "step", no_eager_fallback)
    state, following = read_prompts(other, 2)
    fast, slow = clone_state(state), clone_state(state)
    with torch.inference_mode():
        torch.testing.assert_close(
            step(following[:, 0], fast)[0], eager(following[:, 0], slow)[0], rtol=1e-4, atol=1e-4
        )
        with torch.no_grad():
            other.embed.weight.add_(0.1)  # weights changed in place after compiling: the compiled step sees it
        torch.testing.assert_close(
            step(following[:, 1], fast)[0], eager(following[:, 1], slow)[0], rtol=1e-4, atol=1e-4
        )


def test_torchs_loader_the_gpus_path_runs_the_package_on_another_models_weights(compiled):
    """The path a GPU takes (torch's loader, the weights handed over as constants), run here on the package
    the CPU's runner runs, for another model of the architecture."""
    model, step = compiled
    other = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(0.8)
    path, origin = step_package(other, MAX_BATCH)
    assert origin == " (from the cache)"
    run = loaded_runner(path, step_constants(other))
    state, following = read_prompts(other, 3)
    fast, slow = clone_state(state), clone_state(state)
    names = list(fast[0])
    with torch.inference_mode():
        for t in range(3):
            ids = following[:, t].contiguous()
            logits = run([ids, *(layer[name] for layer in fast for name in names)])[0]
            torch.testing.assert_close(logits, other.step(ids, slow)[0], rtol=1e-4, atol=1e-4)
    assert_states_close(fast, slow)


def test_batches_and_states_the_package_was_not_compiled_for_step_eagerly(compiled):
    model, step = compiled
    state, following = read_prompts(model, MAX_BATCH + 1)
    with torch.inference_mode():
        logits, _ = step(following[:, 0], clone_state(state))  # one row more than compiled for
        torch.testing.assert_close(logits, model.step(following[:, 0], clone_state(state))[0])
        strided = [
            {
                name: t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() > 1 else t
                for name, t in layer.items()
            }
            for layer in clone_state(state)
        ]
        logits, _ = step(following[:, 0], strided)  # the same values, laid out otherwise
        torch.testing.assert_close(logits, model.step(following[:, 0], clone_state(state))[0])


def test_the_step_falls_back_to_eager_where_compiling_fails(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(torch.export, "export", no_compiler)
    model = tiny_model()
    step, note = compile_step(model, 2)  # a batch range not compiled before: the cache has no package for it
    assert step == model.step
    assert note == "eager (compiling the step failed: RuntimeError: no C++ compiler found)"


def assert_gives_the_eager_logits(model: AFTLM, step) -> None:
    """`step` is compiled (it never steps eagerly) and gives the eager step's logits."""
    state, following = read_prompts(model, 2)
    with torch.inference_mode():
        expected = model.step(following[:, 0], clone_state(state))[0]
        with mock.patch.object(model, "step", no_eager_fallback):
            logits = step(following[:, 0], clone_state(state))[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def cache_copy(model: AFTLM, cache: Path) -> Path:
    """The session cache's compiled step for `model` (package, library, record) copied into the cache folder
    `cache`; the copy's package."""
    package, _ = step_package(model, MAX_BATCH)
    (cache / "compiled").mkdir(parents=True)
    for original in package.parent.glob(f"{package.stem}.*"):
        shutil.copyfile(original, cache / "compiled" / original.name)
    return cache / "compiled" / package.name


@pytest.fixture
def stand_in_compiler(compiled, monkeypatch) -> list[str]:
    """The names of the packages that a stand-in for the compiler writes: the package compiled before (a real
    compile takes tens of seconds), written as files.atomic_write writes (on a full disk, torch's package
    writer fails too: it aborts the process)."""
    package, _ = step_package(compiled[0], MAX_BATCH)
    compiled_package, builds = package.read_bytes(), []

    def compile_again(model: AFTLM, max_batch: int, written: bool, path: Path) -> None:
        builds.append(path.name)
        aftgen.files.atomic_write(path, compiled_package, durable=False)

    monkeypatch.setattr(aftgen.compiled.step, "_package_step", compile_again)
    return builds


@pytest.fixture
def own_cache(stand_in_compiler, compiled, tmp_path, monkeypatch) -> tuple[Path, list[str]]:
    """A cache folder of this test's holding a copy of the compiled step (its package), and the names of the
    packages the stand-in compiler writes."""
    package = cache_copy(compiled[0], tmp_path)
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path))
    return package, stand_in_compiler


def _garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * (path.stat().st_size // 256))


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


DAMAGES = {  # a library cut short is the subprocess test's: it kills the process that loads it
    "an empty library": lambda package: library_of(package).write_bytes(b""),
    "a garbage library": lambda package: _garbage(library_of(package)),
    "a FIFO for the library": lambda package: _fifo(library_of(package)),
    "a package cut short": lambda package: package.write_bytes(package.read_bytes()[:50_000]),
    "a garbage package": _garbage,
    "no record": lambda package: package.with_suffix(".json").unlink(),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_step_in_the_cache_is_compiled_again_with_one_line(compiled, own_cache, damage, capsys, no_hang):
    model, _ = compiled
    package, builds = own_cache
    DAMAGES[damage](package)
    step, note = compile_step(model, MAX_BATCH)
    assert note.startswith("compiled in"), note  # not eager, and not "from the cache"
    assert builds == [package.name]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "the compiled step in the cache was damaged" in lines[0], lines
    assert_gives_the_eager_logits(model, step)
    assert compile_step(model, MAX_BATCH)[1].startswith("compiled (from the cache)")  # what was rebuilt is recorded


def test_a_library_cut_short_is_compiled_again_not_loaded(compiled, tmp_path):
    """The audit's case: a library cut short was mapped past its end, and its loader died of SIGBUS (exit -7)."""
    package = cache_copy(compiled[0], tmp_path)
    compiled_package = tmp_path / "compiled.pt2"
    shutil.copyfile(package, compiled_package)
    library_of(package).write_bytes(library_of(package).read_bytes()[:50_000])
    child = f"""
import shutil, aftgen.compiled.step
from test_step import MAX_BATCH, assert_gives_the_eager_logits, tiny_model
aftgen.compiled.step._package_step = lambda model, rows, written, path: shutil.copyfile({str(compiled_package)!r}, path)
model = tiny_model()
step, note = aftgen.compiled.step.compile_step(model, MAX_BATCH)
assert_gives_the_eager_logits(model, step)
print(note)
"""
    tests = os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])  # conftest's
    env = os.environ | {"AFTGEN_CACHE": str(tmp_path), "PYTHONPATH": tests}
    result = subprocess.run(
        [sys.executable, "-c", child], cwd=Path(__file__).parent, capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("compiled in"), result.stdout
    assert len(result.stderr.splitlines()) == 1 and "(50,000 bytes) is not the file recorded" in result.stderr


def assert_compiled_privately(model: AFTLM, step, note: str, builds: list[str], lines: list[str], why: str) -> None:
    """The step compiled again (once) outside the cache, and one line saying `why`."""
    assert note.startswith("compiled in"), note  # not eager, and not "from the cache"
    assert len(builds) == 1 and len(lines) == 1, lines
    assert lines[0].startswith("warning: ") and why in lines[0], lines
    assert lines[0].endswith("compiled code is kept in a private temporary folder"), lines
    assert_gives_the_eager_logits(model, step)


def test_a_damaged_step_that_cannot_be_deleted_is_compiled_privately_naming_it(compiled, own_cache, capsys):
    model, _ = compiled
    package, builds = own_cache
    library_of(package).unlink()
    (library_of(package) / "in the way").mkdir(parents=True)  # a folder: never deleted whole
    step, note = compile_step(model, MAX_BATCH)
    lines = capsys.readouterr().err.splitlines()[1:]  # after the line that says it was damaged
    why = f"{library_of(package)} cannot be deleted (Is a directory): delete it to compile the step again"
    assert_compiled_privately(model, step, note, builds, lines, why)


def test_a_file_where_the_compiled_folder_should_be_compiles_the_step_privately(
    compiled, stand_in_compiler, tmp_path, monkeypatch, capsys
):
    (tmp_path / "compiled").write_text("not a folder")
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path))
    step, note = compile_step(compiled[0], MAX_BATCH)
    why = f"{tmp_path / 'compiled'} is not a folder: delete it to keep the compiled step in the cache"
    assert_compiled_privately(compiled[0], step, note, stand_in_compiler, capsys.readouterr().err.splitlines(), why)
    assert (tmp_path / "compiled").read_text() == "not a folder"


def test_a_full_cache_disk_compiles_the_step_privately_leaving_nothing_there(compiled, own_cache, monkeypatch, capsys):
    model, _ = compiled
    package, builds = own_cache
    for entry in package.parent.glob(f"{package.stem}.*"):
        entry.unlink()  # not in the cache: compiled now, onto a disk that is full
    write = aftgen.files.atomic_write

    def write_on_a_full_disk(path: Path, data: bytes | str, durable: bool = True) -> None:
        if Path(path).parent != package.parent:
            return write(path, data, durable)
        with aftgen.files.atomic_open(path, "wb", durable):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(aftgen.files, "atomic_write", write_on_a_full_disk)
    step, note = compile_step(model, MAX_BATCH)
    lines = capsys.readouterr().err.splitlines()
    assert_compiled_privately(model, step, note, builds, lines, f"disk full while writing {package}")
    assert [entry.name for entry in package.parent.iterdir()] == [package.with_suffix(".lock").name]


def test_a_linked_compiled_folder_is_not_read_through_the_link(compiled, own_cache, tmp_path, capsys):
    model, _ = compiled
    package, builds = own_cache
    package.parent.rename(tmp_path / "elsewhere")  # an intact entry, reached through the link
    package.parent.symlink_to(tmp_path / "elsewhere")
    step, note = compile_step(model, MAX_BATCH)
    why = f"{package.parent} is a link, which aftgen never makes"
    assert_compiled_privately(model, step, note, builds, capsys.readouterr().err.splitlines(), why)

"""The same request, the same text, with --batch-invariant: a row's logits do not depend on the rows beside it,
on every path that steps a batch (the compiled package, float32, bf16 and fp16-stored weights, through each of
the product's kernels this machine runs, and the eager step rows apart), and a server's text is what `aftgen sample
--seed` prints, alone, with n: 2 and among eight other requests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest
import torch
from conftest import no_compiler
from serving import LONG, Stream, busy_slots, client, running
from typer.testing import CliRunner

from aftgen.cli import app
from aftgen.compiled.step import compile_step
from aftgen.device import Placement
from aftgen.layers import Invariance
from aftgen.model import AFTLM, AFTConfig, clone_state
from aftgen.native import library, matmul_rows
from aftgen.serve import batch as batch_module
from aftgen.serve.batch import Batch, CompiledBatchStep, eager_step

VOCAB = 256
ROWS = (1, 2, 9, 32)
WEIGHTS = {"float32": torch.float32, "bf16": torch.bfloat16}
STORED = {"fp16 on disk, bf16 served": (torch.float16, torch.bfloat16)}  # the shipped model, served on a CPU


def small_model(weights: torch.dtype, stored: torch.dtype = torch.float32) -> AFTLM:
    """Wide enough that products of another order round differently somewhere in every step; its weights as
    read from a checkpoint `stored` in that dtype."""
    torch.manual_seed(0)
    model = AFTLM(AFTConfig(vocab_size=VOCAB, n_layer=2, n_embd=64, n_head=4, window=8, context_length=64))
    with torch.no_grad():
        for block in model.blocks:
            block.mixer.perturb_()
        for parameter in model.parameters():
            parameter.copy_(parameter.to(stored))
    return model.eval().lower_weights(weights)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Iterator[dict]:
    """Each weight dtype's model and its compiled step, compiled once into a cache of this module's own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AFTGEN_CACHE", str(tmp_path_factory.mktemp("cache")))
        patch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        steps = {}
        for name, dtypes in ({name: (torch.float32, dtype) for name, dtype in WEIGHTS.items()} | STORED).items():
            model = small_model(dtypes[1], dtypes[0])  # fp16-stored: the bf16 package, from the cache
            step, note = compile_step(model, max(ROWS), batch_invariant=True)
            if note.startswith("eager"):
                no_compiler(note)
            steps[name] = model, step
        yield steps


def histories(model: AFTLM, count: int) -> list[tuple[int, list]]:
    """(owner, batch-1 state) for `count` rows that read different prompts of different lengths."""
    generator = torch.Generator().manual_seed(count)
    joining = []
    for row in range(count):
        ids = torch.randint(0, VOCAB, (1, 3 + row % 11), generator=generator)
        joining.append((row, model.prefill(ids, last_only=True)[1]))
    return joining


def stepped(model: AFTLM, step, joining: list, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The logits of each step of a batch of `joining`'s rows, fed `tokens` (steps, rows)."""
    batch = Batch(model, capacity=len(joining), step=step)
    with torch.inference_mode():
        batch.add([(owner, clone_state(state)) for owner, state in joining])
        return [batch.step(column).clone() for column in tokens]


def assert_each_row_as_alone(model: AFTLM, step) -> None:
    for rows in ROWS:
        joining = histories(model, rows)
        tokens = torch.randint(0, VOCAB, (3, rows), generator=torch.Generator().manual_seed(rows))
        together = stepped(model, step, joining, tokens)
        for row in range(rows):
            alone = stepped(model, step, joining[row : row + 1], tokens[:, row : row + 1])
            for t, logits in enumerate(alone):
                assert torch.equal(logits[0], together[t][row]), f"row {row} of {rows}, step {t}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_a_compiled_rows_logits_are_its_own_alone_whatever_the_rows_beside_it(compiled, weights, threads):
    model, step = compiled[weights]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_each_row_as_alone(model, step)
    finally:
        torch.set_num_threads(before)


def kernel_paths() -> list[tuple[int, bool]]:
    """(level, AMX tiles) for each of the product's kernels this machine runs: the vector kernel's levels (base,
    x86-64-v3, v4), with and without the tiles where the machine has them."""
    loaded = library.library()
    tiles = loaded.aftgen_matmul_rows_use(-1, 1) == 0  # the machine's own kernels: what every other test runs
    return [(level, amx) for level in range(loaded.aftgen_matmul_rows_levels()) for amx in {False, tiles}]


@contextlib.contextmanager
def kernels_used(level: int, amx: bool) -> Iterator[None]:
    """Every product, the step packages' too, through the vector kernel of `level` and the tiles or not."""
    loaded = library.library()
    assert loaded.aftgen_matmul_rows_use(level, amx) == 0
    try:
        yield
    finally:
        if loaded.aftgen_matmul_rows_use(-1, 1) != 0:  # the machine's own again: AMX where it has it
            loaded.aftgen_matmul_rows_use(-1, 0)


@pytest.mark.parametrize("weights", [*WEIGHTS, *STORED])
def test_a_rows_logits_are_its_own_through_each_of_the_products_kernels(compiled, weights):
    """Each path a CPU may take, forced on this one: a Zen 4's (AVX-512 without AMX), an AVX2 machine's, an old
    one's, and AMX's; a row's logits the same bits alone and among others on each."""
    model, step = compiled[weights]
    bf16 = torch.zeros(64, 64, dtype=torch.bfloat16)
    for level, amx in kernel_paths():
        with kernels_used(level, amx):
            assert matmul_rows.kernel(bf16) == ("amx" if amx else "vector")
            assert_each_row_as_alone(model, step)


def test_a_servers_default_step_is_timed_and_falls_back_over_a_tenth_slower(monkeypatch, capsys):
    """The decision made as the server's step is prepared (the timings given: no clock here), and kept as plain
    attributes of the step the engine holds."""
    model, cpu = small_model(torch.float32), Placement(torch.device("cpu"))
    steps = {True: lambda ids, state: ("invariant", state), False: lambda ids, state: ("kernels", state)}
    monkeypatch.setattr(batch_module, "compile_step", lambda model, rows, batch_invariant: (steps[batch_invariant], ""))
    for times, invariant in [({1: (1.0, 1.0), 32: (2.2, 2.0)}, True), ({1: (1.0, 1.0), 32: (2.3, 2.0)}, False)]:
        monkeypatch.setattr(batch_module, "timed_steps", lambda model, invariant, kernels, rows, times=times: times)
        step = CompiledBatchStep(model, 32, cpu, wait=60, invariance=Invariance(True, by_default=True))
        assert step(None, [])[0] == ("invariant" if invariant else "kernels") and step.batch_invariant == invariant
        assert (step.batch_invariant_reason is None) == invariant
        assert ("not batch-invariant" in capsys.readouterr().err) != invariant
    asked = CompiledBatchStep(model, 32, cpu, wait=60, invariance=Invariance(True))
    assert asked(None, [])[0] == "invariant" and asked.batch_invariant  # asked for: not timed


@pytest.mark.parametrize("weights", WEIGHTS)
def test_the_eager_steps_rows_are_their_own_alone_while_the_step_compiles(weights, monkeypatch):
    """The server's step until its compile is done (and where none works): the eager step, rows apart."""
    model = small_model(WEIGHTS[weights])
    monkeypatch.setattr(CompiledBatchStep, "_compile", lambda *args: None)  # a compile that never ends
    assert_each_row_as_alone(model, CompiledBatchStep(model, max(ROWS), None, wait=0, invariance=Invariance(True)))
    assert_each_row_as_alone(model, eager_step(model, batch_invariant=True))  # a server that does not compile


PROMPT = "NURSE:"
ASKS = {"seeded": dict(seed=5, temperature=0.8), "greedy": dict(seed=5, temperature=0.0)}


def sampled(model_dir, compile_step: bool, invariant: bool | None, seed: int, temperature: float) -> str:
    """What `aftgen sample --seed` prints after the prompt (`invariant`: --batch-invariant, None: its default)."""
    command = ["sample", "-m", str(model_dir), "-p", PROMPT, "-n", "60", "--seed", str(seed), "--no-echo"]
    command += ["--temperature", str(temperature), "--compile" if compile_step else "--no-compile"]
    command += [] if invariant is None else ["--batch-invariant" if invariant else "--no-batch-invariant"]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    return result.stdout.removesuffix("\n")


@contextlib.contextmanager
def others_running(url: str) -> Iterator[None]:
    """Eight other requests generating (sampled, greedy, other seeds), each longer than the test."""
    with httpx.Client(timeout=60) as http:
        others = [Stream(http, url, "JULIET: " * (i + 1), LONG, seed=i, temperature=0.5 * (i % 3)) for i in range(8)]
        for stream in others:
            stream.texts(1)
        assert busy_slots(url) == 8
        try:
            yield
        finally:
            for stream in others:
                stream.close()


@pytest.mark.parametrize("compile_step", [True, False], ids=["compiled", "eager"])
def test_a_request_gives_aftgen_samples_text_alone_with_n_2_and_among_eight_others(tiny_run, compile_step):
    """The machine's own weights (bf16 where the CPU has bf16 units, else float32). `aftgen sample --compile`
    runs first: it compiles the package the server then loads, so the server never steps eagerly meanwhile.
    Both asked for it: by default a server keeps it only where its own timing finds it at most a tenth slower
    (tested with given timings: a tiny model's step is mostly overhead)."""
    invariant = True
    expected = {name: sampled(tiny_run, compile_step, invariant, **ask) for name, ask in ASKS.items()}
    with running(tiny_run, compile_step=compile_step, dtype="auto", batch_invariant=invariant) as url:
        api = client(url)

        def texts(n: int = 1) -> dict[str, list[str]]:
            asked = {name: api.completions.create(model=tiny_run.name, prompt=PROMPT, max_tokens=60, n=n, **ask)
                     for name, ask in ASKS.items()}  # fmt: skip
            return {name: [choice.text for choice in sorted(reply.choices, key=lambda c: c.index)]
                    for name, reply in asked.items()}  # fmt: skip

        alone, two = texts(), texts(n=2)
        with others_running(url):
            among_others = texts()
    for name, text in expected.items():
        assert alone[name][0] == two[name][0] == among_others[name][0] == text, name

"""Shared fixtures: a small synthetic corpus and one tiny trained run, made fresh for the session.

AFTGEN_TEST_DEVICE (default cpu) is where every test that builds a model, trains, samples or serves
runs it: `AFTGEN_TEST_DEVICE=cuda pytest` is the suite on a GPU. Tests about the CPU itself carry
the `cpu` marker and run there whatever the variable says (`-m "not cpu"` leaves them out).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

DEVICE = os.environ.get("AFTGEN_TEST_DEVICE", "cpu")
# The suite's aftgen commands (in this process and in the ones it starts) take every core and stay out of
# the machine's registry of running aftgen processes (aftgen.cores), as the CI machine's only job.
os.environ["AFTGEN_SOLO"] = "1"

WORDS = (
    "the king queen lord lady sword crown night day love death heart blood fair foul sweet bitter "
    "speak hear see know come go stay fly rise fall my thy his her our your good ill old young"
).split()


def make_corpus(chars: int, seed: int = 0) -> str:
    """Play-like text: speaker lines of random words, reproducible."""
    rng = random.Random(seed)
    speakers = ["ROMEO", "JULIET", "KING", "NURSE"]
    lines = []
    while sum(len(line) + 1 for line in lines) < chars:
        lines.append(f"{rng.choice(speakers)}:")
        for _ in range(rng.randint(1, 3)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(3, 9))]
            lines.append(" ".join(words).capitalize() + rng.choice([".", ",", "!", "?"]))
        lines.append("")
    return "\n".join(lines)[:chars]


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu: about the CPU itself; runs there whatever AFTGEN_TEST_DEVICE says")
    if DEVICE != "cpu":
        from aftgen.device import pick_device
        from aftgen.errors import AftgenError

        try:
            pick_device(DEVICE)
        except AftgenError as exc:
            raise pytest.UsageError(f"AFTGEN_TEST_DEVICE={DEVICE}: {exc}") from None


def no_compiler(note: str) -> None:
    """A test that needs the C++ compiler, where the step fell back to eager: skipped on a developer's machine
    without one, failed where AFTGEN_REQUIRE_COMPILER is set (.ci/run sets it, as it does for the browser)."""
    if os.environ.get("AFTGEN_REQUIRE_COMPILER"):
        pytest.fail(f"a C++ compiler is required here (AFTGEN_REQUIRE_COMPILER) but the step is {note}")
    pytest.skip(f"no compiler here: {note}")


def on_device(value):
    """A tensor or module moved to the device under test."""
    return value.to(DEVICE)


@pytest.fixture(autouse=True)
def _no_fallbacks_yet(monkeypatch):
    """Each test starts with no fallback recorded or said: aftgen.compiled.availability keeps them for the process,
    and a test that forces one would otherwise show it in the next test's /health figures and stderr."""
    from aftgen.compiled import availability

    monkeypatch.setattr(availability, "_verdicts", {})
    monkeypatch.setattr(availability, "_said", set())


@pytest.fixture(autouse=True)
def _exact_matmuls():
    """Full fp32 matmuls on a GPU: training turns TF32 on (aftgen.device.resolve), and the tests compare
    forms of the model to 1e-5, which TF32's 10-bit mantissa cannot hold."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@contextlib.contextmanager
def torch_on_one_thread():
    """Tiny models on a shared 2-core machine run fastest on one thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    with torch_on_one_thread():
        yield


@pytest.fixture(scope="module")
def one_thread_per_module():
    """One thread for a whole module, so that its module-scoped servers (their engine threads too) start on it."""
    with torch_on_one_thread():
        yield


@pytest.fixture
def no_hang():
    """Fail a test whose read blocks (a FIFO with no writer) or never ends (/dev/zero) instead of hanging
    the suite: the alarm's exception interrupts the read."""

    def stop(signum, frame):
        raise TimeoutError("the command hung")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    os.environ["AFTGEN_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "plays.txt"
    path.write_text(make_corpus(40_000))
    return path


def train_tiny(corpus: Path, out: Path, on_eval=None, **changes) -> Path:
    """In-process training; vocabulary 400 on `corpus` reuses the tokenizer the tiny_run fixture cached."""
    from aftgen.training.loop import train
    from aftgen.training.options import TrainOptions

    # fp32: the recipe's measured choice of dtype would make two runs' weights differ by chance
    options = dict(preset="tiny", vocab_size=400, max_steps=8, eval_interval=2, device=DEVICE, dtype="fp32") | changes
    return train(TrainOptions(corpus=corpus, out=out, **options), quiet=True, on_eval=on_eval)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, corpus) -> Path:
    """A tiny model trained for a few steps: enough to exercise every code path quickly."""
    return train_tiny(corpus, tmp_path_factory.mktemp("runs") / "tiny", max_steps=40, eval_interval=20)


@pytest.fixture(scope="module")
def url(tiny_run) -> Iterator[str]:
    """The module's server."""
    from serving import watched

    with watched(tiny_run) as base:
        yield base

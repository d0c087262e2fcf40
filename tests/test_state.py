"""State files: a generation saved and resumed goes on exactly, a file's size does not grow with the history, and
one from another model or with damaged bytes is refused."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import DEVICE
from typer.testing import CliRunner

from aftgen.api import load
from aftgen.checkpoint import save_checkpoint
from aftgen.cli import app
from aftgen.errors import AftgenError
from aftgen.generation.controls import SamplingOptions
from aftgen.generation.loop import generate
from aftgen.generation.prompt import read_prompt
from aftgen.state import load_state, save_state

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tiny_run):
    return load(tiny_run, device=DEVICE)


def test_save_then_load_state_continues_exactly(tiny_run, tmp_path):
    common = ["--model", str(tiny_run), "--device", DEVICE, "--temperature", "1.2", "--repeat-penalty", "1.3"]
    whole = runner.invoke(app, ["sample", *common, "-p", "KING:", "-n", "60", "--seed", "5"])
    first = runner.invoke(
        app,
        ["sample", *common, "-p", "KING:", "-n", "25", "--seed", "5", "--save-state", str(tmp_path / "s.safetensors")],
    )
    second = runner.invoke(app, ["sample", *common, "-n", "35", "--load-state", str(tmp_path / "s.safetensors")])
    assert whole.exit_code == first.exit_code == second.exit_code == 0, first.stderr + second.stderr
    assert first.stdout + second.stdout == whole.stdout


def test_a_state_file_from_before_positions_per_row_loads_and_continues_alike(tiny, tmp_path):
    """Files written before each row kept its own position hold every layer's position 0-dim: read as (1,)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model, tokenizer = tiny
    context = read_prompt(model, tokenizer, "KING:", seed=0)
    now, before = tmp_path / "now.safetensors", tmp_path / "before.safetensors"
    save_state(now, context, model, tokenizer)
    with safe_open(now, "pt") as opened:
        metadata = opened.metadata()
    tensors = load_file(now)
    save_file({name: t.view(()) if name.endswith(".position") else t for name, t in tensors.items()}, before, metadata)
    loaded = {path: load_state(path, model, tokenizer) for path in (now, before)}
    assert [layer["position"].shape for layer in loaded[before].state] == [(1,)] * model.config.n_layer
    texts = ["".join(generate(model, tokenizer, c, SamplingOptions(max_new_tokens=20))) for c in loaded.values()]
    assert texts[0] == texts[1]


def test_state_file_size_is_independent_of_history(tiny, tmp_path):
    model, tokenizer = tiny
    sizes = []
    for prompt, tokens in (("KING:", 3), ("KING: " * 300, 200)):
        context = read_prompt(model, tokenizer, prompt, seed=0)
        "".join(generate(model, tokenizer, context, SamplingOptions(max_new_tokens=tokens), final=False))
        save_state(tmp_path / "s.safetensors", context, model, tokenizer)
        sizes.append((tmp_path / "s.safetensors").stat().st_size)
    assert sizes[0] == sizes[1]


def test_state_from_another_model_or_corrupt_bytes_is_refused(tiny, tmp_path):
    model, tokenizer = tiny
    path = tmp_path / "s.safetensors"
    save_state(path, read_prompt(model, tokenizer, "KING:", seed=0), model, tokenizer)
    torch.manual_seed(1)
    changed = type(model)(model.config).eval()
    with pytest.raises(AftgenError, match="different model weights"):
        load_state(path, changed, tokenizer)
    data = path.read_bytes()
    for bad in (os.urandom(4000), data[: len(data) // 2], b"", data[:8]):
        (tmp_path / "bad").write_bytes(bad)
        with pytest.raises(AftgenError, match="state file"):
            load_state(tmp_path / "bad", model, tokenizer)


def test_cli_refuses_a_state_from_another_model(tiny, tiny_run, tmp_path):
    model, tokenizer = tiny
    other_run = tmp_path / "other"
    torch.manual_seed(1)
    save_checkpoint(other_run, type(model)(model.config), tokenizer)
    state = tmp_path / "s.safetensors"
    save_state(state, read_prompt(model, tokenizer, "KING:", seed=0), model, tokenizer)
    result = runner.invoke(app, ["sample", "--model", str(other_run), "--device", DEVICE, "--load-state", str(state)])
    assert result.exit_code == 2 and "different model weights" in result.stderr

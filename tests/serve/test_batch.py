"""aftgen.serve.batch: rows at their own positions stepped as one batch, and the batched step compiled or eager."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, on_device

from aftgen.api import load
from aftgen.device import resolve
from aftgen.model import AFTLM, AFTConfig, clone_state
from aftgen.serve.batch import Batch, CompiledBatchStep

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@pytest.mark.parametrize("mixer", ["aft_local", "aft_simple"])
def test_batched_step_matches_each_sequence_alone(mixer):
    """Rows at different positions join and leave, one or two at once; each row's logits stay within 1e-4 of
    its own batch-1 step (so greedy picks agree), and a row that leaves has its own state and position back."""
    torch.manual_seed(0)
    config = AFTConfig(vocab_size=64, n_layer=2, n_embd=32, n_head=4, window=5, context_length=16, mixer=mixer)
    model = on_device(AFTLM(config).eval())
    with torch.inference_mode():
        positions = [3, 8, 13, 1, 6]
        alone = [model.prefill(torch.randint(0, 64, (1, n)), last_only=True)[1] for n in positions]
        batch = Batch(model, capacity=4)
        batch.add([(i, clone_state(alone[i])) for i in (0, 1, 2)])
        joins = {5: 3, 11: 4}
        leaves = {11: [1], 17: [1], 20: [0, 1]}  # middle rows (the last fills their place), then two at once
        for t in range(24):
            if t in leaves:
                leaving = [batch.rows[r] for r in leaves[t]]
                for row in leaving:
                    state, position = batch.state_of(row)
                    assert position == positions[row]
                    for mine, theirs in zip(state, alone[row], strict=True):
                        for name in mine:
                            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-4)
                batch.remove(leaving)
                assert not set(leaving) & set(batch.rows)
            if t in joins:
                batch.add([(joins[t], clone_state(alone[joins[t]]))])
            tokens = torch.randint(0, 64, (len(batch),))
            logits = batch.step(tokens)
            for r, i in enumerate(batch.rows):
                own, _ = model.step(tokens[r : r + 1], alone[i])
                positions[i] += 1
                assert (own - logits[r : r + 1]).abs().max() < 1e-4
                assert own.argmax() == logits[r].argmax()


def test_a_step_that_cannot_be_compiled_runs_eagerly_with_one_line_on_stderr(tiny_run, monkeypatch, capsys):
    model, _ = load(tiny_run, device=DEVICE)
    note = "eager (compiling the step failed: RuntimeError: no C++ compiler)"

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr("aftgen.compiled.step._compiled_step", no_compiler)
    step = CompiledBatchStep(model, 4, resolve(DEVICE, "fp32"))
    assert step.step == model.step
    said = "the compiled step cannot be used here (RuntimeError: no C++ compiler): the eager step runs"
    assert capsys.readouterr().err.splitlines() == [f"warning: {said}"]
    assert step.figures() == {"step": "eager", "batch_invariant": False, "step_note": note}

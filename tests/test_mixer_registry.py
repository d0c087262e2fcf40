"""A mixer is its class and one registry line: one registered at run time passes the every-mixer tests,
trains, samples and serves with nothing else changed; one whose state grows is refused by the server."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, train_tiny
from mixer_checks import (
    check_causality,
    check_prefill_last_only_gives_the_last_logits_and_the_same_state,
    check_prefill_then_step_equals_parallel,
)
from serving import client, running
from typer.testing import CliRunner

from aftgen.checkpoint import load_checkpoint, save_checkpoint
from aftgen.cli import app
from aftgen.mixers import MIXERS, Kind, MixerState
from aftgen.model import AFTLM, AFTConfig

runner = CliRunner()


class CausalMean(torch.nn.Module):
    """y_t = proj(the mean of v over tokens <= t). Its state is a running sum and count: a fixed size."""

    no_weight_decay = ()
    fixed_size_state = True

    def __init__(self, n_embd: int):
        super().__init__()
        self.v, self.proj = torch.nn.Linear(n_embd, n_embd), torch.nn.Linear(n_embd, n_embd)

    @classmethod
    def from_config(cls, config) -> CausalMean:
        return cls(config.n_embd)

    @classmethod
    def shaping_fields(cls, config) -> tuple[str, ...]:
        return ()

    def perturb_(self) -> None:
        """Its weights all start random."""

    def initial_state(self, batch_size: int, device=None) -> MixerState:
        zeros = torch.zeros(batch_size, self.v.out_features, device=device)
        return {
            "sum": zeros,
            "count": zeros[:, :1].clone(),
            "position": torch.zeros(batch_size, dtype=torch.long, device=device),  # (B,): a row's, as it is batched
        }

    def forward(self, x, state=None, return_state=False, last_only=False):
        B, T, _ = x.shape
        state = self.initial_state(B, x.device) if state is None else state
        sums = state["sum"][:, None] + self.v(x).cumsum(1)  # (B, T, C)
        counts = state["count"][:, None] + torch.arange(1, T + 1, device=x.device)[None, :, None]  # (B, T, 1)
        y = self.proj(sums / counts)
        new = {"sum": sums[:, -1], "count": counts[:, -1], "position": state["position"] + T}
        return (y[:, -1:] if last_only else y), (new if return_state else None)

    def step(self, x, state: MixerState) -> torch.Tensor:
        state["sum"].add_(self.v(x))
        state["count"].add_(1)
        state["position"].add_(1)
        return self.proj(state["sum"] / state["count"])


class PastValues(CausalMean):
    """The same mean from every past value, kept in the state as a KV cache keeps them: a state that grows."""

    fixed_size_state = False

    def initial_state(self, batch_size: int, device=None) -> MixerState:
        values = torch.zeros(batch_size, 0, self.v.out_features, device=device)
        return {"values": values, "position": torch.zeros((), dtype=torch.long, device=device)}

    def forward(self, x, state=None, return_state=False, last_only=False):
        B, T, _ = x.shape
        state = self.initial_state(B, x.device) if state is None else state
        values = torch.cat([state["values"], self.v(x)], dim=1)
        seen = torch.arange(1, values.shape[1] + 1, device=x.device)[:, None]
        y = self.proj((values.cumsum(1) / seen)[:, -T:])
        new = {"values": values, "position": state["position"] + T}
        return (y[:, -1:] if last_only else y), (new if return_state else None)

    def step(self, x, state: MixerState) -> torch.Tensor:
        state["values"] = torch.cat([state["values"], self.v(x)[:, None]], dim=1)
        state["position"].add_(1)
        return self.proj(state["values"].mean(1))


@pytest.fixture
def registered(monkeypatch) -> None:
    """Both mixers in the registry for one test; monkeypatch takes them out after it."""
    monkeypatch.setitem(MIXERS, "mean", Kind(CausalMean, "a causal mean"))
    monkeypatch.setitem(MIXERS, "past_values", Kind(PastValues, "a causal mean over a growing state"))


@pytest.mark.usefixtures("registered")
@pytest.mark.parametrize("mixer", ["mean", "past_values"])
def test_registered_mixers_pass_the_every_mixer_tests(mixer):
    check_prefill_then_step_equals_parallel(mixer)
    check_prefill_last_only_gives_the_last_logits_and_the_same_state(mixer)
    check_causality(mixer)


@pytest.mark.usefixtures("registered", "one_thread")
def test_a_mixer_registered_at_run_time_trains_samples_and_serves(tmp_path, corpus):
    out = train_tiny(corpus, tmp_path / "mean", mixer="mean", max_steps=4)
    model, _ = load_checkpoint(out)
    assert isinstance(model.blocks[0].mixer, CausalMean)
    sampled = runner.invoke(app, ["sample", "--model", str(out), "-p", "KING:", "-n", "20", "--seed", "1",
                                  "--device", DEVICE])  # fmt: skip
    assert sampled.exit_code == 0 and sampled.stdout.startswith("KING:"), sampled.output
    with running(out) as url:
        reply = client(url).completions.create(model=out.name, prompt="KING:", max_tokens=8, seed=1)
    assert reply.usage.completion_tokens == 8 and reply.choices[0].text


@pytest.mark.usefixtures("registered")
def test_a_mixer_whose_state_grows_samples_but_the_server_refuses_it_in_one_line(tmp_path, tiny_run):
    _, tokenizer = load_checkpoint(tiny_run)
    config = AFTConfig.from_preset("tiny", tokenizer.vocab_size, mixer="past_values")
    save_checkpoint(tmp_path, AFTLM(config), tokenizer)
    sampled = runner.invoke(app, ["sample", "--model", str(tmp_path), "-p", "KING:", "-n", "20", "--device", DEVICE])
    assert sampled.exit_code == 0, sampled.output
    served = runner.invoke(app, ["serve", "--model", str(tmp_path), "--port", "0", "--device", DEVICE])
    assert served.exit_code != 0 and served.output.strip().splitlines() == [
        "error: aftgen serve batches fixed-size states; a past_values model's state grows with its stream"
    ]

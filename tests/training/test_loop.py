"""The training loop (aftgen/training/loop.py): keeping the best weights, patience, lower-precision weight files,
the weight average, the time budget, and the optimizers it steps."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import DEVICE, on_device, train_tiny
from safetensors.torch import load_file

from aftgen import evaluate
from aftgen.checkpoint import WEIGHTS, load_checkpoint
from aftgen.model import AFTLM, AFTConfig
from aftgen.record import TRAINING_INFO, TRAINING_STATE

pytestmark = pytest.mark.usefixtures("one_thread")


def scripted_held_out(monkeypatch, scores: list[float]) -> None:
    """Make the quick held-out check return `scores` in turn (real training, chosen verdicts)."""
    remaining = iter(scores)
    monkeypatch.setattr(evaluate, "window_loss", lambda *args: next(remaining))


def test_keep_best_publishes_the_best_scoring_weights(tmp_path, corpus, tiny_run, monkeypatch):
    scores = [3.0, 2.0, 2.5, 2.6]  # evals at steps 2, 4, 6, 8: step 4 is best
    options = dict(max_steps=8, eval_interval=2, dropout=0.1)

    # The same run without keep_best: at the eval of step 6, model.safetensors still holds step 4.
    step_4: dict[str, torch.Tensor] = {}

    def grab(row: dict) -> None:
        if row["step"] == 6:
            step_4.update(load_file(tmp_path / "latest" / WEIGHTS))

    scripted_held_out(monkeypatch, scores)
    train_tiny(corpus, tmp_path / "latest", on_eval=grab, keep_best=False, **options)
    scripted_held_out(monkeypatch, scores)
    out = train_tiny(corpus, tmp_path / "best", keep_best=True, **options)

    info = json.loads((out / TRAINING_INFO).read_text())
    assert info["best"]["step"] == 4 and info["step"] == 8
    published = load_file(out / WEIGHTS)
    latest = {k[len("model.") :]: v for k, v in load_file(out / TRAINING_STATE).items() if k.startswith("model.")}
    assert published.keys() == step_4.keys()
    for name in published:
        torch.testing.assert_close(published[name], step_4[name], atol=0, rtol=0, msg=name)
    assert any(not torch.equal(published[name], latest[name]) for name in published), (
        "the latest weights were published"
    )
    # The final score in the card describes the published weights.
    model, tokenizer = load_checkpoint(out)
    from aftgen.evaluate import evaluate_text

    text = corpus.read_text()
    score = evaluate_text(model, tokenizer, text[int(0.9 * len(text)) :]).nats_per_char  # the last 10% is held out
    assert info["final_eval"]["nats_per_char"] == pytest.approx(score, abs=1e-6)


def test_keep_best_checks_the_last_step_and_survives_resume(tmp_path, corpus, tiny_run, monkeypatch):
    # evals at 3 and 6, then the end (step 8) is checked too, and is best
    scripted_held_out(monkeypatch, [3.0, 2.0, 1.0])
    out = train_tiny(corpus, tmp_path / "run", keep_best=True, max_steps=8, eval_interval=3)
    info = json.loads((out / TRAINING_INFO).read_text())
    assert info["best"]["step"] == 8

    # A resumed run remembers the best so far: a worse score later does not replace it.
    scripted_held_out(monkeypatch, [5.0, 5.0])
    before = load_file(out / WEIGHTS)
    train_tiny(corpus, out, keep_best=True, max_steps=12, eval_interval=3, resume=True)
    info = json.loads((out / TRAINING_INFO).read_text())
    assert info["best"]["step"] == 8 and info["step"] == 12
    after = load_file(out / WEIGHTS)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_patience_stops_after_checks_without_a_new_best(tmp_path, corpus, tiny_run, monkeypatch):
    # evals every 2 steps: step 4 is best, steps 6 and 8 miss it, so patience 2 ends the run at step 8
    scripted_held_out(monkeypatch, [3.0, 2.0, 2.5, 2.6])
    out = train_tiny(corpus, tmp_path / "run", keep_best=True, patience=2, max_steps=40, eval_interval=2)
    info = json.loads((out / TRAINING_INFO).read_text())
    assert info["step"] == 8 and info["best"]["step"] == 4
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [2, 4, 6, 8]
    assert "final_eval" in info  # a finished run, scored like one that spent its budget


def test_patience_counts_the_checks_before_a_resume(tmp_path, corpus, tiny_run, monkeypatch):
    # steps 2, 4, 6 before the resume (best: 4), then 8 and 10: the third check since the best is step 10
    scripted_held_out(monkeypatch, [3.0, 2.0, 2.5, 2.6, 2.7, 2.8, 2.9])
    out = train_tiny(corpus, tmp_path / "run", keep_best=True, patience=3, max_steps=6, eval_interval=2)
    train_tiny(corpus, out, keep_best=True, patience=3, max_steps=40, eval_interval=2, resume=True)
    info = json.loads((out / TRAINING_INFO).read_text())
    assert info["step"] == 10 and info["best"]["step"] == 4


@pytest.mark.parametrize("stored", ["fp16", "bf16"])
def test_half_precision_weights_halve_the_file_and_load_as_fp32(tmp_path, corpus, tiny_run, stored):
    full = train_tiny(corpus, tmp_path / "fp32", max_steps=4)
    half = train_tiny(corpus, tmp_path / stored, max_steps=4, weights_dtype=stored)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[stored]
    assert {t.dtype for t in load_file(half / WEIGHTS).values()} == {dtype}
    assert (half / WEIGHTS).stat().st_size < 0.55 * (full / WEIGHTS).stat().st_size
    model, _ = load_checkpoint(half)
    reference = load_file(full / WEIGHTS)  # the same run at fp32
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, reference[name].to(dtype).float(), atol=0, rtol=0, msg=name)


def test_weight_average_is_the_ramped_mean_of_every_step_then_an_ema():
    """Checked against closed forms, not the update rule: while the ramp (1 + s) / (10 + s) is below the
    decay, the average after T steps weighs step s's weights by C(s + 9, 8) / C(T + 10, 9) and the
    starting ones by 10 / C(T + 10, 9) (the ramp's product telescopes); once the decay caps the ramp,
    it is the plain exponential average, the last step weighed 1 - decay."""
    from aftgen.training.averaging import WeightAverage

    torch.manual_seed(0)
    model = on_device(AFTLM(AFTConfig(vocab_size=50, n_layer=1, n_embd=16, n_head=2, window=4, context_length=16)))
    snapshots = [[p.detach().clone() for p in model.parameters()]]
    ramped, capped = WeightAverage(model, decay=0.999), WeightAverage(model, decay=0.5)
    steps = 30
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        snapshots.append([p.detach().clone() for p in model.parameters()])
        before = [p.clone() for p in capped.model.parameters()]
        ramped.update(model, step)
        capped.update(model, step)
    total = math.comb(steps + 10, 9)
    shares = [10 / total] + [math.comb(s + 9, 8) / total for s in range(1, steps + 1)]
    assert sum(shares) == pytest.approx(1)
    for i, got in enumerate(ramped.model.parameters()):
        want = sum(share * snapshot[i] for share, snapshot in zip(shares, snapshots, strict=True))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for got, old, new in zip(capped.model.parameters(), before, snapshots[-1], strict=True):
        torch.testing.assert_close(got, 0.5 * old + 0.5 * new)
    assert not any(p.requires_grad for p in ramped.model.parameters())


def test_ema_checks_and_publishes_the_average(tmp_path, corpus, tiny_run):
    rows: list[dict] = []
    out = train_tiny(corpus, tmp_path / "run", ema=0.9, max_steps=12, eval_interval=4, on_eval=rows.append)
    state = load_file(out / TRAINING_STATE)
    published = load_file(out / WEIGHTS)
    for name, tensor in published.items():
        torch.testing.assert_close(tensor, state[f"average.{name}"], atol=0, rtol=0, msg=name)
    assert any(not torch.equal(published[name], state[f"model.{name}"]) for name in published)
    # Each check scores the average and, beside it, the raw weights it averages.
    assert all(row["held_out_nats_per_char"] != row["raw_weights_held_out_nats_per_char"] for row in rows)
    assert "moving average of the training weights, decay 0.9" in (out / "README.md").read_text()


class TickingClock:
    """time.monotonic for the training loop that moves 10 ms a call: a wall-time budget, run deterministically."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        self.now += 0.01
        return self.now


def test_max_time_stops_the_run_and_its_schedule_follows_the_clock(tmp_path, corpus, tiny_run, monkeypatch):
    from aftgen.training import loop

    monkeypatch.setattr(loop, "time", TickingClock())
    lr, floor = 2e-3, 0.1
    out = train_tiny(corpus, tmp_path / "run", max_time="2s", max_steps=10**6, lr=lr, warmup_steps=0, eval_interval=1)
    info = json.loads((out / TRAINING_INFO).read_text())
    assert 2.0 <= info["elapsed"] < 2.5 and 0 < info["step"] < 1000  # the clock ended it, far from max_steps
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [row["lr"] for row in rows]
    assert rates == sorted(rates, reverse=True)  # cosine decay along the clock...
    assert rates[0] > 0.95 * lr and rates[-1] < 1.1 * floor * lr  # ...from the peak to the floor
    # By steps alone (step / 10**6) the schedule would not have left the peak.
    assert rates[-1] < lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * 0.9)))

    # training.json: what the recipe's probe planned, and tokens/s over the whole run from its steps, batch and time.
    speed, settings = info["speed"], info["settings"]
    tokens = info["step"] * settings["batch_size"] * settings["context_length"]
    assert speed["planned_tokens_per_s"] == info["recipe"]["tokens_per_s"] > 0
    assert speed["measured_tokens_per_s"] == pytest.approx(tokens / info["elapsed"], rel=1e-3)


def test_dropout_keeps_each_value_with_one_minus_p_scaled_up_and_its_gradient_too():
    from aftgen.model import Dropout

    torch.manual_seed(0)
    layer, x = Dropout(0.3), torch.ones(200_000, requires_grad=True)
    y = layer(x)
    kept = y != 0
    assert kept.float().mean().item() == pytest.approx(0.7, abs=0.005)
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / 0.7))
    y.sum().backward()
    torch.testing.assert_close(x.grad, y.detach())  # the same mask scales the gradient
    torch.manual_seed(0)
    assert torch.equal(layer(x), y)  # drawn from torch's seeded generator (a resumed run restores it)
    assert layer.eval()(x) is x and Dropout(0.0)(x) is x


def test_no_decay_trains_the_papers_aft_local(tmp_path, corpus, tiny_run):
    from typer.testing import CliRunner

    from aftgen.cli import app

    out = tmp_path / "paper"
    args = ["train", str(corpus), "--out", str(out), "--preset", "tiny", "--vocab-size", "400", "--max-steps", "4"]
    result = CliRunner().invoke(app, [*args, "--eval-interval", "2", "--no-decay", "--quiet", "--device", DEVICE])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["decay"] is False
    trained, _ = load_checkpoint(out)
    untrained = AFTLM(trained.config)
    for block, fresh in zip(trained.blocks, untrained.blocks, strict=True):
        assert torch.equal(block.mixer.decay(), torch.zeros_like(block.mixer.decay()))  # lambda = 0: no decay
        assert not block.mixer.decay_logit.requires_grad
        torch.testing.assert_close(block.mixer.decay_logit, fresh.mixer.decay_logit, atol=0, rtol=0)  # never trained


def test_muon_without_torch_optim_muon_is_one_error(tiny_run, monkeypatch):
    from aftgen.checkpoint import load_checkpoint
    from aftgen.errors import AftgenError
    from aftgen.training.optimizer import make_optimizer
    from aftgen.training.options import TrainOptions

    model, _ = load_checkpoint(tiny_run)
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(AftgenError, match="--optimizer muon needs torch.optim.Muon"):
        make_optimizer(model, TrainOptions(corpus="x", optimizer="muon", lr=1e-3, weight_decay=0.1))


def test_muon_steps_the_block_matrices_and_adamw_the_rest(tiny_run):
    from aftgen.checkpoint import load_checkpoint
    from aftgen.training.optimizer import make_optimizer
    from aftgen.training.options import TrainOptions

    model, _ = load_checkpoint(tiny_run)
    optimizer = make_optimizer(model, TrainOptions(corpus="x", optimizer="muon", lr=1e-3, weight_decay=0.1))
    muon, adamw = optimizer.parts
    by_muon = {id(p) for group in muon.param_groups for p in group["params"]}
    names = {id(p): name for name, p in model.named_parameters()}
    assert {names[i] for i in by_muon} == {
        name for name, p in model.named_parameters() if p.dim() == 2 and name.endswith("weight") and "embed" not in name
    }
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))
    saved = optimizer.state_dict()  # one numbering over both parts, as the training state file stores it
    assert sorted(i for g in saved["param_groups"] for i in g["params"]) == list(range(len(list(model.parameters()))))

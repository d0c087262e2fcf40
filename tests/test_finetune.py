"""Fine-tuning (`train --init-from`): the base model's tokenizer and architecture kept, its score logged
as step 0, its provenance recorded, resumable, from fp16 weights too, and through the Hub."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, make_corpus, train_tiny
from fake_hub import FakeHub
from hub_users import TOKEN, aftgen, aftgen_session, hub_env
from safetensors.torch import load_file
from typer.testing import CliRunner

from aftgen.checkpoint import WEIGHTS, load_checkpoint
from aftgen.cli import app
from aftgen.errors import AftgenError
from aftgen.model import AFTConfig
from aftgen.record import TRAINING_INFO
from aftgen.training.base import BaseModel
from aftgen.training.loop import TrainingInterrupted
from aftgen.training.options import FINE_TUNE_DEFAULTS, TrainOptions
from aftgen.training.plan import refuse_changes

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()


@pytest.fixture(scope="module")
def other_corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("other") / "other.txt"
    path.write_text(make_corpus(20_000, seed=7).lower())  # the same words, another text
    return path


def fine_tune(corpus, out, base, on_eval=None, **changes):
    """A few steps from `base`; TrainOptions' own fine-tuning defaults unless `changes` say otherwise."""
    from aftgen.training.loop import train

    options = dict(init_from=str(base), max_steps=6, eval_interval=2, device=DEVICE) | changes
    return train(TrainOptions(corpus=corpus, out=out, **options), quiet=True, on_eval=on_eval)


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "option, message",
    [
        (["--layers", "3"], "--layers 3 contradicts the base model (n_layer 2)"),
        (["--vocab-size", "500"], "--vocab-size 500 contradicts the base model (vocab_size 400)"),
        (["--mixer", "attention"], "--mixer attention contradicts the base model (mixer aft_local)"),
        (["--activation", "gelu"], "--activation gelu contradicts the base model (activation relu2)"),
        (["--preset", "small"], "--preset: fine-tuning keeps the base model's tokenizer and sizes"),
    ],
)
def test_an_option_contradicting_the_base_model_is_one_error(tmp_path, corpus, tiny_run, option, message):
    args = ["train", str(corpus), "--out", str(tmp_path / "ft"), "--init-from", str(tiny_run), *option]
    result = runner.invoke(app, args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.output
    assert not (tmp_path / "ft").exists()  # refused before any work


def test_a_mixer_whose_weights_the_context_length_shapes_keeps_it(corpus):
    # aft_full's window is its training length (Mixer.shaping_fields); aft_local's is --window alone.
    options = TrainOptions(corpus=corpus, init_from="base", context_length=16)
    sizes = dict(vocab_size=400, n_layer=2, n_embd=32, n_head=2, window=8, context_length=32)

    def base(mixer: str) -> BaseModel:
        return BaseModel("base", Path("base"), AFTConfig(**sizes, mixer=mixer), tokenizer=None)

    refuse_changes(options, base("aft_local"))  # a new training length is allowed
    with pytest.raises(AftgenError, match=r"--context-length 16 contradicts the base model \(context_length 32\)"):
        refuse_changes(options, base("aft_full"))


def test_fine_tuning_starts_from_the_base_and_logs_its_score_as_step_0(tmp_path, corpus, tiny_run):
    out = fine_tune(corpus, tmp_path / "ft", tiny_run, dropout=0.1, context_length=16)
    rows = metrics(out)
    assert [row["step"] for row in rows] == [0, 2, 4, 6]
    # The base's own last check, on the same held-out split (base: context 32, the run: 16), is step 0's.
    base_last = metrics(tiny_run)[-1]
    assert base_last["step"] == 40
    base, tokenizer = load_checkpoint(tiny_run)
    tuned, tuned_tokenizer = load_checkpoint(out)
    assert tuned_tokenizer.model_proto == tokenizer.model_proto
    assert tuned.config.n_layer == base.config.n_layer and tuned.config.context_length == 16
    assert rows[0]["train_loss"] is None and rows[0]["held_out_nats_per_char"] > rows[-1]["held_out_nats_per_char"]
    info = json.loads((out / TRAINING_INFO).read_text())
    assert info["base_model"]["model"] == str(tiny_run)
    assert info["base_model"]["weights_sha256"] == base.weights_sha256()
    assert {name: info["options"][name] for name in FINE_TUNE_DEFAULTS} == FINE_TUNE_DEFAULTS | {"eval_interval": 2}
    assert "fine-tuned from" in (out / "README.md").read_text()


def test_step_0_is_the_base_models_quick_check_on_the_same_split(tmp_path, corpus, tiny_run):
    out = fine_tune(corpus, tmp_path / "ft", tiny_run, max_steps=2)
    assert metrics(out)[0]["held_out_nats_per_char"] == pytest.approx(metrics(tiny_run)[-1]["held_out_nats_per_char"])


def test_fine_tune_interrupted_then_resumed_equals_one_run(tmp_path, other_corpus, tiny_run):
    def ctrl_c_at_4(row: dict) -> None:
        if row["step"] == 4:
            os.kill(os.getpid(), signal.SIGINT)

    straight = fine_tune(other_corpus, tmp_path / "straight", tiny_run, max_steps=8, dropout=0.1)
    with pytest.raises(TrainingInterrupted):
        fine_tune(other_corpus, tmp_path / "resumed", tiny_run, max_steps=8, dropout=0.1, on_eval=ctrl_c_at_4)
    resumed = fine_tune(other_corpus, tmp_path / "resumed", tiny_run, max_steps=8, dropout=0.1, resume=True)
    one, two = load_file(straight / WEIGHTS), load_file(resumed / WEIGHTS)
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-6, rtol=0, msg=name)
    info = json.loads((resumed / TRAINING_INFO).read_text())
    assert info["step"] == 8 and info["base_model"]["model"] == str(tiny_run)
    assert [row["step"] for row in metrics(resumed)] == [0, 2, 4, 6, 8]


def test_fine_tuning_from_fp16_weights(tmp_path, corpus, tiny_run):
    half = train_tiny(corpus, tmp_path / "half", max_steps=4, weights_dtype="fp16")
    out = fine_tune(corpus, tmp_path / "ft", half, max_steps=4)
    base, _ = load_checkpoint(half)  # widened to fp32 as it loads
    assert json.loads((out / TRAINING_INFO).read_text())["base_model"]["weights_sha256"] == base.weights_sha256()
    tuned, _ = load_checkpoint(out)
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in tuned.parameters())


def test_pull_fine_tune_push_pull_through_the_hub(tmp_path, corpus, tiny_run):
    with FakeHub(token=TOKEN) as server:
        server.create_repo("alice/base")
        server.commit(
            "alice/base",
            "main",
            {name: (tiny_run / name).read_bytes() for name in ("config.json", WEIGHTS, "tokenizer.model")},
        )
        env = hub_env(server, tmp_path / "hf")
        out = tmp_path / "tuned"
        train = ["train", str(corpus), "--out", str(out), "--init-from", "alice/base", "--max-steps", "2"]
        pulled, tuned, pushed, again = aftgen_session(
            env,
            ["pull", "alice/base"],
            [*train, "--eval-interval", "2", "--threads", "1", "--quiet"],
            ["push", str(out), "bob/tuned"],
            ["pull", "bob/tuned"],
        )
        for done in (pulled, tuned, pushed, again):
            assert done.returncode == 0, done.stderr
        info = json.loads((out / TRAINING_INFO).read_text())["base_model"]
        assert info["hub_id"] == "alice/base" and info["revision"] == server.repos["alice/base"].branches["main"]
        card = server.files("bob/tuned")["README.md"].decode()
        assert "base_model: alice/base" in card and "pipeline_tag: text-generation" in card
    # Offline, a base that was never pulled is one clear line.
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    missing = aftgen(offline, "train", str(corpus), "--out", str(tmp_path / "x"), "--init-from", "carol/absent")
    lines = missing.stderr.strip().splitlines()
    assert missing.returncode == 2 and len(lines) == 1, missing.stderr
    assert lines[0].startswith("error: carol/absent: not in the Hugging Face cache")


def test_fine_tuning_takes_its_base_runs_batch_size_or_for_a_bare_checkpoint_the_nearest_presets(tmp_path, corpus):
    from aftgen.checkpoint import CHECKPOINT_FILES
    from aftgen.model import PRESETS

    base = train_tiny(corpus, tmp_path / "base", batch_size=4, max_steps=2)
    bare = tmp_path / "bare"  # the checkpoint alone, as the Hub serves it: no training.json
    bare.mkdir()
    for name in CHECKPOINT_FILES:
        (bare / name).write_bytes((base / name).read_bytes())

    def batch_size(out) -> int:
        return json.loads((out / TRAINING_INFO).read_text())["settings"]["batch_size"]

    assert batch_size(fine_tune(corpus, tmp_path / "ft", base, max_steps=2)) == 4
    assert batch_size(fine_tune(corpus, tmp_path / "ft-bare", bare, max_steps=2)) == PRESETS["tiny"]["batch_size"]
    assert batch_size(fine_tune(corpus, tmp_path / "ft-given", base, max_steps=2, batch_size=2)) == 2


def test_a_resumed_fine_tune_keeps_the_options_it_started_with_over_fine_tunings_defaults(tmp_path, corpus, tiny_run):
    out = fine_tune(corpus, tmp_path / "ft", tiny_run, max_steps=2, lr=5e-4, eval_interval=1)
    fine_tune(corpus, out, tiny_run, max_steps=4, eval_interval=None, resume=True)  # no --lr, no --eval-interval
    options = json.loads((out / TRAINING_INFO).read_text())["options"]
    assert options["lr"] == 5e-4 != FINE_TUNE_DEFAULTS["lr"] and options["eval_interval"] == 1
    assert [row["step"] for row in metrics(out)] == [0, 1, 2, 3, 4]

"""Past one CPU: torchrun training equals one process, mixed precision, checkpoints across devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aftgen.api import load
from aftgen.checkpoint import load_checkpoint, save_checkpoint
from aftgen.compiled.functions import TRAINING_STEP, Compiled
from aftgen.device import Placement
from aftgen.mixers import AFTMixer
from aftgen.training.batches import batch
from aftgen.training.loop import train
from aftgen.training.options import TrainOptions

pytestmark = pytest.mark.cpu  # torchrun over gloo, CPU autocast, CPU threads: these are about the CPU

# Dropout 0 (the tiny preset's), so the only difference between the runs is float rounding.
# fp32, not a measured dtype; AdamW, since Muon's bf16 Newton-Schulz turns the processes' different order
# of summing gradients into differences of 1e-4; a warmup past the last step, so the schedule of a 3-step
# run that is then resumed to 6 steps matches a 6-step run's.
TRAIN = ["--preset", "tiny", "--vocab-size", "400", "--eval-interval", "3", "--threads", "1", "--device", "cpu",
         "--dtype", "fp32", "--optimizer", "adamw", "--warmup-steps", "6"]  # fmt: skip
GLOBAL_BATCH = 8


def aftgen_train(corpus: Path, out: Path, *args: str, processes: int = 1) -> subprocess.CompletedProcess:
    """`aftgen train` as a user runs it: plainly, or under torchrun with `processes` workers."""
    launcher = [sys.executable, "-m", "aftgen"]
    if processes > 1:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(processes),
            "-m",
            "aftgen",
        ]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    command = [
        *launcher,
        "train",
        str(corpus),
        "--out",
        str(out),
        *TRAIN,
        "--batch-size",
        str(GLOBAL_BATCH // processes),
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def max_weight_difference(a: Path, b: Path) -> float:
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert set(first) == set(second)
    return max(float((first[name] - second[name]).abs().max()) for name in first)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    aftgen_train(corpus, out, "--max-steps", "6")
    return out


def test_two_processes_train_like_one_even_across_a_resume(tmp_path, corpus, single_run):
    out = tmp_path / "run"
    aftgen_train(corpus, out, "--max-steps", "3", processes=2)
    done = aftgen_train(corpus, out, "--max-steps", "6", "--resume", processes=2)
    assert max_weight_difference(out, single_run) < 1e-5
    # Rank 0 alone wrote files and printed the folder; the run records the global batch.
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in single_run.iterdir())
    assert done.stdout.split() == [str(out)]
    info = json.loads((out / "training.json").read_text())
    assert (info["world_size"], info["global_batch_size"], info["settings"]["batch_size"]) == (
        2,
        GLOBAL_BATCH,
        GLOBAL_BATCH // 2,
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    single_rows = [json.loads(line) for line in (single_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6]
    for row, single in zip(rows, single_rows, strict=True):  # the logged loss is the global batch's
        assert row["train_loss"] == pytest.approx(single["train_loss"], abs=1e-5)


def test_ranks_split_one_global_batch(corpus):
    ids = torch.arange(1000, dtype=torch.int32)
    whole, _ = batch(ids, 8, 16, torch.Generator().manual_seed(5))
    parts = [batch(ids, 2, 16, torch.Generator().manual_seed(5), rank, 4)[0] for rank in range(4)]
    assert torch.equal(torch.cat(parts), whole)


def test_mixer_math_stays_fp32_under_autocast(monkeypatch):
    """Autocast would run the mixer's einsums in bf16; the mixer must switch it off around them."""
    import aftgen.mixers.aft as mixer_module

    seen = []
    for name in ("aft_parallel", "aft_step"):
        original = getattr(mixer_module, name)

        def spy(*args, _original=original, **kwargs):
            seen.append((torch.is_autocast_enabled("cpu"), args[1].dtype))
            return _original(*args, **kwargs)

        monkeypatch.setattr(mixer_module, name, spy)
    mixer = AFTMixer(16, 2, window=4, context_length=16, decay=True)
    with torch.no_grad(), Placement(torch.device("cpu"), torch.bfloat16).autocast():
        y, state = mixer(torch.randn(2, 10, 16), return_state=True)
        z = mixer.step(torch.randn(2, 16), state)
    assert seen == [(False, torch.float32), (False, torch.float32)]  # keys reach the sums in fp32
    assert y.dtype == z.dtype == torch.bfloat16 and torch.isfinite(y).all() and torch.isfinite(z).all()


def test_bf16_training_on_cpu_runs_and_stays_finite(tmp_path, corpus):
    runs = {}
    for dtype in ("fp32", "bf16"):
        out = tmp_path / dtype
        train(
            TrainOptions(
                corpus=corpus,
                out=out,
                preset="tiny",
                max_steps=4,
                eval_interval=4,
                vocab_size=400,
                device="cpu",
                dtype=dtype,
            ),
            quiet=True,
        )
        runs[dtype] = out
    info = json.loads((runs["bf16"] / "training.json").read_text())
    assert info["device"] == "cpu bf16"
    weights = load_file(runs["bf16"] / "model.safetensors")
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in weights.values())
    assert max_weight_difference(runs["bf16"], runs["fp32"]) > 0  # autocast really ran
    fp32 = json.loads((runs["fp32"] / "training.json").read_text())
    assert info["final_eval"]["nats_per_char"] == pytest.approx(fp32["final_eval"]["nats_per_char"], rel=0.02)


def test_checkpoints_load_onto_a_chosen_device_in_fp32(tmp_path, tiny_run):
    model, tokenizer = load(tiny_run, device="cpu")
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    # A model that lived in another dtype (as on a GPU run) is still saved, and loaded, in fp32.
    model.to(torch.bfloat16)
    save_checkpoint(tmp_path, model, tokenizer)
    assert {t.dtype for t in load_file(tmp_path / "model.safetensors").values()} == {torch.float32}
    again, _ = load_checkpoint(tmp_path, device=torch.device("cpu"))
    assert {p.dtype for p in again.parameters()} == {torch.float32}
    auto, _ = load(tiny_run, device="auto")
    state = auto.initial_state(2)  # recurrent state follows the model's device
    assert {t.device for layer in state for t in layer.values()} == {next(auto.parameters()).device}


def test_compile_failure_falls_back_to_eager_with_one_warning(monkeypatch, capsys):
    def broken_compile(module):
        def call(*args, **kwargs):
            raise RuntimeError("no C++ compiler found\n(long details)")

        return call

    monkeypatch.setattr(torch, "compile", broken_compile)
    layer = torch.nn.Linear(2, 2)
    run = Compiled(layer, TRAINING_STEP)
    x = torch.ones(1, 2)
    assert torch.equal(run(x), layer(x)) and torch.equal(run(x), layer(x))
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 1 and "no C++ compiler found" in warnings[0] and TRAINING_STEP in warnings[0]

"""Training: AdamW with warmup and cosine decay, periodic held-out checks, atomic checkpoints, exact resume.

`train` sets up a `Run` (data, model, optimiser, maybe a resumed state: one object owning them), whose
`loop` takes one step after another, with a held-out check and a checkpoint every eval_interval steps,
and `finish` evaluates the published weights in full. Started by torchrun, each process runs it and
they train one model together (see distributed.py).
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aftgen import cores, curves, distributed, evaluate
from aftgen.checkpoint import TOKENIZER, WEIGHTS, read_weights
from aftgen.compiled.functions import TRAINING_STEP, Compiled
from aftgen.corpus import PreparedCorpus, prepare_corpus
from aftgen.device import Placement, resolve
from aftgen.distributed import World
from aftgen.errors import AftgenError
from aftgen.mixers import fixed_size_state
from aftgen.model import AFTLM
from aftgen.tokenizer import Tokenizer
from aftgen.training import batches
from aftgen.training.averaging import WeightAverage
from aftgen.training.base import BaseModel
from aftgen.training.optimizer import learning_rate, make_optimizer, set_learning_rate
from aftgen.training.options import TrainOptions
from aftgen.training.plan import (
    Plan,
    VocabularyChooser,
    refuse_changes,
    refuse_contradictions,
    settle,
    vocabulary_chooser,
)
from aftgen.training.progress import Interrupts, Reporter
from aftgen.training.run_folder import RunFolder, TrainingState, claimed, describe_run
from aftgen.training.state_file import Resumed

EvalCallback = Callable[[dict], None]


class TrainingInterrupted(Exception):
    """Raised after an interrupted run has been saved."""

    def __init__(self, out):
        super().__init__(str(out))
        self.out = out


def train(options: TrainOptions, quiet: bool = False, on_eval: EvalCallback | None = None):
    """Train a tokenizer and a model on options.corpus; returns the run folder."""
    options.check()
    placement = resolve(options.device, options.dtype, distributed.local_rank())
    with distributed.join(placement.device) as world:
        try:
            return _train(options, placement, world, quiet, on_eval)
        except Exception as exc:
            if world.distributed and distributed.lost_peer(exc):
                raise AftgenError(
                    f"process {world.rank}: lost contact with the other training processes ({type(exc).__name__}); "
                    "the last checkpoint is kept: fix the failed process and run again with --resume"
                ) from None
            raise


def _train(options: TrainOptions, placement: Placement, world: World, quiet: bool, on_eval: EvalCallback | None):
    base = BaseModel.find(options.init_from, world) if options.init_from and not options.resume else None
    if base is not None:
        refuse_changes(options, base)
    warn = functools.partial(print, file=sys.stderr)  # even when quiet: another process's lock taken over
    with claimed(options, world, warn) as resumed, Reporter(quiet or not world.main) as reporter:
        if resumed is not None:
            refuse_contradictions(options, resumed)
        chooser = vocabulary_chooser(options, placement, reporter.log)
        corpus = _load_corpus(options, base, world, quiet, chooser)
        plan = settle(options, corpus, placement, world, base, resumed, reporter.log, chooser and chooser.choice)
        placement = resolve(placement.device, plan.options.dtype)
        training, folder = _start(plan, corpus, base, resumed, placement, world, reporter.log)
        run = Run(plan, folder, corpus, training, placement, world, reporter, on_eval)
        if base is not None:  # where fine-tuning starts: the base model's score on the new held-out text
            run.check_and_save(0.0, Meter(), None)
        stopped_by = run.loop()
        if stopped_by:
            saved = f"saved step {training.step} to {folder.path}"
            reporter.log(f"{stopped_by}: {saved}; continue with: {folder.continue_command()}")
            raise TrainingInterrupted(folder.path)
        if world.main:
            run.finish()
    return folder.path


def _load_corpus(
    options: TrainOptions, base: BaseModel | None, world: World, quiet: bool, chooser: VocabularyChooser | None
) -> PreparedCorpus:
    """The corpus prepared (aftgen.corpus: rank 0 trains the tokenizer unless the run has one, of the size
    `chooser` chooses where given; one process per machine writes the token files)."""
    tokenizer = Tokenizer.load(options.run_folder / TOKENIZER) if options.resume else base and base.tokenizer
    log = (lambda _: None) if quiet or not world.main else None
    return prepare_corpus(options.sources(), options.corpus_options(), log, tokenizer, world, chooser)


def _start(
    plan: Plan,
    corpus: PreparedCorpus,
    base: BaseModel | None,
    resumed: Resumed | None,
    placement: Placement,
    world: World,
    log,
) -> tuple[TrainingState, RunFolder]:
    """The model, optimiser and batch generator: fresh from the seed, from a base model's weights (the
    optimiser still fresh), or restored from the run folder; and the run folder that saves them."""
    options = plan.options
    torch.manual_seed(options.seed)
    model = AFTLM(plan.config)
    base_model = resumed.base_model if resumed else None
    if base is not None:
        base.load_weights_into(model)
        base_model = base.describe(model)
        log(f"fine-tuning {base.spec} ({model.num_parameters():,} parameters)")
    model = model.to(placement.device)
    training = TrainingState(model, make_optimizer(model, options), torch.Generator().manual_seed(options.seed))
    if options.ema:
        training.average = WeightAverage(model, options.ema)
    folder = RunFolder(plan, world, describe_run(plan, model, placement.describe(), world, base_model), resumed)
    if resumed:
        folder.resume(training)
        log(f"resuming {folder.path} at step {training.step}")
        if resumed.world_size != world.size:
            log(f"note: trained so far by {resumed.world_size} processes, now {world.size}: the global batch changes")
    if world.rank:  # own dropout masks per process (the model's initialisation above is the same everywhere)
        torch.manual_seed(options.seed + 1_000_003 * world.rank + training.step)
    if folder.curves is None and world.main:
        log(curves.MISSING)
    log(
        f"{model.num_parameters():,} parameters, vocabulary {corpus.tokenizer.vocab_size}, "
        f"{len(corpus.train_ids):,} training tokens, {len(corpus.held_out_ids):,} held-out tokens, "
        f"on {placement.describe()}"
        + (f" x {world.size} processes (global batch {plan.batch_size * world.size})" if world.distributed else "")
        + f" -> {folder.path}"
    )
    return training, folder


class Clock:
    """Seconds trained (before this process too) and progress through the run's budget."""

    def __init__(self, options: TrainOptions, elapsed_before: float):
        self.options, self.offset = options, elapsed_before - time.monotonic()

    def elapsed(self) -> float:
        return self.offset + time.monotonic()

    def progress(self, step: int, elapsed: float) -> float:
        """0 -> 1 by steps, or by wall time when that runs out first (the schedule then follows the clock)."""
        by_steps = step / self.options.max_steps if self.options.max_steps else 0.0
        return max(by_steps, elapsed / self.options.max_time) if self.options.max_time else by_steps


class Meter:
    """Mean training loss and tokens/s since the last held-out check."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss_sum, self.steps, self.tokens, self.since = 0.0, 0, 0, time.monotonic()

    def add(self, loss: float, tokens: int) -> None:
        self.loss_sum, self.steps, self.tokens = self.loss_sum + loss, self.steps + 1, self.tokens + tokens

    def mean_loss(self) -> float:
        return self.loss_sum / max(1, self.steps)

    def tokens_per_s(self) -> float:
        return self.tokens / max(time.monotonic() - self.since, 1e-9)

    def status(self) -> str:
        return f"loss {self.mean_loss():.3f}  {self.tokens_per_s():,.0f} tok/s"


@dataclass
class Run:
    """A training run's parts, set up: what the step loop, its held-out checks and its saves all read."""

    plan: Plan
    folder: RunFolder
    corpus: PreparedCorpus
    training: TrainingState
    placement: Placement
    world: World
    reporter: Reporter
    on_eval: EvalCallback | None = None

    def loop(self) -> str | None:
        """Train until the step or time budget is spent, or --patience runs out; returns the signal that
        interrupted it, if one did."""
        options, training, world = self.plan.options, self.training, self.world
        trainer = world.wrap(training.model)
        if options.compile:
            trainer = Compiled(trainer, TRAINING_STEP)  # where it cannot be compiled, one line says why
        # fp16 needs loss scaling so small gradients do not flush to zero; bf16 and fp32 do not.
        scaler = torch.amp.GradScaler(self.placement.device.type, enabled=self.placement.dtype == torch.float16)
        clock, meter, stopped_by = Clock(options, training.elapsed), Meter(), None
        batch_size, length = self.plan.batch_size, self.plan.config.context_length
        training.model.train()
        with Interrupts() as interrupts:
            while True:
                # All processes must decide alike: rank 0's clock and a signal to any of them count for all.
                mine = [clock.elapsed() if world.main else 0.0, float(interrupts.requested is not None)]
                training.elapsed, stop_votes = world.sum(mine)
                progress = clock.progress(training.step, training.elapsed)
                if stop_votes:
                    stopped_by = interrupts.requested or "stop requested on another process"
                if stop_votes or progress >= 1.0:
                    break
                lr = learning_rate(options, training.step, progress)
                set_learning_rate(training.optimizer, lr)
                inputs, targets = batches.batch(
                    self.corpus.train_ids, batch_size, length, training.generator, *world.slot
                )
                loss = self.step(trainer, scaler, inputs, targets)
                cores.adapt()
                meter.add(loss, inputs.numel() * world.size)
                self.reporter.update(training.step, progress, meter.status())
                if training.step % options.eval_interval == 0:
                    self.check_and_save(clock.elapsed(), meter, lr)
                    if self.out_of_patience():
                        break
            training.elapsed = clock.elapsed()
            self.final_save(stopped_by)
        return stopped_by

    def out_of_patience(self) -> bool:
        """Whether the last `patience` held-out checks all missed the best (rank 0 keeps the score, so it decides)."""
        patience, folder, world = self.plan.options.patience, self.folder, self.world
        if not patience:
            return False
        spent = world.sum([float(world.main and folder.checks_since_best() >= patience)])[0] > 0
        if spent and world.main:
            self.reporter.log(
                f"stopping early: {patience} held-out checks since the best one (step {folder.best['step']})"
            )
        return spent

    def step(self, trainer, scaler, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimiser step on a batch; the loss before it."""
        training, device = self.training, self.placement.device
        model, optimizer = training.model, training.optimizer
        inputs, targets = inputs.to(device), targets.to(device)
        with self.placement.autocast():
            logits = trainer(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        if not torch.isfinite(loss):
            raise self.folder.diverged("the loss", training.step + 1)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP averages the gradients over the processes here
        if self.plan.options.grad_clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.plan.options.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        training.step += 1
        if training.average:
            training.average.update(model, training.step)
        return loss.item()

    def held_out_nats_per_char(self, model: AFTLM) -> float:
        """The quick held-out check: evenly spaced windows of the training length (or all of a shorter text)."""
        ids, chars = self.corpus.held_out_ids, self.corpus.held_out_chars
        length, chars_per_token = min(model.config.context_length, len(ids) - 1), chars / (len(ids) - 1)
        return evaluate.window_loss(model, ids, length, self.plan.options.eval_windows) / chars_per_token

    def check_and_save(self, elapsed: float, meter: Meter, lr: float | None) -> None:
        """Every eval_interval steps: a row of metrics from the held-out check, and a checkpoint."""
        training, world = self.training, self.world
        train_loss = world.sum([meter.mean_loss()])[0] / world.size if meter.steps else None  # over the global batch
        if world.main:
            held_out = self.held_out_nats_per_char(training.published)
            row = {
                "step": training.step,
                "elapsed": round(elapsed, 2),
                "train_loss": train_loss,
                "held_out_nats_per_char": held_out,
                "held_out_bits_per_char": held_out / math.log(2),
                "tokens_per_s": round(meter.tokens_per_s(), 1),
                "lr": lr,
            }
            raw = ""
            if training.average:  # how much the average gains over the weights it averages
                row["raw_weights_held_out_nats_per_char"] = self.held_out_nats_per_char(training.model)
                raw = f" (raw weights {row['raw_weights_held_out_nats_per_char']:.4f})"
            improved = self.folder.record(row)
            trained = f"train loss {train_loss:.4f}, " if train_loss is not None else "before training: "
            speed = f", {row['tokens_per_s']:,.0f} tok/s" if meter.steps else ""
            self.reporter.log(
                f"step {training.step}: {trained}held-out {held_out:.4f} nats/char "
                f"({row['held_out_bits_per_char']:.4f} bits/char){raw}{speed}"
            )
            if self.on_eval:
                self.on_eval(row)
            self.folder.save(training, self.corpus.tokenizer, elapsed, improved)
        meter.reset()

    def final_save(self, stopped_by: str | None) -> None:
        """The last checkpoint; with keep_best, checked first unless the last step was just checked."""
        folder, training = self.folder, self.training
        last_checked = bool(folder.metrics) and folder.metrics[-1]["step"] == training.step
        improved = False
        if self.plan.options.keep_best and self.world.main and not stopped_by and not last_checked:
            improved = folder.is_best(training.step, self.held_out_nats_per_char(training.published))
        if folder.curves:  # before the save, so that its model card shows them
            folder.curves.flush()
        folder.save(training, self.corpus.tokenizer, training.elapsed, improved)

    def finish(self) -> None:
        """Score the published weights (the best ones with keep_best, at their stored precision) on all of
        the held-out text, and put the score in the card and training.json."""
        folder, training, corpus, log = self.folder, self.training, self.corpus, self.reporter.log
        model = training.model.eval()
        model.load_state_dict(read_weights(folder.path / WEIGHTS, model))
        if self.plan.options.keep_best:
            best = folder.best
            score = best["held_out_nats_per_char"]
            log(f"keeping the weights of step {best['step']} (quick held-out {score:.4f} nats/char)")
        # A growing state (attention's KV cache: quadratic time, RoPE untrained past the training length)
        # is scored in windows of the training length.
        reset_every = 0 if fixed_size_state(model.config.mixer) else model.config.context_length
        final = evaluate.evaluate_ids(
            model, corpus.held_out_ids, corpus.held_out_chars, corpus.held_out_bytes, reset_every
        )
        folder.finish(
            model, corpus.tokenizer, training.step, training.elapsed, final.to_dict() | {"reset_every": reset_every}
        )
        log(
            f"done: {training.step} steps in {training.elapsed:.0f} s; held-out {final.nats_per_char:.4f} nats/char "
            f"({final.bits_per_char:.4f} bits/char)"
        )

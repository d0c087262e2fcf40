"""A training run's folder: what may be trained into it, what a resumed run reads of it, and every write to it,
as the run's plan says: metrics, the best held-out check, checkpoints, the training state, training.json and the
model card."""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from aftgen import curves
from aftgen.card import model_card
from aftgen.checkpoint import is_checkpoint, save_checkpoint
from aftgen.distributed import World
from aftgen.errors import AftgenError
from aftgen.files import locked_folder
from aftgen.model import AFTLM
from aftgen.record import TRAINING_INFO, TRAINING_STATE, write_metrics, write_run_info
from aftgen.tokenizer import Tokenizer
from aftgen.training.averaging import WeightAverage
from aftgen.training.options import TrainOptions
from aftgen.training.plan import Plan
from aftgen.training.state_file import Resumed, load_training_state, save_training_state


@dataclass
class TrainingState:
    """What the training steps change, and a resumed run restores."""

    model: AFTLM
    optimizer: torch.optim.Optimizer
    generator: torch.Generator  # draws the batches
    step: int = 0
    elapsed: float = 0.0  # seconds trained so far, by this process and before it (resume)
    average: WeightAverage | None = None  # with --ema: the weights checked and published

    @property
    def averaged(self) -> AFTLM | None:
        """The averaged weights, with --ema."""
        return self.average.model if self.average else None

    @property
    def published(self) -> AFTLM:
        """The weights the held-out checks score and the checkpoint holds: the average, if one is kept."""
        return self.average.model if self.average else self.model


@contextlib.contextmanager
def claimed(options: TrainOptions, world: World, warn: Callable[[str], None]) -> Iterator[Resumed | None]:
    """The run folder of `options`, kept to this run while the block runs (files.locked_folder: a second run into
    it is refused; only the rank that writes it locks it) and checked before any work: no run overwritten by
    accident, no resume of nothing. Yields a resumed run's record (None for a new run)."""
    path = options.run_folder
    with locked_folder(path, warn) if world.main else contextlib.nullcontext():
        holds_run = (path / TRAINING_INFO).exists() or (path / TRAINING_STATE).exists() or is_checkpoint(path)
        if not options.resume and not options.overwrite and holds_run:
            raise AftgenError(
                f"{path} already holds a run (or a checkpoint); "
                "pass --resume to continue it or --overwrite to replace it"
            )
        if options.resume and not (path / TRAINING_STATE).exists():
            raise AftgenError(f"{path} has no training state to resume; drop --resume to start a new run")
        yield Resumed.read(path) if options.resume else None


class RunFolder:
    """Every write to a run's folder, as its plan says. Rank 0 alone checks held-out loss and writes."""

    def __init__(self, plan: Plan, world: World, description: dict, resumed: Resumed | None = None):
        self.plan, self.world, self.path = plan, world, plan.options.run_folder
        self.description = description  # what training.json says besides the progress (describe_run)
        self.metrics: list[dict] = list(resumed.metrics) if resumed else []
        # {"step", "held_out_nats_per_char"} of the best held-out check
        self.best: dict | None = resumed.best if resumed else None
        self.saved_step: int | None = None
        self.curves = curves.LiveCurves(self.path) if world.main and curves.available() else None

    def resume(self, training: TrainingState) -> None:
        """Restore the weights, optimiser, random states, step and clock saved in the folder."""
        info = load_training_state(self.path, training.model, training.optimizer, training.generator, training.averaged)
        training.step, training.elapsed = info["step"], info["elapsed"]
        self.saved_step = training.step

    def record(self, row: dict) -> bool:
        """Add a held-out check to metrics.jsonl (and redraw curves.png); whether it is the best so far."""
        self.metrics.append(row)
        if self.world.main:
            write_metrics(self.path, self.metrics)
            if self.curves:
                self.curves.checked(self.metrics)
        return self.is_best(row["step"], row["held_out_nats_per_char"])

    def is_best(self, step: int, held_out_nats_per_char: float) -> bool:
        if self.best is not None and held_out_nats_per_char >= self.best["held_out_nats_per_char"]:
            return False
        self.best = {"step": step, "held_out_nats_per_char": held_out_nats_per_char}
        return True

    def checks_since_best(self) -> int:
        """Held-out checks after the best one (0 when the last check was the best)."""
        return sum(row["step"] > self.best["step"] for row in self.metrics) if self.best else 0

    def info(self, step: int, elapsed: float) -> dict:
        return self.description | {
            "step": step,
            "elapsed": elapsed,
            "best": self.best,
            "speed": self.speed(step, elapsed),
        }

    def speed(self, step: int, elapsed: float) -> dict:
        """Training tokens/s: what the recipe's probe planned (None without a recipe) and what the run measured over
        its whole time (checks and saves included), so a plan the run does not reach shows."""
        tokens = step * self.plan.batch_size * self.world.size * self.plan.config.context_length
        planned = self.plan.recipe.get("tokens_per_s") if self.plan.recipe else None
        return {
            "planned_tokens_per_s": planned,
            "measured_tokens_per_s": round(tokens / elapsed, 1) if elapsed else None,
        }

    def save(self, training: TrainingState, tokenizer: Tokenizer, elapsed: float, improved: bool = False) -> None:
        """The training state first (it alone is enough to resume), the weights, training.json last.

        With keep_best, model.safetensors holds the weights that scored best on the held-out check
        (nanoGPT's always_save_checkpoint=False); the training state always holds the latest.
        """
        if not self.world.main:
            return
        if not all(torch.isfinite(p).all() for p in training.model.parameters()):
            raise self.diverged("the weights", training.step)  # never replace good weights with broken ones
        info = self.info(training.step, elapsed)
        save_training_state(self.path, training.model, training.optimizer, training.generator, info, training.averaged)
        if improved or not self.plan.options.keep_best or not is_checkpoint(self.path):
            self.publish(training.published, tokenizer, info)
        write_run_info(self.path, info)
        self.saved_step = training.step

    def publish(self, model: AFTLM, tokenizer: Tokenizer, info: dict) -> None:
        """The Hub-shaped checkpoint: weights at the chosen precision, tokenizer, card, config."""
        card = model_card(model.config, info, self.metrics, curves=(self.path / curves.CURVES).is_file())
        save_checkpoint(self.path, model, tokenizer, card, self.plan.options.weights_dtype)

    def finish(self, model: AFTLM, tokenizer: Tokenizer, step: int, elapsed: float, final_eval: dict) -> None:
        """Publish the card and training.json with the final evaluation of the published weights."""
        self.description = self.description | {"final_eval": final_eval}
        info = self.info(step, elapsed)
        self.publish(model, tokenizer, info)
        write_run_info(self.path, info)

    def diverged(self, what: str, step: int) -> AftgenError:
        if self.saved_step is not None:
            kept = f"the last good checkpoint (step {self.saved_step}) in {self.path} is kept"
        else:
            kept = "no checkpoint was written yet"
        return AftgenError(
            f"{what} became NaN or inf at step {step}; {kept}. "
            f"Try a lower learning rate (--lr {self.plan.options.lr / 3:.2g})"
        )

    def continue_command(self) -> str:
        return f"aftgen train {shlex.join(map(str, self.plan.options.sources()))} --out {self.path} --resume"


def describe_run(plan: Plan, model: AFTLM, device: str, world: World, base_model: dict | None) -> dict:
    """What training.json records about the run, besides its progress; `base_model`: where a fine-tuning run
    started (BaseModel.describe)."""
    options = plan.options
    return {
        "name": options.run_folder.name,
        "command": options.command,
        "corpus": [str(source) for source in options.sources()],
        "corpus_digest": plan.corpus_digest,
        "held_out": plan.held_out,
        "settings": plan.recorded_settings(),
        "options": options.to_dict(),
        **({"recipe": plan.recipe} if plan.recipe else {}),
        "parameters": model.num_parameters(),
        "tokenizer_type": options.tokenizer_type,
        "device": device,
        "world_size": world.size,
        "global_batch_size": plan.batch_size * world.size,
        **({"base_model": base_model} if base_model else {}),
    }

"""A training run's folder: what may be trained into it, its record (metrics, the best held-out
check) and every write to it: checkpoints, the training state, training.json and the model card."""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from aftgen import curves
from aftgen.card import model_card
from aftgen.checkpoint import is_checkpoint, save_checkpoint
from aftgen.distributed import World
from aftgen.errors import AftgenError
from aftgen.files import locked_folder
from aftgen.model import AFTLM, AFTConfig
from aftgen.record import TRAINING_INFO, TRAINING_STATE, read_run_files, write_metrics, write_run_info
from aftgen.tokenizer import Tokenizer
from aftgen.training.averaging import WeightAverage
from aftgen.training.options import FINE_TUNE_DEFAULTS, RECIPE_FIELDS, TrainOptions
from aftgen.training.state_file import load_training_state, read_training_info, save_training_state


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
def open_run_folder(
    options: TrainOptions, world: World, base: AFTConfig | None, warn: Callable[[str], None]
) -> Iterator[RunFolder]:
    """The run folder of `options`, kept to this run while the block runs (files.locked_folder: a second
    run into it is refused); only the rank that writes it locks it."""
    with locked_folder(options.run_folder, warn) if world.main else contextlib.nullcontext():
        yield RunFolder(options, world, base)


class RunFolder:
    """The run folder of `options`, checked before any work. Rank 0 alone checks held-out loss and writes."""

    def __init__(self, options: TrainOptions, world: World, base: AFTConfig | None = None):
        self.path, self.options, self.world = options.run_folder, options, world
        self.settings: dict = {}  # model sizes and batch size
        self.base_model: dict | None = None  # where a fine-tuning run started (BaseModel.describe)
        self.held_out: dict = {}  # what was held out, exactly (aftgen.corpus)
        self.metrics: list[dict] = []
        self.best: dict | None = None  # {"step", "held_out_nats_per_char"} of the best held-out check
        self.saved_step: int | None = None
        self.saved_world_size = world.size
        self.description: dict = {}  # what training.json says besides the step
        self.recipe: dict | None = None  # what the recipe chose for a fresh run (recipe.py)
        self._saved_options: dict = {}
        self.curves = curves.LiveCurves(self.path) if world.main and curves.available() else None
        self._refuse_mistakes()
        if options.resume:
            saved, _ = read_training_info(self.path)  # the state file alone describes the run
            self.settings, self.best, self.base_model = saved["settings"], saved.get("best"), saved.get("base_model")
            self.saved_world_size = saved.get("world_size", 1)
            self.recipe, self._saved_options = saved.get("recipe"), saved.get("options", {})
            # checks past the checkpoint (a save that failed, a kill before it) are made again: never twice
            self.metrics = [row for row in read_run_files(self.path)[1] if row["step"] <= saved["step"]]
        else:
            self.settings = options.resolved(base)  # refuses what contradicts a base model before any work

    def resumed_options(self, options: TrainOptions) -> TrainOptions:
        """`options` with what the user did not give taken from the run's record: a resumed run goes on
        with the recipe (or fine-tuning defaults) it started with, not a new choice."""
        dtype = self._saved_options.get("dtype", "auto") if options.dtype == "auto" else options.dtype
        options = replace(options, dtype=dtype)
        options.fill(
            {name: self._saved_options.get(name) for name in (*RECIPE_FIELDS, *FINE_TUNE_DEFAULTS, "max_steps")}
        )
        return options

    def settle(self, options: TrainOptions, base: AFTConfig | None) -> None:
        """Take the options with nothing left to choose: the model's sizes follow from them."""
        self.options = options
        if not options.resume:
            self.settings = options.resolved(base)

    def _refuse_mistakes(self) -> None:
        """No run overwritten by accident, no resume of nothing."""
        path, options = self.path, self.options
        holds_run = (path / TRAINING_INFO).exists() or (path / TRAINING_STATE).exists() or is_checkpoint(path)
        if not options.resume and not options.overwrite and holds_run:
            raise AftgenError(
                f"{path} already holds a run (or a checkpoint); "
                "pass --resume to continue it or --overwrite to replace it"
            )
        if options.resume and not (path / TRAINING_STATE).exists():
            raise AftgenError(f"{path} has no training state to resume; drop --resume to start a new run")

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
        progress = {"step": step, "elapsed": elapsed, "best": self.best}
        return self.description | ({"base_model": self.base_model} if self.base_model else {}) | progress

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
        if improved or not self.options.keep_best or not is_checkpoint(self.path):
            self.publish(training.published, tokenizer, info)
        write_run_info(self.path, info)
        self.saved_step = training.step

    def publish(self, model: AFTLM, tokenizer: Tokenizer, info: dict) -> None:
        """The Hub-shaped checkpoint: weights at the chosen precision, tokenizer, card, config."""
        card = model_card(model.config, info, self.metrics, curves=(self.path / curves.CURVES).is_file())
        save_checkpoint(self.path, model, tokenizer, card, self.options.weights_dtype)

    def finish(self, model: AFTLM, tokenizer: Tokenizer, step: int, elapsed: float, final_eval: dict) -> None:
        """Publish the card and training.json with the final evaluation of the published weights."""
        self.description["final_eval"] = final_eval
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
            f"Try a lower learning rate (--lr {self.options.lr / 3:.2g})"
        )

    def continue_command(self) -> str:
        return f"aftgen train {shlex.join(map(str, self.options.sources()))} --out {self.path} --resume"


def describe_run(options: TrainOptions, run: RunFolder, model: AFTLM, device: str, world: World) -> dict:
    """What training.json records about the run, besides its progress."""
    return {
        "name": Path(run.path).name,
        "command": options.command,
        "corpus": [str(source) for source in options.sources()],
        "held_out": run.held_out,
        "settings": run.settings,
        "options": options.to_dict(),
        **({"recipe": run.recipe} if run.recipe else {}),
        "parameters": model.num_parameters(),
        "tokenizer_type": options.tokenizer_type,
        "device": device,
        "world_size": world.size,
        "global_batch_size": run.settings["batch_size"] * world.size,
    }

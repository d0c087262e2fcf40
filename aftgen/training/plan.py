"""A training run's plan: every setting of the run decided in one place, once, before its first step.

`settle` takes the user's options (TrainOptions: None is "not given"), the prepared corpus and where the run
starts (fresh, a base model to fine-tune, or a resumed run's record). An option the user did not give takes
its value from the first of these layers that has it, in this order:

1. the user's options;
2. a resumed run's record: the options it ran with, and its model and batch size, which stay as they were;
3. fine-tuning: FINE_TUNE_DEFAULTS (and FINE_TUNE_STEPS without a budget), the base model's architecture, and
   its run's batch size (`base_batch_size`);
4. a fresh run: the recipe (recipe.py: rank 0 measures the machine, the other processes follow it), and the
   data options' defaults (CorpusOptions);
5. the preset's sizes and batch size (model.PRESETS), under them AFTConfig's defaults.

The result is checked once (the model's sizes together, and against the corpus) and frozen: the loop, the
optimiser and the run folder read the plan and decide nothing.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from aftgen import cores
from aftgen.corpus import CorpusOptions, PreparedCorpus
from aftgen.device import Placement
from aftgen.distributed import World
from aftgen.errors import AftgenError
from aftgen.files import shown
from aftgen.mixers import shaping_fields
from aftgen.model import PRESETS, AFTConfig
from aftgen.options import flag
from aftgen.training import probe, recipe, vocabulary
from aftgen.training.base import BaseModel
from aftgen.training.options import (
    ARCHITECTURE,
    FINE_TUNE_DEFAULTS,
    FINE_TUNE_STEPS,
    FRESH_ONLY,
    MODEL_FIELDS,
    RECIPE_FIELDS,
    RESUME_MAY_CHANGE,
    SIZES,
    SIZES_PRESET,
    THIS_COMMAND,
    TrainOptions,
)
from aftgen.training.state_file import Resumed

# What a resumed run takes from its record where the user does not give it: every option of the run.
RESUMED_FIELDS = tuple(field.name for field in fields(TrainOptions) if field.name not in THIS_COMMAND)


@dataclass(frozen=True)
class Plan:
    """A training run, settled: what every part of it reads."""

    options: TrainOptions  # the user's, with every option the run reads filled in
    config: AFTConfig  # the model
    batch_size: int  # sequences per step, per process
    held_out: dict  # what was held out, exactly (aftgen.corpus)
    recipe: dict | None = None  # what the recipe chose and from what (recipe.Recipe), as training.json records it
    corpus_digest: str | None = None  # the text's identity (PreparedCorpus.digest): a resumed run checks it

    def recorded_settings(self) -> dict:
        """The model's sizes and the batch size, as training.json and the state file record them ("settings")."""
        return {name: getattr(self.config, name) for name in MODEL_FIELDS} | {"batch_size": self.batch_size}


def settle(
    options: TrainOptions,
    corpus: PreparedCorpus,
    placement: Placement,
    world: World,
    base: BaseModel | None = None,
    resumed: Resumed | None = None,
    log: Callable[[str], None] = print,
    vocabulary_choice: vocabulary.Choice | None = None,
) -> Plan:
    """The run's plan: the options the user left out filled from the layers above, in their order, then checked.
    `vocabulary_choice`: how the corpus's tokenizer got its size (VocabularyChooser), for the record."""
    options, chosen = _layered(options, corpus, placement, world, resumed, log)
    config, batch_size = _model(options, corpus.tokenizer.vocab_size, base, resumed)
    recorded_recipe = resumed.recipe if resumed else chosen and chosen.to_dict()
    if recorded_recipe is not None and vocabulary_choice is not None:
        recorded_recipe |= {"vocabulary": vocabulary_choice.to_dict()}
    if resumed is not None:
        refuse_other_corpus(options, corpus, resumed)
    plan = Plan(options, config, batch_size, corpus.held_out, recorded_recipe, corpus.digest)
    _check(plan, corpus)
    return plan


class VocabularyChooser:
    """A fresh run's vocabulary, chosen from the tokenizer's sample as the corpus is prepared (corpus.VocabularyRule;
    aftgen.training.vocabulary): each candidate's step timed at the run's preset and share of the cores. `choice`
    holds what it chose, once it has."""

    def __init__(self, options: TrainOptions, budget_s: float, placement: Placement, log: Callable[[str], None]):
        self.options, self.budget_s, self.placement, self.log = options, budget_s, placement, log
        self.choice: vocabulary.Choice | None = None

    def __call__(self, slices: list[str], train_chars: int) -> int:
        preset = self.options.preset or SIZES_PRESET
        _fresh_model(self.options, vocabulary.DEFAULT)(preset)  # the user's sizes refused before anything is measured
        cores.look()  # the share of the cores the run will have, as the recipe's probe takes it

        def speed(vocab: int) -> float:
            return probe.tokens_per_s(*_fresh_model(self.options, vocab)(preset), self.placement)

        tokenizer_type = self.options.tokenizer_type or CorpusOptions.tokenizer_type
        self.choice = vocabulary.decide(slices, train_chars, self.budget_s, tokenizer_type, speed, self.log)
        self.log(self.choice.describe())
        return self.choice.vocab


def vocabulary_chooser(
    options: TrainOptions, placement: Placement, log: Callable[[str], None]
) -> VocabularyChooser | None:
    """How a fresh run with a time budget chooses its vocabulary; None where it keeps the one it has or is given:
    --vocab-size, fine-tuning, a resumed run, a character tokenizer, or a budget in steps alone."""
    budget = options.max_time if options.max_time is not None else None if options.max_steps else recipe.DEFAULT_BUDGET
    keeps = options.vocab_size is not None or options.init_from or options.resume or options.tokenizer_type == "char"
    return None if keeps or budget is None else VocabularyChooser(options, budget, placement, log)


def _layered(options, corpus, placement, world, resumed, log) -> tuple[TrainOptions, recipe.Recipe | None]:
    """The options with those the user left out taken from the layers below, in order; and the recipe, if one
    was chosen (a fresh run)."""
    if resumed is not None:
        options = _resumed_options(options, resumed)
    if options.init_from:
        budget = {} if options.max_steps or options.max_time else {"max_steps": FINE_TUNE_STEPS}
        return _under(options, FINE_TUNE_DEFAULTS | budget), None
    if resumed is not None:
        return options, None
    sized = _fresh_model(options, corpus.tokenizer.vocab_size)
    sized(options.preset or SIZES_PRESET)  # the user's sizes refused before the recipe measures anything
    chosen = _recipe(options, corpus, placement, world, sized)
    corpus_defaults = {"vocab_size": CorpusOptions.vocab_size, "tokenizer_type": CorpusOptions.tokenizer_type}
    options = replace(_under(options, corpus_defaults | _recipe_choices(options, chosen)), dtype=chosen.dtype)
    given = replace(chosen, **{name: getattr(options, name) for name in RECIPE_FIELDS})
    log(given.describe(corpus.summary["chars"]))  # what will run: the recipe, with the user's options
    return options, chosen


def _model(
    options: TrainOptions, vocab_size: int, base: BaseModel | None, resumed: Resumed | None
) -> tuple[AFTConfig, int]:
    """The model and batch size: a resumed run's own, a base model's architecture, or a fresh run's preset; the
    user's sizes over the last two."""
    if resumed is not None:
        sizes = {name: resumed.settings[name] for name in MODEL_FIELDS}
        return AFTConfig(vocab_size=vocab_size, **sizes), resumed.settings["batch_size"]
    if base is not None:
        return replace(base.config, **options.given(MODEL_FIELDS)), options.batch_size or base_batch_size(base)
    return _fresh_model(options, vocab_size)(options.preset)


def _resumed_options(options: TrainOptions, resumed: Resumed) -> TrainOptions:
    """`options` with those the user did not give (None, or an option's default) taken from the resumed run's
    record."""
    recorded = {name: resumed.options[name] for name in RESUMED_FIELDS if name in resumed.options}
    return replace(
        options, **{name: value for name, value in recorded.items() if not options.differs_from_default(name)}
    )


def refuse_contradictions(options: TrainOptions, resumed: Resumed) -> None:
    """A resumed run keeps the options it was started with, but for its budget and dtype and this command's own:
    one given otherwise is an error naming it (it would be dropped without a word, or change the run halfway)."""
    recorded = resumed.options | {name: resumed.settings[name] for name in (*MODEL_FIELDS, "batch_size")}
    changed = [
        name
        for name in RESUMED_FIELDS
        if name not in RESUME_MAY_CHANGE and name in recorded and options.differs_from_default(name)
        and getattr(options, name) != recorded[name]
    ]  # fmt: skip
    if changed:
        given = ", ".join(f"{flag(name)} {getattr(options, name)}" for name in changed)
        kept = ", ".join(f"{name} {shown(recorded[name], 40)}" for name in changed)
        raise AftgenError(
            f"{given} contradict{'s' * (len(changed) == 1)} the run in {options.run_folder} ({kept}): a resumed run "
            "keeps the options it started with, and only --max-steps, --max-time and the hardware options may "
            "change; drop them, or train a new run (another --out, or --overwrite)"
        )


def refuse_other_corpus(options: TrainOptions, corpus: PreparedCorpus, resumed: Resumed) -> None:
    """A resumed run trains on the text it started on, and checks the same held-out part (keep-best compares its
    scores): another corpus, or the same files split otherwise, is an error naming both."""
    if resumed.corpus_digest is not None and corpus.digest != resumed.corpus_digest:
        given, trained_on = shlex.join(map(str, options.sources())), shown(" ".join(map(str, resumed.corpus)))
        raise AftgenError(
            f"{given} is not the text the run in {options.run_folder} was trained on ({trained_on}): the files' "
            "contents, or their --held-out, --encoding or --errors, differ; resume with the run's corpus, or "
            "train a new run (another --out, or --overwrite)"
        )


def _under(options: TrainOptions, values: dict) -> TrainOptions:
    """`options` with those the user did not give (None) taken from `values` (a lower layer)."""
    return replace(options, **{name: value for name, value in values.items() if getattr(options, name) is None})


def _fresh_model(options: TrainOptions, vocab_size: int) -> Callable[[str], tuple[AFTConfig, int]]:
    """The model and batch size of a fresh run of a preset: AFTConfig's defaults, the preset over them, the
    user's sizes over both (the recipe's activation where the user gives none)."""

    def sized(preset: str) -> tuple[AFTConfig, int]:
        sizes = {name: getattr(AFTConfig, name) for name in ("dropout", "decay", "mixer")} | PRESETS[preset]
        sizes |= {"activation": recipe.ACTIVATION} | options.given((*MODEL_FIELDS, "batch_size"))
        batch_size = sizes.pop("batch_size")
        return AFTConfig(vocab_size=vocab_size, **sizes), batch_size  # AFTConfig refuses sizes that do not fit

    return sized


def _recipe(options, corpus: PreparedCorpus, placement: Placement, world: World, sized) -> recipe.Recipe:
    """What the recipe chooses for a fresh run; rank 0 measures the machine, and the others take its choice."""
    sizes_given = bool(options.given(SIZES))
    presets = (options.preset or SIZES_PRESET,) if sizes_given else recipe.CANDIDATES
    chosen = probe.choose_recipe(options, len(corpus.train_ids), presets, sized, placement) if world.main else None
    shared = world.share_bytes(json.dumps(chosen.to_dict()).encode() if chosen else None)
    return recipe.Recipe(**json.loads(shared))


def _recipe_choices(options: TrainOptions, chosen: recipe.Recipe) -> dict:
    values = {name: getattr(chosen, name) for name in RECIPE_FIELDS}
    if options.keep_best is False:
        values["patience"] = 0  # early stopping publishes the best weights: none without them
    return values


def refuse_changes(options: TrainOptions, base: BaseModel) -> None:
    """Fine-tuning keeps the base model's tokenizer and architecture: an option saying otherwise is an error (before
    any work: the loop calls this once the base model is found)."""
    for name in FRESH_ONLY:
        if getattr(options, name) is not None and name not in ARCHITECTURE:
            raise AftgenError(f"{flag(name)}: fine-tuning keeps the base model's tokenizer and sizes; drop it")
    kept = (*ARCHITECTURE, *shaping_fields(base.config))  # aft_full's window, for one, is its training length
    changed = [name for name in kept if getattr(options, name) not in (None, getattr(base.config, name))]
    if changed:
        name = changed[0]
        raise AftgenError(
            f"{flag(name)} {getattr(options, name)} contradicts the base model ({name} {getattr(base.config, name)}); "
            f"fine-tuning keeps the base model's architecture and tokenizer: drop {flag(name)}"
        )


def base_batch_size(base: BaseModel) -> int:
    """A fine-tuning run's batch size when the user gives none: the one its base model was trained with (its run
    folder's training.json), else, for a checkpoint alone (one pulled from the Hub), that of the preset nearest it
    in parameters: a batch sized for the model, as the base's own run would have chosen."""
    if base.run_batch_size:
        return base.run_batch_size
    size = base.config.approximate_parameters()
    nearest = min(PRESETS, key=lambda preset: abs(math.log(recipe.parameters(preset, base.config.vocab_size) / size)))
    return PRESETS[nearest]["batch_size"]


def _check(plan: Plan, corpus: PreparedCorpus) -> None:
    """What only the settled whole can fail: the patience its checks need, and one training sequence in the corpus."""
    options = plan.options
    if options.patience and not options.keep_best:
        raise AftgenError("--patience needs --keep-best, so that the run publishes the best weights, not the last")
    train_tokens, held_out_tokens, length = len(corpus.train_ids), len(corpus.held_out_ids), plan.config.context_length
    if train_tokens < length + 2 or held_out_tokens < 2:
        raise AftgenError(
            f"{shlex.join(map(str, options.sources()))}: too small: {train_tokens} training tokens, fewer than one "
            f"sequence of {length + 1}; give it more text or pass a smaller --context-length"
        )

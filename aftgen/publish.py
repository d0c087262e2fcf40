"""Publishing a run on the Hugging Face Hub (`aftgen push`): its checkpoint and a fresh model card with a sample.

Through huggingface_hub, with its settings (HF_ENDPOINT, HF_TOKEN; see aftgen.hub, which resolves --model).
"""

from __future__ import annotations

from pathlib import Path

from aftgen.card import run_card
from aftgen.checkpoint import CARD, CARD_LIMIT, CONFIG, TOKENIZER, WEIGHTS, config_json, load_checkpoint
from aftgen.curves import CURVES, CURVES_LIMIT
from aftgen.errors import AftgenError
from aftgen.files import read_bytes, read_text
from aftgen.generation.controls import SamplingOptions
from aftgen.generation.loop import sample_text
from aftgen.generation.prompt import read_prompt
from aftgen.hf import files as transformers_files
from aftgen.hub import hub_errors
from aftgen.model import AFTLM
from aftgen.record import INFO_LIMIT, METRICS, METRICS_LIMIT, TRAINING_INFO, TRAINING_STATE
from aftgen.tokenizer import Tokenizer
from aftgen.training.state_file import largest_training_state

CARD_SAMPLE_TOKENS = 80


def push(
    run_dir: str | Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    include_training_state: bool = False,
) -> str:
    """Upload a run's checkpoint and a fresh model card (with a sample) to the Hub; returns the commit URL.

    The repo is created if needed; `revision` names a branch, created from main if it does not exist.
    A folder with a README.md but no training.json (a curated checkpoint) keeps its own card.
    Optimiser state (training_state.safetensors, training.json) stays local unless include_training_state.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    run_dir = Path(run_dir)
    model, tokenizer = load_checkpoint(run_dir)  # only a complete, valid checkpoint is worth sharing
    if (run_dir / CARD).is_file() and not (run_dir / TRAINING_INFO).is_file():
        card = read_text(run_dir / CARD, CARD_LIMIT, "the model card", follow=False)  # a curated checkpoint's own
    else:
        card = run_card(run_dir, model.config, _card_sample(model, tokenizer))
    limits = {
        name: limit for name, limit in ((METRICS, METRICS_LIMIT), (CURVES, CURVES_LIMIT)) if (run_dir / name).is_file()
    }
    if include_training_state:
        missing = [name for name in (TRAINING_STATE, TRAINING_INFO) if not (run_dir / name).is_file()]
        if missing:
            raise AftgenError(f"{run_dir}: no training state to include (missing {', '.join(missing)})")
        limits |= {TRAINING_STATE: largest_training_state(model, model), TRAINING_INFO: INFO_LIMIT}
    # The checkpoint's files were checked as they loaded; the run's others are published as read here, never
    # through a link: aftgen makes none, and one in a folder from elsewhere may point at any file of the user's.
    # config.json and transformers' files are written afresh, so a folder saved before aftgen wrote them gains them.
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(run_dir / name)) for name in (WEIGHTS, TOKENIZER)
    ]
    generated = {CONFIG: config_json(model.config, tokenizer).encode(), **transformers_files()}
    operations += [CommitOperationAdd(path_in_repo=name, path_or_fileobj=data) for name, data in generated.items()]
    operations += [
        CommitOperationAdd(
            path_in_repo=name, path_or_fileobj=read_bytes(run_dir / name, limit, "the file to publish", follow=False)
        )
        for name, limit in limits.items()
    ]
    operations.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card.encode()))

    api = HfApi()
    with hub_errors(repo_id, revision, writing=True):
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.create_commit(
            repo_id, operations, commit_message=f"Upload aftgen model from {run_dir.name}", revision=revision
        )
    return commit.commit_url


def _card_sample(model: AFTLM, tokenizer: Tokenizer) -> str:
    """A short seeded continuation of nothing, so the card shows what the model writes."""
    context = read_prompt(model, tokenizer, "", seed=0)
    (pieces,) = sample_text(model, tokenizer, context, SamplingOptions(max_new_tokens=CARD_SAMPLE_TOKENS, seed=0))
    return "".join(pieces).strip()

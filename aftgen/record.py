"""A training run's record beside its checkpoint: training.json (what the run is and how far it got, for
people; written last), metrics.jsonl (one row per held-out check) and the name of its training state file.

It sits below the model cards, the curves, publishing and training, which all read it (training writes it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import msgspec

from aftgen.errors import AftgenError
from aftgen.files import as_record, atomic_write, read_json, read_text

TRAINING_INFO, METRICS = "training.json", "metrics.jsonl"
# What --resume needs: weights, optimiser and random states (written and read by aftgen.training.state_file).
TRAINING_STATE = "training_state.safetensors"
INFO_LIMIT = 16 << 20  # bytes: training.json is a few KB
METRICS_LIMIT = 1 << 30  # bytes: metrics.jsonl is about 200 bytes a held-out check


Count = Annotated[int, msgspec.Meta(ge=0)]


class HeldOutCheck(msgspec.Struct):
    """A row of metrics.jsonl as the curves, the card and a resumed run read it (training writes more)."""

    step: Count
    held_out_nats_per_char: float
    elapsed: float | None = None
    train_loss: float | None = None
    lr: float | None = None
    raw_weights_held_out_nats_per_char: float | None = None


class BaseModelRecord(msgspec.Struct):
    model: str
    weights_sha256: str
    hub_id: str | None = None


class _Best(msgspec.Struct):
    step: Count
    held_out_nats_per_char: float


class _FinalEval(msgspec.Struct):
    nats_per_char: float
    bits_per_char: float


class _HeldOut(msgspec.Struct):
    summary: str = "last 10%"


class _Options(msgspec.Struct):
    ema: float | None = None
    keep_best: bool = False


class _Settings(msgspec.Struct):
    batch_size: Count | None = None


class RunInfo(msgspec.Struct):
    """training.json as the card, a fine-tuning run and the benchmarks read it: each field may be absent (an
    older run's), none may be of another type (the rest of the file is for people)."""

    name: str = "aftgen model"
    command: str = "aftgen train ..."
    parameters: int | None = None
    tokenizer_type: str | None = None  # None: a fine-tuning run, whose tokenizer is its base's
    step: Count | None = None
    elapsed: float = 0.0
    base_model: BaseModelRecord | None = None
    best: _Best | None = None
    options: _Options = msgspec.field(default_factory=_Options)
    final_eval: _FinalEval | None = None
    held_out: _HeldOut = msgspec.field(default_factory=_HeldOut)
    settings: _Settings = msgspec.field(default_factory=_Settings)


def write_run_info(folder: Path, info: dict) -> None:
    atomic_write(folder / TRAINING_INFO, json.dumps(info, indent=2) + "\n")


def write_metrics(folder: Path, rows: list[dict]) -> None:
    atomic_write(folder / METRICS, "".join(json.dumps(row) + "\n" for row in rows))


def read_run_files(folder: Path) -> tuple[dict, list[dict]]:
    """training.json and metrics.jsonl of a run folder (empty where absent); every row has its step."""
    info, lines = {}, []
    if (folder / TRAINING_INFO).exists():
        info = read_json(folder / TRAINING_INFO, INFO_LIMIT, "the run's description")
    if (folder / METRICS).exists():
        lines = read_text(folder / METRICS, METRICS_LIMIT, "the run's metrics").splitlines()
    try:
        rows = {number: json.loads(line) for number, line in enumerate(lines, 1) if line.strip()}
    except (json.JSONDecodeError, RecursionError) as exc:
        raise AftgenError(f"{folder}: cannot read {TRAINING_INFO} or {METRICS} ({str(exc)[:200]})") from None
    as_record(info, RunInfo, folder / TRAINING_INFO, "the run's description")
    for number, row in rows.items():
        as_record(row, HeldOutCheck, f"{folder / METRICS}: line {number}", "a held-out check")
    return info, list(rows.values())

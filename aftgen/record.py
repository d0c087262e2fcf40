"""A training run's record beside its checkpoint: training.json (what the run is and how far it got, for
people; written last), metrics.jsonl (one row per held-out check) and the name of its training state file.

It sits below the model cards, the curves, publishing and training, which all read it (training writes it).
"""

from __future__ import annotations

import json
from pathlib import Path

from aftgen.errors import AftgenError
from aftgen.files import atomic_write, is_count, read_json, read_text

TRAINING_INFO, METRICS = "training.json", "metrics.jsonl"
# What --resume needs: weights, optimiser and random states (written and read by aftgen.training.state_file).
TRAINING_STATE = "training_state.safetensors"
INFO_LIMIT = 16 << 20  # bytes: training.json is a few KB
METRICS_LIMIT = 1 << 30  # bytes: metrics.jsonl is about 200 bytes a held-out check


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
    if not isinstance(info, dict) or not all(isinstance(row, dict) for row in rows.values()):
        raise AftgenError(f"{folder}: {TRAINING_INFO} or {METRICS} does not hold JSON objects")
    for number, row in rows.items():
        if not is_count(row.get("step")):
            raise AftgenError(f"{folder / METRICS}: line {number} has no step (a whole number); delete that line")
    return info, list(rows.values())

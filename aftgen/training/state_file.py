"""A training run's state file, training_state.safetensors: the latest weights, optimiser moments and random
states, everything `--resume` needs, in one atomic write and no pickle. Its header alone describes the run
(settings, step, best held-out check)."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from aftgen.checkpoint import safetensors_metadata
from aftgen.errors import AftgenError
from aftgen.files import atomic_write, is_count, read_bytes
from aftgen.model import AFTLM
from aftgen.record import TRAINING_STATE, read_run_files
from aftgen.training.options import MODEL_FIELDS

HEADER_LIMIT = 16 << 20  # bytes: the header (tensor names, the run's description) and random states (5 KB each)


def save_training_state(
    folder: Path, model: AFTLM, optimizer: torch.optim.Optimizer, generator, info: dict, average: AFTLM | None = None
) -> None:
    """Model, optimiser moments, random states and the weight average if there is one, in one safetensors
    file (one atomic write, no pickle)."""
    opt = optimizer.state_dict()
    models = {"model": model} | ({"average": average} if average is not None else {})
    tensors = {
        f"{name}.{k}": v.detach().float().contiguous() for name, m in models.items() for k, v in m.state_dict().items()
    }
    for index, slots in opt["state"].items():
        for key, value in slots.items():
            tensors[f"optimizer.{index}.{key}"] = torch.as_tensor(value).float().contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    tensors["rng.data"] = generator.get_state()
    device = next(model.parameters()).device
    if device.type == "cuda":  # dropout on a GPU draws from the GPU's own generator
        tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": g["params"]} for g in opt["param_groups"]]
    metadata = {"info": json.dumps(info), "param_groups": json.dumps(groups)}
    atomic_write(folder / TRAINING_STATE, save_safetensors(tensors, metadata=metadata))


@dataclass(frozen=True)
class Resumed:
    """What a resumed run reads of its folder: the state file's header (which alone describes the run) and
    the held-out checks up to its step."""

    step: int
    options: dict  # what the run ran with, as training.json records them
    settings: dict  # its model sizes and batch size, as recorded (aftgen.training.plan turns them into a Plan)
    recipe: dict | None
    base_model: dict | None
    best: dict | None
    world_size: int
    metrics: list[dict]
    corpus: list  # the files it was trained on, as given
    corpus_digest: str | None  # their text's identity (aftgen.corpus.PreparedCorpus.digest); None in older runs

    @classmethod
    def read(cls, path: Path) -> Resumed:
        saved, _ = read_training_info(path)
        # checks past the checkpoint (a save that failed, a kill before it) are made again: never twice
        metrics = [row for row in read_run_files(path)[1] if row["step"] <= saved["step"]]
        return cls(saved["step"], saved.get("options") or {}, saved["settings"], saved.get("recipe"),
                   saved.get("base_model"), saved.get("best"), saved.get("world_size", 1), metrics,
                   _listed(saved.get("corpus")), saved.get("corpus_digest"))  # fmt: skip


def _listed(value: object) -> list:
    return value if isinstance(value, list) else []


def _bad_training_state(path: Path, reason: object) -> AftgenError:
    return AftgenError(f"{path}: cannot read training state ({str(reason)[:200]}); start again with --overwrite")


def read_training_info(folder: Path) -> tuple[dict, list]:
    """The run's description (settings, step, ...) and the optimiser's param groups, from the state file's
    header, checked to hold what a resumed run reads."""
    path = folder / TRAINING_STATE
    try:
        metadata = safetensors_metadata(path)
        info, groups = json.loads(metadata["info"]), json.loads(metadata["param_groups"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError, struct.error) as exc:
        raise _bad_training_state(path, exc) from None  # RecursionError: JSON nested deeper than json reads
    problem = _description_problem(info) if isinstance(groups, list) else "its optimiser groups are not a list"
    if problem:
        raise _bad_training_state(path, problem)
    return info, groups


def _description_problem(info: object) -> str | None:
    """What a resumed run would fail to read in the header's description of the run, or None."""
    if not isinstance(info, dict):
        return "its description is not a JSON object"
    settings = info.get("settings")
    if not isinstance(settings, dict) or not all(name in settings for name in (*MODEL_FIELDS, "batch_size")):
        return f"its settings lack some of {', '.join((*MODEL_FIELDS, 'batch_size'))}"
    if not is_count(settings["batch_size"]) or not settings["batch_size"]:
        return f"batch_size {settings['batch_size']!r} is not a whole number above 0"
    if not is_count(info.get("step")) or not _is_number(info.get("elapsed")):
        return "it lacks the step or the time trained"
    best = info.get("best")
    if best is not None and not (
        isinstance(best, dict) and is_count(best.get("step")) and _is_number(best.get("held_out_nats_per_char"))
    ):
        return "its best held-out check lacks a step or a score"
    wrong = [name for name in ("options", "recipe", "base_model") if not isinstance(info.get(name) or {}, dict)]
    return f"its {wrong[0]} is not a JSON object" if wrong else None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load_training_state(
    folder: Path, model: AFTLM, optimizer: torch.optim.Optimizer, generator, average: AFTLM | None = None
) -> dict:
    """Restore what save_training_state wrote, in place; return the run's description. An average the
    file lacks (the run had none so far) starts from the restored weights."""
    path = folder / TRAINING_STATE
    info, groups = read_training_info(folder)
    try:
        tensors = load_safetensors(read_bytes(path, largest_training_state(model, average), "the training state"))
        model.load_state_dict(_prefixed(tensors, "model."))
        if average is not None:
            average.load_state_dict(_prefixed(tensors, "average.") or model.state_dict())
        state: dict[int, dict] = {}
        for name, value in tensors.items():
            if name.startswith("optimizer."):
                _, index, key = name.split(".", 2)
                state.setdefault(int(index), {})[key] = value
        for group in groups:  # JSON has no tuples
            group |= {key: tuple(group[key]) for key in ("betas", "ns_coefficients") if key in group}
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        torch.set_rng_state(tensors["rng.torch"])
        generator.set_state(tensors["rng.data"])
        device = next(model.parameters()).device
        if device.type == "cuda" and "rng.cuda" in tensors:
            torch.cuda.set_rng_state(tensors["rng.cuda"], device)
    except (OSError, SafetensorError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise _bad_training_state(path, exc) from None
    return info


def largest_training_state(model: AFTLM, average: AFTLM | None) -> int:
    """The most bytes the state file holds for this model: fp32 weights (and their average), two optimiser
    moments and a step count a parameter, and room for the header and the random states."""
    weights = sum(t.numel() for t in model.state_dict().values())
    moments = sum(p.numel() * 2 + 1 for p in model.parameters())
    return HEADER_LIMIT + 4 * (weights * (2 if average is not None else 1) + moments)


def _prefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name[len(prefix) :]: value for name, value in tensors.items() if name.startswith(prefix)}

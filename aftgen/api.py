"""The library's front door: `load` a model from a folder, a Hub id or the shipped default."""

from __future__ import annotations

from pathlib import Path

import torch

from aftgen.checkpoint import CONFIG, load_checkpoint
from aftgen.device import pick_device
from aftgen.errors import AftgenError
from aftgen.hub import resolve_model
from aftgen.model import AFTLM
from aftgen.tokenizer import Tokenizer

DEFAULT_MODEL = "shakespeare"


def default_model_path() -> Path:
    """The model shipped inside the package (models/shakespeare in the source tree)."""
    from importlib.resources import files

    return Path(str(files("aftgen.models") / DEFAULT_MODEL))


def load(path: str | Path | None = None, device: str | torch.device = "cpu") -> tuple[AFTLM, Tokenizer]:
    """Load (model, tokenizer) from a checkpoint folder or a Hub id; None means the shipped default model.

    A Hub id, OWNER/NAME[@REV], is fetched through the Hugging Face cache (so it works offline once pulled).

    `device`: 'cpu' (the default), 'cuda', 'cuda:1', 'mps', or 'auto' (the best one here).
    """
    return load_checkpoint(model_folder(path), pick_device(device))


def model_folder(path: str | Path | None = None) -> Path:
    """The local folder of a checkpoint folder, a Hub id (fetched) or, for None, the shipped default model."""
    if path is None:
        location = default_model_path()
        if not (location / CONFIG).exists():
            raise AftgenError("the shipped default model is missing from this install; pass --model PATH")
        return location
    return resolve_model(path)

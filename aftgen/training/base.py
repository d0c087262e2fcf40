"""The pretrained checkpoint a fine-tuning run starts from (`aftgen train --init-from MODEL`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aftgen.checkpoint import TOKENIZER, WEIGHTS, check_checkpoint, read_weights
from aftgen.distributed import World
from aftgen.files import is_count
from aftgen.hub import parse_hub_id, resolve_model
from aftgen.model import AFTLM, AFTConfig
from aftgen.record import read_run_files
from aftgen.tokenizer import Tokenizer


@dataclass
class BaseModel:
    """Where the base model came from, its config and tokenizer (its weights are read into the new model)."""

    spec: str  # as given: a folder or OWNER/NAME[@REV]
    folder: Path
    config: AFTConfig
    tokenizer: Tokenizer
    run_batch_size: int | None = None  # the batch size it was trained with, where its run folder's record says

    @classmethod
    def find(cls, spec: str, world: World) -> BaseModel:
        """Resolve `spec` as --model does (a local folder first, else the Hub through its cache).

        Rank 0 fetches first, so processes on one machine never download the same files at once.
        """
        if not world.main:
            world.barrier()
        folder = resolve_model(spec)
        if world.main:
            world.barrier()
        config = check_checkpoint(folder)
        batch_size = (read_run_files(folder)[0].get("settings") or {}).get("batch_size")
        return cls(
            spec, folder, config, Tokenizer.load(folder / TOKENIZER), batch_size if is_count(batch_size) else None
        )

    @property
    def hub_id(self) -> str | None:
        """OWNER/NAME when the base came from the Hub (not a local folder of that name)."""
        parsed = parse_hub_id(self.spec)
        return parsed[0] if parsed and not Path(self.spec).exists() else None

    def load_weights_into(self, model: AFTLM) -> None:
        """The base's weights, checked against `model`'s shapes and widened to fp32 (fp16 files too)."""
        model.load_state_dict(read_weights(self.folder / WEIGHTS, model))

    def describe(self, model: AFTLM) -> dict:
        """What training.json records: where the base came from, which revision, which weights."""
        record = {"model": self.spec, "path": str(self.folder.resolve()), "weights_sha256": model.weights_sha256()}
        if self.hub_id:  # the Hub cache holds a snapshot per commit: its folder is named by the commit
            record |= {"hub_id": self.hub_id, "revision": self.folder.resolve().name}
        return record

"""Checkpoints: a folder shaped like a Hugging Face model repo, loaded without pickle.

    config.json                  architecture (validated field by field)
    model.safetensors            weights in fp32, fp16 or bf16 (verified against the config: names, shapes)
    tokenizer.model              SentencePiece model
    README.md                    model card
    *_aftgen.py                  what Hugging Face transformers imports to load the same files (aftgen.hf)

A training run's folder adds its own files beside them (aftgen/record.py, aftgen/training/state_file.py).
"""

from __future__ import annotations

import io
import json
import struct
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from aftgen.errors import AftgenError
from aftgen.files import atomic_write, open_regular, read_bytes, read_json
from aftgen.hf import TRANSFORMERS_KEYS, transformers_keys, write_files
from aftgen.model import AFTLM, AFTConfig
from aftgen.tokenizer import Tokenizer

CONFIG, WEIGHTS, TOKENIZER, CARD = "config.json", "model.safetensors", "tokenizer.model", "README.md"
CHECKPOINT_FILES = (CONFIG, WEIGHTS, TOKENIZER)
MODEL_TYPE = "aftgen"
FORMAT_VERSION = 1
# Precisions model.safetensors may hold; weights are always used in fp32 (fp16 halves the file).
WEIGHT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CONFIG_LIMIT = 1 << 20  # bytes: config.json is a dozen fields, far under this
CARD_LIMIT = 16 << 20  # bytes: a model card is a few KB of markdown
HEADER_LIMIT = 1 << 20  # bytes: a weights file's header, a name, dtype, shape and offsets per tensor
HEADER_MOST = 100_000_000  # bytes: the most safetensors itself reads as a header


def save_checkpoint(
    directory: Path | str, model: AFTLM, tokenizer: Tokenizer, card: str | None = None, weights_dtype: str = "fp32"
) -> None:
    """Write weights (stored as `weights_dtype`), tokenizer, model card and config, each atomically.

    config.json goes last, so a folder that has one held a complete checkpoint when it was written.
    """
    directory = Path(directory)
    if weights_dtype not in WEIGHT_DTYPES:
        raise AftgenError(f"unknown weights dtype '{weights_dtype}'; choose one of: {', '.join(WEIGHT_DTYPES)}")
    stored = WEIGHT_DTYPES[weights_dtype]
    weights = {name: t.detach().to("cpu", stored).contiguous() for name, t in model.state_dict().items()}
    atomic_write(directory / WEIGHTS, save_safetensors(weights, metadata={"format": "pt"}))
    atomic_write(directory / TOKENIZER, tokenizer.model_proto)
    if card is not None:
        atomic_write(directory / CARD, card)
    write_files(directory)
    atomic_write(directory / CONFIG, config_json(model.config, tokenizer))


def config_json(config: AFTConfig, tokenizer: Tokenizer) -> str:
    """config.json's text: the architecture, and what transformers needs to load the folder (aftgen.hf)."""
    data = {"model_type": MODEL_TYPE, "format_version": FORMAT_VERSION, **config.to_dict()}
    return json.dumps(data | transformers_keys(tokenizer.bos_id), indent=2) + "\n"


def is_checkpoint(directory: Path | str) -> bool:
    return all((Path(directory) / name).is_file() for name in CHECKPOINT_FILES)


def read_config(directory: Path | str) -> AFTConfig:
    """Parse and validate config.json."""
    path = Path(directory) / CONFIG
    data = read_json(path, CONFIG_LIMIT, "the model's config")
    if not isinstance(data, dict):
        raise AftgenError(f"{path}: must hold a JSON object")
    data = {key: value for key, value in data.items() if key not in TRANSFORMERS_KEYS}
    model_type = data.pop("model_type", None)
    if model_type != MODEL_TYPE:
        raise AftgenError(f"{path}: model_type is {model_type!r}, not 'aftgen'; this is not an aftgen checkpoint")
    version = data.pop("format_version", None)
    if version != FORMAT_VERSION:
        raise AftgenError(f"{path}: format_version {version!r} is not supported (expected {FORMAT_VERSION})")
    try:
        return AFTConfig.from_dict(data)
    except AftgenError as exc:
        raise AftgenError(f"{path}: {exc}") from None


def read_weights(path: Path, model: AFTLM) -> dict[str, torch.Tensor]:
    """The safetensors weights for `model`, refusing any missing, extra, misshapen or non-finite tensor.

    Weights stored in a lower precision are widened to the model's own dtypes.
    """
    expected = model.state_dict()
    # fp32 is the widest a stored float may be; other tensors keep the model's dtype
    largest = HEADER_LIMIT + sum(t.numel() * max(4, t.element_size()) for t in expected.values())
    data = read_bytes(path, largest, "the weights file")
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError) as exc:
        raise AftgenError(f"{path}: cannot read weights ({exc}); the file may be truncated or corrupt") from None
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
        raise AftgenError(f"{path}: weights do not match config.json ({detail})")
    for name, tensor in tensors.items():
        want = expected[name]
        storable = tensor.dtype in WEIGHT_DTYPES.values() if want.is_floating_point() else tensor.dtype == want.dtype
        if tensor.shape != want.shape or not storable:
            raise AftgenError(
                f"{path}: tensor '{name}' is {tensor.dtype} {tuple(tensor.shape)}, "
                f"config.json needs {want.dtype} {tuple(want.shape)}"
            )
        if not torch.isfinite(tensor).all():
            raise AftgenError(f"{path}: tensor '{name}' holds NaN or inf")
        tensors[name] = tensor.to(want.dtype)
    return tensors


def load_weights(path: Path, model: AFTLM) -> None:
    """Load checked weights (read_weights) into `model` by assignment, so it may live on the meta device."""
    model.load_state_dict(read_weights(path, model), assign=True)


def check_checkpoint(directory: Path | str) -> AFTConfig:
    """Refuse a folder that is not a complete aftgen checkpoint; return its validated config."""
    directory = Path(directory)
    if not directory.is_dir():
        raise AftgenError(f"{directory}: no such checkpoint folder")
    missing = [name for name in CHECKPOINT_FILES if not (directory / name).is_file()]
    # Another library's config.json says most about what the folder is, so it is read before the rest is missed.
    if CONFIG in missing:
        raise AftgenError(f"{directory}: not an aftgen checkpoint (missing {', '.join(missing)})")
    config = read_config(directory)
    if missing:
        raise AftgenError(f"{directory}: not an aftgen checkpoint (missing {', '.join(missing)})")
    return config


def load_checkpoint(directory: Path | str, device: str | torch.device = "cpu") -> tuple[AFTLM, Tokenizer]:
    """Load a local checkpoint folder as (model in eval mode on `device`, tokenizer).

    Weights are stored on no particular device, so a model trained anywhere loads anywhere.
    """
    directory = Path(directory)
    config = check_checkpoint(directory)
    tokenizer = Tokenizer.load(directory / TOKENIZER)
    if tokenizer.vocab_size != config.vocab_size:
        raise AftgenError(
            f"{directory}: tokenizer has {tokenizer.vocab_size} pieces "
            f"but config.json says vocab_size {config.vocab_size}"
        )
    # Built without memory and filled from the file, so a config cannot allocate more than the weights hold.
    with torch.device("meta"):
        model = AFTLM(config)
    load_weights(directory / WEIGHTS, model)
    return model.to(device).eval(), tokenizer


def safetensors_metadata(source: Path | str | bytes) -> dict[str, str]:
    """The __metadata__ of a safetensors file (or its bytes), from its header alone: 8-byte length, then JSON.

    Raises ValueError for a file that is not safetensors, AftgenError for a path that is not a regular file.
    """
    # Only the header is read from a path, so the file's own size needs no bound here.
    opened = io.BytesIO(source) if isinstance(source, bytes) else open_regular(source, sys.maxsize, "safetensors")
    with opened as handle:
        (length,) = struct.unpack("<Q", handle.read(8).ljust(8, b"\0"))
        if length > HEADER_MOST:
            raise ValueError("safetensors header too large")
        try:
            header = json.loads(handle.read(length).decode("utf-8"))
        except RecursionError:  # nested deeper than json reads: malformed like any other header
            raise ValueError("safetensors header nested too deep") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}

"""State files: a generation's context saved to go on later, the same size however long its history.

One safetensors file (no pickle) holds, per layer, the mixer's recurrent state, plus the next
token's logits, the recent tokens (repeat penalty), the random generator's state and the bytes of a
character the last token left unfinished: everything needed so that saving and loading in the
middle of a run changes nothing about what comes next. The metadata names the model it belongs to
(SHA-256 of the weights and of the tokenizer); any other model is refused, and so is a file holding
what no model writes (tokens outside the vocabulary, values the model cannot step from).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from aftgen.checkpoint import safetensors_metadata
from aftgen.errors import AftgenError
from aftgen.files import atomic_write, read_bytes
from aftgen.generation.context import MAX_REPEAT_LAST_N, Context
from aftgen.model import AFTLM, clone_state
from aftgen.tokenizer import Tokenizer

# Version 2: an AFT window holds exp(k), not k (window_exp_k); a version-1 file would be misread, so it is refused.
FORMAT, VERSION = "aftgen-state", "2"
PENDING_BYTES = 8  # an unfinished character is at most 3 bytes, plus a held 3-byte escape character
NO_TOKEN = -1  # pads the recent-token slots of a short history
HEADER_LIMIT = 64 << 10  # bytes: a state file's header, its tensors' names and shapes and the model's hashes
MAX_CACHED_TOKENS = 1 << 20  # positions a growing cache (an attention mixer's) may hold in a file


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.model_proto).hexdigest()


def save_state(path: Path | str, context: Context, model: AFTLM, tokenizer: Tokenizer) -> None:
    """Write `context` atomically; its size depends on the model only, never on the history."""
    tensors = {f"layer{i}.{name}": t.contiguous() for i, layer in enumerate(context.state) for name, t in layer.items()}
    recent = context.history()[0, -MAX_REPEAT_LAST_N:]
    pending = torch.tensor(list(context.pending), dtype=torch.uint8)
    tensors |= {
        "logits": context.logits.float().contiguous(),
        "recent": torch.cat([torch.full((MAX_REPEAT_LAST_N - len(recent),), NO_TOKEN), recent]),
        "generator": context.generator.get_state(),
        "pending": torch.cat([pending, torch.zeros(PENDING_BYTES - len(pending), dtype=torch.uint8)]),
        "pending_length": torch.tensor(len(pending)),
    }
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "weights_sha256": model.weights_sha256(),
        "tokenizer_sha256": tokenizer_hash(tokenizer),
    }
    atomic_write(path, save_safetensors({name: t.cpu() for name, t in tensors.items()}, metadata=metadata))


def load_state(path: Path | str, model: AFTLM, tokenizer: Tokenizer) -> Context:
    """Read a state file written by `save_state` for this very model and tokenizer."""
    path = Path(path)
    expected = _expected_tensors(model)
    data = read_bytes(path, _largest(expected), "the state file")
    try:
        metadata = safetensors_metadata(data)
        tensors = load_safetensors(data)
    except (ValueError, AttributeError, SafetensorError):
        raise AftgenError(f"{path}: not an aftgen state file, or a truncated one") from None
    _check_origin(path, metadata, model, tokenizer)
    if set(tensors) != set(expected):
        raise AftgenError(f"{path}: state file does not match this model's layers")
    tensors = _positions_per_row(tensors, expected)
    for name, tensor in tensors.items():
        if not _fits(tensor, expected[name]):
            raise AftgenError(
                f"{path}: tensor '{name}' is {tensor.dtype} {tuple(tensor.shape)}, "
                f"expected {expected[name].dtype} {tuple(expected[name].shape)}"
            )
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise AftgenError(f"{path}: tensor '{name}' holds NaN or inf")
    pending_length = int(tensors["pending_length"])
    if not 0 <= pending_length <= PENDING_BYTES:
        raise AftgenError(f"{path}: corrupt state file (pending_length {pending_length})")
    _check_tokens(path, tensors, expected, model.config.vocab_size)
    generator = torch.Generator()
    try:
        generator.set_state(tensors["generator"])
    except RuntimeError:
        raise AftgenError(f"{path}: corrupt random generator state") from None
    device = model.embed.weight.device
    state = [
        {name: tensors[f"layer{i}.{name}"].clone().to(device) for name in layer}
        for i, layer in enumerate(model.initial_state(1))
    ]
    recent = tensors["recent"]
    context = Context(
        state=state,
        logits=tensors["logits"].clone(),
        generator=generator,
        recent=recent[recent != NO_TOKEN][None].clone(),
        pending=bytes(tensors["pending"][:pending_length].tolist()),
    )
    _check_continues(path, context, model)
    return context


def _positions_per_row(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors, with a 0-dim position read as the (1,) one of its single row: a file written before each row
    kept its own position (an AFT layer's) holds the same count in a 0-dim tensor."""
    return {
        name: tensor.view(1)
        if name.endswith(".position") and tensor.dim() == 0 and expected[name].dim() == 1
        else tensor
        for name, tensor in tensors.items()
    }


def _check_tokens(path: Path, tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], vocab: int) -> None:
    """Refuse recent tokens outside the vocabulary, and positions a model never writes: every layer has read
    the same number of tokens, and a growing cache (a dimension empty in a fresh state) holds them all."""
    recent = tensors["recent"]
    if not ((recent == NO_TOKEN) | ((recent >= 0) & (recent < vocab))).all():
        raise AftgenError(f"{path}: corrupt state file (recent tokens outside the vocabulary of {vocab})")
    positions = sorted({int(tensor) for name, tensor in tensors.items() if name.endswith(".position")})
    cached = [
        length
        for name, fresh in expected.items()
        for length, fresh_length in zip(tensors[name].shape, fresh.shape, strict=True)
        if fresh_length == 0
    ]
    if len(positions) > 1 or positions[0] < 0 or any(length < positions[0] for length in cached):
        raise AftgenError(f"{path}: corrupt state file (its layers' positions {positions} do not fit it)")


@torch.inference_mode()
def _check_continues(path: Path, context: Context, model: AFTLM) -> None:
    """Refuse a state the model cannot go on from: finite values no model writes (3e38, say) pass the NaN
    check and then overflow, so one step is taken from a copy of it."""
    token = context.logits.argmax(-1).to(model.embed.weight.device)
    logits, _ = model.step(token, clone_state(context.state))
    if not torch.isfinite(logits).all():
        raise AftgenError(f"{path}: this model's scores from this state are NaN or infinite: the state file is damaged")


def _check_origin(path: Path, metadata: dict, model: AFTLM, tokenizer: Tokenizer) -> None:
    """Refuse a file that is not an aftgen state file of this version, or one another model wrote."""
    if metadata.get("format") != FORMAT:
        raise AftgenError(f"{path}: not an aftgen state file")
    if metadata.get("version") != VERSION:
        raise AftgenError(
            f"{path}: state file version {metadata.get('version')!r} is not supported (expected {VERSION})"
        )
    for what, saved, ours in (
        ("model weights", metadata.get("weights_sha256"), model.weights_sha256()),
        ("tokenizer", metadata.get("tokenizer_sha256"), tokenizer_hash(tokenizer)),
    ):
        if saved != ours:
            raise AftgenError(
                f"{path}: this state was saved with different {what} (sha256 {str(saved)[:12]}, this model's "
                f"{ours[:12]}); continue it with the model that wrote it"
            )


def _expected_tensors(model: AFTLM) -> dict[str, torch.Tensor]:
    """Tensors of the kind a state file for `model` holds (shapes as in a fresh context)."""
    expected = {f"layer{i}.{name}": t for i, layer in enumerate(model.initial_state(1)) for name, t in layer.items()}
    return expected | {
        "logits": torch.zeros(1, model.config.vocab_size),
        "recent": torch.zeros(MAX_REPEAT_LAST_N, dtype=torch.long),
        "generator": torch.Generator().get_state(),
        "pending": torch.zeros(PENDING_BYTES, dtype=torch.uint8),
        "pending_length": torch.tensor(0),
    }


def _largest(expected: dict[str, torch.Tensor]) -> int:
    """The most bytes a state file for this model holds: its tensors (a growing cache at MAX_CACHED_TOKENS
    positions) and a header. Anything larger is refused before it is read."""
    sizes = (math.prod(n or MAX_CACHED_TOKENS for n in t.shape) * t.element_size() for t in expected.values())
    return HEADER_LIMIT + sum(sizes)


def _fits(tensor: torch.Tensor, expected: torch.Tensor) -> bool:
    """Same dtype and shape; a dimension empty in a fresh state (a growing cache) may hold any length."""
    if tensor.dtype != expected.dtype or tensor.dim() != expected.dim():
        return False
    return all(want in (have, 0) for have, want in zip(tensor.shape, expected.shape, strict=True))

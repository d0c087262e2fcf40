"""vLLM's tokenizer routes: POST /tokenize, POST /detokenize and GET /tokenizer_info.

lm-evaluation-harness's remote tokenizer (`tokenizer_backend=remote`) reads these to score a model
through /v1/completions without a Hugging Face tokenizer. It finds BOS and EOS by tokenizing their
names (`<s>`, `</s>`), so a prompt sent here reads the control tokens' names as those tokens, as a
Hugging Face tokenizer (and so vLLM's /tokenize) does, and /detokenize writes them back by name:
detokenize(tokenize(text)) == text for any text. Messages are read as the chat route reads them.
"""

from __future__ import annotations

import functools
import re

from aftgen.options import Range
from aftgen.serve.conversation import chat_ids
from aftgen.serve.options import ServeOptions
from aftgen.serve.schema import boolean, checked_request, integer, invalid, messages, text
from aftgen.tokenizer import Tokenizer


@functools.cache  # a server has one tokenizer
def special_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """The control tokens (BOS, EOS) by name."""
    return {tokenizer.sp.id_to_piece(i): i for i in range(tokenizer.vocab_size) if tokenizer.sp.is_control(i)}


def longest_sequence(options: ServeOptions) -> int:
    """The most tokens one request reads and writes: what /detokenize takes at most."""
    return options.max_prompt_tokens + options.max_tokens


def tokenizer_info(tokenizer: Tokenizer, options: ServeOptions) -> dict:
    """GET /tokenizer_info: what lm-eval's remote tokenizer reads (eos_token, bos_token), and the vocabulary."""
    names = {i: name for name, i in special_tokens(tokenizer).items()}
    sp = tokenizer.sp
    return {
        "tokenizer_class": "SentencePiece (aftgen: byte fallback, no normalisation)",
        "vocab_size": tokenizer.vocab_size,
        "bos_token": names.get(sp.bos_id()),
        "bos_token_id": tokenizer.bos_id,
        "eos_token": names.get(sp.eos_id()),
        "eos_token_id": sp.eos_id() if sp.eos_id() >= 0 else None,
        "unk_token": sp.id_to_piece(sp.unk_id()),
        "pad_token": None,
        "model_max_length": options.max_prompt_tokens,
    }


def tokenize(body: dict, tokenizer: Tokenizer, options: ServeOptions, model_name: str) -> dict:
    """POST /tokenize: a `prompt` or chat `messages` as token ids (BOS first unless add_special_tokens is false)."""
    fields = {"model": text, "prompt": text, "messages": messages, "add_special_tokens": boolean}
    values = checked_request(body, fields | {"return_token_strs": boolean}, model_name)
    given = [name for name in ("prompt", "messages") if name in values]
    if len(given) != 1:
        raise invalid("prompt", "give one of 'prompt' (a string) or 'messages' (chat messages)")
    if "messages" in values:
        ids = chat_ids(tokenizer, values["messages"])
    else:
        ids = encode_with_names(tokenizer, values["prompt"])
    if values.get("add_special_tokens", True):
        ids = [tokenizer.bos_id, *ids]
    pieces = [tokenizer.sp.id_to_piece(i) for i in ids] if values.get("return_token_strs") else None
    return {"count": len(ids), "max_model_len": options.max_prompt_tokens, "tokens": ids, "token_strs": pieces}


def detokenize(body: dict, tokenizer: Tokenizer, options: ServeOptions, model_name: str) -> dict:
    """POST /detokenize: token ids as text, the control tokens by name."""
    values = checked_request(body, {"model": text, "tokens": token_ids(tokenizer, options)}, model_name)
    if "tokens" not in values:
        raise invalid("tokens", "'tokens' is required")
    return {"prompt": decode_with_names(tokenizer, values["tokens"])}


def token_ids(tokenizer: Tokenizer, options: ServeOptions):
    """The check of a list of token ids: each in the vocabulary, at most longest_sequence of them."""
    most, one = longest_sequence(options), integer(Range(0, tokenizer.vocab_size - 1))

    def check(name: str, value: object) -> list[int]:
        if not isinstance(value, list) or len(value) > most:
            raise invalid(name, f"'{name}' must be a list of at most {most} token ids")
        return [one(f"{name}[{i}]", token) for i, token in enumerate(value)]

    return check


def encode_with_names(tokenizer: Tokenizer, prompt: str) -> list[int]:
    specials = special_tokens(tokenizer)
    parts = re.split(f"({'|'.join(map(re.escape, specials))})", prompt) if specials else [prompt]
    ids = []
    for i, part in enumerate(parts):  # odd parts are the names the split kept
        ids += [specials[part]] if i % 2 else tokenizer.encode(part)
    return ids


def decode_with_names(tokenizer: Tokenizer, ids: list[int]) -> str:
    names = {i: name for name, i in special_tokens(tokenizer).items()}
    out, run = [], []
    for token in [*ids, None]:
        if token is None or token in names:
            out.append(tokenizer.decode(run))
            out.append(names.get(token, ""))
            run = []
        else:
            run.append(token)
    return "".join(out)

"""OpenAI request bodies checked field by field and turned into the engine's Work.

Every field is checked for type and range before any work starts; anything wrong, unknown or not
supported is a 400 in OpenAI's error shape naming the field (`param`). Fields OpenAI defines that
aftgen does not implement are accepted only at their neutral value (say, `logprobs: null`), so a
client that sends its defaults works and one that relies on the feature hears about it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from aftgen.chat import REPLY_END, ROLES, message_text
from aftgen.constraints import ANY_JSON_OBJECT, MAX_CHOICES, Constraint, json_source
from aftgen.generation.controls import API_DEFAULTS, CONTROLS, SEEDS, SamplingOptions
from aftgen.generation.prompt import opening
from aftgen.options import Range
from aftgen.serve.conversation import chat_ids
from aftgen.serve.options import ServeOptions
from aftgen.serve.sessions import valid_name
from aftgen.serve.work import Work
from aftgen.tokenizer import Tokenizer

MAX_STOPS, MAX_STOP_CHARS, MAX_MESSAGES = 4, 256, 4096
LOGPROBS = Range(0, 20)  # likeliest alternatives a token's score may come with, as OpenAI allows


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None, retry_after=1
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.retry_after = retry_after  # seconds, for a 503's Retry-After

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """A checked request: the engine's work and how to answer it."""

    work: Work
    chat: bool
    stream: bool = False
    include_usage: bool = False


def invalid(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def integer(allowed: Range) -> Callable[[str, object], int]:
    def check(name: str, value: object) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise invalid(name, f"'{name}' must be an integer, got {value!r}")
        return within(name, value, allowed)

    return check


def number(allowed: Range) -> Callable[[str, object], float]:
    def check(name: str, value: object) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise invalid(name, f"'{name}' must be a number, got {value!r}")
        return float(within(name, value, allowed))

    return check


def within(name: str, value: float, allowed: Range) -> float:
    if value not in allowed:
        raise invalid(name, f"'{name}' must be {allowed}, got {value}")
    return value


def boolean(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise invalid(name, f"'{name}' must be true or false, got {value!r}")
    return value


def text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise invalid(name, f"'{name}' must be a string, got {type(value).__name__}")
    return value


def stops(name: str, value: object) -> tuple[str, ...]:
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise invalid(name, f"'{name}' must be a string or a list of strings")
    if len(strings) > MAX_STOPS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in strings):
        raise invalid(name, f"'{name}' takes up to {MAX_STOPS} non-empty strings of up to {MAX_STOP_CHARS} chars")
    return tuple(strings)


def session_name(name: str, value: object) -> str:
    if not isinstance(value, str) or not valid_name(value):
        raise invalid(name, f"'{name}' must be 1-64 letters, digits, '_', '.' or '-' (not starting with '.')")
    return value


def stream_options(name: str, value: object) -> bool:
    """OpenAI's {"include_usage": bool}; returns include_usage."""
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise invalid(name, f"'{name}' must be an object with only 'include_usage'")
    return boolean(f"{name}.include_usage", value.get("include_usage", False))


# Defined by OpenAI, not implemented here: accepted at these values only.
NEUTRAL = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
    "top_logprobs": (0,),  # completions: its `logprobs` says how many
    "echo": (False,),  # chat: OpenAI's has none
    "best_of": (1,),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "store": (False,),
}
IGNORED = ("user", "metadata", "service_tier", "parallel_tool_calls")  # no effect on what is generated


def response_format(name: str, value: object) -> Constraint | None:
    """OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": {...}, ...}}."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", ANY_JSON_OBJECT)
    if kind == "json_schema":
        given = value.get("json_schema")
        if not isinstance(given, dict) or not isinstance(given.get("schema"), dict):
            raise invalid(f"{name}.json_schema", f"'{name}.json_schema' must be an object with a 'schema' object")
        return Constraint("json_schema", json_source(given["schema"]))
    raise invalid(name, f"'{name}' must be an object whose 'type' is 'text', 'json_object' or 'json_schema'")


def json_schema(name: str, value: object) -> Constraint:
    """llama.cpp's `json_schema`, and vLLM's structured_outputs.json (an object, or its JSON text)."""
    if isinstance(value, str):
        return Constraint("json_schema", value)
    if not isinstance(value, dict):
        raise invalid(name, f"'{name}' must be a JSON schema (an object)")
    return Constraint("json_schema", json_source(value))


def grammar(name: str, value: object) -> Constraint:
    """llama.cpp's `grammar`: GBNF (or Lark, which llguidance reads natively)."""
    return Constraint("grammar", text(name, value))


def regex(name: str, value: object) -> Constraint:
    return Constraint("regex", text(name, value))


def choice(name: str, value: object) -> Constraint:
    if not isinstance(value, list) or not value or not all(isinstance(item, str) for item in value):
        raise invalid(name, f"'{name}' must be a non-empty list of strings")
    if len(value) > MAX_CHOICES:
        raise invalid(name, f"'{name}' takes at most {MAX_CHOICES} strings, got {len(value)}")
    return Constraint("choice", json.dumps(value))


STRUCTURED_OUTPUTS = {"json": json_schema, "regex": regex, "grammar": grammar, "choice": choice}  # vLLM's names


def structured_outputs(name: str, value: object) -> Constraint:
    """vLLM's {"json" | "regex" | "grammar" | "choice": ...}, one of them."""
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in STRUCTURED_OUTPUTS:
        raise invalid(name, f"'{name}' must be an object with one of: {', '.join(STRUCTURED_OUTPUTS)}")
    key, given = next(iter(value.items()))
    return STRUCTURED_OUTPUTS[key](f"{name}.{key}", given)


# Fields that ask for text of a given shape (OpenAI's, vLLM's, llama.cpp's): a request gives one at most.
CONSTRAINT_FIELDS = {
    "response_format": response_format,
    "structured_outputs": structured_outputs,
    "json_schema": json_schema,
    "grammar": grammar,
}


@dataclass(frozen=True)
class NumericField:
    """A number a request may give to say how tokens are drawn: its range, defaults and help."""

    integer: bool
    range: Range
    default: float | None  # the command line's (`aftgen sample`), which the playground starts from
    request_default: float | None  # what a request that leaves the field out gets
    help: str

    def check(self) -> Callable[[str, object], float]:
        return (integer if self.integer else number)(self.range)


def numeric_fields(options: ServeOptions) -> dict[str, NumericField]:
    """The controls of CONTROLS, then max_tokens (up to this server's limit) and seed: what GET /controls
    describes to the playground, and what a request's values are checked against."""
    controls = {
        name: NumericField(
            control.type is int, control.range, control.default, API_DEFAULTS.get(name, control.default), control.help
        )
        for name, control in CONTROLS.items()
    }
    most = options.max_tokens
    length = min(SamplingOptions.max_new_tokens, most)
    return controls | {
        "max_tokens": NumericField(
            True,
            Range(0, most),
            length,
            most,
            "Tokens of the reply at most (`aftgen sample -n`, -1: no limit; the server: its --max-tokens at most).",
        ),
        "seed": NumericField(True, SEEDS, None, None, "Random seed (none: a random one)."),
    }


def sampling_fields(options: ServeOptions) -> dict[str, Callable[[str, object], object]]:
    """Fields both routes take, with the server's limits."""
    numeric = {name: field.check() for name, field in numeric_fields(options).items()}
    return numeric | {
        "model": text,
        "n": integer(Range(1, options.parallel)),
        "stream": boolean,
        "stream_options": stream_options,
        "stop": stops,
        "session": session_name,
        **CONSTRAINT_FIELDS,
    }


def controls_body(options: ServeOptions) -> dict:
    """GET /controls: each numeric field with its type, range (`high` null: none; each end open or closed) and
    defaults, so that the playground retypes none of them."""
    return {
        "controls": [
            {
                "name": name,
                "type": "integer" if field.integer else "number",
                "help": field.help,
                "default": field.default,
                "request_default": field.request_default,
                "allowed": str(field.range),
                "low": field.range.low,
                "high": field.range.high,
                "open_low": field.range.open_low,
                "open_high": field.range.open_high,
            }  # fmt: skip
            for name, field in numeric_fields(options).items()
        ]
    }


def controls_table(options: ServeOptions) -> str:
    """The numeric fields as docs/reference.md shows them, in Markdown: what /controls says, for people."""
    rows = ["| control | `aftgen sample` | HTTP API | allowed | meaning |", "|---|---|---|---|---|"]
    for name, field in numeric_fields(options).items():
        defaults = ["none" if value is None else f"{value:g}" for value in (field.default, field.request_default)]
        rows.append(f"| `{name}` | {defaults[0]} | {defaults[1]} | {field.range} | {field.help} |")
    return "\n".join(rows) + "\n"


def checked_fields(body: dict, fields: dict[str, Callable[[str, object], object]]) -> dict:
    """Each known field's checked value (null counts as absent); unknown or unsupported fields refused."""
    values = {}
    for name, value in body.items():
        if name in fields:
            if value is not None:
                values[name] = fields[name](name, value)
        elif name in NEUTRAL:
            if value is not None and not any(value == v and type(value) is type(v) for v in NEUTRAL[name]):
                raise invalid(name, f"'{name}' is not supported by aftgen serve (only {NEUTRAL[name][0]!r} or null)")
        elif name not in IGNORED:
            raise invalid(name, f"Unrecognized request argument supplied: {name}")
    return values


def prompt_field(name: str, value: object) -> str | list[int]:
    """A completion's prompt: a string or a list of token ids (or a list holding one of them: several prompts
    take several requests). prompt_ids checks the ids against the vocabulary."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str) or (isinstance(value, list) and all(type(token) is int for token in value)):  # not bool
        return value
    message = (
        f"'{name}' must be a string or a list of token ids (one prompt per request; concurrent requests are batched)"
    )
    raise invalid(name, message)


def content_text(name: str, value: object) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(_is_text_part(part) for part in value):
        raise invalid(name, f"'{name}' must be a string or a list of text parts")
    return "".join(part["text"] for part in value)


def _is_text_part(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def messages(name: str, value: object) -> list[tuple[str, str]]:
    """Chat messages as (role, content) pairs."""
    if not isinstance(value, list) or not value or len(value) > MAX_MESSAGES:
        raise invalid(name, f"'{name}' must be a list of 1 to {MAX_MESSAGES} messages")
    pairs = []
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, f"'{where}' must be an object with 'role' and 'content'")
        unknown = sorted(set(message) - {"role", "content", "name"})
        if unknown:
            raise invalid(f"{where}.{unknown[0]}", f"Unrecognized argument in '{where}': {unknown[0]}")
        if message.get("role") not in ROLES:
            raise invalid(f"{where}.role", f"'{where}.role' must be one of: {', '.join(ROLES)}")
        pairs.append((message["role"], content_text(f"{where}.content", message.get("content"))))
    return pairs


def unencodable(body: dict) -> str | None:
    """Where the body holds text that is not Unicode (a lone surrogate such as "\\ud800", which JSON can
    spell but UTF-8 cannot), as a field path like `messages[0].content`; None if nowhere. A list's items
    get a path only where one is wrong or holds more: a prompt of 300,000 token ids is one pass."""
    pending: list[tuple[str, object]] = [("", body)]
    while pending:
        where, value = pending.pop()
        if isinstance(value, str) and not _encodes(value):
            return where
        if isinstance(value, dict):
            for key, item in value.items():
                path = f"{where}.{key}" if where else key
                if not _encodes(key):
                    return path.encode("utf-8", "backslashreplace").decode()
                pending.append((path, item))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, (str, dict, list)) and (not isinstance(item, str) or not _encodes(item)):
                    pending.append((f"{where}[{i}]", item))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def prompt_ids(values: dict, chat: bool, tokenizer: Tokenizer, limit: int) -> list[int]:
    """The prompt's token ids, refusing one over `limit` tokens (BOS included); one whose bytes alone
    show it cannot fit is refused before it is tokenized (no token stands for more than `longest_piece`)."""
    param = "messages" if chat else "prompt"
    if not chat and isinstance(values["prompt"], list):
        return given_ids(values["prompt"], tokenizer, limit)
    texts = [message_text(role, content) for role, content in values["messages"]] if chat else [values["prompt"]]
    at_least = sum(-(-len(text.encode("utf-8")) // tokenizer.longest_piece) for text in texts) + 1  # + BOS
    if at_least > limit:
        message = f"the prompt is at least {at_least} tokens, more than this server's limit of {limit}"
        raise APIError(400, message, param=param, code="context_length_exceeded")
    ids = chat_ids(tokenizer, values["messages"]) if chat else tokenizer.encode(values["prompt"])
    return within_limit(param, ids, tokenizer, limit)


def within_limit(param: str, ids: list[int], tokenizer: Tokenizer, limit: int) -> list[int]:
    """`ids`, refused where they are more than `limit` tokens as read (BOS included)."""
    count = len(opening(tokenizer, ids, None))
    if count > limit:
        message = f"the prompt is {count} tokens, more than this server's limit of {limit}"
        raise APIError(400, message, param=param, code="context_length_exceeded")
    return ids


def given_ids(ids: list[int], tokenizer: Tokenizer, limit: int) -> list[int]:
    """A prompt given as token ids, refusing one over `limit` tokens (before its ids are walked) or outside the
    vocabulary."""
    within_limit("prompt", ids, tokenizer, limit)
    vocabulary = Range(0, tokenizer.vocab_size, open_high=True)
    outside = next((i for i, token in enumerate(ids) if token not in vocabulary), None)
    if outside is not None:
        raise invalid("prompt", f"'prompt[{outside}]' must be a token id {vocabulary}, got {ids[outside]}")
    return ids


def echo_within_limit(n: int, tokens: int, alternatives: int, limit: int) -> None:
    """Refuse an echo whose scores (each choice's copy of each prompt token's, with its alternatives) would make a
    reply past `limit` scores: the reply is built and held whole, on the HTTP side's one thread."""
    count = n * tokens * (1 + alternatives)
    if count > limit:
        message = (
            f"'echo' with 'logprobs': {alternatives} on {tokens} prompt tokens and 'n': {n} makes {count} scores, more "
            f"than this server's limit of {limit}: ask for fewer choices or alternatives, or send a shorter prompt"
        )
        raise APIError(400, message, param="echo", code="reply_too_large")


def logprobs_asked(values: dict, chat: bool) -> int | None:
    """How many alternatives each token's score comes with (None: no scores): completions' `logprobs: N`, chat's
    `logprobs: true` with `top_logprobs: N`."""
    if not chat:
        return values.get("logprobs")
    if values.get("top_logprobs", 0) > 0 and not values.get("logprobs"):
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return values.get("top_logprobs", 0) if values.get("logprobs") else None


def checked_request(body: dict, fields: dict[str, Callable[[str, object], object]], model_name: str) -> dict:
    """The checks every route makes of its body: Unicode text, each field (checked_fields), the served model."""
    where = unencodable(body)
    if where is not None:
        raise invalid(where, f"'{where}' holds a lone surrogate (such as \\ud800): it is not valid Unicode text")
    values = checked_fields(body, fields)
    if values.get("model", model_name) != model_name:
        message = f"The model '{values['model']}' does not exist; this server serves '{model_name}'"
        raise APIError(404, message, param="model", code="model_not_found")
    return values


def parse_request(body: dict, chat: bool, options: ServeOptions, tokenizer: Tokenizer, model_name: str) -> Request:
    """Check a /v1/completions (chat=False) or /v1/chat/completions body; raises APIError."""
    if chat:
        fields = {
            "messages": messages,
            "max_completion_tokens": integer(Range(0, options.max_tokens)),
            "logprobs": boolean,
            "top_logprobs": integer(LOGPROBS),
        }
    else:
        fields = {"prompt": prompt_field, "logprobs": integer(LOGPROBS), "echo": boolean}
    values = checked_request(body, sampling_fields(options) | fields, model_name)
    required = "messages" if chat else "prompt"
    if required not in values:
        raise invalid(required, f"'{required}' is required")
    if "stream_options" in values and not values.get("stream"):
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    if "max_tokens" in values and "max_completion_tokens" in values:
        raise invalid("max_tokens", "give 'max_tokens' or 'max_completion_tokens', not both")
    if values.get("session") is not None and values.get("n", 1) > 1:
        raise invalid("n", "a session continues one conversation: 'n' must be 1 with 'session'")
    if values.get("echo") and values.get("session") is not None:
        raise invalid("echo", "'echo' scores a prompt from its start: a session continues one, so not with 'session'")
    ids = prompt_ids(values, chat, tokenizer, options.max_prompt_tokens)
    given = {name: values[name] for name in CONTROLS if name in values}
    shaped = [name for name in CONSTRAINT_FIELDS if values.get(name) is not None]
    if len(shaped) > 1:
        raise invalid(shaped[1], f"give one of {', '.join(CONSTRAINT_FIELDS)} at most, not {' and '.join(shaped)}")
    sampling = SamplingOptions(
        max_new_tokens=values.get("max_tokens", values.get("max_completion_tokens", options.max_tokens)),
        seed=values.get("seed"),
        stop=values.get("stop", (REPLY_END,) if chat else ()),
        constraint=values[shaped[0]] if shaped else None,
        **API_DEFAULTS | given,
    )
    scores = {"logprobs": logprobs_asked(values, chat), "echo": values.get("echo", False)}
    if scores["echo"] and scores["logprobs"] is not None:
        echo_within_limit(values.get("n", 1), len(ids), scores["logprobs"], options.max_echo_scores)
    work = Work(ids, sampling, values.get("n", 1), values.get("session"), REPLY_END if chat else None, **scores)
    work.constraint_field = shaped[0] if shaped else None
    stream, usage = values.get("stream", False), values.get("stream_options", False)
    return Request(work, chat, stream, usage)

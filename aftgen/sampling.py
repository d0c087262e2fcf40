"""Generation: the prompt read in the parallel form, then one recurrent step per token.

Sampling controls follow llama.cpp / transformers meanings: temperature (0 = greedy), top-k,
top-p (nucleus), min-p, repeat penalty over the last n tokens, stop strings.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from aftgen import cores, rowdot
from aftgen.constraints import Constraint, Matcher, compiled, masked
from aftgen.corpus.encode import chunks
from aftgen.errors import AftgenError
from aftgen.model import AFTLM, ModelState, PrefillFunction, StepFunction, clone_state
from aftgen.options import Range, flag
from aftgen.tokenizer import Tokenizer

MAX_REPEAT_LAST_N = 1024  # a context keeps this many recent tokens for the repeat penalty, so its size is fixed
# Below this temperature sampling is greedy: a lower one only splits logits closer than a thousandth, and
# dividing by it overflows float32 long before it reaches Python's smallest floats.
GREEDY_BELOW = 1e-4
# A prompt is read in pieces of this many tokens from its own start (the last piece: what is left), whoever reads
# it: `aftgen sample`, `chat`, `prime` and a server at its default --prompt-chunk. The parallel form does not round
# alike however a text is cut (its products run with M = the piece's length, its chunked scan restarts at each
# piece), so pieces fixed by the prompt alone give the same state and logits, bit for bit, alone, beside other
# prompts being read, after a prefix cache's hit, and in `aftgen sample`. 256: a server's pause between two steps
# while it reads (the pieces are its turns' reading), and long texts still go in constant memory.
PROMPT_CHUNK = 256
# A prompt's text is encoded this many characters at a time, cut before a space that follows a non-space, where no
# token straddles the cut (aftgen.corpus.encode.chunks), so that a text of any length is read in constant memory
# into the context its whole text gives. Only a run of more than half this many characters without such a space is
# cut where it must be; its ids may then differ from the whole text's, though they still decode to it.
TEXT_CHUNK = 1 << 20


SEEDS = Range(0, (1 << 63) - 1)  # a seed torch.Generator.manual_seed takes as it is given

Filter = Callable[..., torch.Tensor]  # (B, V) logits, each row's value (B, 1)[, its recent tokens (B, V)] -> logits


@dataclass(frozen=True)
class Control:
    """A sampling control: its default (whose type is the control's), range and help, and its filter.

    `aftgen sample` and `aftgen chat` take each one in CONTROLS as an option, the server as a request
    field, SamplingOptions as a field of its own. The engine draws every row of its batch in one pass, so a filter
    takes the logits (B, V) and each row's value (B, 1), and returns logits (tokens ruled out: -inf).
    """

    default: float
    range: Range
    help: str
    filter: Filter | None = None  # None: a setting another control's filter reads (see `history`)
    # A value at which the filter leaves a row exactly as it is: a batch whose rows all have it skips the
    # filter, and a row that has it is filtered beside the others unchanged (None: the filter always runs).
    neutral: float | None = None
    # The control that says how many of a row's recent tokens this filter reads: the filter then takes a
    # third argument, (B, V) True where the token is among them. Such filters run first, on the model's
    # scores, and a greedy row picks from what they leave.
    history: str | None = None

    @property
    def type(self) -> type:
        return type(self.default)


def divide_by_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    # Less the top logit first (softmax does not mind): a small temperature then sends the others to -inf,
    # never to +inf. A greedy row (below GREEDY_BELOW) is divided too, beside the others, but by
    # GREEDY_BELOW: choose() takes its argmax, and its scores here only must not overflow.
    logits = logits.float()
    return (logits - logits.amax(-1, keepdim=True)) / temperature.clamp(min=GREEDY_BELOW)


def keep_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    top_k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # 0: off
    order = logits.argsort(dim=-1, descending=True, stable=True)  # exactly k, ties to the lower id
    drop_sorted = torch.arange(vocab, device=logits.device) >= top_k
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def keep_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1, stable=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    # Keep the smallest set whose probability reaches top_p: a token goes if the ones before it already do.
    # The likeliest always stays, even for a top_p that float32 rounds to 0; at 1 every token stays, even
    # where the sum before the last rounds up to 1.
    before = torch.cat([torch.full_like(cumulative[..., :1], -1.0), cumulative[..., :-1]], dim=-1)
    drop_sorted = (before >= top_p) & (top_p < 1.0)
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def keep_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))


def apply_repeat_penalty(logits: torch.Tensor, penalty: torch.Tensor, recent: torch.Tensor) -> torch.Tensor:
    """CTRL's penalty, as llama.cpp applies it: divide positive logits of recent tokens, multiply negative ones.
    recent: (B, V) True where the token is among the row's recent ones (each counted once)."""
    return torch.where(recent, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


# Every sampling control, by name; the filters run in this order (temperature first), those that read a
# row's history before the others.
CONTROLS: dict[str, Control] = {
    "temperature": Control(0.8, Range(0, 2), f"0 (or below {GREEDY_BELOW:g}): greedy.", divide_by_temperature),
    "top_k": Control(0, Range(0), "Keep the k likeliest tokens (0: off).", keep_top_k, neutral=0),
    "top_p": Control(1.0, Range(0, 1, open_low=True), "Keep the smallest set reaching p.", keep_top_p, neutral=1.0),
    "min_p": Control(
        0.0, Range(0, 1, open_high=True), "Drop tokens below min_p x the top probability.", keep_min_p, neutral=0.0
    ),
    "repeat_penalty": Control(  # 1e-4 already makes a recent token all but certain; below, logits only overflow
        1.0,
        Range(1e-4, 100),
        "Divide recent tokens' positive logits by this (1: off).",
        apply_repeat_penalty,
        neutral=1.0,
        history="repeat_last_n",
    ),
    "repeat_last_n": Control(64, Range(0, MAX_REPEAT_LAST_N), "How many recent tokens the penalty covers."),
}
# Where the HTTP API's default differs from the command line's: the server speaks OpenAI's API, whose clients
# expect OpenAI's defaults (temperature 1), while `aftgen sample` and `chat` keep llama.cpp's (0.8).
API_DEFAULTS = {"temperature": 1.0}


def check_seed(seed: int | None) -> None:
    """Refuse a seed outside SEEDS (None: a random one)."""
    if seed is not None and seed not in SEEDS:
        raise AftgenError(f"--seed must be {SEEDS}, got {seed}")


@dataclass
class SamplingOptions:
    """How to pick tokens (llama.cpp / transformers names and meanings), and how many continuations.

    Each control in CONTROLS is a field of the same name, type and default (tests/test_sampling.py holds
    the two together): a control added to CONTROLS gets its field here too.
    """

    max_new_tokens: int = 200  # -1: until stopped
    seed: int | None = None
    stop: tuple[str, ...] = ()
    num_samples: int = 1  # continuations of one prompt
    temperature: float = CONTROLS["temperature"].default
    top_k: int = CONTROLS["top_k"].default
    top_p: float = CONTROLS["top_p"].default
    min_p: float = CONTROLS["min_p"].default
    repeat_penalty: float = CONTROLS["repeat_penalty"].default
    repeat_last_n: int = CONTROLS["repeat_last_n"].default
    constraint: Constraint | None = None  # what the text must be: a JSON schema, a regex, ... (aftgen.constraints)

    def check(self) -> None:
        """Refuse values outside their meaning, before any work."""
        if self.max_new_tokens < -1:
            raise AftgenError(f"--max-new-tokens must be -1 (no limit) or >= 0, got {self.max_new_tokens}")
        check_seed(self.seed)
        for name, control in CONTROLS.items():
            if getattr(self, name) not in control.range:
                raise AftgenError(f"{flag(name)} must be {control.range}, got {getattr(self, name)}")
        if self.num_samples < 1:
            raise AftgenError(f"--num-samples must be >= 1, got {self.num_samples}")
        if any(not s for s in self.stop):
            raise AftgenError("--stop strings must not be empty")


def filter_logits(logits: torch.Tensor, options: SamplingOptions | Sequence[SamplingOptions]) -> torch.Tensor:
    """The filters that read no history (temperature, top-k, top-p, min-p) in turn, each row with its own
    options (one for all the rows, or one per row): tokens ruled out get -inf. logits: (B, V)."""
    rows = _per_row(options, logits.shape[0])
    return _filtered(logits, rows, [name for name, control in CONTROLS.items() if control.history is None])


def _per_row(given: object, count: int) -> list:
    """One per row: `given` for every row, or `given` itself where it already is a sequence."""
    return list(given) if isinstance(given, Sequence) else [given] * count


def _filtered(
    logits: torch.Tensor, rows: list[SamplingOptions], names: list[str], history: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """The named controls' filters in turn, each row with its own value; one whose rows are all at its
    neutral value is skipped."""
    for name in names:
        control = CONTROLS[name]
        values = [getattr(row, name) for row in rows]
        if control.filter is None or (control.neutral is not None and all(v == control.neutral for v in values)):
            continue
        column = torch.tensor([[float(value)] for value in values], device=logits.device)
        if control.history is None:
            logits = control.filter(logits, column)
        else:
            lengths = [int(getattr(row, control.history)) for row in rows]
            logits = control.filter(logits, column, recent_tokens(history, lengths, logits.shape[-1], logits.device))
    return logits


def recent_tokens(
    history: Sequence[torch.Tensor], lengths: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """(B, vocab): True where a token is among its row's last `lengths[row]` ids (history: a tensor of ids a row)."""
    recent = torch.zeros(len(lengths), vocab, dtype=torch.bool)
    for row, ids, length in zip(recent, history, lengths, strict=True):
        if length:
            row[ids.reshape(-1)[-length:]] = True
    return recent.to(device)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each token's log-probability (T,) under its row of logits (T, V), float32: the model's distribution before
    any sampling filter, as OpenAI and vLLM report it. `aftgen eval` sums these, the server echoes them."""
    return chosen(logits.float().log_softmax(-1), tokens)


def chosen(logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logprobs.gather(-1, tokens[:, None].to(logprobs.device))[:, 0]


def token_scores(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[tuple[int, str]]:
    """Each token's (id, score record) under its row of logits (T, V): its log-probability (token_logprobs'
    figure) and the `top` likeliest tokens', likeliest first, packed for the trip to the replies (read_score)."""
    count = min(top, logits.shape[-1])
    packed = rowdot.top_scores(logits, tokens, count) if logits.device.type == "cpu" else None
    if packed is None:  # a GPU's logits, no C++ compiler here, or more alternatives than the kernel keeps
        packed = top_scores_in_torch(logits.float().log_softmax(-1), tokens, count)
    # one call for the step, cut into rows: a call a row costs the engine twice that
    text = packed.numpy().astype("<i4", copy=False).tobytes().hex()
    width = 8 * packed.shape[1]
    return list(zip(tokens.tolist(), [text[at : at + width] for at in range(0, len(text), width)], strict=True))


def top_scores_in_torch(logprobs: torch.Tensor, tokens: torch.Tensor, count: int) -> torch.Tensor:
    """rowdot.top_scores's packing (T, 1 + 2 count) int32 on the CPU, from logprobs (T, V) on any device; among
    equal figures, in torch.topk's order (a stable sort, which would keep top_scores's, costs a CPU 30 times as
    much)."""
    best = logprobs.topk(count, -1)
    figures = torch.cat([chosen(logprobs, tokens)[:, None], best.values], 1)  # (T, 1 + count) float32
    return torch.cat([figures.view(torch.int32), best.indices.int()], 1).cpu()


# A score record is the hex of little-endian float32 [the token's log-probability, the alternatives'] and int32
# [the alternatives' ids]: a server writes one a token from the engine's process and reads it in the HTTP one,
# where numbers in JSON (six floats and five ints for `logprobs: 5`) cost the engine, which sets the pace,
# a tenth of its time; a record costs it one string. The HTTP side, with time to spare, reads them.
NO_SCORE = ""  # the record of a token nothing predicts (a context's first)


def read_score(record: str, top: int) -> tuple[float | None, tuple[int, ...], tuple[float, ...]]:
    """A score record's log-probability and its at most `top` likeliest tokens' (ids, log-probabilities), likeliest
    first; (None, (), ()) for NO_SCORE."""
    if record == NO_SCORE:
        return None, (), ()
    count = (len(record) // 8 - 1) // 2
    numbers = _record_layout(count).unpack(bytes.fromhex(record))
    return numbers[0], numbers[1 + count : 1 + count + top], numbers[1 : 1 + min(count, top)]


@functools.cache
def _record_layout(count: int) -> struct.Struct:
    return struct.Struct(f"<{1 + count}f{count}i")


class ScoresNotFinite(AftgenError):
    """Some rows' logits are NaN or +inf (or all -inf): no token can be drawn from them. `rows`: which."""

    def __init__(self, rows: list[int]):
        super().__init__(
            "the model's scores for the next token are NaN or infinite, so no token can be drawn: its weights "
            "or the state it continues are damaged (use another checkpoint or state file)"
        )
        self.rows = rows


def choose(
    logits: torch.Tensor,
    options: SamplingOptions | Sequence[SamplingOptions],
    history: Sequence[torch.Tensor],
    generator: torch.Generator | Sequence[torch.Generator],
) -> torch.Tensor:
    """The next token for each row of logits (B, V), every row in one pass with its own options and its own
    recent ids (`history`: a (B, n) tensor, or one tensor of ids per row, oldest first).

    `options` and `generator`: one for all the rows, or one per row. Each row draws from its generator
    exactly what it would draw alone, so a server's sequence follows its own seed whatever runs beside it;
    a greedy row draws nothing. Raises ScoresNotFinite, naming the rows, before any generator draws.
    """
    count = logits.shape[0]
    rows, generators = _per_row(options, count), _per_row(generator, count)
    reading = [name for name, control in CONTROLS.items() if control.history is not None]
    scores = _filtered(logits.float(), rows, reading, history)
    unusable = ~torch.isfinite(scores.amax(-1))  # the top is NaN if any is, +inf if any is, -inf if all are
    if unusable.any():
        raise ScoresNotFinite(unusable.nonzero()[:, 0].tolist())
    greedy = [row.temperature < GREEDY_BELOW for row in rows]
    if all(greedy):
        return scores.argmax(-1)
    probs = filter_logits(scores, rows).softmax(-1)
    drawn = draw(probs, [None if g else generator for g, generator in zip(greedy, generators, strict=True)])
    if any(greedy):
        drawn = torch.where(torch.tensor(greedy, device=drawn.device), scores.argmax(-1), drawn)
    return drawn


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs (B, V): the first whose cumulative probability passes u * total, with u
    uniform in [0, 1) from the row's generator (None: the row draws nothing, and its token means nothing).

    One number a row a token, and one pass for all the rows (llama.cpp draws the same way). The sums run
    along each row alone, in float64, so a row draws the same beside any others. The generators are CPU
    ones, whatever the device: a seed then draws the same on any.
    """
    uniform = torch.zeros(probs.shape[0], 1, dtype=torch.float64)
    for row, generator in zip(uniform, generators, strict=True):
        if generator is not None:
            row.uniform_(generator=generator)
    cumulative = probs.double().cumsum(-1)
    total = cumulative[:, -1:].contiguous()
    # u * total rounds to total for the largest u: the last token with any probability then
    last = torch.searchsorted(cumulative, total)
    return torch.searchsorted(cumulative, uniform.to(probs.device) * total, right=True).minimum(last)[:, 0]


class StopFilter:
    """Holds back text that might be the start of a stop string; ends output before a stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        hold = max((n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0)
        out, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold :]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Context:
    """Where a generation stands: enough to continue it exactly, and nothing that grows with its length."""

    state: ModelState
    logits: torch.Tensor  # (1, vocab): scores for the next token
    generator: torch.Generator
    recent: torch.Tensor = field(
        default_factory=lambda: torch.zeros(1, 0, dtype=torch.long)
    )  # last ids, for the repeat penalty (read them through history(): the newest may wait in `arrived`)
    pending: bytes = b""  # the start of a character the last token left unfinished
    arrived: list[int] = field(default_factory=list)  # ids remembered since `recent` was last brought up to date

    def remember(self, ids: Sequence[int]) -> None:
        # A list append per token: the tensor is made only where it is read (a repeat penalty, a state file).
        self.arrived.extend(ids)
        if len(self.arrived) >= MAX_REPEAT_LAST_N:
            self.history()

    def history(self) -> torch.Tensor:
        """The last MAX_REPEAT_LAST_N ids at most, (1, n), oldest first."""
        if self.arrived:
            arrived = torch.tensor([self.arrived], dtype=torch.long)
            self.recent, self.arrived = torch.cat([self.recent, arrived], dim=1)[:, -MAX_REPEAT_LAST_N:], []
        return self.recent

    def fork(self, generator: torch.Generator | None = None) -> Context:
        """An independent copy drawing from `generator`, or sharing this one's (so forks draw different samples)."""
        generator = generator or self.generator
        return Context(clone_state(self.state), self.logits.clone(), generator, self.history().clone(), self.pending)


def new_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()  # nondeterministic
    else:
        generator.manual_seed(seed)
    return generator


class PromptReader:
    """Token ids read into a context in the parallel form, in pieces of `piece` ids from their start (PROMPT_CHUNK's
    comment says why; constant memory). A fresh context starts from the model's initial state with a generator
    seeded with `seed` (random if None); a continued one keeps its own generator unless a seed is given.
    `read_prompt` reads a whole prompt at once, the server some pieces a turn between its batched steps. Run it
    under torch.inference_mode(), as generation runs.
    """

    def __init__(
        self,
        model: AFTLM,
        ids: list[int],
        context: Context | None = None,
        seed: int | None = None,
        prefill: PrefillFunction | None = None,
        score: int | None = None,
        piece: int | None = None,
        mark: bool = False,
    ):
        """`score`: keep each id's score (token_scores, with this many alternatives) in `scores`, reading every
        position's logits (slower: only where asked); a fresh context's first id, which nothing predicts, has none.
        `piece`: ids a piece (None: PROMPT_CHUNK). `mark`: keep a copy of the state where a last piece shorter than
        `piece` starts, in `last_start` (a server caches it: a longer prompt continues from there in its own pieces)."""
        if context is None:
            context = Context(model.initial_state(1), torch.zeros(1, model.config.vocab_size), new_generator(seed))
        elif seed is not None:
            context.generator.manual_seed(seed)
        self.model, self.ids, self.context, self.prefill = model, ids, context, prefill
        self.unread, self.score, self.piece, self.mark = len(ids), score, piece or PROMPT_CHUNK, mark
        self.scores: list[tuple[int, str]] = []  # (id, score record)
        self.last_start: tuple[int, ModelState, torch.Tensor] | None = None  # (ids read, state, logits), with `mark`

    @property
    def done(self) -> bool:
        return self.unread == 0

    def skip(self, state: ModelState, logits: torch.Tensor, count: int) -> None:
        """Go on from a state that has already read the first `count` ids (a prefix cache's), with its logits:
        a piece's end or all of them, so that the rest is read in the pieces it would be read in from the start."""
        self.context.state, self.context.logits, self.unread = state, logits, len(self.ids) - count

    def read(self, budget: int | None = None) -> int:
        """Read whole pieces until `budget` ids are read or none are left (None: every one); returns how many were
        read, past `budget` where a piece ends beyond it. `prefill` (from compile_prefill, for `piece` ids) reads
        the whole pieces, `model.prefill` the last, shorter one."""
        count = 0
        while self.unread and (budget is None or count < budget):
            count += self._read_piece()
        return count

    def _read_piece(self) -> int:
        start = len(self.ids) - self.unread
        end = min(len(self.ids), (start // self.piece + 1) * self.piece)
        if self.mark and end - start < self.piece and start > 0:
            self.last_start = start, clone_state(self.context.state), self.context.logits.clone()
        ids = torch.tensor([self.ids[start:end]], dtype=torch.long)
        read = self.prefill if self.prefill is not None and ids.shape[1] == self.piece else self.model.prefill
        logits, self.context.state = read(ids, self.context.state, last_only=self.score is None)
        if self.score is not None:
            self._keep_scores(ids[0], logits[0])
        self.context.logits = logits[:, -1].float()
        self.unread = len(self.ids) - end
        return end - start

    def _keep_scores(self, ids: torch.Tensor, logits: torch.Tensor) -> None:
        """The scores of `ids`, read now, whose logits (T, V) predict each one's next id."""
        if self.scores:  # the last chunk's logits predict this one's first id
            predicting = torch.cat([self.context.logits.to(logits.dtype), logits[:-1]])
        else:
            predicting, ids = logits[:-1], ids[1:]
            self.scores.append((int(self.ids[0]), NO_SCORE))
        self.scores += token_scores(predicting, ids, self.score)

    def finish(self) -> Context:
        """The context once every id is read: its last ids remembered for the repeat penalty, and a
        character an earlier run left unfinished abandoned (reading nothing leaves both as they were)."""
        if self.ids:
            self.context.remember(self.ids[-MAX_REPEAT_LAST_N:])
            self.context.pending = b""
        return self.context


def opening(tokenizer: Tokenizer, ids: list[int], context: Context | None) -> list[int]:
    """What a prompt's ids read into `context`: BOS first when there is none yet (a fresh context), unless the
    ids begin with it (a client that sends token ids may give it)."""
    return ids if context is not None or ids[:1] == [tokenizer.bos_id] else [tokenizer.bos_id, *ids]


@torch.inference_mode()
def read_prompt(
    model: AFTLM,
    tokenizer: Tokenizer,
    prompt: str | Iterable[str],
    context: Context | None = None,
    seed: int | None = None,
    prefill: PrefillFunction | None = None,
) -> Context:
    """Read text into a context (a fresh one, with BOS, if None): see PromptReader. `prompt`: the text, or its blocks
    in order (a file's, as read), encoded TEXT_CHUNK characters at a time and read a whole number of pieces at a time,
    so that neither its text nor its ids are ever held whole."""
    ids = opening(tokenizer, [], context)
    for text in chunks([prompt] if isinstance(prompt, str) else prompt, TEXT_CHUNK):
        ids += tokenizer.encode(text)
        if whole := len(ids) - len(ids) % PROMPT_CHUNK:  # the pieces fall where they would in the whole prompt
            context, seed, ids = _read_ids(model, ids[:whole], context, seed, prefill), None, ids[whole:]
    return _read_ids(model, ids, context, seed, prefill)


def _read_ids(
    model: AFTLM, ids: list[int], context: Context | None, seed: int | None, prefill: PrefillFunction | None
) -> Context:
    reader = PromptReader(model, ids, context, seed, prefill)
    reader.read()
    return reader.finish()


class TextStream:
    """One generation's tokens in, its text out: whole characters only, ending after max_new_tokens or
    before a stop string. `generate` drives one; a server drives many, stepping them as one batch.

    The caller asks `next_token()`, runs the model on it and hands the new logits to `accept`, which
    reads the token into the context before returning its text, so the context is consistent between
    any two calls.
    """

    def __init__(self, tokenizer: Tokenizer, context: Context, options: SamplingOptions, constraint: object = None):
        """`constraint`: options.constraint as constraints.compiled gave it, where the caller has it (a server
        compiles it before the request is admitted); else it is compiled here."""
        self.context, self.options = context, options
        self.decoder, self.stops = tokenizer.stream_decoder(), StopFilter(options.stop)
        self.matcher = None
        if options.constraint is not None:
            self.matcher = Matcher(constraint or compiled(options.constraint, tokenizer))
        self.produced = 0
        self.decoded = 0  # characters decoded so far, stop strings or not: where the next token's text starts

    def begin(self) -> str:
        """Text of a character an earlier run left unfinished (context.pending), now that it goes on."""
        self.context.pending, pending = b"", self.context.pending
        return self._shown(self.decoder.feed_bytes(pending))

    @property
    def stopped(self) -> bool:
        """Ended before the token limit: at a stop string, or with its constraint's text complete."""
        return self.stops.stopped or (self.matcher is not None and self.matcher.finished)

    @property
    def done(self) -> bool:
        limit = self.options.max_new_tokens
        return self.stopped or 0 <= limit <= self.produced

    def next_token(self) -> torch.Tensor:
        return next_tokens([self])

    def accept(self, token: int, logits: torch.Tensor) -> str:
        """Read `token` into the context, with the logits (1, vocab) the model gave after it."""
        self.produced += 1
        self.context.logits = logits
        self.context.remember((token,))
        if self.matcher is not None:
            self.matcher.advance(token)
        return self._shown(self.decoder.feed(token))

    def _shown(self, decoded: str) -> str:
        self.decoded += len(decoded)
        return self.stops.feed(decoded)

    def end(self, final: bool = True) -> str:
        """The text held back at the end. With final=False the run is to be continued later: a character
        the last token left unfinished stays in context.pending instead of becoming U+FFFD."""
        if self.stops.stopped:
            return ""
        if final:
            tail = self.decoder.flush()
        else:
            tail, self.context.pending = "", self.decoder.pending()
        return self.stops.feed(tail) + ("" if self.stops.stopped else self.stops.flush())


class Histories(Sequence):
    """Each context's recent ids, (1, n) each, made only where a filter reads them (Context.history)."""

    def __init__(self, contexts: Sequence[Context]):
        self.contexts = contexts

    def __len__(self) -> int:
        return len(self.contexts)

    def __getitem__(self, row: int) -> torch.Tensor:
        return self.contexts[row].history()


def next_tokens(streams: Sequence[TextStream], logits: torch.Tensor | None = None) -> torch.Tensor:
    """Each stream's next token (B,), drawn together in one pass, each from its own options, recent
    tokens and generator (see choose): ScoresNotFinite names streams by their index. `logits`: the streams'
    contexts' logits as one (B, vocab) tensor, where the caller has them so (a batch's step gives them)."""
    contexts = [stream.context for stream in streams]
    logits = torch.cat([context.logits for context in contexts]) if logits is None else logits
    return choose(
        masked(logits, [stream.matcher for stream in streams]),  # constrained rows' ruled-out tokens: -inf
        [stream.options for stream in streams],
        Histories(contexts),
        [context.generator for context in contexts],
    )


@torch.inference_mode()
def generate(
    model: AFTLM,
    tokenizer: Tokenizer,
    context: Context,
    options: SamplingOptions,
    step: StepFunction | None = None,
    final: bool = True,
) -> Iterator[str]:
    """Stream text from a context, advancing it in place; `step` defaults to `model.step`.

    Yields only whole characters; ends after max_new_tokens or before a stop string. Each token is
    read into the context before its text is yielded, so leaving the loop at any point (Ctrl-C in
    chat) leaves a consistent context. With final=False the run is to be continued later (see TextStream.end).
    """
    step = step or model.step
    stream = TextStream(tokenizer, context, options)
    carried = stream.begin()
    if carried:
        yield carried
    while not stream.done:
        token = stream.next_token()
        logits, _ = step(token, context.state)
        text = stream.accept(int(token), logits)
        cores.adapt()
        if text:
            yield text
    if not stream.stops.stopped:  # a complete constraint's text may still be held back for a stop string
        yield stream.end(final)


def sample_text(
    model: AFTLM,
    tokenizer: Tokenizer,
    context: Context,
    options: SamplingOptions,
    step: StepFunction | None = None,
    final: bool = True,
) -> Iterator[Iterator[str]]:
    """`options.num_samples` continuations of one context (a prompt read once by `read_prompt`, its state shared).

    One sample advances `context` itself (so the caller can save it); several each start from a copy.
    """
    options.check()
    several = options.num_samples > 1
    for _ in range(options.num_samples):
        yield generate(model, tokenizer, context.fork() if several else context, options, step, final)

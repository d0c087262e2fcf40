"""Reading a prompt into a context in the parallel form, in pieces fixed by the prompt alone (PromptReader,
read_prompt), and what a prompt's ids read (opening)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from aftgen.corpus.encode import chunks
from aftgen.generation.context import MAX_REPEAT_LAST_N, Context
from aftgen.generation.drawing import new_generator
from aftgen.generation.scores import NO_SCORES, token_scores
from aftgen.model import AFTLM, ModelState, PrefillFunction, clone_state
from aftgen.tokenizer import Tokenizer

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
            self.scores.append((int(self.ids[0]), NO_SCORES))
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

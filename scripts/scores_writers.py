"""The `logprobs` JSON of a turn's tokens written three ways, side by side (issue 57): by the native library
(aftgen/native/scores_json.cpp, the server's default), by aftgen.serve.replies's Python writer, and by msgspec from
the values (no JSON written by hand).

    python scripts/scores_writers.py micro [--repeats 2000]
    python scripts/scores_writers.py bench native|python|msgspec [aftgen bench serve's options]

`micro`: each writer's time a token over a turn's events (32 rows of one token each, `logprobs: 5`, completions'
shape and chat's), with the shipped model's tokenizer, alone in this process; first it checks that the three
give a client the same values.
`bench`: `aftgen bench serve` whose server writes `logprobs` with that writer. The bench starts its server as
`python -m aftgen serve ...`; this script starts it as `python scripts/scores_writers.py serve WRITER ...` instead,
which puts the writer in aftgen.serve.replies (the server's HTTP side writes the JSON) and runs `aftgen serve`.
Nothing in aftgen changes: a plain server writes with the native library where it can be had.

msgspec writes a figure as the shortest text of the float32 figure made a Python float (exact, up to 17 digits:
-1.2345678806304932), where the other two write `%.9g` (-1.23456788), which gives the same float32 back; and it
writes a token's text in UTF-8 where they escape what is not ASCII (`\\u00e9`). A client reads the same values.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import torch

from aftgen.api import load
from aftgen.cli import run
from aftgen.generation.scores import read_scores, token_scores
from aftgen.serve import replies
from aftgen.serve.replies import ScoresWriter, chat_logprobs, completions_logprobs
from aftgen.tokenizer import Tokenizer

ROWS, TOP = 32, 5  # a turn of 32 streams, each with one new token and `logprobs: 5`


class Alternative(msgspec.Struct):
    """One of chat's `top_logprobs`."""

    token: str
    bytes: list[int]
    logprob: float


class Entry(msgspec.Struct):
    """Chat's entry of a token."""

    token: str
    bytes: list[int]
    logprob: float | None
    top_logprobs: list[Alternative]


class MsgspecScoresWriter(ScoresWriter):
    """ScoresWriter's Python path with each token's JSON encoded by msgspec from the token's text, bytes and
    figures."""

    def __init__(self, tokenizer: Tokenizer):
        super().__init__(tokenizer, native=False)
        self.texts = [tokenizer.token_text(token) for token in range(tokenizer.vocab_size)]
        self.bytes = [list(tokenizer.token_bytes(token)) for token in range(tokenizer.vocab_size)]
        self.encode = msgspec.json.Encoder().encode

    def _json(self, chat: bool, top: int, token: int, record: str) -> tuple[str, ...]:
        logprob, ids, values = read_scores(record, top)
        if not all(0 <= other < len(self.texts) for other in (token, *ids)):  # as ScoresWriter refuses them
            raise ValueError(f"a score record names a token outside the vocabulary of {len(self.texts)}")
        if chat:
            alternatives = [Alternative(self.texts[other], self.bytes[other], value)
                            for other, value in zip(ids, values, strict=True)]  # fmt: skip
            return (self.encode(Entry(self.texts[token], self.bytes[token], logprob, alternatives)).decode(),)
        named: dict[str, float] = {}  # of alternatives with one text, the likelier (as ScoresWriter)
        for other, value in zip(ids, values, strict=True):
            named.setdefault(self.texts[other], value)
        shown = (self.texts[token], logprob, None if logprob is None else named)
        return tuple(self.encode(value).decode() for value in shown)


WRITERS = {
    "native": ScoresWriter,
    "python": functools.partial(ScoresWriter, native=False),
    "msgspec": MsgspecScoresWriter,
}


def turn(tokenizer: Tokenizer, chat: bool) -> list[tuple[bool, int, list]]:
    """A turn's asks as aftgen.serve.replies.scores_as_json passes them: ROWS rows of one token with TOP
    alternatives, packed by the engine's own code from logits shaped like a model's."""
    generator = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(ROWS, tokenizer.vocab_size, generator=generator)
    tokens = torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
    return [(chat, TOP, [(0, token, record)]) for token, record in token_scores(logits, tokens, TOP)]


def values_read(written: list, chat: bool) -> list:
    """What a client reads from a turn's JSON, figures as float32."""
    read = [json.loads(chat_logprobs(scores) if chat else completions_logprobs(scores)) for scores in written]
    return json.loads(json.dumps(read), parse_float=lambda text: float(np.float32(float(text))))


def micro(repeats: int) -> None:
    tokenizer = load(None)[1]
    writers = {name: make(tokenizer) for name, make in WRITERS.items()}
    if writers["native"].native is None:
        sys.exit("scores_writers: the native library cannot be had here")
    for chat in (False, True):
        asks = turn(tokenizer, chat)
        read = {name: values_read(writer.write(asks), chat) for name, writer in writers.items()}
        if read["msgspec"] != read["native"] or read["python"] != read["native"]:
            sys.exit(f"scores_writers: the writers disagree ({'chat' if chat else 'completions'})")
        for name, writer in writers.items():
            times = []
            for _ in range(5):  # the best of five stretches: other processes only ever add time
                start = time.perf_counter()
                for _ in range(repeats):
                    writer.write(asks)
                times.append((time.perf_counter() - start) / repeats / ROWS)
            print(f"{'chat' if chat else 'completions':>11}, {name:>7}: {1e6 * min(times):.2f} us a token")


def serve(writer: str, options: list[str]) -> None:
    """`aftgen serve` with `writer`'s ScoresWriter (the HTTP side makes it through aftgen.serve.replies)."""
    replies.ScoresWriter = WRITERS[writer]
    print(f"scores_writers: this server writes logprobs with {writer}", file=sys.stderr)
    sys.argv = ["aftgen", "serve", *options]
    run()


def bench(writer: str, options: list[str]) -> None:
    """`aftgen bench serve` with its server started by `serve` above."""
    import aftgen.bench.serve as bench_serve

    def popen(command: list[str], *args, **kwargs) -> subprocess.Popen:
        if command[1:4] == ["-m", "aftgen", "serve"]:
            command = [command[0], __file__, "serve", writer, *command[4:]]
        return subprocess.Popen(command, *args, **kwargs)

    bench_serve.subprocess = SimpleNamespace(**vars(subprocess) | {"Popen": popen})
    sys.argv = ["aftgen", "bench", "serve", *options]
    run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("mode", choices=["micro", "bench", "serve"])
    parser.add_argument("writer", nargs="?", choices=list(WRITERS), default="native")
    parser.add_argument("--repeats", type=int, default=2000)
    known, rest = parser.parse_known_args()
    if known.mode == "micro":
        micro(known.repeats)
    else:
        (bench if known.mode == "bench" else serve)(known.writer, rest)


if __name__ == "__main__":
    main()

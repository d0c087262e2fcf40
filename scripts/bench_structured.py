"""What structured output leaves alone and always gives (issue 48's bar; its cost at 32 streams is a row of
`aftgen bench serve`).

1. 50 seeded requests at temperature 1.0 with a JSON schema (a string of at most 20 characters, an integer,
   an enum) all parse and validate, and 50 with the regex [0-9]{3}-[0-9]{4} all match.
2. One constrained stream beside 31 free ones: the free streams' seeded text is what it is beside 32 free
   ones. On a --batch-invariant server, where a row's text never depends on its neighbours.

Run it on a quiet machine (jsonschema is in the test extra):

    .venv/bin/python scripts/bench_structured.py [--model M]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re

import httpx
import jsonschema

from aftgen.bench.options import BenchServeOptions
from aftgen.bench.serve import PROMPTS, ServerProcess

STREAMS, REQUESTS = 32, 50
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "kind": {"enum": ["friend", "foe", "stranger"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
PHONE = "[0-9]{3}-[0-9]{4}"


async def replies(server: ServerProcess, bodies: list[dict]) -> list[dict]:
    """Each body's first choice, STREAMS requests at a time (the server queues none)."""
    slots = asyncio.Semaphore(STREAMS)
    async with httpx.AsyncClient(base_url=f"http://{server.host}:{server.port}", timeout=600) as http:

        async def reply(body: dict) -> dict:
            async with slots:
                answer = await http.post("/v1/completions", json=body)
            answer.raise_for_status()
            return answer.json()["choices"][0]

        return await asyncio.gather(*map(reply, bodies))


def shapes(server: ServerProcess, tokens: int) -> None:
    base = {"prompt": "ROMEO:", "max_tokens": tokens, "temperature": 1.0}
    people = asyncio.run(replies(server, [base | {"seed": i, "json_schema": PERSON} for i in range(REQUESTS)]))
    valid = 0
    for choice in people:
        try:
            jsonschema.validate(json.loads(choice["text"]), PERSON)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            print(f"not valid ({choice['finish_reason']}): {choice['text']!r}: {exc}")
    phones = asyncio.run(
        replies(server, [base | {"seed": i, "structured_outputs": {"regex": PHONE}} for i in range(REQUESTS)])
    )
    matched = sum(bool(re.fullmatch(PHONE, choice["text"])) for choice in phones)
    print(f"JSON schema: {valid}/{REQUESTS} parse and validate; regex {PHONE}: {matched}/{REQUESTS} match")


def beside(options: BenchServeOptions) -> None:
    free = [
        {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 64, "temperature": 1.0, "seed": i} for i in range(STREAMS)
    ]
    with ServerProcess(BenchServeOptions(model=options.model, tokens=64, batch_invariant=True)) as server:
        alone = asyncio.run(replies(server, free))
        shaped = asyncio.run(replies(server, [free[0] | {"json_schema": PERSON}, *free[1:]]))
    same = sum(a["text"] == b["text"] for a, b in zip(alone[1:], shaped[1:], strict=True))
    print(f"beside a constrained stream (--batch-invariant): {same}/{STREAMS - 1} free streams' text unchanged")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a run folder or Hub id (default: the shipped model)")
    args = parser.parse_args()
    options = BenchServeOptions(model=args.model, tokens=128)
    with ServerProcess(options) as server:
        shapes(server, options.tokens)
    beside(options)


if __name__ == "__main__":
    main()

"""`aftgen serve`: a real server on 127.0.0.1 (in-process uvicorn, ephemeral port) and a tiny model,
talked to with the official openai client and with plain HTTP for the error cases."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import httpx
import pytest
from serving import (
    AUTH,
    LONG,
    Stream,
    assert_openai_error,
    busy_slots,
    client,
    health,
    library_text,
    post,
    running,
    wait_for,
)

from aftgen.api import load
from aftgen.bench.measure import tree_memory_mb
from aftgen.state import load_state

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def test_completions_and_chat_through_the_openai_client(url, tiny_run):
    api = client(url)
    assert [m.id for m in api.models.list().data] == [tiny_run.name]
    whole = api.completions.create(model=tiny_run.name, prompt="KING:", max_tokens=30, seed=7, temperature=0.8)
    assert whole.choices[0].text == library_text(tiny_run, "KING:", max_new_tokens=30, seed=7, temperature=0.8)
    assert whole.choices[0].finish_reason == "length"
    usage, tokenizer = whole.usage, load(tiny_run)[1]
    assert usage.prompt_tokens == 1 + len(tokenizer.encode("KING:"))  # BOS, then the prompt
    assert (usage.completion_tokens, usage.total_tokens) == (30, usage.prompt_tokens + 30)
    chunks = list(
        api.completions.create(model=tiny_run.name, prompt="KING:", max_tokens=30, seed=7, temperature=0.8, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"

    several = api.completions.create(model=tiny_run.name, prompt="KING:", max_tokens=30, seed=7, temperature=0.8, n=3)
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert several.choices[0].text == whole.choices[0].text and several.usage.completion_tokens == 90

    llama_cpp_fields = dict(top_k=5, min_p=0.05, repeat_penalty=1.3, repeat_last_n=16)
    tuned = api.completions.create(
        model=tiny_run.name, prompt="KING:", max_tokens=30, seed=3, extra_body=llama_cpp_fields
    )
    assert tuned.choices[0].text == library_text(tiny_run, "KING:", max_new_tokens=30, seed=3, temperature=1.0,
                                                 **llama_cpp_fields)  # fmt: skip

    greedy = api.completions.create(model=tiny_run.name, prompt="KING:", max_tokens=60, temperature=0)
    stop = greedy.choices[0].text[20:23]
    stopped = api.completions.create(model=tiny_run.name, prompt="KING:", max_tokens=60, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == greedy.choices[0].text[: greedy.choices[0].text.index(stop)]

    messages = [{"role": "user", "content": "KING:"}]
    chat = api.chat.completions.create(model=tiny_run.name, messages=messages, max_tokens=40, seed=1)
    as_aftgen_chat = library_text(tiny_run, "KING:\n", max_new_tokens=40, seed=1, temperature=1.0, stop=("\n\n",))
    assert chat.choices[0].message.content == as_aftgen_chat
    streamed = list(
        api.chat.completions.create(
            model=tiny_run.name,
            messages=messages,
            max_tokens=40,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert content == chat.choices[0].message.content and "\n\n" not in content  # the default stop: a blank line
    assert streamed[-1].usage.completion_tokens == chat.usage.completion_tokens > 0


def test_seeded_request_gives_the_same_text_alone_and_among_eight_others(url, tiny_run):
    """Four others are generating when it starts and four more join while it runs: the same text, sampled
    and greedy. Everything in the batch asks for more tokens than the test reads, so all nine share it."""
    api, model = client(url), tiny_run.name
    asks = [dict(seed=11, temperature=0.9), dict(temperature=0)]
    alone = [
        api.completions.create(model=model, prompt="NURSE:", max_tokens=100, **ask).choices[0].text for ask in asks
    ]
    for ask, text in zip(asks, alone, strict=True):
        with httpx.Client(timeout=60) as http:
            others = [
                Stream(http, url, "JULIET: " * (i + 1), LONG, **ask | {"seed": i}) for i in range(4)
            ]  # drawn alike
            for stream in others:
                stream.texts(1)
            mine = Stream(http, url, "NURSE:", LONG, **ask)
            pieces = mine.texts(1)
            others += [Stream(http, url, "ROMEO:\n" * (i + 1), LONG, temperature=0.5) for i in range(4)]
            assert busy_slots(url) == 9  # all nine in the batch at once
            while len("".join(pieces)) < len(text) + 8:
                more = mine.texts(1)
                assert more, "the stream ended early"
                pieces += more
            for stream in [mine, *others]:
                stream.close()
        assert "".join(pieces).startswith(text)


SOAK_SECONDS = float(os.environ.get("AFTGEN_SOAK_SECONDS", "12"))
SOAK_CLIENTS = 32
SOAK_RSS_GROWTH_MB = 50  # README, "What happens when...": the bound on resident memory growth after warm-up


def resident_mb() -> float:
    """This process's resident memory and its children's (the server's HTTP side runs in it, its engine in one)."""
    return tree_memory_mb(os.getpid())[0]


async def soak_client(http: httpx.AsyncClient, url: str, index: int, until: float, tally: dict) -> None:
    """Until `until`: streams of completions and chat, a named session of its own half the time; one
    request in six ends early (the client goes away), one in six is a bad request."""
    rng = random.Random(index)
    while time.monotonic() < until:
        roll = rng.random()
        if roll < 1 / 6:
            body = rng.choice([{"prompt": 5}, {"prompt": "x", "temperature": -1}, {"messages": []}, {"frob": 1}])
            response = await http.post(f"{url}/v1/completions", json=body, headers=AUTH)
            assert response.status_code == 400 and set(response.json()["error"]) == {"message", "type", "param", "code"}
            tally["bad"] += 1
            continue
        chat = rng.random() < 0.5
        body = {"max_tokens": rng.randint(5, 60), "stream": True, "temperature": 0.9}
        body |= (
            {"messages": [{"role": "user", "content": "KING:"}]}
            if chat
            else {"prompt": rng.choice(["KING:", "NURSE:"])}
        )
        if rng.random() < 0.5:
            body["session"] = f"soak-{index}"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        leave_after = rng.randint(1, 5) if roll < 2 / 6 else None
        async with http.stream("POST", f"{url}{path}", json=body, headers=AUTH) as response:
            assert response.status_code == 200, await response.aread()
            sent = []
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    sent.append(line[6:])
                    if leave_after is not None and len(sent) == leave_after:
                        break
        if leave_after is not None:
            tally["left"] += 1
            continue
        assert sent[-1] == "[DONE]", sent[-3:]  # not cut short
        chunks = [json.loads(data) for data in sent[:-1]]
        assert all("error" not in chunk for chunk in chunks), chunks
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        tally["whole"] += 1


@pytest.mark.soak
def test_soak_32_streaming_clients_leave_no_stream_cut_short_and_memory_flat(tiny_run, tmp_path):
    """About 12 s (AFTGEN_SOAK_SECONDS) of 32 clients on 127.0.0.1: streams run to [DONE], resident
    memory after warm-up grows by at most SOAK_RSS_GROWTH_MB, and every session file loads."""
    tally = {"whole": 0, "left": 0, "bad": 0}

    async def clients(url: str, seconds: float) -> None:
        limits = httpx.Limits(max_connections=SOAK_CLIENTS)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            until = time.monotonic() + seconds
            await asyncio.gather(*(soak_client(http, url, i, until, tally) for i in range(SOAK_CLIENTS)))

    with running(tiny_run, sessions_dir=tmp_path, parallel=SOAK_CLIENTS, queue=SOAK_CLIENTS) as url:
        asyncio.run(clients(url, min(5.0, SOAK_SECONDS / 4)))  # warm-up: buffers, caches and sessions fill
        before = resident_mb()
        asyncio.run(clients(url, SOAK_SECONDS))
        wait_for(lambda: health(url)["slots_busy"] == 0)
        growth = resident_mb() - before
    print(f"soak: {tally}, resident memory {before:.0f} MB + {growth:.1f} MB")
    assert tally["whole"] > SOAK_CLIENTS and tally["left"] and tally["bad"]
    assert growth <= SOAK_RSS_GROWTH_MB
    model, tokenizer = load(tiny_run)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == SOAK_CLIENTS
    for path in files:
        load_state(path, model, tokenizer)


def test_extreme_sampling_settings_stop_no_other_stream(url):
    """Issue 36's reproduction, while a stream and a session's streamed turn run: a repeat penalty of 1e-300
    is a 400 naming it, a temperature of 1e-39 with a penalty samples, and one of 1e-300 or 5e-324 is
    greedy; the stream and the session's turn go on with no error event."""
    greedy = post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 8, "temperature": 0}).json()
    with httpx.Client(timeout=60) as http:
        assert post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 3, "session": "mid"}).is_success
        others = [Stream(http, url, "QUEEN:", LONG), Stream(http, url, " and", LONG, session="mid")]
        for other in others:
            other.texts(1)
        body = {"prompt": "x", "max_tokens": 3, "repeat_penalty": 1e-300}
        refused = assert_openai_error(post(url, "/v1/completions", json=body), 400, "repeat_penalty")
        assert "[0.0001, 100]" in refused["message"]
        body = {"prompt": "x", "max_tokens": 3, "temperature": 1e-39, "repeat_penalty": 1.1}
        assert post(url, "/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
        for temperature in (1e-300, 5e-324):
            body = {"prompt": "KING:", "max_tokens": 8, "temperature": temperature}
            assert post(url, "/v1/completions", json=body).json()["choices"] == greedy["choices"]
        for other in others:
            assert len(other.texts(20)) == 20  # texts() reads choices: an error event would fail here
            other.close()

"""The engine (aftgen.serve.engine), driven turn by turn or behind an in-process server: requests admitted while
rows are free and queued past them (a 503 past the queue, a 504 past their time), nothing admitted before the step
that serves is ready, long prompts read in chunks between the others' steps, every row drawing what it draws alone,
events handed on at once or every few milliseconds, and a row, a constraint or a session's turn that fails failing
its own request alone."""

from __future__ import annotations

import concurrent.futures
import json
import random
import socket
import urllib.parse
from collections.abc import Iterator

import httpx
import jsonschema
import llguidance
import pytest
import torch
from conftest import DEVICE
from serving import (
    KEY,
    LONG,
    PERSON,
    Stream,
    assert_openai_error,
    busy_slots,
    health,
    library_text,
    post,
    running,
    slow_compile,
    wait_for,
)

from aftgen import constraints
from aftgen.api import load
from aftgen.constraints import Constraint, json_source
from aftgen.device import resolve
from aftgen.generation.controls import SamplingOptions
from aftgen.generation.loop import generate
from aftgen.generation.prompt import PromptReader, read_prompt
from aftgen.model import tokens_read
from aftgen.serve import rows as rows_module
from aftgen.serve.batch import Batch, CompiledBatchStep
from aftgen.serve.engine import TEXT_EVERY, Engine
from aftgen.serve.options import ServeOptions
from aftgen.serve.sessions import SUFFIX
from aftgen.serve.work import Done, Failed, Finished, Started, Text, Work
from aftgen.state import load_state

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

AMBIGUOUS = 'start: s\ns: s s | s s s | "a" | "e" | " "'  # each token's mask costs more than the one before


def test_queued_requests_wait_and_a_disconnect_frees_the_slot_at_once(tiny_run):
    with running(tiny_run, parallel=1, queue=1) as url, httpx.Client(timeout=60) as http:
        stream = Stream(http, url, "KING:", LONG)
        stream.texts(1)
        waiting = concurrent.futures.ThreadPoolExecutor(1).submit(
            post, url, "/v1/completions", json={"prompt": "x", "max_tokens": 2}
        )
        wait_for(lambda: health(url)["queued"] == 1)
        refused = post(url, "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "server_overloaded"
        stream.close()  # the client goes away: the queued request gets the row
        assert waiting.result().json()["usage"]["completion_tokens"] == 2
        with socket.create_connection(urllib.parse.urlsplit(url)[1].split(":")) as raw:  # not streaming this time
            body = json.dumps({"prompt": "KING:", "max_tokens": LONG}).encode()
            head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            raw.sendall(f"{head}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            wait_for(lambda: health(url)["slots_busy"] == 1)
        wait_for(lambda: health(url)["slots_busy"] == 0)


def test_a_request_past_its_time_gets_504(tiny_run):
    with running(tiny_run, in_process=True, timeout=0.05) as url:
        error = assert_openai_error(post(url, "/v1/completions", json={"prompt": "x", "max_tokens": LONG}), 504)
        assert "0.05 s" in error["message"]
        assert busy_slots(url) == 0


def test_a_server_whose_step_is_still_compiling_admits_nothing_until_it_is_done(tiny_run, monkeypatch, capsys):
    """The compile outlasts the wait: a request waits, unread and unstepped (one whose time runs out meanwhile
    gets its 504), and once the step is compiled it gets what `aftgen sample` gives, from the compiled step alone."""
    model, tokenizer = load(tiny_run, device=DEVICE)
    done, calls = slow_compile(monkeypatch, model)
    placement = resolve(DEVICE, "fp32")
    engine = Engine(model, tokenizer, ServeOptions(cache_mb=0), placement, CompiledBatchStep(model, 4, placement, 0.1))
    assert "still compiling after 0.1 s" in capsys.readouterr().err
    events: list = []
    engine.publish = events.extend
    options = SamplingOptions(max_new_tokens=8, temperature=0.8, seed=3)
    ticket, late = (engine.submit(Work(tokenizer.encode("KING:"), options)) for _ in range(2))
    late.deadline = 0.0
    for _ in range(4):
        engine.turn()
    assert [(owner, type(event)) for owner, event in events] == [(late, Failed)]
    assert engine.stats()["step"] == "compiling"
    done.set()
    wait_for(engine.ready)
    while not any(owner is ticket and isinstance(event, Done) for owner, event in events):
        engine.turn()
    assert calls and set(calls) == {1}
    text = "".join(event.text for owner, event in events if owner is ticket and isinstance(event, Text))
    assert text == library_text(tiny_run, "KING:", max_new_tokens=8, temperature=0.8, seed=3)
    assert {name: engine.stats()[name] for name in ("step", "batch_invariant")} == {
        "step": "compiled",
        "batch_invariant": False,
    }


def test_a_long_prompt_is_read_in_chunks_between_the_others_steps(tiny_run):
    """Driven turn by turn: while a 200-token prompt is read 16 tokens a turn, the running request
    gets a token every turn, and what the prompt then generates matches `aftgen sample`."""
    model, tokenizer = load(tiny_run, device=DEVICE)
    engine = Engine(model, tokenizer, ServeOptions(prompt_chunk=16, cache_mb=0), resolve(DEVICE, "fp32"))
    events: list = []
    engine.publish = events.extend
    running_one = engine.submit(Work(tokenizer.encode("KING:"), SamplingOptions(max_new_tokens=LONG, temperature=0)))
    engine.turn()
    prompt = " ".join(["the king and the queen"] * 60)
    ids = tokenizer.encode(prompt)
    assert len(ids) >= 160
    long_one = engine.submit(Work(ids, SamplingOptions(max_new_tokens=20, seed=4, temperature=1.0)))

    def produced() -> int:
        return next(row.stream.produced for row in engine.batch.rows if row.ticket is running_one)

    turns, published = 0, []
    while long_one not in published and turns < 100:
        before, tokens = len(events), produced()
        engine.turn()
        turns += 1
        published = [ticket for ticket, _ in events[before:]]
        assert produced() == tokens + 1  # a token every turn (its text goes out every few milliseconds)
    assert turns == -(-(len(ids) + 1) // 16)  # BOS and the prompt, 16 tokens a turn
    while not any(isinstance(event, Done) for ticket, event in events if ticket is long_one):
        engine.turn()
    text = "".join(event.text for ticket, event in events if ticket is long_one and isinstance(event, Text))
    assert text == library_text(tiny_run, prompt, max_new_tokens=20, seed=4, temperature=1.0)


def test_thirty_two_rows_each_with_its_own_settings_give_what_each_gives_alone(tiny_run):
    """Driven turn by turn: 32 seeded requests, each with its own temperature, top-k, top-p, min-p and repeat
    penalty (some greedy, some at the neutral values), drawn in one pass a token: each request's text is what
    it gives alone, and a second engine (the next start of the server) gives the same again."""
    model, tokenizer = load(tiny_run, device=DEVICE)
    pick = random.Random(0)
    settings = [
        dict(
            seed=seed,
            temperature=pick.choice([0.0, 0.5, 0.9, 1.5]),
            top_k=pick.choice([0, 3, 40]),
            top_p=pick.choice([1.0, 0.9, 0.5]),
            min_p=pick.choice([0.0, 0.1]),
            repeat_penalty=pick.choice([1.0, 1.3, 0.7]),
            repeat_last_n=pick.choice([0, 4, 64]),
        )
        for seed in range(32)
    ]
    prompts = [("KING:", "NURSE:", "ROMEO:", "JULIET: ")[i % 4] for i in range(32)]

    def served() -> list[str]:
        engine = Engine(model, tokenizer, ServeOptions(cache_mb=0, parallel=32), resolve(DEVICE, "fp32"))
        events: list = []
        engine.publish = events.extend
        tickets = [
            engine.submit(Work(tokenizer.encode(prompt), SamplingOptions(max_new_tokens=16, **each)))
            for prompt, each in zip(prompts, settings, strict=True)
        ]
        while sum(isinstance(event, Done) for _, event in events) < len(tickets):
            engine.turn()
        assert not [event for _, event in events if isinstance(event, Failed)]
        return ["".join(e.text for owner, e in events if owner is t and isinstance(e, Text)) for t in tickets]

    alone = []
    for prompt, each in zip(prompts, settings, strict=True):
        context = read_prompt(model, tokenizer, prompt, seed=each["seed"])
        alone.append("".join(generate(model, tokenizer, context, SamplingOptions(max_new_tokens=16, **each))))
    assert served() == alone
    assert served() == alone


def test_text_goes_out_every_few_milliseconds_and_a_start_or_an_end_at_once(tiny_run):
    """Each hand-over of events wakes the HTTP side, so a turn's text waits up to TEXT_EVERY to go with the
    next turns' (joined per choice, in order); a start or an end goes out in the turn it happens."""
    model, tokenizer = load(tiny_run, device=DEVICE)
    now = [100.0]
    engine = Engine(model, tokenizer, ServeOptions(cache_mb=0), resolve(DEVICE, "fp32"), clock=lambda: now[0])
    handed: list[list] = []
    engine.publish = handed.append
    ticket = engine.submit(Work(tokenizer.encode("KING:"), SamplingOptions(max_new_tokens=6, temperature=0)))
    engine.turn()
    assert [type(event) for _, event in handed.pop()][0] is Started
    for _ in range(3):
        engine.turn()  # the clock stands still: the text waits
    assert not handed
    now[0] += TEXT_EVERY
    engine.turn()
    (batch,) = handed
    assert [type(event) for _, event in batch] == [Text] and len(tokenizer.encode(batch[0][1].text)) >= 2
    handed.clear()
    while not handed:
        engine.turn()
    assert [type(event) for _, event in handed[-1]][-2:] == [Finished, Done] and ticket.unfinished == 0


def test_a_row_that_cannot_draw_fails_its_own_request_alone(tiny_run, monkeypatch):
    """Driven turn by turn: a session whose state went NaN and a request whose prompt cannot be read each
    fail with a 500 naming them, while a sampled row drawn together with the NaN row, a row with a repeat
    penalty and another session's turn give what they give alone, and both sessions stay in memory."""
    model, tokenizer = load(tiny_run, device=DEVICE)
    engine = Engine(model, tokenizer, ServeOptions(cache_mb=0), resolve(DEVICE, "fp32"))
    events: list = []
    engine.publish = events.extend

    def submit(prompt: str, session: str | None = None, **options):
        work = Work(tokenizer.encode(prompt), SamplingOptions(max_new_tokens=12, **options), session=session)
        return engine.submit(work)

    def seen(ticket, kind) -> list:
        return [event for owner, event in events if owner is ticket and isinstance(event, kind)]

    def run(*tickets) -> None:
        for _ in range(200):
            if all(seen(ticket, Done) or seen(ticket, Failed) for ticket in tickets):
                return
            engine.turn()
        raise AssertionError("the engine never finished")

    for name in ("damaged", "good"):
        run(submit("KING:", session=name, temperature=0))
    damaged = engine.sessions.get("damaged")
    for layer in damaged.state:
        for tensor in layer.values():
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
    engine.sessions.put("damaged", damaged)
    good_read = tokens_read(engine.sessions.get("good").state)
    unreadable, read = tokenizer.encode("QUEEN:"), PromptReader.read

    def read_or_fail(self, budget=None):
        if self.ids[1:] == unreadable:
            raise RuntimeError("simulated failure")
        return read(self, budget)

    monkeypatch.setattr(PromptReader, "read", read_or_fail)
    sampled, penalised = dict(temperature=1.0, seed=5), dict(temperature=0.8, seed=6, repeat_penalty=1.3)
    tickets = {
        "sampled": submit("KING:", **sampled),  # the same filters as the damaged row's: drawn with it
        "penalised": submit("KING:", **penalised),
        "damaged": submit(" and", session="damaged", temperature=1.0),
        "unreadable": submit("QUEEN:"),
        "good": submit(" and", session="good", temperature=0),
    }
    run(*tickets.values())
    for name, named in (("damaged", "choice 0: "), ("unreadable", "reading the prompt")):
        [failure] = seen(tickets[name], Failed)
        assert failure.status == 500 and named in failure.message and not seen(tickets[name], Done)
    assert "session 'damaged'" in seen(tickets["damaged"], Failed)[0].message
    for name, options in (("sampled", sampled), ("penalised", penalised)):
        text = "".join(event.text for event in seen(tickets[name], Text))
        assert text == library_text(tiny_run, "KING:", max_new_tokens=12, **options)
    assert seen(tickets["good"], Done) and engine.occupied() == 0 and not engine.busy_sessions
    assert tokens_read(engine.sessions.get("good").state) == good_read + len(tokenizer.encode(" and")) + 12
    assert engine.sessions.get("damaged") is not None


@pytest.fixture(scope="module")
def engine(tiny_run) -> Engine:
    """An engine driven turn by turn, each row stepped apart (--batch-invariant): a row's text is its own."""
    model, tokenizer = load(tiny_run)
    options = ServeOptions(cache_mb=0, parallel=8, batch_invariant=True)
    return Engine(model, tokenizer, options, resolve(DEVICE, "fp32"))


def outcomes(engine: Engine, rows: list[SamplingOptions]) -> list[str | Failed]:
    """Each row's text, or how its request failed, all generating at once from one prompt."""
    events: list = []
    engine.publish = events.extend  # the compiler's thread publishes a refusal too: extend is atomic
    tickets = [engine.submit(Work(engine.tokenizer.encode("KING:"), options)) for options in rows]

    def ended(ticket) -> Failed | Done | None:
        return next((e for owner, e in list(events) if owner is ticket and isinstance(e, (Done, Failed))), None)

    while not all(ended(ticket) for ticket in tickets):
        engine.turn()
    return [
        ended(ticket)
        if isinstance(ended(ticket), Failed)
        else "".join(e.text for o, e in events if o is ticket and isinstance(e, Text))
        for ticket in tickets
    ]


def texts(engine: Engine, rows: list[SamplingOptions]) -> list[str]:
    """Each row's text, all generating at once from one prompt; none may fail."""
    got = outcomes(engine, rows)
    assert not [outcome for outcome in got if isinstance(outcome, Failed)], got
    return got


def test_a_constrained_row_leaves_the_free_rows_beside_it_alone(engine):
    free = [SamplingOptions(max_new_tokens=24, temperature=1.0, seed=seed) for seed in range(3)]
    alone = [texts(engine, [options])[0] for options in free]
    shaped = SamplingOptions(max_new_tokens=60, seed=9, constraint=Constraint("json_schema", json_source(PERSON)))
    together = texts(engine, [free[0], shaped, *free[1:]])
    assert [together[0], *together[2:]] == alone
    jsonschema.validate(json.loads(together[1]), PERSON)


def test_a_constraint_that_breaks_while_drawing_fails_its_request_alone(engine, monkeypatch):
    """llguidance's limits reached deep in an ambiguous grammar (made small here, so a few tokens reach them):
    that request ends with an error naming them, and the free rows beside it draw what they draw alone."""
    monkeypatch.setattr(constraints, "_limits", lambda: llguidance.LLParserLimits(step_max_items=300))
    free = [SamplingOptions(max_new_tokens=24, temperature=1.0, seed=seed) for seed in range(3)]
    alone = texts(engine, free)
    shaped = SamplingOptions(max_new_tokens=200, seed=9, constraint=Constraint("grammar", AMBIGUOUS + " "))
    failed, *together = outcomes(engine, [shaped, *free])
    assert together == alone
    assert failed.status == 500 and failed.code == "constraint_broken" and "Too many items" in failed.message


def test_a_constraint_whose_masks_cost_more_than_the_steps_ends_its_request(engine, monkeypatch):
    """With no grace and no share of the steps' time, a constraint's first mask is past its budget."""
    monkeypatch.setattr(rows_module, "MASK_GRACE", 0.0)
    monkeypatch.setattr(rows_module, "MASK_SHARE", 0.0)
    free = SamplingOptions(max_new_tokens=24, temperature=1.0, seed=1)
    shaped = SamplingOptions(max_new_tokens=200, seed=9, constraint=Constraint("grammar", AMBIGUOUS))
    failed, text = outcomes(engine, [shaped, free])
    assert text == texts(engine, [free])[0]
    assert failed.status == 500 and failed.code == "constraint_too_costly", failed


@pytest.fixture(scope="module")
def url_in_process(tiny_run) -> Iterator[str]:
    """A server whose engine runs in this process, for tests that break it on purpose."""
    with running(tiny_run, in_process=True) as base:
        yield base


def test_a_failing_step_fails_its_requests_with_500_and_the_server_goes_on(url_in_process, monkeypatch):
    url = url_in_process

    def broken(self, tokens):
        raise RuntimeError("simulated failure")

    with monkeypatch.context() as patch:
        patch.setattr(Batch, "step", broken)
        error = assert_openai_error(post(url, "/v1/completions", json={"prompt": "x", "max_tokens": 5}), 500)
        assert error["type"] == "server_error"
    assert post(url, "/v1/completions", json={"prompt": "x", "max_tokens": 5}).json()["usage"]["completion_tokens"] == 5
    assert busy_slots(url) == 0


def test_a_session_turn_that_fails_leaves_the_session_in_memory_as_it_was(url_in_process, monkeypatch):
    """A failing step fails the session's turn; the session (memory only here) goes on as a twin that
    never had that turn does: continued, not started anew."""
    url = url_in_process

    def broken(self, tokens):
        raise RuntimeError("simulated failure")

    def turn(session: str, prompt: str) -> dict:
        body = {"prompt": prompt, "session": session, "max_tokens": 8, "temperature": 1.0}
        return post(url, "/v1/completions", json=body | ({"seed": 5} if prompt == "KING:" else {}))

    for name in ("failing", "twin"):
        assert turn(name, "KING:").status_code == 200
    with monkeypatch.context() as patch:
        patch.setattr(Batch, "step", broken)
        assert_openai_error(turn("failing", " and so"), 500)
    after, twin = turn("failing", " then").json(), turn("twin", " then").json()
    assert after["choices"] == twin["choices"] and after["usage"] == twin["usage"]


@pytest.mark.parametrize("stage", ["reading its prompt", "generating"])
@pytest.mark.parametrize("ending", ["cancelled", "timed out"])
def test_a_session_turn_that_never_finishes_leaves_the_session_as_it_was(tiny_run, tmp_path, stage, ending):
    """Driven turn by turn: a session's turn whose client leaves (or whose time runs out) while its prompt
    is read or while it generates changes nothing, in memory or on disk: the session's next turn samples
    what a twin's does (the generator untouched too) and leaves the same state."""
    model, tokenizer = load(tiny_run, device=DEVICE)
    options = ServeOptions(prompt_chunk=4, cache_mb=0, sessions_dir=tmp_path)
    engine = Engine(model, tokenizer, options, resolve(DEVICE, "fp32"))
    events: list = []
    engine.publish = events.extend

    def submit(session: str, prompt: str, max_new_tokens: int, seed: int | None = None):
        sampling = SamplingOptions(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
        return engine.submit(Work(tokenizer.encode(prompt), sampling, session=session))

    def seen(ticket, kind) -> list:
        return [event for owner, event in events if owner is ticket and isinstance(event, kind)]

    def turn(session: str, prompt: str, seed: int | None = None) -> str:
        ticket = submit(session, prompt, 20, seed)
        while not seen(ticket, Done):
            engine.turn()
        return "".join(event.text for event in seen(ticket, Text))

    assert turn("s", "KING:", seed=3) == turn("twin", "KING:", seed=3)
    saved = (tmp_path / f"s{SUFFIX}").read_bytes()
    unfinished = submit("s", " and the queen" * 10, LONG)
    engine.turn()
    while stage == "generating" and not seen(unfinished, Text):
        engine.turn()
    assert bool(seen(unfinished, Started)) == (stage == "generating") and engine.occupied() == 1
    if ending == "cancelled":
        engine.cancel(unfinished)
    else:
        unfinished.deadline = 0.0
    engine.turn()
    assert engine.occupied() == 0 and not seen(unfinished, Done)
    assert [failure.status for failure in seen(unfinished, Failed)] == ([504] if ending == "timed out" else [])
    assert (tmp_path / f"s{SUFFIX}").read_bytes() == saved
    assert turn("s", " then") == turn("twin", " then")
    mine, twins = (load_state(tmp_path / f"{name}{SUFFIX}", model, tokenizer) for name in ("s", "twin"))
    for layer, twin_layer in zip(mine.state, twins.state, strict=True):
        assert all(torch.equal(layer[name], twin_layer[name]) for name in layer)
    assert torch.equal(mine.generator.get_state(), twins.generator.get_state())
    assert torch.equal(mine.history(), twins.history()) and torch.equal(mine.logits, twins.logits)

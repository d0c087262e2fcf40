"""Generation: sampling controls, stop strings, streaming UTF-8, state files, prime and chat."""

from __future__ import annotations

import dataclasses
import io
import os
import random
import signal
import subprocess
import sys
import threading
import time
import typing
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, on_device
from typer.testing import CliRunner

from aftgen import sampling
from aftgen.api import load
from aftgen.checkpoint import save_checkpoint
from aftgen.cli import app
from aftgen.errors import AftgenError
from aftgen.sampling import (
    GREEDY_BELOW,
    SamplingOptions,
    ScoresNotFinite,
    StopFilter,
    apply_repeat_penalty,
    choose,
    draw,
    filter_logits,
    generate,
    read_prompt,
    recent_tokens,
)
from aftgen.state import load_state, save_state

runner = CliRunner()
PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def kept(logits: torch.Tensor, **options) -> int:
    return int(torch.isfinite(filter_logits(logits, SamplingOptions(temperature=1.0, **options))).sum())


def penalised(logits: torch.Tensor, history: torch.Tensor, penalty: float, last_n: int = 64) -> torch.Tensor:
    """Every row of logits with the same repeat penalty over its own history's last n ids."""
    rows, vocab = logits.shape
    recent = recent_tokens(history, [last_n] * rows, vocab, logits.device)
    return apply_repeat_penalty(logits, torch.full((rows, 1), penalty), recent)


def test_each_control_is_a_typed_field_of_sampling_options_with_its_default():
    """SamplingOptions' fields for the controls are CONTROLS, name for name, with the same type and default,
    and the HTTP API's own defaults name controls (a new control needs both its entry and its field)."""
    fields = {f.name: f for f in dataclasses.fields(SamplingOptions)}
    controls = [name for name in fields if name not in ("max_new_tokens", "seed", "stop", "num_samples", "constraint")]
    assert controls == list(sampling.CONTROLS)
    hints = typing.get_type_hints(SamplingOptions)
    for name, control in sampling.CONTROLS.items():
        assert fields[name].default == control.default and hints[name] is control.type, name
        assert getattr(SamplingOptions(), name) == control.default
    assert set(sampling.API_DEFAULTS) <= set(sampling.CONTROLS)
    with pytest.raises(TypeError):
        SamplingOptions(top_q=0.5)


def test_top_k_keeps_exactly_k_even_with_ties():
    assert kept(torch.randn(1, 50), top_k=5) == 5
    assert kept(torch.zeros(1, 50), top_k=3) == 3


@pytest.mark.parametrize("top_p,expected", [(0.5, 1), (0.8, 2), (0.81, 3), (0.95, 3), (0.96, 4), (1.0, 4)])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, expected):
    assert kept(PROBS.log(), top_p=top_p) == expected


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    assert kept(PROBS.log(), min_p=0.2) == 3  # 0.05 < 0.2 * 0.5
    assert kept(PROBS.log(), min_p=0.7) == 1


def test_temperature_sharpens_or_flattens():
    logits = PROBS.log()
    entropy = [
        -(p * p.log()).sum()
        for p in (filter_logits(logits, SamplingOptions(temperature=t)).softmax(-1) for t in (0.5, 1, 2))
    ]
    assert entropy[0] < entropy[1] < entropy[2]
    greedy = choose(logits, SamplingOptions(temperature=0), torch.zeros(1, 0, dtype=torch.long), torch.Generator())
    assert int(greedy) == 0


def test_top_p_keeps_the_likeliest_token_even_where_float32_rounds_top_p_to_zero():
    assert kept(PROBS.log(), top_p=5e-324) == 1
    assert kept(PROBS.log(), top_p=1e-300) == 1


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-39, GREEDY_BELOW / 2])
def test_a_temperature_below_the_smallest_that_matters_is_greedy(temperature):
    """With or without a repeat penalty (at its smallest too), whatever the scores' scale."""
    torch.manual_seed(0)
    logits, history = torch.randn(16, 50) * 30, torch.randint(0, 50, (16, 8))
    for penalty in (1.0, 1.3, 1e-4):
        options = SamplingOptions(temperature=temperature, repeat_penalty=penalty)
        greedy = choose(logits, SamplingOptions(temperature=0, repeat_penalty=penalty), history, torch.Generator())
        assert torch.equal(choose(logits, options, history, torch.Generator()), greedy)


def test_the_smallest_temperature_and_penalty_sample_from_finite_probabilities():
    """At GREEDY_BELOW with a penalty of 1e-4 the recent tokens' scores grow 10^8 times: still finite."""
    torch.manual_seed(0)
    logits, history = torch.randn(16, 50) * 1e6, torch.randint(0, 50, (16, 8))
    options = SamplingOptions(temperature=GREEDY_BELOW, repeat_penalty=1e-4)
    probs = filter_logits(penalised(logits, history, 1e-4), options).softmax(-1)
    assert torch.isfinite(probs).all()
    drawn = choose(logits, options, history, [torch.Generator().manual_seed(i) for i in range(16)])
    assert torch.equal(drawn, penalised(logits, history, 1e-4).argmax(-1))  # the gaps are that large


def test_rows_whose_scores_are_not_finite_are_refused_by_name_before_anything_is_drawn():
    logits = torch.randn(5, 10)
    logits[0, :4] = float("-inf")  # ruled out tokens: the row still draws
    logits[1, 3], logits[2, 0], logits[3] = float("nan"), float("inf"), float("-inf")
    generators = [torch.Generator().manual_seed(i) for i in range(5)]
    before = [generator.get_state() for generator in generators]
    for options in (SamplingOptions(temperature=1.0), SamplingOptions(temperature=0)):
        with pytest.raises(ScoresNotFinite) as refused:
            choose(logits, options, torch.zeros(5, 0, dtype=torch.long), generators)
        assert refused.value.rows == [1, 2, 3] and "NaN or infinite" in str(refused.value)
    assert all(torch.equal(g.get_state(), state) for g, state in zip(generators, before, strict=True))
    first = choose(logits[:1], SamplingOptions(temperature=1.0), torch.zeros(1, 0, dtype=torch.long), generators[:1])
    assert int(first) >= 4  # never a ruled-out token


def test_draw_follows_each_rows_probabilities_from_its_own_generator():
    """Rows drawn together draw what each draws alone, draw for draw; a token is drawn as often as its
    probability says (within 5 standard deviations over 4000 draws), one with none never."""
    probs = torch.tensor([[0.5, 0.3, 0.0, 0.15, 0.05], [0.0, 0.0, 1.0, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    alone = [torch.Generator().manual_seed(seed) for seed in range(3)]
    together = [torch.Generator().manual_seed(seed) for seed in range(3)]
    counts = torch.zeros_like(probs)
    for _ in range(4000):
        drawn = draw(probs, together)
        assert drawn.tolist() == [int(draw(probs[i : i + 1], [alone[i]])) for i in range(3)]
        counts[torch.arange(3), drawn] += 1
    spread = (probs * (1 - probs) * 4000).sqrt()
    assert ((counts - probs * 4000).abs() <= 5 * spread).all() and counts[probs == 0].sum() == 0


def test_rows_with_their_own_settings_draw_together_what_each_draws_alone():
    """One pass for 32 rows, each with its own controls (some at their neutral values, some greedy), its own
    history and seed, three tokens running: each row draws what it draws alone, and its generator ends
    where it would alone (a greedy row's does not move)."""
    torch.manual_seed(0)
    pick = random.Random(0)
    logits, history = torch.randn(32, 50) * 3, torch.randint(0, 50, (32, 12))
    rows = [
        SamplingOptions(
            temperature=pick.choice([0.0, GREEDY_BELOW / 2, 0.3, 0.8, 1.5]),
            top_k=pick.choice([0, 1, 5, 50, 1 << 64]),
            top_p=pick.choice([1.0, 0.9, 0.3, 1e-300]),
            min_p=pick.choice([0.0, 0.05, 0.5]),
            repeat_penalty=pick.choice([1.0, 1.3, 0.5, 1e-4]),
            repeat_last_n=pick.choice([0, 3, 64]),
        )
        for _ in range(32)
    ]
    alone = [torch.Generator().manual_seed(seed) for seed in range(32)]
    together = [torch.Generator().manual_seed(seed) for seed in range(32)]
    for _ in range(3):
        singles = [int(choose(logits[i : i + 1], rows[i], history[i : i + 1], alone[i])) for i in range(len(rows))]
        assert choose(logits, rows, history, together).tolist() == singles
        logits = logits.roll(1, dims=-1)
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(alone, together, strict=True))
    greedy = [i for i, row in enumerate(rows) if row.temperature < GREEDY_BELOW]
    assert greedy and all(
        torch.equal(together[i].get_state(), torch.Generator().manual_seed(i).get_state()) for i in greedy
    )


def test_repeat_penalty_lowers_recent_tokens_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    assert penalised(logits, torch.tensor([[0, 1, 0]]), 2.0).tolist() == [[1.0, -4.0, 1.0]]  # each token once
    # Through choose: a greedy pick moves off a token made recently.
    options = SamplingOptions(temperature=0, repeat_penalty=3.0, repeat_last_n=2)
    assert int(choose(torch.tensor([[2.0, 1.0]]), options, torch.tensor([[0]]), torch.Generator())) == 1
    assert int(choose(torch.tensor([[2.0, 1.0]]), options, torch.tensor([[0, 1, 1]]), torch.Generator())) == 0


def test_stop_filter_cuts_a_stop_string_split_across_pieces():
    stops = StopFilter(("STOP",))
    out = "".join(stops.feed(piece) for piece in ["ab", "c S", "T", "O", "P and more"])
    assert out == "abc " and stops.stopped
    partial = StopFilter(("STOP",))
    assert partial.feed("xx ST") == "xx " and partial.flush() == "ST"  # held back, then given up at the end


@pytest.fixture(scope="module")
def tiny(tiny_run):
    return load(tiny_run, device=DEVICE)


def run_text(model, tokenizer, prompt: str, **options) -> str:
    options = SamplingOptions(**options)
    return "".join(generate(model, tokenizer, read_prompt(model, tokenizer, prompt, seed=options.seed), options))


def test_generation_is_seeded_and_stop_strings_cut_it(tiny):
    model, tokenizer = tiny
    first = run_text(model, tokenizer, "KING:", max_new_tokens=40, seed=3, temperature=1.0)
    assert first == run_text(model, tokenizer, "KING:", max_new_tokens=40, seed=3, temperature=1.0)
    assert first != run_text(model, tokenizer, "KING:", max_new_tokens=40, seed=4, temperature=1.0)
    stop = first[12:15]
    cut = run_text(model, tokenizer, "KING:", max_new_tokens=40, seed=3, temperature=1.0, stop=(stop,))
    assert cut == first[: first.find(stop)]


def test_streaming_holds_byte_pieces_until_a_character_is_whole(tiny):
    _, tokenizer = tiny
    text = "na\u00efve \u65e5\u672c \U0001f600 \ue000s end"  # none of these is in the training corpus
    decoder = tokenizer.stream_decoder()
    pieces = [decoder.feed(token) for token in tokenizer.encode(text)] + [decoder.flush()]
    assert "".join(pieces) == text
    assert "" in pieces[:-1] and all("\ufffd" not in piece for piece in pieces)


def test_cli_stream_through_a_pipe_is_valid_utf8(tiny_run):
    done = subprocess.run(
        [sys.executable, "-m", "aftgen", "sample", "--model", str(tiny_run), "--device", DEVICE,
         "-p", "\U0001f600 \u65e5", "-n", "60", "--temperature", "2", "--seed", "1"],
        capture_output=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode("utf-8").startswith("\U0001f600 \u65e5")  # strict: raises on a broken character


@pytest.mark.parametrize(
    "args,message",
    [
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "2.5"], "--temperature"),  # the server's range too
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--top-k", "-1"], "--top-k"),
        (["--min-p", "1"], "--min-p"),
        (["--repeat-penalty", "0"], "--repeat-penalty"),
        (["--repeat-penalty", "1e-300"], "--repeat-penalty"),  # below 1e-4 a penalty only overflows
        (["--repeat-last-n", "-1"], "--repeat-last-n"),
        (["-n", "-2"], "--max-new-tokens"),
        (["--num-samples", "0"], "--num-samples"),
        (["--stop", ""], "--stop"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "no such file"),
        (["--load-state", "/nonexistent/s.safetensors"], "no such state file"),
        (["--num-samples", "2", "--save-state", "s.safetensors"], "--save-state"),
    ],
)
def test_invalid_values_fail_before_any_work(args, message):
    # The model does not exist either: the option error coming first shows nothing was loaded.
    result = runner.invoke(app, ["sample", "--model", "/nonexistent/model", *args])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr


def test_cli_samples_greedily_below_the_smallest_temperature_that_matters(tiny_run):
    def sample(*args: str) -> str:
        result = runner.invoke(app, ["sample", "--model", str(tiny_run), "--device", DEVICE, "-p", "KING:", *args])
        assert result.exit_code == 0, result.output
        return result.stdout

    for penalty in ("1", "1.1"):
        greedy = sample("-n", "12", "--temperature", "0", "--repeat-penalty", penalty)
        for temperature in ("1e-300", "1e-39"):
            assert sample("-n", "12", "--temperature", temperature, "--repeat-penalty", penalty) == greedy


def test_save_then_load_state_continues_exactly(tiny_run, tmp_path):
    common = ["--model", str(tiny_run), "--device", DEVICE, "--temperature", "1.2", "--repeat-penalty", "1.3"]
    whole = runner.invoke(app, ["sample", *common, "-p", "KING:", "-n", "60", "--seed", "5"])
    first = runner.invoke(
        app,
        ["sample", *common, "-p", "KING:", "-n", "25", "--seed", "5", "--save-state", str(tmp_path / "s.safetensors")],
    )
    second = runner.invoke(app, ["sample", *common, "-n", "35", "--load-state", str(tmp_path / "s.safetensors")])
    assert whole.exit_code == first.exit_code == second.exit_code == 0, first.stderr + second.stderr
    assert first.stdout + second.stdout == whole.stdout


def test_a_state_file_from_before_positions_per_row_loads_and_continues_alike(tiny, tmp_path):
    """Files written before each row kept its own position hold every layer's position 0-dim: read as (1,)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model, tokenizer = tiny
    context = read_prompt(model, tokenizer, "KING:", seed=0)
    now, before = tmp_path / "now.safetensors", tmp_path / "before.safetensors"
    save_state(now, context, model, tokenizer)
    with safe_open(now, "pt") as opened:
        metadata = opened.metadata()
    tensors = load_file(now)
    save_file({name: t.view(()) if name.endswith(".position") else t for name, t in tensors.items()}, before, metadata)
    loaded = {path: load_state(path, model, tokenizer) for path in (now, before)}
    assert [layer["position"].shape for layer in loaded[before].state] == [(1,)] * model.config.n_layer
    texts = ["".join(generate(model, tokenizer, c, SamplingOptions(max_new_tokens=20))) for c in loaded.values()]
    assert texts[0] == texts[1]


def test_state_file_size_is_independent_of_history(tiny, tmp_path):
    model, tokenizer = tiny
    sizes = []
    for prompt, tokens in (("KING:", 3), ("KING: " * 300, 200)):
        context = read_prompt(model, tokenizer, prompt, seed=0)
        "".join(generate(model, tokenizer, context, SamplingOptions(max_new_tokens=tokens), final=False))
        save_state(tmp_path / "s.safetensors", context, model, tokenizer)
        sizes.append((tmp_path / "s.safetensors").stat().st_size)
    assert sizes[0] == sizes[1]


def test_state_from_another_model_or_corrupt_bytes_is_refused(tiny, tmp_path):
    model, tokenizer = tiny
    path = tmp_path / "s.safetensors"
    save_state(path, read_prompt(model, tokenizer, "KING:", seed=0), model, tokenizer)
    torch.manual_seed(1)
    changed = type(model)(model.config).eval()
    with pytest.raises(AftgenError, match="different model weights"):
        load_state(path, changed, tokenizer)
    data = path.read_bytes()
    for bad in (os.urandom(4000), data[: len(data) // 2], b"", data[:8]):
        (tmp_path / "bad").write_bytes(bad)
        with pytest.raises(AftgenError, match="state file"):
            load_state(tmp_path / "bad", model, tokenizer)


def test_cli_refuses_a_state_from_another_model(tiny, tiny_run, tmp_path):
    model, tokenizer = tiny
    other_run = tmp_path / "other"
    torch.manual_seed(1)
    save_checkpoint(other_run, type(model)(model.config), tokenizer)
    state = tmp_path / "s.safetensors"
    save_state(state, read_prompt(model, tokenizer, "KING:", seed=0), model, tokenizer)
    result = runner.invoke(app, ["sample", "--model", str(other_run), "--device", DEVICE, "--load-state", str(state)])
    assert result.exit_code == 2 and "different model weights" in result.stderr


def test_prime_reads_a_long_text_in_chunks(tiny, tiny_run, corpus, tmp_path, monkeypatch):
    model, tokenizer = tiny
    style = tmp_path / "style.safetensors"
    result = runner.invoke(app, ["prime", "--model", str(tiny_run), "--device", DEVICE, str(corpus), "-o", str(style)])
    assert result.exit_code == 0, result.stderr
    primed = load_state(style, model, tokenizer)
    assert int(primed.state[0]["position"]) == 1 + len(tokenizer.encode(corpus.read_text()))
    # Chunk boundaries do not change what was read.
    monkeypatch.setattr(sampling, "PROMPT_CHUNK", 37)
    small_chunks = read_prompt(model, tokenizer, corpus.read_text()[:3000], seed=0)
    monkeypatch.undo()
    one_pass = read_prompt(model, tokenizer, corpus.read_text()[:3000], seed=0)
    assert (small_chunks.logits - one_pass.logits).abs().max() < 1e-4
    sampled = runner.invoke(
        app,
        ["sample", "--model", str(tiny_run), "--device", DEVICE, "--load-state", str(style), "-n", "10", "--seed", "2"],
    )
    assert sampled.exit_code == 0 and sampled.stdout.strip()


def test_chat_never_rereads_history(tiny, monkeypatch, capsys):
    from aftgen.chat import run_chat

    model, tokenizer = tiny
    read_lengths = []
    prefill = model.prefill
    monkeypatch.setattr(
        model, "prefill", lambda ids, state=None, **kw: read_lengths.append(ids.shape[1]) or prefill(ids, state, **kw)
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO("KING:\nQUEEN: speak\nNURSE:\n"))
    context = run_chat(model, tokenizer, SamplingOptions(max_new_tokens=15, seed=0), None, None)
    replies = capsys.readouterr().out
    assert replies.count("\n") >= 3
    turns = [len(tokenizer.encode(line + "\n")) for line in ("KING:", "QUEEN: speak", "NURSE:")]
    assert read_lengths == [turns[0] + 1, turns[1], turns[2]]  # only each new line (plus BOS at the start)
    assert int(context.state[0]["position"]) == sum(turns) + 1 + 3 * 15


def _read_into(stream, sink: list[bytes]) -> None:
    for chunk in iter(lambda: stream.read1(4096), b""):
        sink.append(chunk)


def test_chat_ctrl_c_stops_the_reply_and_ctrl_d_exits(tiny_run):
    chat = subprocess.Popen(
        [sys.executable, "-m", "aftgen", "chat", "--model", str(tiny_run), "--device", DEVICE,
         "-n", "-1", "--stop", "NEVER-STOP-7"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = [], []
    readers = [
        threading.Thread(target=_read_into, args=(s, sink), daemon=True)
        for s, sink in ((chat.stdout, out), (chat.stderr, err))
    ]
    for reader in readers:
        reader.start()

    def wait_for(condition, timeout=60.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert chat.poll() is None and time.monotonic() < deadline, b"".join(err).decode()
            time.sleep(0.05)

    try:
        for turn, line in enumerate((b"KING:\n", b"QUEEN:\n")):
            chat.stdin.write(line)
            chat.stdin.flush()
            seen = len(b"".join(out))
            wait_for(lambda seen=seen: len(b"".join(out)) > seen + 20)  # the reply streams, with no end of its own
            chat.send_signal(signal.SIGINT)
            wait_for(lambda turn=turn: b"".join(err).count(b"[stopped]") == turn + 1)
        chat.stdin.close()  # Ctrl-D
        assert chat.wait(timeout=60) == 0, b"".join(err).decode()
    finally:
        chat.kill()
    assert b"".join(out).decode("utf-8").strip()


def test_compiled_chunk_reader_reads_a_long_prompt_as_eager_does(tiny_run, monkeypatch):
    """prime --compile's reader: whole chunks through the compiled prefill (compiled whole: torch.compile with
    fullgraph, never the eager fallback), the rest eager, the same state."""
    from aftgen.model import compile_prefill

    monkeypatch.setattr(sampling, "PROMPT_CHUNK", 64)
    model, tokenizer = load(str(tiny_run), device=DEVICE)
    text = "KING: good night sweet lady, the crown is fair. " * 30  # several whole chunks and a remainder
    assert len(tokenizer.encode(text)) > 3 * 64
    reader, note = compile_prefill(model, 64)
    assert reader != model.prefill and note.startswith("compiled"), note  # bound methods: equal, never the same
    eager = read_prompt(model, tokenizer, text, seed=0)
    compiled = read_prompt(model, tokenizer, text, seed=0, prefill=reader)
    torch.testing.assert_close(compiled.logits, eager.logits, atol=1e-4, rtol=1e-4)
    for fast, slow in zip(compiled.state, eager.state, strict=True):
        assert fast.keys() == slow.keys()
        for name in fast:
            torch.testing.assert_close(fast[name], slow[name], atol=1e-4, rtol=1e-4, msg=name)


def test_compiled_step_generates_what_the_eager_step_does(tiny_run):
    """sample/chat --compile: the step through torch.compile gives the eager step's logits and states."""
    from aftgen.model import compile_step

    model, tokenizer = load(str(tiny_run), device=DEVICE)
    step, note = compile_step(model)
    assert step != model.step and note.startswith("compiled"), note
    fast = read_prompt(model, tokenizer, "KING: good night", seed=0)
    slow = read_prompt(model, tokenizer, "KING: good night", seed=0)
    with torch.inference_mode():
        for token in torch.randint(0, tokenizer.vocab_size, (40,), generator=torch.Generator().manual_seed(1)):
            fast_logits, _ = step(on_device(token.view(1)), fast.state)
            slow_logits, _ = model.step(on_device(token.view(1)), slow.state)
            torch.testing.assert_close(fast_logits, slow_logits, atol=1e-4, rtol=1e-4)
    for compiled_layer, eager_layer in zip(fast.state, slow.state, strict=True):
        for name in compiled_layer:
            torch.testing.assert_close(compiled_layer[name], eager_layer[name], atol=1e-4, rtol=1e-4, msg=name)


def test_chunk_reader_falls_back_to_eager_where_compiling_fails(tiny_run, monkeypatch):
    from aftgen.model import compile_prefill

    def no_compiler(function, **options):
        def fails(*args, **kwargs):
            raise RuntimeError("no C++ compiler found")

        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    model, _ = load(str(tiny_run), device=DEVICE)
    reader, note = compile_prefill(model, 16)
    assert reader == model.prefill and note.startswith("eager (torch.compile failed: RuntimeError")


def test_the_readme_python_api_example_runs_as_written(tiny_run, tmp_path, monkeypatch):
    """README's Python block that imports aftgen, run unchanged (its runs/corpus is the tiny run): no import
    missing, and prefill and step work outside torch.no_grad(), as an inference API should."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    blocks = [block.split("```", 1)[0] for block in readme.split("```python\n")[1:]]
    code = next(block for block in blocks if "from aftgen import" in block)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "corpus").symlink_to(tiny_run)
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(compile(code, "README.md", "exec"), names)
    assert names["logits"].shape == (1, names["model"].config.vocab_size)
    assert not names["logits"].requires_grad

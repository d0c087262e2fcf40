"""Checkpoints (aftgen.checkpoint): a damaged or foreign checkpoint is one error, never a traceback or a model
built from it."""

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from bad_input import JSON, assert_one_error, invoke, retensor
from conftest import make_corpus
from hypothesis import given, settings
from hypothesis import strategies as st

from aftgen.checkpoint import (
    CONFIG,
    TOKENIZER,
    WEIGHTS,
    load_checkpoint,
    read_config,
)
from aftgen.errors import AftgenError

pytestmark = pytest.mark.usefixtures("one_thread")


def _edit_json(name: str, change):
    def edit(folder: Path) -> None:
        data = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps(change(data)))

    return edit


def _write(name: str, content):
    def edit(folder: Path) -> None:
        (folder / name).write_bytes(content(folder / name) if callable(content) else content)

    return edit


def _flip_header(path: Path) -> bytes:
    data = bytearray(path.read_bytes())
    data[20:40] = b"\xff" * 20
    return bytes(data)


GPT2_CONFIG = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_layer": 12,
    "n_embd": 768,
    "vocab_size": 50257,
}


CHECKPOINT_CASES = {
    "no weights": (lambda f: (f / WEIGHTS).unlink(), "missing model.safetensors"),
    "no tokenizer": (lambda f: (f / TOKENIZER).unlink(), "missing tokenizer.model"),
    "no config": (lambda f: (f / CONFIG).unlink(), "not an aftgen checkpoint"),
    "truncated weights": (_write(WEIGHTS, lambda p: p.read_bytes()[: p.stat().st_size // 2]), "truncated or corrupt"),
    "corrupt weights header": (_write(WEIGHTS, _flip_header), "truncated or corrupt"),
    "empty weights": (_write(WEIGHTS, b""), "truncated or corrupt"),
    "misshapen tensor": (
        retensor(lambda t: t | {"embed.weight": t["embed.weight"][:, :16].contiguous()}),
        "config.json needs",
    ),
    "extra tensor": (retensor(lambda t: t | {"lm_head.weight": t["embed.weight"].clone()}), "unexpected"),
    "missing tensor": (retensor(lambda t: {k: v for k, v in t.items() if k != "ln_out.bias"}), "missing"),
    "integer tensor": (retensor(lambda t: t | {"ln_out.bias": t["ln_out.bias"].int()}), "torch.int32"),
    "NaN weights": (retensor(lambda t: t | {"ln_out.bias": t["ln_out.bias"] * float("nan")}), "NaN or inf"),
    "config not JSON": (_write(CONFIG, b"{not json"), "not valid JSON"),
    "config not UTF-8": (_write(CONFIG, b"\xff\xfe{}"), "not valid JSON"),
    "config deeply nested": (_write(CONFIG, b"[" * 100_000), "not valid JSON"),
    "config 5000-digit number": (_write(CONFIG, b'{"vocab_size": 1' + b"0" * 5000 + b"}"), "not valid JSON"),
    "config a list": (_write(CONFIG, b"[1, 2]"), "must hold a JSON object"),
    "config wrong type": (_edit_json(CONFIG, lambda c: c | {"n_layer": "2"}), "'n_layer' must be int"),
    "config bool for int": (_edit_json(CONFIG, lambda c: c | {"n_head": True}), "'n_head' must be int"),
    "config unknown key": (_edit_json(CONFIG, lambda c: c | {"rope_theta": 10000}), "unknown keys: rope_theta"),
    "config from GPT-2": (_write(CONFIG, json.dumps(GPT2_CONFIG).encode()), "model_type is 'gpt2'"),
    "config newer format": (
        _edit_json(CONFIG, lambda c: c | {"format_version": 99}),
        "format_version 99 is not supported",
    ),
    "config absurd size": (_edit_json(CONFIG, lambda c: c | {"n_embd": 10**12}), "must be at most"),
    "config vocab mismatch": (_edit_json(CONFIG, lambda c: c | {"vocab_size": c["vocab_size"] + 1}), "tokenizer has"),
    "tokenizer garbage": (_write(TOKENIZER, b"\x08\x96\x01 definitely not sentencepiece"), "not a valid SentencePiece"),
    "tokenizer truncated": (_write(TOKENIZER, lambda p: p.read_bytes()[:100]), "not a valid SentencePiece"),
}


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_bad_checkpoint(tmp_path, tiny_run, case):
    folder = tmp_path / "model"
    shutil.copytree(tiny_run, folder)
    edit, message = CHECKPOINT_CASES[case]
    edit(folder)
    assert_one_error(invoke("sample", "--model", folder, "--prompt", "KING:", "-n", "4"), message)


def test_config_bigger_than_its_weights_is_refused_without_allocating(tmp_path, tiny_run):
    """200 layers of width 1024 would take 10 GB; the model is built on the meta device, checked, refused."""
    shutil.copytree(tiny_run, tmp_path / "model")
    _edit_json(CONFIG, lambda c: c | {"n_layer": 200, "n_embd": 1024, "n_head": 2})(tmp_path / "model")
    with pytest.raises(AftgenError, match="weights do not match config.json"):
        load_checkpoint(tmp_path / "model")


def test_tokenizer_from_another_model_is_refused(tmp_path, tiny_run):
    from aftgen.tokenizer import train_tokenizer

    shutil.copytree(tiny_run, tmp_path / "model")
    other = train_tokenizer(make_corpus(20_000, seed=9), 300, log=lambda _: None)
    (tmp_path / "model" / TOKENIZER).write_bytes(other.model_proto)
    assert_one_error(
        invoke("sample", "--model", tmp_path / "model", "--prompt", "x"),
        r"tokenizer has \d+ pieces but config.json says vocab_size \d+",
    )


@pytest.fixture(scope="module")
def scratch_checkpoint(tmp_path_factory, tiny_run) -> Path:
    folder = tmp_path_factory.mktemp("damaged") / "model"
    shutil.copytree(tiny_run, folder)
    return folder


def damaged(original: bytes) -> st.SearchStrategy[bytes]:
    """Truncations, a few overwritten bytes (often in the header) and plain random bytes."""
    where = st.integers(0, len(original) - 1) | st.integers(0, min(len(original) - 1, 400))
    edits = st.lists(st.tuples(where, st.integers(0, 255)), min_size=1, max_size=8)

    def apply(changes):
        data = bytearray(original)
        for index, value in changes:
            data[index] = value
        return bytes(data)

    return st.integers(0, len(original) - 1).map(lambda n: original[:n]) | edits.map(apply) | st.binary(max_size=600)


@pytest.mark.parametrize("name", [CONFIG, WEIGHTS, TOKENIZER])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_checkpoint_loader_on_damaged_files(scratch_checkpoint, tiny_run, name, data):
    original = (tiny_run / name).read_bytes()
    (scratch_checkpoint / name).write_bytes(data.draw(damaged(original)))
    try:
        model, tokenizer = load_checkpoint(scratch_checkpoint)
    except AftgenError:
        return
    finally:
        (scratch_checkpoint / name).write_bytes(original)
    ids = torch.tensor([[tokenizer.bos_id, *tokenizer.encode("KING: fair")]])
    assert model(ids).shape == (1, ids.shape[1], model.config.vocab_size)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=200).map(str.encode) | JSON.map(lambda v: json.dumps(v).encode()))
def test_read_config_on_arbitrary_bytes(content):
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / CONFIG).write_bytes(content)
        try:
            read_config(folder)
        except AftgenError:
            pass

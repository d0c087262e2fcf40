"""A checkpoint in Hugging Face transformers (aftgen.hf): the files beside the weights load with trust_remote_code
and give aftgen's ids, log-probabilities, loss and greedy text, generating from a state of constant size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fake_hub import FakeHub
from hub_users import TOKEN, aftgen_session, hub_env

from aftgen.checkpoint import CHECKPOINT_FILES, load_checkpoint, read_config, save_checkpoint
from aftgen.hf import SOURCES, TOKENIZER_CONFIG
from aftgen.mixers.aft import aft_naive, aft_parallel, aft_step, empty_state, soft_cap, step_tables
from aftgen.model import AFTLM, AFTConfig
from aftgen.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
from aftgen.hf import modeling_aftgen  # noqa: E402 (imports transformers)

SHIPPED = Path(__file__).parents[2] / "models" / "shakespeare"
TEXT = "ROMEO:\nBut soft! what light through yonder window breaks?\nIt is the east. <s> \u2581\ue000 é😀\n"


def random_inputs(T: int, s: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, 2, T, 3, 4, generator=g).to(dtype).unbind(0)
    w = soft_cap(torch.randn(3, s, generator=g) * 2)
    return q, soft_cap(k.float() * 3), v, w, torch.rand(3, generator=g) * 0.3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("s,T,chunk", [(5, 40, 8), (0, 21, 4), (8, 50, 64), (3, 9, 2)])
def test_the_shipped_formula_agrees_with_aftgens_mixer_and_the_oracle(s, T, chunk, dtype):
    q, k, v, w, decay = random_inputs(T, s, dtype=dtype)
    q, v = q.float(), v.float()  # as both mixers take them, whatever the model's dtype
    oracle = aft_naive(q, k, v, w, decay)
    state = modeling_aftgen.empty_state(2, 3, 4, s)
    theirs, _ = modeling_aftgen.aft_chunks(q, k, v, w, decay, state, chunk)
    ours, _ = aft_parallel(q, k, v, w, decay)
    assert (theirs.double() - oracle).abs().max() < 1e-5
    assert (ours.double() - oracle).abs().max() < 1e-5
    # The step forms: one token at a time from each one's state.
    state, aftgen_state = modeling_aftgen.empty_state(2, 3, 4, s), empty_state(2, 3, 4, s)
    tables = step_tables(w, decay)
    stepped, aftgen_stepped = [], []
    for t in range(T):
        y, state = modeling_aftgen.aft_read(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], w, decay, state)
        stepped.append(y[:, 0])
        aftgen_stepped.append(aft_step(q[:, t], k[:, t], v[:, t], tables, aftgen_state))
    assert (torch.stack(stepped, 1).double() - oracle).abs().max() < 1e-5
    assert (torch.stack(aftgen_stepped, 1).double() - oracle).abs().max() < 1e-5


def exported(source: Path, folder: Path) -> Path:
    """A copy of `source` saved by aftgen now (with transformers' files), its weights stored as they were."""
    model, tokenizer = load_checkpoint(source)
    stored = {torch.float16: "fp16", torch.bfloat16: "bf16"}
    save_checkpoint(folder, model, tokenizer, weights_dtype=stored.get(_stored_dtype(source), "fp32"))
    return folder


def _stored_dtype(folder: Path) -> torch.dtype:
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as weights:
        return weights.get_tensor(next(iter(weights.keys()))).dtype


def gelu_model(folder: Path, tokenizer_source: Path) -> Path:
    """An untrained AFT-simple model with GELU (a config.json without "activation"), stored in fp32."""
    tokenizer = Tokenizer.load(tokenizer_source / "tokenizer.model")
    torch.manual_seed(0)
    config = AFTConfig(vocab_size=tokenizer.vocab_size, n_layer=2, n_embd=32, n_head=2, window=0,
                       context_length=32, mixer="aft_simple")  # fmt: skip
    model = AFTLM(config)
    for block in model.blocks:
        block.mixer.perturb_()
    save_checkpoint(folder, model.eval(), tokenizer)
    return folder


def greedy(model: AFTLM, ids: list[int], count: int) -> list[int]:
    """aftgen's greedy continuation: the prompt read in parallel, then one step a token."""
    logits, state = model.prefill(torch.tensor([ids]), last_only=True)
    chosen = []
    for _ in range(count):
        chosen.append(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))
        logits, state = model.step(torch.tensor(chosen[-1:]), state)
    return chosen


@pytest.fixture(scope="module", params=["shipped", "fresh", "gelu"])
def folder(request, tmp_path_factory, tiny_run) -> Path:
    made = {
        "shipped": lambda path: exported(SHIPPED, path),
        "fresh": lambda path: tiny_run,  # saved by training: a run folder as it is
        "gelu": lambda path: gelu_model(path, tiny_run),
    }
    return made[request.param](tmp_path_factory.mktemp(request.param))


def load(folder: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, dtype=dtype, output_loading_info=True
    )
    assert not any(info.values()), info  # every weight read, none left over
    return model.eval(), AutoTokenizer.from_pretrained(folder, trust_remote_code=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_reads_a_checkpoint_as_aftgen_does(folder, dtype):
    ours, tokenizer = load_checkpoint(folder)
    model, hf_tokenizer = load(folder, dtype)
    ids = [tokenizer.bos_id, *tokenizer.encode(TEXT)]
    assert hf_tokenizer(TEXT).input_ids == ids
    assert hf_tokenizer.decode(ids) == TEXT
    with torch.no_grad():
        expected = torch.log_softmax(ours(torch.tensor([ids])), -1)
        output = model(torch.tensor([ids]), labels=torch.tensor([ids]))
    logprobs = torch.log_softmax(output.logits.float(), -1)
    loss = -expected[0, :-1].gather(-1, torch.tensor(ids[1:])[:, None]).mean()
    close = 1e-3 if dtype == torch.float32 else 0.25  # bf16: every activation rounded to 8 bits of mantissa
    assert (logprobs - expected).abs().max() < close
    assert abs(float(output.loss) / float(loss) - 1) < (1e-4 if dtype == torch.float32 else 0.02)


def test_generate_is_aftgens_greedy_text_from_a_state_of_constant_size(folder):
    ours, tokenizer = load_checkpoint(folder)
    model, hf_tokenizer = load(folder, torch.float32)
    prompt = hf_tokenizer("ROMEO:", return_tensors="pt").input_ids
    fed, sizes = [], []

    def record(module, args, kwargs):
        fed.append(kwargs["input_ids"].shape[1])
        state = kwargs.get("state")
        sizes.append(sum(t.numel() for layer in state for t in layer.values()) if state else None)

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = model.generate(prompt, max_new_tokens=24, do_sample=False)
    finally:
        hook.remove()
    assert out[0, prompt.shape[1] :].tolist() == greedy(ours, prompt[0].tolist(), 24)
    assert fed == [prompt.shape[1]] + [1] * 23  # the prompt once, then only each new token
    assert sizes[0] is None and len(set(sizes[1:])) == 1  # the state read at every step: one size throughout


def test_aftgen_ignores_transformers_keys_and_an_old_folder_still_loads(tiny_run, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    for name in CHECKPOINT_FILES:
        shutil.copyfile(tiny_run / name, old / name)
    config = json.loads((tiny_run / "config.json").read_text())
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"}
    for key in ("auto_map", "architectures", "bos_token_id"):
        del config[key]
    (old / "config.json").write_text(json.dumps(config))
    assert read_config(old) == read_config(tiny_run)
    load_checkpoint(old)


def test_pushing_an_old_folder_adds_what_transformers_needs(tiny_run, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    for name in CHECKPOINT_FILES:
        shutil.copyfile(tiny_run / name, old / name)
    config = json.loads((tiny_run / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "auto_map"}))
    with FakeHub(token=TOKEN) as hub:
        (pushed,) = aftgen_session(hub_env(hub, tmp_path / "home"), ["push", str(old), "carol/old"])
        assert pushed.returncode == 0, pushed.stderr
        repo = hub.repos["carol/old"]
        files = repo.commits[repo.branches["main"]]
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in [*CHECKPOINT_FILES, TOKENIZER_CONFIG, *SOURCES]:
        (clone / name).write_bytes(files[name])
    model, hf_tokenizer = load(clone, torch.float32)
    ours, tokenizer = load_checkpoint(old)
    ids = hf_tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        assert (torch.log_softmax(model(ids).logits, -1) - torch.log_softmax(ours(ids), -1)).abs().max() < 1e-3

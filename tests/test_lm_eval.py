"""lm-evaluation-harness against a real `aftgen serve`, as its users point it: `local-completions` with the remote
tokenizer (vLLM's /tokenizer_info, /tokenize, /detokenize) and no other adapter, on two tasks of our own made
from local files (no download): a multiple-choice task (loglikelihood) and a rolling-perplexity one
(loglikelihood_rolling, as wikitext's). Its figures are checked against `aftgen eval`'s on the same text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from serving import KEY, running

from aftgen.api import load
from aftgen.corpus.sources import scan_file
from aftgen.evaluate import evaluate_file, stream_nll

lm_eval = pytest.importorskip("lm_eval")  # the test extra has it; a bare install skips

# Each a sentence of the tiny model's corpus (tests/conftest.py make_corpus): Shakespeare-like verse.
QUESTIONS = [
    {"question": "KING: What say you,", "choices": ["my lord?", "zq xv?", "0 0 0"], "answer": 0},
    {"question": "QUEEN: Good morrow,", "choices": ["kj wq", "sweet prince.", "##"], "answer": 1},
]
PASSAGES = [
    "KING: What light through yonder window breaks? It is the east, and the sun doth rise.",
    "QUEEN: Now is the winter of our discontent made glorious summer by this sun of York.",
]


def task_files(folder: Path) -> Path:
    """Two tasks' YAML and JSON-lines data in `folder`, for lm-eval's --include_path."""
    for name, rows in [("choice", QUESTIONS), ("rolling", [{"text": text} for text in PASSAGES])]:
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = f"dataset_path: json\ntest_split: test\ndataset_kwargs:\n  cache_dir: {folder / 'cache'}\n"
    (folder / "choice.yaml").write_text(
        f"task: aftgen_choice\n{common}  data_files:\n    test: {folder / 'choice.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "rolling.yaml").write_text(
        f"task: aftgen_rolling\n{common}  data_files:\n    test: {folder / 'rolling.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: bits_per_byte\n  - metric: byte_perplexity\n"
    )
    return folder


def test_lm_eval_scores_aftgen_serve_as_aftgen_eval_does(tiny_run, tmp_path, monkeypatch):
    for offline in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(offline, "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # what local-completions sends as its key
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(task_files(tmp_path)), include_defaults=False)
    with running(tiny_run, max_body_bytes=1 << 16) as url:
        results = simple_evaluate(
            model="local-completions",
            model_args={
                "base_url": f"{url}/v1/completions",
                "tokenizer_backend": "remote",
                "auth_token": KEY,
                "max_length": 300,  # the server's max_prompt_tokens (tests/test_serve.py LIMITS): one window a text
            },
            tasks=["aftgen_choice", "aftgen_rolling"],
            task_manager=tasks,
            log_samples=True,
            bootstrap_iters=0,
        )

    model, tokenizer = load(tiny_run)
    bits = 0.0
    for i, text in enumerate(PASSAGES):  # each from its start, as lm-eval scores each document
        (tmp_path / f"passage{i}.txt").write_text(text)
        ours = evaluate_file(model, tokenizer, scan_file(tmp_path / f"passage{i}.txt"))  # what `aftgen eval` prints
        bits += ours.bits_per_byte * len(text.encode())
    theirs = results["results"]["aftgen_rolling"]["bits_per_byte,none"]
    assert theirs == pytest.approx(bits / sum(len(text.encode()) for text in PASSAGES), rel=0.005)

    for sample in results["samples"]["aftgen_choice"]:  # each choice scored as the model scores it
        question = sample["doc"]["question"]
        for choice, ((score, _),) in zip(sample["doc"]["choices"], sample["resps"], strict=True):
            context = tokenizer.encode(question)
            whole = tokenizer.encode(f"{question} {choice}")
            losses = stream_nll(model, torch.tensor([tokenizer.bos_id, *whole]))
            assert score == pytest.approx(-float(losses[len(context) :].sum()), abs=1e-3)
    assert 0 <= results["results"]["aftgen_choice"]["acc,none"] <= 1

"""A checkpoint in Hugging Face transformers against aftgen, with issue 58's figures: ids (of 2,000 characters),
log-probabilities and loss (of 1,024 tokens), greedy text and the time a token of a long generate().

aftgen's side runs here (its numbers written to a file); transformers' side in `--python`, an environment that
need not hold aftgen, with the network off, reading the checkpoint folder as saved by aftgen now:

    .venv/bin/python scripts/transformers_check.py TEXT_FILE [--model M] [--python OTHER_VENV/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from aftgen.api import default_model_path
from aftgen.checkpoint import load_checkpoint, save_checkpoint
from aftgen.hub import resolve_model

CHARS, TOKENS, GREEDY, LONG = 2000, 1024, 64, 2000

TRANSFORMERS_SIDE = """
import json, sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, reference = sys.argv[1], json.load(open(sys.argv[2]))
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
ids = tokenizer(reference["text"]).input_ids
print(f"ids of {len(reference['text'])} characters: {len(ids)}, equal to aftgen's: {ids == reference['ids']}")
window = tokenizer(reference["long_text"], return_tensors="pt").input_ids[:, : len(reference["logprobs"]) + 1]
with torch.no_grad():
    output = model(window, labels=window)
logprobs = torch.log_softmax(output.logits[0, :-1], -1).gather(-1, window[0, 1:, None])[:, 0]
worst = (logprobs - torch.tensor(reference["logprobs"])).abs().max().item()
print(f"log-probabilities of {len(logprobs)} tokens: largest difference {worst:.2e} (bar 1e-3)")
print(f"labels= loss {output.loss.item():.6f}, aftgen {reference['loss']:.6f}: "
      f"relative {abs(output.loss.item() / reference['loss'] - 1):.2e} (bar 1e-4)")
prompt = tokenizer("ROMEO:", return_tensors="pt").input_ids
greedy = model.generate(prompt, max_new_tokens=len(reference["greedy"]), do_sample=False)[0, prompt.shape[1]:]
print(f"greedy {len(greedy)} tokens equal to aftgen's: {greedy.tolist() == reference['greedy']}")

class Clock:
    def __init__(self):
        self.times = []
    def put(self, value):
        self.times.append(time.perf_counter())
    def end(self):
        pass

clock = Clock()
model.generate(prompt, max_new_tokens=reference["long"], min_new_tokens=reference["long"], do_sample=True,
               top_k=0, streamer=clock)
ticks = clock.times[1:]  # the first put is the prompt
early = (ticks[300] - ticks[100]) / 200
late = (ticks[2000 - 1] - ticks[1800 - 1]) / 200
print(f"generate() of {len(ticks)} tokens: {early * 1e3:.2f} ms a token over tokens 100-300, "
      f"{late * 1e3:.2f} ms over 1,800-2,000: ratio {late / early:.2f} (bar 1.5)")
"""


def reference(model_folder: Path, text: str, long_text: str) -> dict:
    """aftgen's ids of `text`, log-probabilities of the first TOKENS of `long_text` and their mean loss, and its
    greedy tokens."""
    model, tokenizer = load_checkpoint(model_folder)
    ids = [tokenizer.bos_id, *tokenizer.encode(text)]
    window = torch.tensor([[tokenizer.bos_id, *tokenizer.encode(long_text)][: TOKENS + 1]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(window[:, :-1]), -1)[0].gather(-1, window[0, 1:, None])[:, 0]
        logits, state = model.prefill(torch.tensor([[tokenizer.bos_id, *tokenizer.encode("ROMEO:")]]), last_only=True)
        greedy = []
        for _ in range(GREEDY):
            greedy.append(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))
            logits, state = model.step(torch.tensor(greedy[-1:]), state)
    loss = float(-logprobs.double().mean())
    return {"text": text, "long_text": long_text, "ids": ids, "logprobs": logprobs.tolist(), "loss": loss,
            "greedy": greedy, "long": LONG}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", type=Path, help="a UTF-8 text; the first 2,000 characters of its last 10% are read")
    parser.add_argument("--model", default=None, help="a run folder or Hub id (default: the shipped model)")
    parser.add_argument("--python", default=sys.executable, help="the Python that has transformers")
    args = parser.parse_args()
    source = resolve_model(args.model) if args.model else default_model_path()
    text = args.text.read_text(encoding="utf-8")
    held_out = text[len(text) - len(text) // 10 :]
    with tempfile.TemporaryDirectory() as work:
        folder, numbers = Path(work) / "model", Path(work) / "reference.json"
        model, tokenizer = load_checkpoint(source)
        save_checkpoint(folder, model, tokenizer)  # as aftgen saves a checkpoint now: transformers' files too
        numbers.write_text(json.dumps(reference(folder, held_out[:CHARS], held_out[: 4 * CHARS])))
        env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        subprocess.run([args.python, "-c", TRANSFORMERS_SIDE, str(folder), str(numbers)], env=env, check=True)


if __name__ == "__main__":
    main()

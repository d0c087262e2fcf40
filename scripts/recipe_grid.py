"""Measure the recipe's choices over a grid (issue 49): for each vocabulary, preset and context length, train
with those options for a fixed wall-time budget, then score the run on the corpus's held-out text.

    python scripts/recipe_grid.py ../corpora/debian-docs-10mb --budget 300 --vocab 512,1024,2048,4096 \
        --preset small,medium --context 1,2 --results grid.jsonl
    python scripts/recipe_grid.py --results grid.jsonl --report docs/recipe-vocabulary.png

A corpus folder holds train.txt and held_out.txt (scripts/make_corpora.py makes them). Each run appends one
JSON line to --results: its options, the steps it made, the characters a token, the share of a token's
multiply-adds spent in the embedding's softmax, and held-out nats/char from `aftgen eval`. Runs already in the
results file are skipped, so an interrupted grid goes on where it stopped. Run it alone on the machine: every
figure is a race against the clock.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from aftgen.checkpoint import read_config
from aftgen.files import append_durably, atomic_write, read_json, read_text
from aftgen.model import PRESETS, AFTConfig

AFTGEN = [sys.executable, "-m", "aftgen"]
RESULTS_LIMIT = 16 << 20  # bytes: a results file of a few thousand lines
RECORD_LIMIT = 64 << 20  # bytes: a run's training.json


def logits_share(config: AFTConfig) -> float:
    """The share of a token's multiply-adds in the tied embedding's product with the last layer (the softmax's
    logits), against the blocks' matrices: what a larger vocabulary costs a step of this width."""
    logits = config.vocab_size * config.n_embd
    return logits / (logits + config.n_layer * (4 + 2 * config.mlp_ratio) * config.n_embd**2)


def run_one(corpus: Path, out: Path, budget: int, vocab: int, preset: str, context_factor: int) -> dict:
    """Train with these options for `budget` seconds, score on held_out.txt; the figures as a dict."""
    context = PRESETS[preset]["context_length"] * context_factor
    command = AFTGEN + ["train", str(corpus / "train.txt"), "--out", str(out), "--overwrite", "--quiet",
                        "--max-time", str(budget), "--vocab-size", str(vocab), "--preset", preset,
                        "--context-length", str(context)]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True)
    wall = time.perf_counter() - started
    scored = subprocess.run(AFTGEN + ["eval", str(corpus / "held_out.txt"), "--model", str(out), "--json"],
                            check=True, capture_output=True, text=True)  # fmt: skip
    score = json.loads(scored.stdout)
    record = read_json(out / "training.json", RECORD_LIMIT, "a run's record")
    config = read_config(out)
    return {
        "corpus": corpus.name, "budget_s": budget, "vocab": vocab, "preset": preset, "context": context,
        "steps": record["step"], "train_s": record["elapsed"], "wall_s": round(wall, 1),
        "parameters": record["parameters"], "chars_per_token": score["chars"] / score["tokens"],
        "logits_share": logits_share(config), "nats_per_char": score["nats_per_char"],
    }  # fmt: skip


def done_keys(results: Path) -> set[tuple]:
    if not results.exists():
        return set()
    lines = read_text(results, RESULTS_LIMIT, "the grid's results").splitlines()
    return {key(json.loads(line)) for line in lines if line.strip()}


def key(row: dict) -> tuple:
    return row["corpus"], row["budget_s"], row["vocab"], row["preset"], row["context"]


def report(rows: list[dict], picture: Path) -> None:
    """The results as a Markdown table on stdout, and held-out nats/char against the vocabulary, a line for each
    corpus, budget, preset and context, drawn to `picture`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    print("| corpus | budget | preset | context | vocabulary | chars/token | logits' share | steps | chars read | "
          "nats/char |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    lines: dict[tuple, list[dict]] = {}
    for row in sorted(rows, key=lambda row: (*key(row)[:2], *key(row)[3:], row["vocab"])):
        tokens = row["steps"] * row["context"] * PRESETS[row["preset"]]["batch_size"]
        print(f"| {row['corpus']} | {row['budget_s']} s | {row['preset']} | {row['context']} | {row['vocab']} | "
              f"{row['chars_per_token']:.2f} | {row['logits_share']:.0%} | {row['steps']:,} | "
              f"{tokens * row['chars_per_token'] / 1e6:.1f}M | {row['nats_per_char']:.4f} |")  # fmt: skip
        lines.setdefault((row["corpus"], row["budget_s"], row["preset"], row["context"]), []).append(row)
    figure, axes = plt.subplots(figsize=(9, 4.5))
    for (corpus, budget, preset, context), points in lines.items():
        label = f"{corpus}, {budget} s, {preset}, context {context}"
        axes.plot([p["vocab"] for p in points], [p["nats_per_char"] for p in points], marker="o", label=label)
    axes.set(xscale="log", xlabel="vocabulary (pieces)", ylabel="held-out nats/char")
    axes.set_xticks([512, 1024, 2048, 4096], ["512", "1,024", "2,048", "4,096"])
    axes.minorticks_off()
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    figure.tight_layout()
    figure.savefig(picture, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path, nargs="?", help="a folder with train.txt and held_out.txt")
    parser.add_argument("--report", type=Path, help="write no runs: the results' table, and their plot here")
    parser.add_argument("--budget", type=int, default=300, help="seconds of training a run")
    parser.add_argument("--vocab", default="512,1024,2048,4096")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--context", default="1", help="context lengths as multiples of the preset's")
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--runs", type=Path, default=Path("/tmp/recipe-grid"), help="where the runs go")
    args = parser.parse_args()
    if args.report:
        lines = read_text(args.results, RESULTS_LIMIT, "the grid's results").splitlines()
        return report([json.loads(line) for line in lines if line.strip()], args.report)
    if args.corpus is None:
        parser.error("give a corpus folder to measure, or --report")
    done = done_keys(args.results)
    if not args.results.exists():
        atomic_write(args.results, b"")
    for preset in args.preset.split(","):
        for factor in map(int, args.context.split(",")):
            for vocab in map(int, args.vocab.split(",")):
                context = PRESETS[preset]["context_length"] * factor
                if (args.corpus.name, args.budget, vocab, preset, context) in done:
                    continue
                out = args.runs / f"{args.corpus.name}-{args.budget}s-{preset}-v{vocab}-c{context}"
                row = run_one(args.corpus, out, args.budget, vocab, preset, factor)
                append_durably(args.results, (json.dumps(row) + "\n").encode())
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

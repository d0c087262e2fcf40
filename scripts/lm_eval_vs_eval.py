"""lm-evaluation-harness's bits per byte on a text, through `aftgen serve`, against `aftgen eval`'s (issue 48's bar:
within 0.5%).

One `aftgen serve` (as `aftgen bench serve` starts it), lm-eval's `local-completions` with its remote tokenizer
on a rolling-perplexity task holding the text (a local JSON-lines file: no download), then `aftgen eval --json`
on the same text. Needs the test extra (lm-eval):

    .venv/bin/python scripts/lm_eval_vs_eval.py TEXT_FILE [--model M] [--chars 5000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from aftgen.bench.options import BenchServeOptions
from aftgen.bench.serve import ServerProcess

CONTEXT = 8192  # tokens: the server's default --max-prompt-tokens, so that the text is one window


def rolling_task(folder: Path, text: str) -> None:
    (folder / "text.jsonl").write_text(json.dumps({"text": text}) + "\n")
    (folder / "text.yaml").write_text(
        f"task: aftgen_text\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n  cache_dir: {folder / 'cache'}\n"
        f"  data_files:\n    test: {folder / 'text.jsonl'}\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: bits_per_byte\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", type=Path, help="a UTF-8 text file (its last --chars characters are scored)")
    parser.add_argument("--model", default=None, help="a run folder or Hub id (default: the shipped model)")
    parser.add_argument("--chars", type=int, default=5000)
    args = parser.parse_args()
    os.environ |= {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as folder:
        text = args.text.read_text(encoding="utf-8")[-args.chars :]
        rolling_task(Path(folder), text)
        (Path(folder) / "text.txt").write_text(text, encoding="utf-8")
        with ServerProcess(BenchServeOptions(model=args.model)) as server:
            model_args = {
                "base_url": f"http://{server.host}:{server.port}/v1/completions",
                "tokenizer_backend": "remote",
                "max_length": CONTEXT,
            }
            tasks = TaskManager(include_path=folder, include_defaults=False)
            results = simple_evaluate("local-completions", model_args, ["aftgen_text"], task_manager=tasks)
        theirs = results["results"]["aftgen_text"]["bits_per_byte,none"]
        command = [sys.executable, "-m", "aftgen", "eval", str(Path(folder) / "text.txt"), "--json"]
        command += ["--model", args.model] if args.model else []
        ours = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)["bits_per_byte"]
    difference = theirs / ours - 1
    print(f"{len(text):,} characters: lm-eval {theirs:.5f} bits/byte, aftgen eval {ours:.5f} bits/byte: "
          f"{difference:+.3%} ({'within' if abs(difference) <= 0.005 else 'past'} the bar of 0.5%)")  # fmt: skip


if __name__ == "__main__":
    main()

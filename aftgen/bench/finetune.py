"""`aftgen bench finetune`: where fine-tuning a pretrained model beats training from scratch, and
where the advantage fades. Each pair of runs, one fine-tuning the base with the fine-tuning defaults
and one from scratch with the defaults plus --keep-best, trains at the same time for the same wall
time on one thread each, so the machine's load hits both alike."""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from aftgen.bench.targets import TARGETS, Row
from aftgen.corpus import read_text
from aftgen.files import atomic_write
from aftgen.record import read_run_files

ENTRY_SEPARATOR = "\n%\n"  # fortune files: entries separated by '%' lines
EVAL_INTERVAL = 50  # both runs check often enough for --keep-best to catch a small corpus's best


def mixed_text(files: list[Path], seed: int = 0) -> str:
    """The entries of all files (fortune-style, '%'-separated; a plain file is one entry), shuffled
    with a fixed seed, so a slice of any size mixes every file."""
    entries = [entry for path in files for entry in read_text(path).split(ENTRY_SEPARATOR)]
    random.Random(seed).shuffle(entries)
    return ENTRY_SEPARATOR.join(entry.strip("\n") for entry in entries if entry.strip())


def train_for(corpus: Path, out: Path, seconds: float, init_from: str | None) -> float:
    """Train on one thread for `seconds`; the final held-out nats/char. Meant for a fresh process."""
    import torch

    from aftgen.training.loop import train
    from aftgen.training.options import TrainOptions

    torch.set_num_threads(1)
    changes = {"init_from": init_from} if init_from else {"keep_best": True}
    options = TrainOptions(corpus, out, max_time=seconds, max_steps=10**9, eval_interval=EVAL_INTERVAL, **changes)
    train(options, quiet=True)
    return read_run_files(out)[0]["final_eval"]["nats_per_char"]


def bench_finetune(
    base: str, corpus: list[Path], sizes: list[int | None], seconds: list[float], log: Callable[[str], None] = print
) -> list[Row]:
    """Held-out nats/char of fine-tuning `base` and of training from scratch, per corpus size (chars;
    None: all of it) and wall time, and the main target: 50 KB, 60 s."""
    text = mixed_text(corpus)
    rows: list[Row] = []
    context = get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="aftgen-bench-finetune-") as folder:
        for size in sizes:
            path, sliced = Path(folder) / f"corpus-{size or 'all'}.txt", text[:size] if size else text
            atomic_write(path, sliced, durable=False)  # a temporary folder's: nothing to keep after a crash
            for budget in seconds:
                where = {"corpus_chars": len(sliced), "train_seconds": budget}
                with ProcessPoolExecutor(max_workers=2, mp_context=context) as pool:
                    runs = {
                        kind: pool.submit(train_for, path, Path(folder) / f"{kind}-{size}-{budget}", budget, start)
                        for kind, start in (("fine-tuned", base), ("from scratch", None))
                    }
                    scores = {kind: run.result() for kind, run in runs.items()}
                gain = scores["from scratch"] - scores["fine-tuned"]
                for kind, score in scores.items():
                    rows.append(
                        {"measure": f"held-out, {kind}", "value": round(score, 4), "unit": "nats/char", **where}
                    )
                rows.append(
                    {"measure": "fine-tuning's advantage", "value": round(gain, 4), "unit": "nats/char", **where}
                )
                log(f"  {where['corpus_chars']:,} chars, {budget:g} s: fine-tuned {scores['fine-tuned']:.4f}, "
                    f"from scratch {scores['from scratch']:.4f} nats/char (advantage {gain:+.4f})")  # fmt: skip
                if size == 50_000 and budget == 60:
                    rows.append(TARGETS["fine-tuning advantage"].judge(gain))
    return rows

"""`aftgen bench ...`: the benchmarks' commands (registered on the main app with add_typer)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from aftgen.bench.options import BenchServeOptions
from aftgen.cli.common import (
    DeviceOption,
    DtypeOption,
    command,
    options_from,
    progress,
    require_file,
    set_up_torch,
    whole_numbers,
)
from aftgen.errors import AftgenError

bench_app = typer.Typer(help="Measure speed and memory on this machine (no subcommand: `bench all`).")
AsJson = Annotated[bool, typer.Option("--json", help="One JSON object per row on stdout.")]
PlotFile = Annotated[
    Path | None, typer.Option("--plot", help="Also draw the rows to this PNG (needs matplotlib: aftgen\\[plot]).")
]
Corpus = Annotated[Path | None, typer.Option("--corpus", help="Text for the quality rows (left out without it).")]
QualityTime = Annotated[float, typer.Option("--quality-time", help="Training seconds per mixer for the quality rows.")]


def _report(rows: list, as_json: bool, plot: Path | None) -> None:
    from aftgen.bench.mixers import comparison_targets
    from aftgen.bench.report import plot_comparison, print_comparison

    rows = rows + comparison_targets(rows)
    print_comparison(rows, as_json)
    if plot is not None:
        plot_comparison(rows, plot)
        print(f"plot: {plot}", file=sys.stderr)


def _check_plot(plot: Path | None) -> None:
    """--plot without matplotlib is refused before the benchmark runs, not after it."""
    from aftgen.bench.report import pyplot

    if plot is not None:
        pyplot()


@bench_app.callback(invoke_without_command=True)
def bench_main(
    ctx: typer.Context, corpus: Corpus = None, quality_time: QualityTime = 40.0, as_json: AsJson = False,
    plot: PlotFile = None,
) -> None:  # fmt: skip
    """Every mixer side by side: training speed and memory, decode latency, held-out quality."""
    if ctx.invoked_subcommand is None:
        bench_all(corpus, quality_time, as_json, plot)


@bench_app.command("all")
@command
def bench_all(
    corpus: Corpus = None, quality_time: QualityTime = 40.0, as_json: AsJson = False, plot: PlotFile = None
) -> None:
    """train + decode (+ quality with --corpus) in one run: the paper's comparison on this machine."""
    import torch

    from aftgen.bench.mixers import bench_decode, bench_quality, bench_train
    from aftgen.mixers import MIXERS

    require_file(corpus, "file")
    _check_plot(plot)
    set_up_torch()
    progress(f"bench: {', '.join(MIXERS)}; {torch.get_num_threads()} threads; ratios against attention")
    rows = bench_train(tuple(MIXERS), repeats=1, rounds=2, log=progress) + bench_decode(repeats=50, log=progress)
    if corpus is None:
        progress("quality rows left out: pass --corpus FILE (e.g. Tiny Shakespeare)")
    else:
        rows += bench_quality(corpus, quality_time, tuple(MIXERS), log=progress)
    _report(rows, as_json, plot)


@bench_app.command("train")
@command
def bench_train_command(
    repeats: Annotated[int, typer.Option(help="Timed steps per configuration and round (the fastest counts).")] = 3,
    rounds: Annotated[int, typer.Option(help="Rounds over all configurations in turn (the fastest round counts).")] = 3,
    lengths: Annotated[str, typer.Option(help="Training lengths T, comma-separated.")] = "256,1024,4096",
    mixers: Annotated[str, typer.Option(help="Token mixers, comma-separated (default: all).")] = "",
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    as_json: AsJson = False,
    plot: PlotFile = None,
) -> None:
    """Training-step tokens/s and peak memory at each T (equal tokens per step up to 4,096), and the mixer alone."""
    from aftgen.bench.mixers import bench_train
    from aftgen.device import resolve
    from aftgen.mixers import MIXERS

    _check_plot(plot)
    chosen = whole_numbers(lengths, "--lengths")
    names = tuple(name.strip() for name in mixers.split(",")) if mixers else tuple(MIXERS)
    unknown = [name for name in names if name not in MIXERS]
    if unknown:
        raise AftgenError(f"unknown --mixers '{','.join(unknown)}'; choose from: {', '.join(MIXERS)}")
    set_up_torch()
    placement = resolve(device, dtype)  # refused here, before any probe, if the device cannot do it
    progress(f"bench train: {placement.describe()}, T = {', '.join(map(str, chosen))}")
    where = {"device": str(placement.device), "dtype": placement.dtype_name}
    rows = bench_train(names, repeats, rounds, log=progress, lengths=chosen, **where)
    _report(rows, as_json, plot)


@bench_app.command("decode")
@command
def bench_decode_command(as_json: AsJson = False, plot: PlotFile = None) -> None:
    """aft_local's recurrent step against attention's KV cache: latency and state size after 1k, 8k, 32k tokens."""
    from aftgen.bench.mixers import bench_decode

    _check_plot(plot)
    set_up_torch()
    _report(bench_decode(log=progress), as_json, plot)


@bench_app.command("quality")
@command
def bench_quality_command(
    corpus: Annotated[Path, typer.Argument(help="UTF-8 text; the last 10% is held out.")],
    seconds: Annotated[float, typer.Option("--time", help="Training wall time per mixer, in seconds.")] = 150.0,
    as_json: AsJson = False,
) -> None:
    """Train every mixer for the same wall time on the same split; held-out nats/char and bits/char."""
    from aftgen.bench.mixers import bench_quality
    from aftgen.mixers import MIXERS

    require_file(corpus, "file")
    set_up_torch()
    _report(bench_quality(corpus, seconds, tuple(MIXERS), log=progress), as_json, None)


@bench_app.command("generate")
@command
def bench_generate_command(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Time this checkpoint (folder or Hub id).")] = None,
    preset: Annotated[
        str | None,
        typer.Option(help="Time a randomly initialised model of this preset (default: small, `aftgen train`'s size)."),
    ] = None,
    contexts: Annotated[
        str, typer.Option(help="Contexts (tokens) after which the step is timed, comma-separated.")
    ] = "1000,8000,32000,100000",
    tokens: Annotated[
        int, typer.Option(help="Tokens generated; memory is compared after the first 1,000 and after all of them.")
    ] = 100_000,
    device: DeviceOption = "auto",
    as_json: AsJson = False,
) -> None:
    """Per-token latency after 1k-100k tokens of context, ingestion speed, memory, and the matvec floor."""
    import torch

    from aftgen.api import load
    from aftgen.bench.generate import STRETCH, bench_generate, random_model
    from aftgen.bench.report import print_rows
    from aftgen.device import pick_device

    if model is not None and preset is not None:
        raise AftgenError("give --model or --preset, not both")
    first = 1_000
    if tokens <= first or tokens % STRETCH:
        raise AftgenError(f"--tokens must be a multiple of {STRETCH} above {first:,}, got {tokens}")
    lengths = whole_numbers(contexts, "--contexts")
    set_up_torch()
    where = pick_device(device)
    # Timing depends on the sizes, not on the weights: random ones serve, and need no checkpoint.
    lm = load(model, where)[0] if model is not None else random_model(preset or "small").to(where)
    progress(f"bench generate: {lm.num_parameters():,} parameters on {where}, {torch.get_num_threads()} threads")
    print_rows(bench_generate(lm, log=progress, contexts=lengths, generated=(first, tokens)), as_json)


@bench_app.command("finetune")
@command
def bench_finetune_command(
    corpus: Annotated[list[Path], typer.Argument(help="Text files or folders (fortune-style '%' entries are mixed).")],
    base: Annotated[str, typer.Option(help="The model to fine-tune (a folder or OWNER/NAME).")] = "models/shakespeare",
    sizes: Annotated[str, typer.Option(help="Corpus sizes in characters, comma-separated; 'all' for all.")] = "50000",
    seconds: Annotated[str, typer.Option(help="Training wall times, comma-separated.")] = "60",
    as_json: AsJson = False,
) -> None:
    """Fine-tuning a pretrained model against training from scratch, side by side, per corpus size and time."""
    from aftgen.bench.finetune import bench_finetune
    from aftgen.bench.report import print_rows
    from aftgen.corpus.sources import find_files

    try:
        chosen = [None if s.strip() == "all" else int(s) for s in sizes.split(",")]
        budgets = [float(s) for s in seconds.split(",")]
    except ValueError:
        raise AftgenError("--sizes takes numbers or 'all', --seconds numbers, each comma-separated") from None
    files = find_files(corpus)
    set_up_torch()
    progress(f"bench finetune: {base} against from scratch, {len(files)} files")
    print_rows(bench_finetune(base, files, chosen, budgets, log=progress), as_json)


@bench_app.command("serve")
@command
def bench_serve_command(
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Serve this checkpoint (folder or Hub id).")
    ] = None,
    tokens: Annotated[int, typer.Option(help="Tokens each stream generates.")] = BenchServeOptions.tokens,
    rounds: Annotated[
        int, typer.Option(help="Rounds of 1, 8 and 32 streams in turn (each figure: the best round's).")
    ] = BenchServeOptions.rounds,
    threads: Annotated[
        int | None, typer.Option(help="The server's CPU threads (default: its own, the physical cores but one).")
    ] = None,
    device: DeviceOption = BenchServeOptions.device,
    dtype: DtypeOption = BenchServeOptions.dtype,
    batch_invariant: Annotated[
        bool | None,
        typer.Option(
            "--batch-invariant/--no-batch-invariant",
            help="Serve with --batch-invariant or without it (and time its engine so); default: the server's.",
            show_default=False,
        ),
    ] = BenchServeOptions.batch_invariant,
    as_json: AsJson = False,
) -> None:
    """Start `aftgen serve` and drive it with 1, 8 and 32 concurrent streams: tokens/s, inter-token latency, memory."""
    from aftgen.bench.report import print_rows
    from aftgen.bench.serve import bench_serve
    from aftgen.serve.server import require_serve_extra

    options = options_from(BenchServeOptions, locals())
    options.check()
    require_serve_extra()
    print_rows(bench_serve(options, log=progress), as_json)


@bench_app.command("side-by-side")
@command
def bench_side_by_side_command(
    corpus: Annotated[Path, typer.Argument(help="Text the trainings learn (a few hundred KB is plenty).")],
    seconds: Annotated[float, typer.Option(min=5, help="Seconds each training runs.")] = 40.0,
    as_json: AsJson = False,
) -> None:
    """aftgen jobs together on one machine: two trainings, and a server beside a training, each against
    itself alone; with the cores shared and as before, when every process took every core."""
    from aftgen.bench.report import print_rows
    from aftgen.bench.side_by_side import bench_side_by_side
    from aftgen.serve.server import require_serve_extra

    require_file(corpus, "file")
    require_serve_extra()
    print_rows(bench_side_by_side(corpus, seconds, log=progress), as_json)


@bench_app.command("data")
@command
def bench_data_command(
    corpora: Annotated[list[Path], typer.Argument(help="Corpora (files or folders), each measured in turn.")],
    steps: Annotated[int, typer.Option(help="Training steps to run on each prepared corpus.")] = 10,
    as_json: AsJson = False,
) -> None:
    """Preparing and training on large corpora: preparation time, MB/s, peak memory, time to the first step."""
    from aftgen.bench.data import bench_data
    from aftgen.bench.report import print_rows

    print_rows(bench_data(corpora, steps, log=progress), as_json)

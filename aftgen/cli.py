"""The `aftgen` command line: a thin layer over the library. Data on stdout, everything else on stderr."""

from __future__ import annotations

import functools
import json
import os
import shlex
import sys
import tempfile
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from aftgen.corpus import CorpusOptions
from aftgen.errors import AftgenError

if TYPE_CHECKING:
    from aftgen.sampling import SamplingOptions

app = typer.Typer(
    help="Train Attention Free Transformer language models on any text and sample from them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

DEBUG = {"on": False}
MODEL_PANEL, TRAIN_PANEL, DATA_PANEL, SAMPLE_PANEL = "Model size", "Training", "Data", "Sampling"
STATE_PANEL = "State files"
HARDWARE_PANEL = "Hardware"

# Options every command that runs the model shares (aftgen/device.py resolves them).
DeviceOption = Annotated[
    str,
    typer.Option(help="auto (CUDA, then MPS, then CPU) | cpu | cuda | cuda:N | mps.", rich_help_panel=HARDWARE_PANEL),
]
DtypeOption = Annotated[
    str,
    typer.Option(
        help="auto | fp32 | bf16 | fp16: mixed-precision autocast (weights stay fp32). auto: bf16 on GPUs that have it, else fp32.",
        rich_help_panel=HARDWARE_PANEL,
    ),
]
ThreadsOption = Annotated[
    int | None,
    typer.Option(
        help="CPU threads (default: the physical cores, shared among torchrun's processes).",
        rich_help_panel=HARDWARE_PANEL,
    ),
]

# Options for reading a corpus, shared by `train` and `prepare` (aftgen/corpus/ documents them).
CorpusArgument = Annotated[list[Path], typer.Argument(help="Text files, or folders of them (each file a document).")]
VocabSizeOption = Annotated[int, typer.Option(rich_help_panel=DATA_PANEL)]
TokenizerTypeOption = Annotated[str, typer.Option(help="bpe | unigram | char.", rich_help_panel=DATA_PANEL)]
EncodingOption = Annotated[str, typer.Option(help="Text encoding of the corpus.", rich_help_panel=DATA_PANEL)]
ErrorsOption = Annotated[
    str, typer.Option(help="strict | replace | ignore undecodable bytes.", rich_help_panel=DATA_PANEL)
]
GlobOption = Annotated[str, typer.Option(help="Which files in folders to read.", rich_help_panel=DATA_PANEL)]
HeldOutOption = Annotated[
    str | None,
    typer.Option(
        metavar="CHARS",
        help="Hold out at most this many characters, e.g. 500k, 2M (default "
        f"{CorpusOptions.held_out:,}): one file's last 10%, or whole documents making about 10% of several.",
        rich_help_panel=DATA_PANEL,
    ),
]
SkipBadFilesOption = Annotated[
    bool,
    typer.Option(
        help="Skip binary, unreadable or undecodable files (with a warning) instead of stopping.",
        rich_help_panel=DATA_PANEL,
    ),
]


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def command(func):
    """Turn the tool's own errors into one line and exit 2; anything unexpected into one line plus a log."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except AftgenError as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # reader went away: quietly stop
            raise typer.Exit(0) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:
            if DEBUG["on"]:
                raise
            fd, log_path = tempfile.mkstemp(prefix="aftgen-crash-", suffix=".log")
            with os.fdopen(fd, "w") as log:
                traceback.print_exc(file=log)
            fail(f"internal error: {type(exc).__name__}: {exc} (traceback in {log_path}; --debug shows it)", code=1)

    return wrapper


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks for internal errors.")] = False,
) -> None:
    DEBUG["on"] = debug


def _threads(threads: int | None = None) -> None:
    """Set torch's CPU threads and keep freed memory for reuse; called before any torch work, since
    torch fixes its threads on first use."""
    from aftgen.device import reuse_freed_memory, set_threads

    reuse_freed_memory()
    set_threads(threads)


def _placement(device: str, dtype: str, threads: int | None):
    """Threads first, then the device and dtype: one call for every command that runs a model."""
    from aftgen.device import resolve

    _threads(threads)
    return resolve(device, dtype)


@app.command()
@command
def train(
    corpus: CorpusArgument,
    out: Annotated[Path | None, typer.Option(help="Run folder (default runs/<corpus-stem>).")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the run in --out where it stopped.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace a run already in --out.")] = False,
    preset: Annotated[str, typer.Option(help="tiny | small | medium.", rich_help_panel=MODEL_PANEL)] = "small",
    n_layer: Annotated[int | None, typer.Option("--layers", rich_help_panel=MODEL_PANEL)] = None,
    n_embd: Annotated[int | None, typer.Option("--width", rich_help_panel=MODEL_PANEL)] = None,
    n_head: Annotated[int | None, typer.Option("--heads", rich_help_panel=MODEL_PANEL)] = None,
    mixer: Annotated[
        str | None,
        typer.Option(
            help="Token mixer: aft_local | aft_simple (no window) | aft_full (window = whole context; "
            "generation O(context) per token) | attention (softmax + KV cache, the baseline).",
            rich_help_panel=MODEL_PANEL,
        ),
    ] = None,
    window: Annotated[int | None, typer.Option(help="AFT-local window s.", rich_help_panel=MODEL_PANEL)] = None,
    context_length: Annotated[
        int | None, typer.Option(help="Training sequence length.", rich_help_panel=MODEL_PANEL)
    ] = None,
    dropout: Annotated[float | None, typer.Option(rich_help_panel=MODEL_PANEL)] = None,
    decay: Annotated[
        bool | None,
        typer.Option(help="Learned decay beyond the window (off: the paper's AFT-local).", rich_help_panel=MODEL_PANEL),
    ] = None,
    max_steps: Annotated[int, typer.Option(rich_help_panel=TRAIN_PANEL)] = 5000,
    max_time: Annotated[
        str | None, typer.Option(help="Wall-time budget: 150, 90s, 10m, 1h.", rich_help_panel=TRAIN_PANEL)
    ] = None,
    batch_size: Annotated[int | None, typer.Option(rich_help_panel=TRAIN_PANEL)] = None,
    lr: Annotated[float, typer.Option(help="Peak learning rate.", rich_help_panel=TRAIN_PANEL)] = 2e-3,
    warmup_steps: Annotated[int, typer.Option(rich_help_panel=TRAIN_PANEL)] = 100,
    weight_decay: Annotated[float, typer.Option(rich_help_panel=TRAIN_PANEL)] = 0.1,
    grad_clip: Annotated[float, typer.Option(rich_help_panel=TRAIN_PANEL)] = 1.0,
    eval_interval: Annotated[
        int, typer.Option(help="Steps between held-out evals and checkpoints.", rich_help_panel=TRAIN_PANEL)
    ] = 250,
    eval_windows: Annotated[
        int, typer.Option(help="Held-out windows each eval scores.", rich_help_panel=TRAIN_PANEL)
    ] = 32,
    keep_best: Annotated[
        bool,
        typer.Option(
            help="Publish the weights that scored best on the held-out eval, not the latest.",
            rich_help_panel=TRAIN_PANEL,
        ),
    ] = False,
    weights_dtype: Annotated[
        str,
        typer.Option(
            help="fp32 | fp16 | bf16: precision of model.safetensors (fp16 halves it).", rich_help_panel=TRAIN_PANEL
        ),
    ] = "fp32",
    seed: Annotated[int, typer.Option(rich_help_panel=TRAIN_PANEL)] = 1337,
    vocab_size: VocabSizeOption = 1024,
    tokenizer_type: TokenizerTypeOption = "bpe",
    encoding: EncodingOption = "utf-8",
    errors: ErrorsOption = "strict",
    glob: GlobOption = CorpusOptions.glob,
    held_out: HeldOutOption = None,
    skip_bad_files: SkipBadFilesOption = CorpusOptions.skip_bad_files,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    compile_model: Annotated[
        bool,
        typer.Option(
            "--compile/--no-compile",
            help="torch.compile the training model (falls back to eager).",
            rich_help_panel=HARDWARE_PANEL,
        ),
    ] = False,
    threads: ThreadsOption = None,
) -> None:
    """Train a tokenizer and a model on text files and folders; prints the run folder on stdout.

    Each file is a document. The same command under `torchrun --nproc_per_node N -m aftgen train ...` trains on
    N processes.
    """
    from aftgen.training import TrainingInterrupted, TrainOptions, parse_duration
    from aftgen.training import train as run_training

    options = TrainOptions(
        corpus=corpus, out=out, preset=preset, n_layer=n_layer, n_embd=n_embd, n_head=n_head, mixer=mixer,
        window=window, context_length=context_length, batch_size=batch_size, dropout=dropout, decay=decay, lr=lr,
        weight_decay=weight_decay, warmup_steps=warmup_steps, grad_clip=grad_clip, max_steps=max_steps,
        max_time=parse_duration(max_time) if max_time else None, eval_interval=eval_interval,
        eval_windows=eval_windows, keep_best=keep_best, weights_dtype=weights_dtype, seed=seed,
        vocab_size=vocab_size, tokenizer_type=tokenizer_type, encoding=encoding, errors=errors, glob=glob,
        held_out=_held_out(held_out), skip_bad_files=skip_bad_files, resume=resume, overwrite=overwrite,
        device=device, dtype=dtype, compile=compile_model,
        command=shlex.join(["aftgen", *sys.argv[1:]]),
    )  # fmt: skip
    options.check()
    _threads(threads)
    main_process = os.environ.get("RANK", "0") == "0"  # under torchrun only rank 0 prints the run folder
    try:
        run = run_training(options, quiet=quiet)
    except TrainingInterrupted as stop:
        if main_process:
            print(stop.out)
        raise typer.Exit(130) from None
    if main_process:
        print(run)


def _held_out(text: str | None) -> int:
    from aftgen.corpus.split import parse_size

    return parse_size(text) if text else CorpusOptions.held_out


@app.command()
@command
def prepare(
    corpus: CorpusArgument,
    vocab_size: VocabSizeOption = CorpusOptions.vocab_size,
    tokenizer_type: TokenizerTypeOption = CorpusOptions.tokenizer_type,
    encoding: EncodingOption = CorpusOptions.encoding,
    errors: ErrorsOption = CorpusOptions.errors,
    glob: GlobOption = CorpusOptions.glob,
    held_out: HeldOutOption = None,
    skip_bad_files: SkipBadFilesOption = CorpusOptions.skip_bad_files,
    workers: Annotated[int | None, typer.Option(help="Encoding processes (default: one per core).")] = None,
) -> None:
    """Prepare a corpus ahead of training (tokenizer, held-out split, token files); prints the cache folder.

    `aftgen train` with the same paths and data options then starts at once: before a torchrun job, for example.
    """
    from aftgen.corpus import prepare_corpus

    options = CorpusOptions(
        glob=glob, held_out=_held_out(held_out), skip_bad_files=skip_bad_files, encoding=encoding, errors=errors,
        vocab_size=vocab_size, tokenizer_type=tokenizer_type, workers=workers,
    )  # fmt: skip
    prepared = prepare_corpus(corpus, options)
    summary = prepared.summary
    print(
        f"prepared: {summary['train_tokens']:,} training tokens, {summary['held_out_tokens']:,} held-out tokens, "
        f"vocabulary {prepared.tokenizer.vocab_size}",
        file=sys.stderr,
    )
    print(prepared.folder)


# Options shared by `sample` and `chat` (llama.cpp / transformers names and meanings).
ModelOption = Annotated[
    str | None, typer.Option("--model", "-m", help="Checkpoint folder or Hub id (default: the shipped model).")
]
MaxNewTokens = Annotated[
    int, typer.Option("--max-new-tokens", "-n", help="-1: until stopped.", rich_help_panel=SAMPLE_PANEL)
]
Temperature = Annotated[float, typer.Option(help="0: greedy.", rich_help_panel=SAMPLE_PANEL)]
TopK = Annotated[int, typer.Option(help="Keep the k likeliest tokens (0: off).", rich_help_panel=SAMPLE_PANEL)]
TopP = Annotated[float, typer.Option(help="Keep the smallest set reaching p.", rich_help_panel=SAMPLE_PANEL)]
MinP = Annotated[
    float, typer.Option(help="Drop tokens below min_p x the top probability.", rich_help_panel=SAMPLE_PANEL)
]
RepeatPenalty = Annotated[
    float, typer.Option(help="Divide recent tokens' positive logits by this (1: off).", rich_help_panel=SAMPLE_PANEL)
]
RepeatLastN = Annotated[
    int, typer.Option(help="How many recent tokens the penalty covers.", rich_help_panel=SAMPLE_PANEL)
]
Stop = Annotated[
    list[str] | None, typer.Option(help="End before this string (repeatable).", rich_help_panel=SAMPLE_PANEL)
]
Seed = Annotated[
    int | None,
    typer.Option(help="Random seed (with --load-state: replaces the saved generator).", rich_help_panel=SAMPLE_PANEL),
]
LoadState = Annotated[
    Path | None,
    typer.Option(help="Continue from a state file (sample --save-state, prime).", rich_help_panel=STATE_PANEL),
]
SaveState = Annotated[
    Path | None, typer.Option(help="Write the state after the run, to continue it later.", rich_help_panel=STATE_PANEL)
]
Compile = Annotated[
    bool,
    typer.Option(
        "--compile/--no-compile", help="torch.compile the step: seconds of warm-up, then ~3x faster per token."
    ),
]


def _sampling_options(**values) -> SamplingOptions:
    from aftgen.sampling import SamplingOptions

    options = SamplingOptions(**{**values, "stop": tuple(values["stop"] or ())})
    options.check()
    return options


def _require_file(path: Path | None, what: str) -> None:
    """Refuse a missing input file before any work (its contents are checked when read)."""
    if path is not None and not path.is_file():
        raise AftgenError(f"{path}: no such {what}")


def _load_for_generation(model: str | None, load_state: Path | None, compile_step: bool, placement):
    """(model, tokenizer, context or None, step function), telling stderr about the compile."""
    from aftgen.api import load
    from aftgen.model import compile_step as compiled
    from aftgen.state import load_state as read_state

    lm, tokenizer = load(model, placement.device)
    context = read_state(load_state, lm, tokenizer) if load_state else None
    step = lm.step
    if compile_step:
        step, note = compiled(lm)
        print(f"step: {note}", file=sys.stderr)
    return lm, tokenizer, context, step


@app.command()
@command
def sample(
    model: ModelOption = None,
    prompt: Annotated[
        str, typer.Option("--prompt", "-p", help="Text to continue; '-' reads stdin.", rich_help_panel=SAMPLE_PANEL)
    ] = "",
    prompt_file: Annotated[
        Path | None, typer.Option(help="Read the prompt from a file.", rich_help_panel=SAMPLE_PANEL)
    ] = None,
    max_new_tokens: MaxNewTokens = 200,
    temperature: Temperature = 0.8,
    top_k: TopK = 0,
    top_p: TopP = 1.0,
    min_p: MinP = 0.0,
    repeat_penalty: RepeatPenalty = 1.0,
    repeat_last_n: RepeatLastN = 64,
    stop: Stop = None,
    num_samples: Annotated[int, typer.Option(help="Continuations of one prompt.", rich_help_panel=SAMPLE_PANEL)] = 1,
    seed: Seed = None,
    load_state: LoadState = None,
    save_state: SaveState = None,
    compile_step: Compile = False,
    echo: Annotated[bool, typer.Option(help="Print the prompt before the continuation.")] = True,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    threads: ThreadsOption = None,
) -> None:
    """Continue a prompt, streaming text to stdout as it is made."""
    from aftgen.sampling import read_prompt, sample_text
    from aftgen.state import save_state as write_state

    options = _sampling_options(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed, stop=stop,
    )  # fmt: skip
    if num_samples < 1:
        raise AftgenError(f"--num-samples must be >= 1, got {num_samples}")
    if save_state is not None and num_samples > 1:
        raise AftgenError("--save-state keeps one continuation; use it with --num-samples 1")
    _require_file(load_state, "state file")
    if prompt_file is not None:
        from aftgen.corpus import read_text

        prompt = read_text(prompt_file)
    elif prompt == "-":
        prompt = sys.stdin.read()
    placement = _placement(device, dtype, threads)
    lm, tokenizer, context, step = _load_for_generation(model, load_state, compile_step, placement)
    with placement.autocast():
        context = read_prompt(lm, tokenizer, prompt, context, options.seed)
        # A run that will be continued keeps an unfinished last character for the next one.
        runs = sample_text(lm, tokenizer, context, options, num_samples, step, final=save_state is None)
        _write_samples(runs, prompt if echo else "", save_state is None)
    if save_state is not None:
        write_state(save_state, context, lm, tokenizer)
        print(f"state saved to {save_state}", file=sys.stderr)


def _write_samples(runs, prompt: str, newline: bool) -> None:
    """Stream each continuation to stdout as it is made, separated by '---'."""
    for index, pieces in enumerate(runs):
        if index:
            sys.stdout.write("\n\n---\n\n")
        sys.stdout.write(prompt)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        if newline:
            sys.stdout.write("\n")
        sys.stdout.flush()


@app.command()
@command
def prime(
    text_file: Annotated[Path, typer.Argument(help="Text to read (any length: read in chunks, constant memory).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="State file to write.")],
    model: ModelOption = None,
    seed: Seed = None,
    encoding: Annotated[str, typer.Option()] = "utf-8",
    errors: Annotated[str, typer.Option()] = "strict",
    compile_prefill: Annotated[
        bool,
        typer.Option(
            "--compile/--no-compile",
            help="torch.compile the chunk reader: seconds of warm-up, then faster reading of long texts.",
        ),
    ] = False,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    threads: ThreadsOption = None,
) -> None:
    """Read a text once into a state file that `sample`/`chat --load-state` start from."""
    import time

    from aftgen.corpus import read_text
    from aftgen.model import compile_prefill as compiled
    from aftgen.sampling import PROMPT_CHUNK, read_prompt
    from aftgen.state import save_state as write_state

    text = read_text(text_file, encoding, errors)
    placement = _placement(device, dtype, threads)
    lm, tokenizer, _, _ = _load_for_generation(model, None, False, placement)
    prefill = None
    if compile_prefill:
        prefill, note = compiled(lm, PROMPT_CHUNK)
        print(f"prompt reading: {note}", file=sys.stderr)
    start = time.perf_counter()
    with placement.autocast():
        context = read_prompt(lm, tokenizer, text, None, seed, prefill)
    elapsed = time.perf_counter() - start
    write_state(out, context, lm, tokenizer)
    tokens = int(context.state[0]["position"])
    print(f"read {tokens:,} tokens in {elapsed:.1f} s ({tokens / elapsed:,.0f} tokens/s)", file=sys.stderr)
    print(out)


@app.command()
@command
def chat(
    model: ModelOption = None,
    max_new_tokens: MaxNewTokens = 200,
    temperature: Temperature = 0.8,
    top_k: TopK = 0,
    top_p: TopP = 1.0,
    min_p: MinP = 0.0,
    repeat_penalty: RepeatPenalty = 1.0,
    repeat_last_n: RepeatLastN = 64,
    stop: Annotated[
        list[str] | None,
        typer.Option(
            help="End a reply before this string (repeatable; default: a blank line).", rich_help_panel=SAMPLE_PANEL
        ),
    ] = None,
    seed: Seed = None,
    load_state: LoadState = None,
    save_state: SaveState = None,
    compile_step: Compile = False,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    threads: ThreadsOption = None,
) -> None:
    """Talk to a model: each line you type is read into the running state and the model answers.

    History is never re-read, so turns stay as fast as the first. Ctrl-C stops a reply, Ctrl-D ends.
    """
    from aftgen.chat import run_chat
    from aftgen.state import save_state as write_state

    options = _sampling_options(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed, stop=stop or ["\n\n"],
    )  # fmt: skip
    _require_file(load_state, "state file")
    placement = _placement(device, dtype, threads)
    lm, tokenizer, context, step = _load_for_generation(model, load_state, compile_step, placement)
    with placement.autocast():
        context = run_chat(lm, tokenizer, options, context, step)
    if save_state is not None and context is not None:
        write_state(save_state, context, lm, tokenizer)
        print(f"state saved to {save_state}", file=sys.stderr)


@app.command("eval")
@command
def evaluate(
    file: Annotated[Path, typer.Argument(help="Text file to score.")],
    model: Annotated[str | None, typer.Option("--model", "-m", help="Checkpoint folder or Hub id.")] = None,
    reset_every: Annotated[
        int, typer.Option(help="Cut the context into independent windows of N tokens (0: one stream).")
    ] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    encoding: Annotated[str, typer.Option()] = "utf-8",
    errors: Annotated[str, typer.Option()] = "strict",
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    threads: ThreadsOption = None,
) -> None:
    """Held-out loss of a model on a file of any size (read in chunks): nats/token, nats/char, bits/char, bits/byte."""
    from aftgen.api import load
    from aftgen.corpus.sources import scan_file
    from aftgen.evaluate import evaluate_file

    if reset_every < 0:
        raise AftgenError(f"--reset-every must be >= 0, got {reset_every}")
    document = scan_file(file, encoding, errors)  # one clear error for anything that is not text, before loading
    placement = _placement(device, dtype, threads)
    lm, tokenizer = load(model, placement.device)
    with placement.autocast():
        result = evaluate_file(lm, tokenizer, document, encoding, errors, reset_every=reset_every)
    if as_json:
        print(json.dumps(result.to_dict()))
    else:
        print(
            f"{result.nats_per_token:.4f} nats/token  {result.nats_per_char:.4f} nats/char  "
            f"{result.bits_per_char:.4f} bits/char  {result.bits_per_byte:.4f} bits/byte  "
            f"({result.tokens:,} tokens, {result.chars:,} chars)"
        )


@app.command()
@command
def pull(
    repo_id: Annotated[str, typer.Argument(metavar="OWNER/NAME[@REV]", help="Hub model repository.")],
    revision: Annotated[str | None, typer.Option(help="Branch, tag or commit (default: main).")] = None,
) -> None:
    """Download a checkpoint into the Hugging Face cache; prints its folder on stdout."""
    from aftgen.hub import parse_hub_id
    from aftgen.hub import pull as pull_checkpoint

    parsed = parse_hub_id(repo_id)
    if parsed and parsed[1]:  # OWNER/NAME@REV, the spelling --model takes
        if revision:
            raise AftgenError("give the revision once: OWNER/NAME@REV or --revision REV")
        repo_id, revision = parsed
    print(pull_checkpoint(repo_id, revision))


@app.command()
@command
def push(
    run_dir: Annotated[Path, typer.Argument(help="Run or checkpoint folder to upload.")],
    repo_id: Annotated[str, typer.Argument(metavar="OWNER/NAME", help="Hub model repository (created if needed).")],
    private: Annotated[bool, typer.Option(help="Create the repository as private.")] = False,
    revision: Annotated[
        str | None, typer.Option(help="Branch to commit to (created if needed; default: main).")
    ] = None,
    include_training_state: Annotated[
        bool, typer.Option(help="Also upload the optimiser state and training.json, so others can --resume.")
    ] = False,
) -> None:
    """Upload a checkpoint and a generated model card to the Hub; prints the commit URL on stdout."""
    from aftgen.hub import push as push_checkpoint

    print(push_checkpoint(run_dir, repo_id, private, revision, include_training_state))


bench_app = typer.Typer(help="Measure speed and memory on this machine (no subcommand: `bench all`).")
app.add_typer(bench_app, name="bench")
AsJson = Annotated[bool, typer.Option("--json", help="One JSON object per row on stdout.")]
PlotFile = Annotated[
    Path | None, typer.Option("--plot", help="Also draw the rows to this PNG (needs matplotlib: aftgen\\[plot]).")
]
Corpus = Annotated[Path | None, typer.Option("--corpus", help="Text for the quality rows (left out without it).")]
QualityTime = Annotated[float, typer.Option("--quality-time", help="Training seconds per mixer for the quality rows.")]


def _report(rows: list, as_json: bool, plot: Path | None) -> None:
    from aftgen.bench import comparison_targets, plot_comparison, print_comparison

    rows = rows + comparison_targets(rows)
    print_comparison(rows, as_json)
    if plot is not None:
        plot_comparison(rows, plot)
        print(f"plot: {plot}", file=sys.stderr)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _check_corpus(corpus: Path | None) -> None:
    if corpus is not None and not corpus.is_file():
        raise AftgenError(f"{corpus}: no such file")


def _check_plot(plot: Path | None) -> None:
    from aftgen.bench import pyplot

    if plot is not None:
        pyplot()


@bench_app.callback(invoke_without_command=True)
def bench_main(
    ctx: typer.Context,
    corpus: Corpus = None,
    quality_time: QualityTime = 40.0,
    as_json: AsJson = False,
    plot: PlotFile = None,
) -> None:
    """Every mixer side by side: training speed and memory, decode latency, held-out quality."""
    if ctx.invoked_subcommand is None:
        bench_all(corpus, quality_time, as_json, plot)


@bench_app.command("all")
@command
def bench_all(
    corpus: Corpus = None, quality_time: QualityTime = 40.0, as_json: AsJson = False, plot: PlotFile = None
) -> None:
    """train + decode (+ quality with --corpus) in one run: the paper's comparison on this machine."""
    from aftgen.bench import bench_decode, bench_quality, bench_train
    from aftgen.model import MIXERS

    _check_corpus(corpus)
    _check_plot(plot)
    _threads()
    _progress(f"bench: {', '.join(MIXERS)}; {torch_threads()} threads; ratios against attention")
    rows = bench_train(MIXERS, repeats=1, rounds=2, log=_progress) + bench_decode(repeats=50, log=_progress)
    if corpus is None:
        _progress("quality rows left out: pass --corpus FILE (e.g. Tiny Shakespeare)")
    else:
        rows += bench_quality(corpus, quality_time, MIXERS, log=_progress)
    _report(rows, as_json, plot)


@bench_app.command("train")
@command
def bench_train_command(
    repeats: Annotated[int, typer.Option(help="Timed steps per configuration and round (the fastest counts).")] = 3,
    rounds: Annotated[int, typer.Option(help="Rounds over all configurations in turn (the fastest round counts).")] = 3,
    as_json: AsJson = False,
    plot: PlotFile = None,
) -> None:
    """Training-step tokens/s and peak memory at T = 256, 1024, 4096 (equal tokens per step), and the mixer alone."""
    from aftgen.bench import bench_train
    from aftgen.model import MIXERS

    for name, value in (("--repeats", repeats), ("--rounds", rounds)):
        if value < 1:
            raise AftgenError(f"{name} must be >= 1, got {value}")
    _check_plot(plot)
    _threads()
    _report(bench_train(MIXERS, repeats, rounds, log=_progress), as_json, plot)


@bench_app.command("decode")
@command
def bench_decode_command(as_json: AsJson = False, plot: PlotFile = None) -> None:
    """aft_local's recurrent step against attention's KV cache: latency and state size after 1k, 8k, 32k tokens."""
    from aftgen.bench import bench_decode

    _check_plot(plot)
    _threads()
    _report(bench_decode(log=_progress), as_json, plot)


@bench_app.command("quality")
@command
def bench_quality_command(
    corpus: Annotated[Path, typer.Argument(help="UTF-8 text; the last 10% is held out.")],
    seconds: Annotated[float, typer.Option("--time", help="Training wall time per mixer, in seconds.")] = 150.0,
    as_json: AsJson = False,
) -> None:
    """Train every mixer for the same wall time on the same split; held-out nats/char and bits/char."""
    from aftgen.bench import bench_quality
    from aftgen.model import MIXERS

    _check_corpus(corpus)
    if not seconds > 0:
        raise AftgenError(f"--time must be positive, got {seconds}")
    _threads()
    _report(bench_quality(corpus, seconds, MIXERS, log=_progress), as_json, None)


@bench_app.command("generate")
@command
def bench_generate(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Time this checkpoint (folder or Hub id).")] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            "--preset",
            help="Time a randomly initialised model of this training preset (default: small, `aftgen train`'s size).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per row on stdout.")] = False,
) -> None:
    """Per-token latency after 1k-100k tokens of context, ingestion speed, memory, and the matvec floor."""
    from aftgen.api import load
    from aftgen.bench import bench_generate as measure
    from aftgen.bench import print_rows, random_model
    from aftgen.training import PRESETS

    if model is not None and preset is not None:
        raise AftgenError("give --model or --preset, not both")
    if preset is not None and preset not in PRESETS:
        raise AftgenError(f"unknown preset '{preset}'; choose one of: {', '.join(PRESETS)}")
    _threads()
    # Timing depends on the sizes, not on the weights: random ones serve, and need no checkpoint.
    lm = load(model)[0] if model is not None else random_model(preset or "small")
    print(f"bench generate: {lm.num_parameters():,} parameters, {torch_threads()} threads", file=sys.stderr)
    rows = measure(lm, log=lambda line: print(line, file=sys.stderr))
    print_rows(rows, as_json)


@bench_app.command("data")
@command
def bench_data_command(
    corpora: Annotated[list[Path], typer.Argument(help="Corpora (files or folders), each measured in turn.")],
    steps: Annotated[int, typer.Option(help="Training steps to run on each prepared corpus.")] = 10,
    as_json: AsJson = False,
) -> None:
    """Preparing and training on large corpora: preparation time, MB/s, peak memory, time to the first step."""
    from aftgen.bench import print_rows
    from aftgen.corpus.bench import bench_data

    if steps < 1:
        raise AftgenError(f"--steps must be >= 1, got {steps}")
    print_rows(bench_data(corpora, steps, log=_progress), as_json)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def run() -> None:
    """Console entry point: a Ctrl-C that lands outside a command (start-up, exit) still exits 130 quietly."""
    import signal

    try:
        app(prog_name="aftgen")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    finally:  # every file is already complete; a Ctrl-C during interpreter shutdown must not kill it by signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)

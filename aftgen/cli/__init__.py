"""The `aftgen` command line: a thin layer over the library. Data on stdout, everything else on stderr.

One module per group of commands; each command turns its options into the library's option
dataclasses (their defaults are the CLI's) and calls the library.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Annotated

import typer

from aftgen.cli import bench, evaluate, generate, hub, plot, serve, train
from aftgen.cli.common import DEBUG_VARIABLE, quiet_stdout

app = typer.Typer(
    help="Train Attention Free Transformer language models on any text and sample from them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


@app.callback()
def main(
    debug: Annotated[
        bool, typer.Option("--debug", envvar=DEBUG_VARIABLE, help="Show full tracebacks for internal errors.")
    ] = False,
) -> None:
    if debug:  # for the commands' error handler (aftgen.cli.common.command)
        os.environ[DEBUG_VARIABLE] = "1"


app.command()(train.train)
app.command()(train.prepare)
app.command()(generate.sample)
app.command()(generate.prime)
app.command()(generate.chat)
app.command("eval")(evaluate.evaluate)
app.command()(plot.plot)
app.command()(hub.pull)
app.command()(hub.push)
app.command()(serve.serve)
app.add_typer(bench.bench_app, name="bench")


def run() -> None:
    """Console entry point: a Ctrl-C that lands outside a command (start-up, exit) still exits 130 quietly, and a
    reader that leaves before the help ends (`aftgen --help | head -1`) ends it with 0, as in a command."""
    try:
        app(prog_name="aftgen")
    except SystemExit as done:
        if done.code == 1 and isinstance(done.__context__, BrokenPipeError):  # rich's and click's answer to it
            quiet_stdout()
            sys.exit(0)
        raise
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    finally:  # every file is already complete; a Ctrl-C during interpreter shutdown must not kill it by signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)

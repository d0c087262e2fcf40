"""`aftgen serve`: the options of aftgen.serve.options.ServeOptions on the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from aftgen.cli.common import HARDWARE_PANEL, DeviceOption, DtypeOption, ModelOption, command, options_from, placement
from aftgen.serve.options import HTTP_CORES
from aftgen.serve.options import ServeOptions as Defaults

SERVE_PANEL, LIMITS_PANEL = "Server", "Limits"


def _server_option(help: str, **extra):
    return typer.Option(help=help, rich_help_panel=SERVE_PANEL, **extra)


def _limit(help: str | None = None):
    return typer.Option(help=help, rich_help_panel=LIMITS_PANEL)


@command
def serve(
    model: ModelOption = None,
    host: Annotated[str, _server_option("Address to listen on (127.0.0.1: this machine only).")] = Defaults.host,
    port: Annotated[int, _server_option("0: any free port.")] = Defaults.port,
    api_key: Annotated[
        str | None, _server_option("Require 'Authorization: Bearer KEY'.", envvar="AFTGEN_API_KEY")
    ] = None,
    webui: Annotated[
        bool, _server_option("The playground page at / (chat, completion, sampling settings, streaming).")
    ] = Defaults.webui,
    sessions_dir: Annotated[Path | None, _server_option("Save named sessions here (aftgen state files).")] = None,
    cache_mb: Annotated[float, _server_option("Prefix-state cache size (0: off).")] = Defaults.cache_mb,
    parallel: Annotated[int, _limit("Sequences generating at once (rows of the batched step).")] = Defaults.parallel,
    queue: Annotated[int, _limit("Requests waiting for a row; past that: 503.")] = Defaults.queue,
    max_prompt_tokens: Annotated[int, _limit()] = Defaults.max_prompt_tokens,
    max_tokens: Annotated[int, _limit("Most tokens a request may ask for (and its default).")] = Defaults.max_tokens,
    max_body_bytes: Annotated[int, _limit()] = Defaults.max_body_bytes,
    timeout: Annotated[
        float, _limit("Seconds a request may take, queueing included; past that: 504.")
    ] = Defaults.timeout,
    read_timeout: Annotated[
        float, _limit("Seconds a client may stay silent while its request is read; then 408 or closed.")
    ] = Defaults.read_timeout,
    max_sessions: Annotated[int, _limit("Named sessions held in memory.")] = Defaults.max_sessions,
    max_session_files: Annotated[
        int, _limit("Session files kept in --sessions-dir; past that the least recently used is removed.")
    ] = Defaults.max_session_files,
    prompt_chunk: Annotated[int, _limit("Prompt tokens read between two batched steps.")] = Defaults.prompt_chunk,
    compile_step: Annotated[
        bool,
        typer.Option(
            "--compile/--no-compile",
            help="Compile the batched step at start (tens of seconds the first time, about one once cached).",
            rich_help_panel=HARDWARE_PANEL,
        ),
    ] = Defaults.compile_step,
    device: DeviceOption = Defaults.device,
    dtype: DtypeOption = Defaults.dtype,
    threads: Annotated[
        int | None,
        typer.Option(
            help="CPU threads (default: its share of the physical cores, less one left to the HTTP side).",
            rich_help_panel=HARDWARE_PANEL,
        ),
    ] = None,
) -> None:
    """An OpenAI-compatible HTTP server: completions and chat, streaming, every request's state stepped in one batch."""
    from aftgen.serve.server import require_serve_extra
    from aftgen.serve.server import serve as run_server

    options = options_from(Defaults, locals())
    options.check()
    require_serve_extra()
    hardware = {"device": device, "dtype": dtype, "threads": threads}
    run_server(options, placement(hardware, reserve=HTTP_CORES, busy=False))

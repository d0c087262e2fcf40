"""`aftgen serve`: the options of aftgen.serve.options.ServeOptions on the command line."""

from __future__ import annotations

from aftgen.cli.common import command, declared_options, options_from, with_options
from aftgen.serve.options import ServeOptions


@with_options(lambda: declared_options(ServeOptions))
@command
def serve(**given) -> None:
    """An OpenAI-compatible HTTP server: completions and chat, streaming, every request's state stepped in one batch."""
    from aftgen.serve.server import require_serve_extra
    from aftgen.serve.server import serve as run_server

    options = options_from(ServeOptions, given)
    options.check()
    require_serve_extra()
    run_server(options)

"""Start `aftgen serve`: the engine in a process of its own (aftgen.serve.remote), the app under uvicorn."""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import resource
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from aftgen.errors import AftgenError
from aftgen.serve.options import ACCEPT_BURST, MAX_CONNECTIONS, OWN_DESCRIPTORS, ServeOptions

if TYPE_CHECKING:
    import uvicorn

    from aftgen.serve.remote import EngineProcess
    from aftgen.serve.work import EngineClient

INSTALL_HINT = "pip install 'aftgen[serve]'"


def require_serve_extra() -> None:
    """Refuse, in one line, to go on without the serve extra's packages."""
    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise AftgenError(f"aftgen serve needs {' and '.join(missing)}, which are not installed: {INSTALL_HINT}")


def model_name(model: str | None) -> str:
    """What /v1/models calls the model: the shipped one's name, a folder's name, or the Hub id as given."""
    from aftgen.api import DEFAULT_MODEL

    if model is None:
        return DEFAULT_MODEL
    return Path(model).name if Path(model).is_dir() else model


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket (port 0: any free one), IPv4 or IPv6 as the host is written."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise AftgenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def connection_cap(given: int | None) -> int:
    """--max-connections, or what the descriptor limit leaves once the process's own and a burst's are set aside."""
    if given is not None:
        return given
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS.high
    return max(1, soft - OWN_DESCRIPTORS - ACCEPT_BURST)


def start_engine(options: ServeOptions) -> EngineProcess:
    """The engine in a process of its own (aftgen.serve.remote), for the model fetched here (a Hub id), then
    loaded, and its step compiled, there."""
    from aftgen.api import model_folder
    from aftgen.serve.remote import EngineProcess

    return EngineProcess(dataclasses.replace(options, model=str(model_folder(options.model))))


def prepare(options: ServeOptions, engine: EngineClient | None = None) -> tuple[uvicorn.Server, socket.socket, str]:
    """Everything but the serving: (uvicorn server, its socket, the base URL). `server.run(sockets=[sock])` serves.

    `engine`: serve this one (default: start_engine's); an Engine runs in this process (a model changed in
    Python: a sampling control added at run time; a test that breaks the engine on purpose). An engine's
    process that keeps dying ends the serving (EngineProcess.given_up says why)."""
    require_serve_extra()
    import uvicorn

    from aftgen.serve.app import Server
    from aftgen.serve.protocol import QuietServer, bounded_connections
    from aftgen.serve.remote import EngineProcess

    engine = start_engine(options) if engine is None else engine
    app = Server(engine, model_name(options.model)).app()
    sock = listening_socket(options.host, options.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    timeout = options.read_timeout  # for headers and an unread reply (BoundedConnection), a body, an idle keep-alive
    http = bounded_connections(timeout, connection_cap(options.max_connections))
    config = uvicorn.Config(
        app,
        http=http,
        log_level="warning",
        timeout_keep_alive=timeout,
        timeout_graceful_shutdown=5,
        backlog=ACCEPT_BURST,
    )
    server = QuietServer(config)
    if isinstance(engine, EngineProcess):
        engine.on_give_up = lambda: setattr(server, "should_exit", True)  # uvicorn's own way to shut down
    return server, sock, url


def serve(options: ServeOptions) -> None:
    """Serve until Ctrl-C (or SIGTERM), printing where on stderr; AftgenError where the engine's process kept
    dying (the exit status then tells a supervisor to start the server again)."""
    engine = start_engine(options)
    server, sock, url = prepare(options, engine)
    if options.api_key is None and not ipaddress.ip_address(sock.getsockname()[0]).is_loopback:
        print("warning: listening beyond this machine without --api-key: anyone who can reach it can use the model",
              file=sys.stderr)  # fmt: skip
    page = f", playground at {url}/" if options.webui else ""
    print(f"aftgen serve: {model_name(options.model)} at {url}/v1{page} (Ctrl-C stops)", file=sys.stderr, flush=True)
    from aftgen.serve.remote import loaded_kept

    with loaded_kept():
        server.run(sockets=[sock])
    if engine.given_up is not None:
        raise AftgenError(engine.given_up)

"""What `aftgen serve` can be told: each option's default, range and help in one place (the CLI, the checks and
docs/reference.md read them)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aftgen.device import DEVICE_HELP, DTYPE_HELP
from aftgen.errors import AftgenError
from aftgen.generation.prompt import PROMPT_CHUNK
from aftgen.hub import MODEL_HELP
from aftgen.layers import BATCH_INVARIANT_HELP
from aftgen.options import HARDWARE_PANEL, POSITIVE, Range, check_ranges, option

API_KEY = re.compile(r"[!-~]+")  # printable ASCII, no spaces: what an HTTP header carries as it was typed

# Cores left to the HTTP side, which formats and sends every token of every stream while the model steps:
# torch's threads spinning on every core starve it (measured with 32 streams on a busy machine: the p99
# inter-token latency was far worse with torch on every core; figures: docs/benchmarks.md).
HTTP_CORES = 1


SERVER_PANEL, LIMITS_PANEL = "Server", "Limits"
MAX_CONNECTIONS = Range(1, 1 << 20)
# Descriptors the HTTP side's process keeps beside its open connections: its own files (the engine's socket, stdio,
# the event loop's) and a burst of connections (the listening socket's backlog: the most asyncio accepts in one go,
# each holding a descriptor until the cap refuses it), so that it never runs out and stops accepting.
OWN_DESCRIPTORS, ACCEPT_BURST = 64, 128


def _server(default: Any, help: str, range: Range | None = None, **spelling: Any) -> Any:
    return option(default, help, range, SERVER_PANEL, **spelling)


def _limit(default: Any, help: str, range: Range) -> Any:
    return option(default, help, range, LIMITS_PANEL)


def _hardware(default: Any, help: str, range: Range | None = None, **spelling: Any) -> Any:
    return option(default, help, range, HARDWARE_PANEL, **spelling)


@dataclass
class ServeOptions:
    """Everything `aftgen serve` can be told: each field is one option, declared once with its default, range
    and help (read by the command line, check() and docs/reference.md). The integer limits' upper ends lie
    far beyond any real use: they keep 2^64 from reaching torch or a loop."""

    model: str | None = option(None, MODEL_HELP, flags=("--model", "-m"))
    host: str = _server("127.0.0.1", "Address to listen on (127.0.0.1: this machine only).")
    port: int = _server(8000, "0: any free port (the one chosen is printed).", Range(0, 65535))
    api_key: str | None = _server(
        None,
        "Require 'Authorization: Bearer KEY' on every /v1 route and the tokenizer's; past that: 401.",
        envvar="AFTGEN_API_KEY",
    )
    webui: bool = _server(
        True, "The playground page at / (chat, completion, settings, streaming, token probabilities, JSON schema)."
    )
    sessions_dir: Path | None = _server(None, "Save named sessions here (aftgen state files; default: memory only).")
    cache_mb: float = _server(64.0, "Prefix-state cache size, least recently used first out (0: off).", Range(0))
    parallel: int = _limit(32, "Sequences generating at once (rows of the batched step).", Range(1, 4096))
    queue: int = _limit(64, "Requests waiting for a row; past that: 503 with Retry-After.", Range(0, 1 << 20))
    max_prompt_tokens: int = _limit(
        8192, "Prompt tokens a request may send; past that: 400 (context_length_exceeded).", Range(1, 1 << 30)
    )
    max_tokens: int = _limit(
        1024, "Most tokens a request may ask for (and its default); past that: 400.", Range(1, 1 << 30)
    )
    max_echo_scores: int = _limit(
        1 << 18,
        "Scores an echoed prompt may come with: n x its tokens x (1 + logprobs) (one echo of 8,192 tokens with 20 "
        "alternatives fits); past that: 400.",
        Range(1, 1 << 30),
    )
    max_body_bytes: int = _limit(1 << 20, "Request body size; past that: 413.", Range(1024, 1 << 34))
    timeout: float = _limit(600.0, "Seconds a request may take, queueing included; past that: 504.", POSITIVE)
    read_timeout: float = _limit(
        10.0,
        "Seconds a client may take to send a request's headers or its body, stay idle between requests, or leave "
        "its reply unread; past that: 408 or closed.",
        POSITIVE,
    )
    max_connections: int | None = _limit(
        None,
        f"Connections open at once (default: the descriptor limit, `ulimit -n`, less {OWN_DESCRIPTORS + ACCEPT_BURST} "
        "kept for the process's own files and a burst of connections); past that a new one gets a 503 and is closed.",
        MAX_CONNECTIONS,
    )
    max_sessions: int = _limit(
        64, "Named sessions held in memory (the rest wait in --sessions-dir).", Range(1, 1 << 20)
    )
    max_session_files: int = _limit(
        256, "Session files kept in --sessions-dir; past that the least recently used is removed.", Range(1, 1 << 30)
    )
    prompt_chunk: int = _limit(
        PROMPT_CHUNK,
        "Prompt tokens read between two batched steps, in pieces of this many from each prompt's start (at the "
        "default, those `aftgen sample` reads: the same numbers).",
        Range(1, 1 << 20),
    )
    compile_step: bool = _hardware(
        True,
        "Compile the batched step at start (tens of seconds the first time, about one once cached).",
        flags=("--compile/--no-compile",),
    )
    batch_invariant: bool | None = _hardware(
        None, BATCH_INVARIANT_HELP, flags=("--batch-invariant/--no-batch-invariant",)
    )
    device: str = _hardware("auto", DEVICE_HELP)
    dtype: str = _hardware("auto", DTYPE_HELP)
    threads: int | None = _hardware(
        None,
        f"CPU threads (default: its share of the physical cores, less {HTTP_CORES} left to the HTTP side).",
        Range(1),
    )

    def check(self) -> None:
        """Refuse values outside their meaning, before the model is loaded."""
        if not self.host:
            raise AftgenError("--host must not be empty")
        if self.api_key is not None and not API_KEY.fullmatch(self.api_key):
            raise AftgenError(
                "--api-key (or AFTGEN_API_KEY) must be printable ASCII without spaces, as a client sends it in "
                "'Authorization: Bearer KEY': choose one of letters, digits and punctuation"
            )
        check_ranges(self)
        if self.sessions_dir is not None:
            _check_sessions_dir(self.sessions_dir)


def _check_sessions_dir(folder: Path) -> None:
    """Refuse a file, or a folder that holds a model: sessions get a folder of their own."""
    from aftgen.checkpoint import CHECKPOINT_FILES

    if folder.exists() and not folder.is_dir():
        raise AftgenError(f"--sessions-dir {folder} is not a folder")
    model_files = [name for name in CHECKPOINT_FILES if (folder / name).exists()]
    if model_files:
        raise AftgenError(
            f"--sessions-dir {folder} holds a model ({', '.join(model_files)}): give the sessions a folder of their own"
        )

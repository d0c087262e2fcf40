"""What `aftgen serve` can be told, with its defaults and range checks in one place (the CLI reads them)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from aftgen.errors import AftgenError

API_KEY = re.compile(r"[!-~]+")  # printable ASCII, no spaces: what an HTTP header carries as it was typed

# Cores left to the HTTP side, which formats and sends every token of every stream while the model steps:
# torch's threads spinning on every core starve it (measured with 32 streams on a busy 2-core machine:
# p99 inter-token latency 72 ms on one thread, 120 ms on two).
HTTP_CORES = 1


@dataclass
class ServeOptions:
    model: str | None = None  # checkpoint folder or Hub id; None: the shipped model
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000  # 0: any free port (the one chosen is printed)
    api_key: str | None = None  # when set, every /v1 route requires `Authorization: Bearer KEY`
    webui: bool = True  # GET / answers the playground page
    parallel: int = 32  # sequences generating at once: rows of the batched step
    queue: int = 64  # requests waiting for a free row; past that: 503
    max_prompt_tokens: int = 8192  # per request
    max_tokens: int = 1024  # the most a request may ask for, and what it gets if it does not say
    max_body_bytes: int = 1 << 20  # request bodies past this: 413
    timeout: float = 600.0  # seconds a request may take, waiting included; past that: 504
    read_timeout: float = 10.0  # seconds a client may stay silent while its request is read (or kept alive)
    cache_mb: float = 64.0  # prefix-state cache (LRU); 0: off
    sessions_dir: Path | None = None  # named sessions are saved here after every request (None: memory only)
    max_sessions: int = 64  # named sessions held in memory (with a sessions_dir, the rest wait on disk)
    max_session_files: int = 256  # session files kept in sessions_dir; past that the least recently used goes
    prompt_chunk: int = 256  # prompt tokens read between two batched steps
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None  # torch's CPU threads; None: its share of the cores, less HTTP_CORES
    compile_step: bool = True  # the batched step compiled at start (eager where it cannot be)

    def check(self) -> None:
        """Refuse values outside their meaning, before the model is loaded."""
        if not 0 <= self.port <= 65535:
            raise AftgenError(f"--port must be between 0 and 65535, got {self.port}")
        if not self.host:
            raise AftgenError("--host must not be empty")
        if self.api_key is not None and not API_KEY.fullmatch(self.api_key):
            raise AftgenError(
                "--api-key (or AFTGEN_API_KEY) must be printable ASCII without spaces, as a client sends it in "
                "'Authorization: Bearer KEY': choose one of letters, digits and punctuation"
            )
        # (least, most): far beyond any real use, the upper ends keep 2^64 from reaching torch or a loop
        ranges = {
            "--parallel": (self.parallel, 1, 4096),
            "--queue": (self.queue, 0, 1 << 20),
            "--max-prompt-tokens": (self.max_prompt_tokens, 1, 1 << 30),
            "--max-tokens": (self.max_tokens, 1, 1 << 30),
            "--max-body-bytes": (self.max_body_bytes, 1024, 1 << 34),
            "--max-sessions": (self.max_sessions, 1, 1 << 20),
            "--max-session-files": (self.max_session_files, 1, 1 << 30),
            "--prompt-chunk": (self.prompt_chunk, 1, 1 << 20),
        }
        for name, (value, least, most) in ranges.items():
            if not least <= value <= most:
                raise AftgenError(f"{name} must be between {least} and {most}, got {value}")
        for name, seconds in (("--timeout", self.timeout), ("--read-timeout", self.read_timeout)):
            if not seconds > 0:
                raise AftgenError(f"{name} must be positive, got {seconds}")
        if not self.cache_mb >= 0:
            raise AftgenError(f"--cache-mb must be >= 0 (0 turns the cache off), got {self.cache_mb}")
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

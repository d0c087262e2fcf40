"""What `aftgen bench serve` can be told, with its defaults and range checks in one place (the CLI reads them)."""

from __future__ import annotations

from dataclasses import dataclass

from aftgen.errors import AftgenError

STREAMS = (1, 8, 32)  # concurrent streams `aftgen bench serve` drives in turn


@dataclass
class BenchServeOptions:
    model: str | None = None  # None: the shipped model
    tokens: int = 256  # generated per stream
    rounds: int = 3  # 1, 8 and 32 streams in turn, this many times; each figure is the best round's
    threads: int | None = None  # the server's torch threads
    device: str = "auto"  # the server's --device
    dtype: str = "auto"  # the server's --dtype
    batch_invariant: bool | None = None  # the server's --batch-invariant (None: its default)

    def check(self) -> None:
        if not 16 <= self.tokens <= 4096:
            raise AftgenError(f"--tokens must be between 16 and 4096, got {self.tokens}")
        if not 1 <= self.rounds <= 100:
            raise AftgenError(f"--rounds must be between 1 and 100, got {self.rounds}")
        if self.threads is not None and self.threads < 1:
            raise AftgenError(f"--threads must be >= 1, got {self.threads}")

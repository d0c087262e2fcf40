"""Whether a compiled or native path can be used on this machine: decided in one place, said once, kept for reports.

Each path that may fall back (aftgen's native library, torch.compile of a function, the step's AOTInductor
package) is tried through `decide`: what the attempt made, or a Verdict saying why not and what runs instead.
A path that cannot be used is said on stderr in one line, once for each reason, and kept: `aftgen bench` prints
what fell back (`fallbacks`), and a server's /health shows it (`with_fallbacks`: "fallbacks", path -> why).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
NATIVE = "aftgen's native library"
STEP = "the compiled step"


@dataclass(frozen=True)
class Verdict:
    """Whether `path` can be used here; where not, why (one line) and what runs in its place."""

    path: str
    usable: bool
    reason: str | None = None
    instead: str | None = None

    def line(self) -> str:
        return f"{self.path} cannot be used here ({self.reason}): {self.instead}"


_verdicts: dict[str, Verdict] = {}  # each path's latest verdict in this process
_said: set[tuple[str, str]] = set()  # (path, reason) already said on stderr


def decide(
    path: str, attempt: Callable[[], T], instead: str, failures: tuple[type[BaseException], ...] = (Exception,)
) -> tuple[T | None, Verdict]:
    """`attempt()`'s result and a usable Verdict; or, where it raises one of `failures`, None and the Verdict of a
    fallback (`fell_back`). A compiler's failures have no common type (no C++ compiler, an op it cannot trace, a
    device it does not know), hence Exception by default: never silent, as each is said and kept."""
    try:
        made = attempt()
    except failures as exc:
        return None, fell_back(path, failure_line(exc), instead)
    verdict = Verdict(path, True)
    _verdicts[path] = verdict
    return made, verdict


def fell_back(path: str, reason: str, instead: str) -> Verdict:
    """`path` cannot be used here for `reason`, and `instead` runs: said once on stderr (for this path and reason),
    and kept for the reports."""
    verdict = Verdict(path, False, reason, instead)
    _verdicts[path] = verdict
    if (path, reason) not in _said:
        _said.add((path, reason))
        print(f"warning: {verdict.line()}", file=sys.stderr, flush=True)
    return verdict


def fallbacks() -> list[Verdict]:
    """The paths that fell back in this process, at their latest verdict."""
    return [verdict for verdict in _verdicts.values() if not verdict.usable]


def with_fallbacks(figures: dict) -> dict:
    """A server's figures with this process's fallbacks added to those they hold ("fallbacks": path -> why and what
    runs instead); unchanged where nothing fell back."""
    here = {verdict.path: f"{verdict.reason}: {verdict.instead}" for verdict in fallbacks()}
    return figures | {"fallbacks": figures.get("fallbacks", {}) | here} if here else figures


def failure_line(exc: BaseException) -> str:
    """Why an attempt failed, in one line: the exception's type and the first line of its message."""
    first_line = next(iter(str(exc).strip().splitlines()), "")
    return f"{type(exc).__name__}: {first_line[:200]}" if first_line else type(exc).__name__

"""What tests/serve's modules share: one server for the modules that need no server of their own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serving import watched


@pytest.fixture(scope="package")
def url(tiny_run) -> Iterator[str]:
    """One server for the package (each start takes seconds); its engine runs in a process of its own, on the
    threads the engine picks, so the modules' one-thread fixtures do not reach it."""
    with watched(tiny_run) as base:
        yield base

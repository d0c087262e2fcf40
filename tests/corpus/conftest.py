"""Each corpus test prepares into a cache of its own."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path / "cache"))

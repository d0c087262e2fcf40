"""What the generation tests share: the tiny run's model and tokenizer, loaded once."""

from __future__ import annotations

import pytest
from conftest import DEVICE

from aftgen.api import load


@pytest.fixture(scope="module")
def tiny(tiny_run):
    return load(tiny_run, device=DEVICE)

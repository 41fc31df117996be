"""Fixtures shared by the adversarial tests of ``crashproof run``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.supervisor._runs import Run, stop_run


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    """Runs a test started: stopped (every process of theirs) however the test ends."""
    started: list[Run] = []
    yield started
    for run in started:
        stop_run(run)

"""Ingest fixtures: the loopback feed server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ingest_helpers import FeedServer


@pytest.fixture
def server() -> Iterator[FeedServer]:
    """A real HTTP server on 127.0.0.1, scripted per test."""
    srv = FeedServer()
    yield srv
    srv.close()

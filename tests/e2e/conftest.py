"""Fixtures of the e2e tier (helpers live in ``tests/e2e/cluster.py``)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, running_cluster


@pytest.fixture(scope="module")
def cluster_factory() -> Iterator[Callable[..., Cluster]]:
    """Start clusters that live until the end of the module (several tests share one)."""
    stack = contextlib.ExitStack()

    def make(*args: Any, **kw: Any) -> Cluster:
        return stack.enter_context(running_cluster(*args, **kw))

    with stack:
        yield make



"""Fixtures of the integration tests that more than one module takes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.helpers import REDIS_URL, needs_redis
from weightsvc.service.replicas.memory import MemoryRegistry
from weightsvc.service.replicas.redis import RedisRegistry
from weightsvc.service.replicas.registry import Registry


@pytest.fixture(params=["memory", pytest.param("redis", marks=needs_redis)])
async def registry(request: pytest.FixtureRequest, redis_prefix: str) -> AsyncIterator[Registry]:
    """Each registry in turn: the embedded one, and Redis's under a key prefix of the test's own."""
    if request.param == "memory":
        yield MemoryRegistry()
        return
    reg = RedisRegistry(REDIS_URL, prefix=redis_prefix)
    yield reg
    await reg.close()

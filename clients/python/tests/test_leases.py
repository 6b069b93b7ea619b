"""The lease guard, blocking and asyncio: held through 3 x ttl of work, released on
leaving the block (with or without an exception), refused when the slots are held,
and a lease removed behind its back reported as lost."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import pytest

from conftest import Server
from qag_client import AsyncLimiter, Limiter, QagRefused

TTL_MS = 600


def test_the_blocking_lease_guard(start_server: Callable[..., Server]) -> None:
    server = start_server()
    raw = server.client()
    limiter = Limiter(server.client())
    with limiter.lease("qag:run", 1, TTL_MS, "q1") as lease:
        started = time.monotonic()
        while time.monotonic() - started < 3 * TTL_MS / 1000:
            time.sleep(0.05)
            assert limiter.leases("qag:run") == 1 and not lease.lost
        with pytest.raises(QagRefused) as refused:
            with limiter.lease("qag:run", 1, TTL_MS, "q2"):
                pass
        assert (refused.value.live, refused.value.retry_after) == (1, 1)
    assert not raw.exists("qag:run"), "released on leaving the block"

    with pytest.raises(RuntimeError):
        with limiter.lease("qag:run", 1, TTL_MS, "q3"):
            raise RuntimeError("the query failed")
    assert not raw.exists("qag:run"), "released on an exception too"

    with limiter.lease("qag:run", 1, TTL_MS, "q4") as lease:
        raw.delete("qag:run")
        deadline = time.monotonic() + TTL_MS / 1000
        while not lease.lost:
            assert time.monotonic() < deadline, "the loss was not reported within a TTL"
            time.sleep(0.01)
    limiter.close()


def test_the_async_lease_guard(start_server: Callable[..., Server]) -> None:
    server = start_server()
    raw = server.client()

    async def scenario() -> None:
        limiter = AsyncLimiter(server.async_client())
        async with limiter.lease("qag:run", 1, TTL_MS, "q1") as lease:
            started = time.monotonic()
            while time.monotonic() - started < 3 * TTL_MS / 1000:
                await asyncio.sleep(0.05)
                assert await limiter.leases("qag:run") == 1 and not lease.lost
            with pytest.raises(QagRefused):
                async with limiter.lease("qag:run", 1, TTL_MS, "q2"):
                    pass
        assert not raw.exists("qag:run")

        with pytest.raises(RuntimeError):
            async with limiter.lease("qag:run", 1, TTL_MS, "q3"):
                raise RuntimeError("the query failed")
        assert not raw.exists("qag:run")

        async with limiter.lease("qag:run", 1, TTL_MS, "q4") as lease:
            raw.delete("qag:run")
            deadline = time.monotonic() + TTL_MS / 1000
            while not lease.lost:
                assert time.monotonic() < deadline, "the loss was not reported within a TTL"
                await asyncio.sleep(0.01)
        await limiter.aclose()

    asyncio.run(scenario())

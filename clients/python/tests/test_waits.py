"""Waiting instead of a refusal (``wait=``) on both limiters: waiting calls served in
arrival order on connections of their own while other calls go on unstalled; a wait
cut short (a cancelled task, the call's deadline) leaves nothing charged or held; a
lease waiting for a slot; waits beyond ``max_waiting`` busy; without the module, an answer at once; bad waits refused
before anything is sent; through the FastAPI example, a request that waits says so in
``server-timing``."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Tuple

import pytest

from conftest import Server
from qag_client import AsyncLimiter, Bucket, Limiter, QagBusy, QagRefused


def info(server: Server, field: str) -> int:
    return int(server.client().info("qag")[f"qag_{field}"])


def until_info(server: Server, field: str, value: int) -> None:
    deadline = time.monotonic() + 10
    while info(server, field) < value:
        assert time.monotonic() < deadline, f"qag_{field} never reached {value}"
        time.sleep(0.002)


def test_waiting_calls_never_stall_the_others(
    start_server: Callable[..., Server], timing: None
) -> None:
    """Ten waiting takes (threads) on a drained bucket of 10 a second, each made once
    the one before waits: served a tenth of a second apart, in that order, while plain
    calls answer at once. (How long each waited depends on when it came, which a loaded
    machine spreads: the order and the spacing are those of their answers.)"""
    server = start_server()
    limiter = Limiter(server.client())
    bucket = Bucket("qag:ratelimit:key:10/1:acme~wait", 10, 1)
    assert limiter.take(bucket, 10).allowed
    waited: List[float] = [0.0] * 10
    answered: List[Tuple[float, int]] = []
    answered_lock = threading.Lock()

    def waiter(n: int) -> None:
        decision = limiter.take(bucket, wait=3.0)
        with answered_lock:
            answered.append((time.monotonic(), n))
        assert decision.allowed and decision.answered_by == "module"
        waited[n] = decision.waited

    threads = []
    for n in range(10):
        thread = threading.Thread(target=waiter, args=(n,))
        thread.start()
        threads.append(thread)
        until_info(server, "wait_started", n + 1)
    other = Bucket("qag:ratelimit:key:100/1:acme~other", 100, 1)
    started = time.monotonic()
    for _ in range(20):
        assert limiter.take(other).allowed
    assert time.monotonic() - started < 0.3
    for thread in threads:
        thread.join()
    assert [n for _, n in answered] == list(range(10)), answered
    assert all(seconds > 0 for seconds in waited), waited
    assert answered[9][0] - answered[0][0] > 0.7, answered
    assert limiter.counts.errors == 0
    limiter.close()


def test_a_cancelled_wait_leaves_nothing_charged(start_server: Callable[..., Server]) -> None:
    """An asyncio task waiting for its token, cancelled: its connection closes and the
    server gives back what it was charged; a wait too short is refused at once."""
    server = start_server()
    bucket = Bucket("qag:ratelimit:key:1/2:acme~cut", 1, 2)

    async def scenario() -> None:
        limiter = AsyncLimiter(server.async_client())
        assert (await limiter.take(bucket)).allowed
        task = asyncio.ensure_future(limiter.take(bucket, wait=5.0))
        while info(server, "waiters") < 1:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 5
        while info(server, "wait_given_back") < 1:
            assert time.monotonic() < deadline, "never given back"
            await asyncio.sleep(0.01)
        started = time.monotonic()
        refused = await limiter.take(bucket, wait=0.1)
        assert not refused.allowed and refused.waited == 0.0
        assert time.monotonic() - started < 0.2
        await limiter.aclose()

    asyncio.run(scenario())
    tokens = float(server.client().hget(bucket.key, "tokens") or b"0")
    assert tokens > -0.5, tokens


def test_waits_beyond_max_waiting_are_busy(start_server: Callable[..., Server]) -> None:
    """``max_waiting`` bounds the connections a process keeps waiting: with two waiting,
    a third waiting call finds none free within its queue_timeout and raises QagBusy
    (this process's overload: no back-off), while calls that do not wait go on; once a
    waiter is answered its connection serves the next."""
    server = start_server()
    limiter = AsyncLimiter(server.async_client(), max_waiting=2)
    bucket = Bucket("qag:ratelimit:key:2/2:acme~busy", 2, 2)

    async def scenario() -> None:
        assert (await limiter.take(bucket, 2)).allowed
        waiting = []
        for n in range(2):
            waiting.append(asyncio.ensure_future(limiter.take(bucket, wait=5.0)))
            while info(server, "wait_started") < n + 1:
                await asyncio.sleep(0.002)
        started = time.monotonic()
        with pytest.raises(QagBusy):
            await limiter.take(bucket, wait=5.0)
        took = time.monotonic() - started
        assert 0.45 <= took < 1.5, took
        assert not limiter.backing_off
        assert (await limiter.take(Bucket("qag:ratelimit:key:100/1:acme~other", 100, 1))).allowed
        for call in waiting:
            assert (await call).allowed
        assert (await limiter.take(bucket, wait=5.0)).allowed
        await limiter.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_lease_waits_for_a_slot(start_server: Callable[..., Server], kind: str) -> None:
    """Every slot held: a lease with ``wait`` is given the one a release frees, and
    says how long it waited; one whose wait runs out is refused, holding nothing."""
    server = start_server()
    key = "qag:running:acme~wait"

    def release_soon(release: Callable[[], Any]) -> threading.Thread:
        def later() -> None:
            time.sleep(0.2)
            release()

        thread = threading.Thread(target=later)
        thread.start()
        return thread

    if kind == "sync":
        limiter = Limiter(server.client())
        first = limiter.lease(key, 1, 30_000, "first")
        first.__enter__()
        thread = release_soon(lambda: first.__exit__(None, None, None))
        with limiter.lease(key, 1, 30_000, "second", wait=2.0) as second:
            assert second.waited >= 0.15, second.waited
            with pytest.raises(QagRefused) as refused:
                limiter.lease(key, 1, 30_000, "third", wait=0.2).__enter__()
            assert refused.value.waited >= 0.2
        thread.join()
        limiter.close()
    else:

        async def scenario() -> None:
            limiter = AsyncLimiter(server.async_client())
            first = limiter.lease(key, 1, 30_000, "first")
            await first.__aenter__()
            loop = asyncio.get_running_loop()
            loop.call_later(0.2, lambda: asyncio.ensure_future(first.__aexit__(None, None, None)))
            async with limiter.lease(key, 1, 30_000, "second", wait=2.0) as second:
                assert second.waited >= 0.15, second.waited
                with pytest.raises(QagRefused):
                    await limiter.lease(key, 1, 30_000, "third", wait=0.2).__aenter__()
            await limiter.aclose()

        asyncio.run(scenario())
    assert server.client().execute_command("QAG.LEASES", key) == 0, "nothing held"


def test_without_the_module_a_wait_answers_at_once(start_server: Callable[..., Server]) -> None:
    server = start_server(with_module=False)
    limiter = Limiter(server.client())
    bucket = Bucket("qag:ratelimit:key:1/60:acme~script", 1, 60)
    assert limiter.take(bucket, wait=5.0).allowed
    started = time.monotonic()
    refused = limiter.take(bucket, wait=5.0)
    assert (refused.allowed, refused.answered_by) == (False, "script")
    assert time.monotonic() - started < 0.3
    limiter.close()


def test_bad_waits_are_refused_before_anything_is_sent(
    start_server: Callable[..., Server],
) -> None:
    server = start_server()
    limiter = Limiter(server.client())
    server.client().config_resetstat()
    bucket = Bucket("qag:b", 10, 1)
    for bad in (-0.1, 60.5, float("nan"), "1", True):
        with pytest.raises(ValueError, match="wait must be a number of seconds from 0 to 60"):
            limiter.take(bucket, wait=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="wait"):
            limiter.lease("qag:l", 1, 1000, "x", wait=bad)  # type: ignore[arg-type]
    assert "cmdstat_qag" not in str(server.client().info("commandstats"))
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(limiter.take, bucket, wait=0).result().allowed
    limiter.close()

"""The lease guard, blocking and asyncio: held through 3 x ttl of work, released on
leaving the block (with or without an exception), refused when the slots are held, a
lease removed behind its back reported as lost; no slot stranded by an acquire that
timed out or was cancelled, no error raised by a release on the way out, and renewals
that fail reported as a lost lease within its TTL."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable

import pytest

from conftest import Server, idle
from qag_client import (
    AsyncLimiter,
    Limiter,
    QagModuleRequired,
    QagPermissionError,
    QagRefused,
    QagUnavailable,
)

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


def debug_sleep(server: Server, seconds: float) -> threading.Thread:
    """The server stalls for ``seconds`` (DEBUG SLEEP from another connection)."""
    sleeper = threading.Thread(
        target=server.client().execute_command, args=("DEBUG", "SLEEP", seconds)
    )
    sleeper.start()
    time.sleep(0.05)  # it runs
    return sleeper


def leases_back_to_zero(server: Server, limiter: Any, key: str) -> float:
    """Seconds until QAG.LEASES of ``key`` is 0 (at most 3)."""
    raw, started = server.client(), time.monotonic()
    while raw.execute_command("QAG.LEASES", key) != 0:
        assert time.monotonic() - started < 3, "the slot stayed held"
        idle(limiter, 0.02)
    return time.monotonic() - started


def test_an_acquire_stalled_past_its_deadline_leaves_no_slot_held(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    server = start_server(extra=["--enable-debug-command", "yes"])
    limiter = make_limiter(server, deadline=0.5)
    assert limiter.leases("qag:run") == 0  # the module is known: the next request is LEASE
    sleeper = debug_sleep(server, 1)
    with pytest.raises(QagUnavailable, match="deadline"):
        with limiter.lease("qag:run", 2, 60_000, "q1"):
            pass
    while sleeper.is_alive():  # the server answers again
        idle(limiter, 0.01)
    assert leases_back_to_zero(server, limiter, "qag:run") < 1.0
    assert server.client().execute_command("QAG.RELEASE", "qag:run", "q1") == 0


def test_an_acquire_cancelled_mid_call_leaves_no_slot_held(
    start_server: Callable[..., Server],
) -> None:
    server = start_server(extra=["--enable-debug-command", "yes"])

    async def scenario() -> float:
        limiter = AsyncLimiter(server.async_client(), deadline=5.0)
        assert await limiter.leases("qag:run") == 0

        async def request() -> None:
            async with limiter.lease("qag:run", 2, 60_000, "q1"):
                await asyncio.sleep(10)

        sleeper = debug_sleep(server, 1)
        call = asyncio.ensure_future(request())
        await asyncio.sleep(0.1)  # the LEASE was sent; the server has not run it
        call.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await call
        while sleeper.is_alive():
            await asyncio.sleep(0.01)
        raw, answered = server.client(), time.monotonic()
        while raw.execute_command("QAG.LEASES", "qag:run") != 0:
            assert time.monotonic() - answered < 3, "the slot stayed held"
            await asyncio.sleep(0.02)
        await limiter.aclose()
        return time.monotonic() - answered

    assert asyncio.run(scenario()) < 1.0


def test_a_release_timing_out_on_the_way_out_raises_nothing(
    start_server: Callable[..., Server],
    make_limiter: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = start_server(extra=["--enable-debug-command", "yes"])
    limiter = make_limiter(server, deadline=0.3)
    with limiter.lease("qag:run", 2, 60_000, "q1") as lease:
        sleeper = debug_sleep(server, 1)  # the query ran; Redis stalls as it ends
    assert lease.answered_by == "module"
    assert limiter.counts.errors == 1
    assert any(
        record.name == "qag_client" and record.levelname == "WARNING" and "q1" in record.message
        for record in caplog.records
    )
    sleeper.join()


def test_a_release_that_fails_on_the_way_out_goes_on_in_the_background(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    """Writes paused as a lease's block ends (a failover pauses them): the release
    times out, and goes on in the background until Redis answers, the slot not left
    held until its TTL."""
    server = start_server()
    limiter = make_limiter(server, deadline=0.3)
    with limiter.lease("qag:run", 2, 30_000, "q1"):
        server.client().execute_command("CLIENT", "PAUSE", 600, "WRITE")
    assert limiter.counts.errors == 1
    assert leases_back_to_zero(server, limiter, "qag:run") < 1.5


def test_a_lease_is_released_on_a_time_of_its_own(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    """A request whose calls spent its whole deadline (the middleware's budget) still
    releases its slot on the way out, at once: the release's time is its own."""
    from qag_client._driver import Budget, spending

    server = start_server()
    limiter = make_limiter(server, deadline=0.3)
    guard = limiter.lease("qag:run", 2, 30_000, "q1")
    guard.__enter__()
    with spending(Budget(0.0)):
        guard.__exit__(None, None, None)
    assert server.client().execute_command("QAG.LEASES", "qag:run") == 0
    assert limiter.counts.errors == 0


def skip_on_redis_8_when_unloading(admin: Any) -> None:
    info = admin.info("server")
    if "valkey_version" not in info and int(str(info["redis_version"]).split(".")[0]) >= 8:
        pytest.skip(
            "Redis 8.2.3 crashes (SIGSEGV in invalidFunctionWasCalled) when a connection "
            "sends a command of a module unloaded after it last sent that command"
        )


@pytest.mark.parametrize("failure", ["module unloaded", "NOPERM"])
def test_renewals_that_fail_lose_the_lease_within_its_ttl(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any], failure: str
) -> None:
    """With the "module" backend, a module unloaded is a failure like NOPERM (with
    "auto" the script renews: see below)."""
    server = start_server(extra=["--enable-module-command", "yes"])
    admin = server.client()
    if failure == "module unloaded":
        skip_on_redis_8_when_unloading(admin)
    admin.execute_command("ACL", "SETUSER", "gateway", "on", ">secret", "~qag:*", "+@all")
    backend = "module" if failure == "module unloaded" else "auto"
    limiter = make_limiter(
        server, {"username": "gateway", "password": "secret"}, deadline=0.2, backend=backend
    )
    with limiter.lease("qag:run", 1, TTL_MS, "q1") as lease:
        idle(limiter, TTL_MS / 1000)  # renewed meanwhile
        assert not lease.lost
        if failure == "NOPERM":
            admin.execute_command("ACL", "SETUSER", "gateway", "-qag.renew")
        else:
            admin.execute_command("MODULE", "UNLOAD", "qag")
        failed = time.monotonic()
        while not lease.lost:
            assert time.monotonic() - failed < TTL_MS / 1000, "not lost within a TTL"
            idle(limiter, 0.01)
        expected = QagPermissionError if failure == "NOPERM" else QagModuleRequired
        assert isinstance(lease.last_error, expected), lease.last_error
    assert limiter.counts.errors >= 2  # the renewals


def test_renewals_go_on_through_the_script_when_the_module_goes(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    """The module unloaded under a held lease (a node restarted without it): with
    "auto" the renewals go on through the script on the same key, the lease is never
    lost, and its release frees the slot."""
    server = start_server(extra=["--enable-module-command", "yes"])
    admin = server.client()
    skip_on_redis_8_when_unloading(admin)
    limiter = make_limiter(server, deadline=0.2)
    with limiter.lease("qag:run", 1, TTL_MS, "q1") as lease:
        admin.execute_command("MODULE", "UNLOAD", "qag")
        first = float(admin.zscore("qag:run", "q1"))
        idle(limiter, 2 * TTL_MS / 1000)
        assert not lease.lost and lease.last_error is None, lease.last_error
        assert float(admin.zscore("qag:run", "q1")) > first + TTL_MS / 2, "renewed by the script"
        assert limiter.leases("qag:run") == 1
    assert admin.exists("qag:run") == 0, "the release deleted the key"
    assert limiter.counts.errors == 0


def test_leaving_a_block_during_a_back_off_releases_the_slot_once_redis_answers(
    start_server: Callable[..., Server], stop: Callable[[Server], None]
) -> None:
    import os
    import signal

    from qag_client import Bucket, Limiter

    server = start_server()
    limiter = Limiter(server.client(), deadline=0.3, back_off=1.0, on_unavailable="forward")
    with limiter.lease("qag:slots", 2, 30_000, "a"):
        # A blip while the request runs: the take meets it, a back-off starts.
        stop(server)
        assert limiter.take(Bucket("qag:b", 5, 3600)).answered_by == "forwarded"
        os.kill(server.process.pid, signal.SIGCONT)
        assert limiter.backing_off
    # Left during the back-off: released in the background, not left to its 30 s TTL.
    until = time.monotonic() + 3
    while int(server.client().execute_command("QAG.LEASES", "qag:slots")) != 0:
        assert time.monotonic() < until, "the slot is still held"
        time.sleep(0.05)
    limiter.close()

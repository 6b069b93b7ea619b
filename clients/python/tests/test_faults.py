"""Issue 49's search of the client's failure paths, the Python twin of
clients/rust/tests/faults.rs: concurrent callers of an AsyncLimiter (tasks) and of a
Limiter (threads) take from a bucket, wait for a bucket, hold leases (released, left,
or left by an exception), check and add to a quota and are admitted by a window, and
HTTP callers go through the ASGI middleware of examples/fastapi_gateway.py under
uvicorn (a key's bucket, its quota and its concurrent queries), all through a fault
proxy of the tests' own (fault_proxy.py) while a seeded schedule delays replies past the
deadline, swallows replies after their commands ran, resets and refuses connections,
pauses writes (CLIENT PAUSE ... WRITE, as a failover does), stops the server (SIGSTOP),
restarts it with and without the module, and flushes its scripts. Then the promises are
checked against what the callers saw:

- between two restarts (each starts the keys afresh), no bucket allowed more than its
  size and what refilled (the gateway's 200s included), and no more leases were held at
  once than the limit (a call whose answer straddles a restart is left out: it is of
  either server);
- between two restarts, no more quota checks allowed than the quota and the callers (a
  check and its add are two calls), and no more admitted by a window than its requests
  a window in each window the server's life touched; at the end, the quota counted no
  add twice and lost none that was answered;
- no call overran its deadline (and its wait) by more than ``SLACK``, and no request its
  deadline and its work;
- every error is an outage's (QagUnavailable, QagBusy): nothing else, and no answer the
  policy's (it is "raise"); the gateway answers 200, 429 or 503, nothing else;
- a second after the last call ended, no slot is held in Redis (the library's TTL is
  3 s, the gateway's 30 s): every lease that was granted, whether its caller saw the
  grant or not, was given back;
- once the faults end, both limiters' back-offs end by themselves, with no call:
  their probers find the server answering.

``QAG_FAULT_SECONDS`` (default 12) bounds the run, ``QAG_FAULT_SEED`` replays a schedule
(the faults in the same order; their timing against the calls varies); a failure names
its seed and the faults applied. Not checked: quota adds lost in an outage (not sent
again yet: issue 45)."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, List, Optional, Tuple, Union

import httpx
import pytest
import redis
import redis.asyncio

from conftest import Gateway, Server
from fault_proxy import FaultProxy
from qag_client import (
    AsyncLimiter,
    Bucket,
    Limiter,
    QagBusy,
    QagRefused,
    QagUnavailable,
    Quota,
    Scope,
)

DEADLINE = 0.3
WAIT = 0.2
# A call may wait on this process (a place in its pool, a thread, the event loop) up to
# the limiters' queue time (their deadline, by default) before its deadline with the
# server begins, as documented: its bound is both (a blocking admit took 0.61 and 0.65 s
# at 0.3 in two CI runs with redis-py 5.0.8; not reproduced alone).
QUEUE = DEADLINE
# A call's time past its deadline (and wait) that counts as an overrun: a loaded
# machine's scheduling, never a round trip more.
SLACK = 0.25
BACK_OFF = 0.5
# A back-off's prober ends it within a probe's time (the back-off, at most 2 s, at least
# the deadline: one out when the faults end) and a back-off (the next) once the server
# answers, whether calls come or not; and a second for a loaded machine.
PROBED_BY = max(min(BACK_OFF, 2.0), DEADLINE) + BACK_OFF + 1.0
ASYNC_CALLERS = 16
SYNC_CALLERS = 4
CALLERS = ASYNC_CALLERS + SYNC_CALLERS
# The end of a run, with the network's faults only.
TAIL = 4.0

BUCKET = Bucket("qag:faults:bucket", 20, 60.0)
WAITING = Bucket("qag:faults:waiting", 10, 30.0)
LEASES = ("qag:faults:leases", 3, 3000)
# The gateway's: its key's bucket (30 a minute), at most 3 of its requests at once, each
# with the gateway's deadline (the limiter's default).
GATEWAY_BUCKET = (30, 60.0)
GATEWAY_DEADLINE = 0.5
# A request's calls share one deadline; its slot's release, before the response's end,
# has one of its own (so a release is never skipped for the request's time spent).
GATEWAY_REQUEST = 2 * GATEWAY_DEADLINE
HTTP_CALLERS = 6
QUOTA_KEY = "qag:faults:quota"
QUOTA = Quota("month", "UTC", calls=40)
WINDOW = Scope("qag:faults:window", 30, 0)


# What a caller saw of one call.
@dataclass(frozen=True)
class Allowed:
    bucket: str
    sent: float
    received: float


@dataclass(frozen=True)
class Held:
    sent: float
    received: float
    released: float


@dataclass(frozen=True)
class Took:
    what: str
    sent: float
    took: float
    bound: float


@dataclass(frozen=True)
class Failed:
    what: str
    error: Exception


@dataclass(frozen=True)
class PolicyAnswered:
    """An answer that was not Redis's, under "raise"."""

    what: str
    answered_by: str


@dataclass(frozen=True)
class QuotaAllowed:
    sent: float
    received: float


@dataclass(frozen=True)
class QuotaAdd:
    """An add, answered (``counted``) or not."""

    sent: float
    received: float
    counted: bool


@dataclass(frozen=True)
class Admitted:
    sent: float
    received: float


@dataclass(frozen=True)
class Response:
    status: int
    sent: float
    received: float
    work: float


Seen = Union[
    Allowed, Held, Took, Failed, PolicyAnswered, QuotaAllowed, QuotaAdd, Admitted, Response
]


class Record:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: List[Seen] = []
        # When each restart began and when the new server answered.
        self.restarts: List[Tuple[float, float]] = []
        self.faults: List[str] = []
        # The schedule's start: the faults' and the findings' times are from it.
        self.started = time.monotonic()

    def ms(self, at: float) -> int:
        """An instant, in ms since the schedule's start."""
        return round((at - self.started) * 1000)

    def push(self, seen: Seen) -> None:
        with self.lock:
            self.seen.append(seen)


def seconds() -> float:
    return float(os.environ.get("QAG_FAULT_SECONDS", "12"))


# Its verdicts time the callers, so it runs alone: beside the other suites in CI, a blocking
# admit (0.99 s) and a gateway's request (1.41 s), in two processes, overran together and
# ended within 50 ms of each other: the machine's stall, not the client's.
@pytest.mark.cores
def test_the_clients_promises_hold_under_a_random_schedule_of_faults(
    start_server: Callable[..., Server], tmp_path: Path
) -> None:
    given = os.environ.get("QAG_FAULT_SEED")
    seed = int(given) if given else random.getrandbits(63)
    print(f"QAG_FAULT_SEED={seed}", flush=True)
    server = start_server()
    with FaultProxy(server.port) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/"
        flags = ["--key-limit", f"{GATEWAY_BUCKET[0]}/{GATEWAY_BUCKET[1]:g}"]
        flags += ["--max-concurrent", "3", "--quota-calls", "100000"]
        flags += ["--policy", "raise", "--back-off", str(BACK_OFF)]
        gateway = Gateway(url, flags, tmp_path / "gateway.log")
        try:
            record, run, findings = faulted_run(start_server, server, proxy, url, gateway, seed)
        finally:
            gateway.stop()
        swallowed = proxy.swallowed
    print(
        f"seed {seed}: {len(record.faults)} faults over {run:g} s ({swallowed} replies"
        f" swallowed); {summary(record)}"
    )
    assert not findings, (
        f"QAG_FAULT_SEED={seed}:\n"
        + "\n".join(findings)
        + "\nfaults:\n"
        + "\n".join(record.faults)
        + f"\nthe gateway's log: {tmp_path / 'gateway.log'}"
    )


def faulted_run(
    start_server: Callable[..., Server],
    server: Server,
    proxy: FaultProxy,
    url: str,
    gateway: Gateway,
    seed: int,
) -> Tuple[Record, float, List[str]]:
    """The callers and the schedule until the end, then the checks: the record, the
    run's length, the findings."""
    record = Record()
    # An instant and the Unix time then: the windows a span of instants touches.
    anchor = (time.monotonic(), time.time())
    run = seconds()
    end = time.monotonic() + run
    last: List[Server] = []
    failed: List[BaseException] = []

    def schedule() -> None:
        try:
            last.append(faults(start_server, server, proxy, record, seed, end))
        except BaseException as error:  # raised in the test's thread, after the join
            failed.append(error)

    scheduling = threading.Thread(target=schedule, name="faults")
    scheduling.start()
    # The blocking limiter, shared by its threads as a threaded server's handlers share it.
    limiter = Limiter(
        redis.Redis.from_url(url), deadline=DEADLINE, on_unavailable="raise", back_off=BACK_OFF
    )
    blocking = limiter
    threads = [
        threading.Thread(
            target=sync_caller,
            args=(limiter, record, random.Random(seed ^ (n + 1)), n, end),
            name=f"caller-{n}",
        )
        for n in range(ASYNC_CALLERS, CALLERS)
    ]
    for thread in threads:
        thread.start()

    async def run_async() -> Tuple[float, List[str]]:
        limiter = AsyncLimiter(
            redis.asyncio.Redis.from_url(url),
            deadline=DEADLINE,
            on_unavailable="raise",
            back_off=BACK_OFF,
        )
        try:
            async with httpx.AsyncClient(timeout=10) as http:
                callers = [
                    async_caller(limiter, record, random.Random(seed ^ (n + 1)), n, end)
                    for n in range(ASYNC_CALLERS)
                ]
                base = gateway.url("key=faults")
                requests = [
                    request(http, base, record, random.Random(seed ^ (1000 + n)), end)
                    for n in range(HTTP_CALLERS)
                ]
                await asyncio.gather(*callers, *requests)
            for thread in threads:
                await asyncio.to_thread(thread.join)
            await asyncio.to_thread(scheduling.join)
            proxy.heal()
            ended = time.monotonic()
            # Every lease granted, seen or not, given back (the TTL would free it at 3 s):
            # the limiters stay open meanwhile, their background releases running.
            await asyncio.sleep(1)
            left = await asyncio.to_thread(left_in_redis)
            return ended, left + await back_offs_left(limiter, ended)
        finally:
            await limiter.aclose()

    async def back_offs_left(async_limiter: AsyncLimiter, ended: float) -> List[str]:
        """The back-offs end by themselves: no call comes once the faults have ended, and
        each limiter's prober finds the healed server answering within ``PROBED_BY``."""
        while async_limiter.backing_off or blocking.backing_off:
            if time.monotonic() - ended > PROBED_BY:
                return [f"still backing off {PROBED_BY:g} s after the faults ended, no call"]
            await asyncio.sleep(0.02)
        return []

    def left_in_redis() -> List[str]:
        if failed:
            raise failed[0]
        client = last[0].client()
        now_ms = int(time.time() * 1000)
        held = 0
        for key in [*client.keys("qag:running:*"), LEASES[0]]:
            held += int(client.zcount(key, now_ms, "+inf"))
        counted = client.hget(QUOTA_KEY, "calls")
        findings = check_quota_count(record, int(counted or 0))
        if held > 0:
            findings.append(f"{held} slots still held 1 s after the last call ended")
        return findings

    # No collector pause in a call timed against its deadline: the record alone grows to
    # tens of thousands of objects.
    gc.disable()
    try:
        ended, later = asyncio.run(run_async())
    finally:
        gc.enable()
        for thread in threads:
            thread.join()
        scheduling.join()
        limiter.close()
    return record, run, check(record, ended, anchor) + later


class Leaving(Exception):
    """A lease's block left by an exception."""


def lease_id(n: int, calls: int, rng: random.Random) -> str:
    return f"caller-{n}-{rng.getrandbits(32):x}-{calls}"


def answered(record: Record, what: str, sent: float, bound: float, answer: Any) -> Optional[float]:
    """Records a call's time and its failure, or an answer the policy gave: when it
    returned, if Redis answered it."""
    received = time.monotonic()
    record.push(Took(what, sent, received - sent, bound))
    if isinstance(answer, Exception):
        record.push(Failed(what, answer))
        return None
    if answer.answered_by not in ("module", "script"):
        record.push(PolicyAnswered(what, answer.answered_by))
        return None
    return received


def attempt(call: Callable[[], Any]) -> Any:
    """The call's answer, or what it raised."""
    try:
        return call()
    except Exception as error:
        return error


async def attempt_async(call: Awaitable[Any]) -> Any:
    try:
        return await call
    except Exception as error:
        return error


def sync_caller(limiter: Limiter, record: Record, rng: random.Random, n: int, end: float) -> None:
    """One caller (a thread): a take, a waiting take, a quota check and add, an
    admission or a lease held a while, at random, until ``end``."""
    calls = 0
    while time.monotonic() < end:
        calls += 1
        sent = time.monotonic()
        kind = rng.randrange(5)
        if kind == 0:
            answer = attempt(lambda: limiter.take(BUCKET))
            received = answered(record, "sync take", sent, DEADLINE, answer)
            if received is not None and answer.allowed:
                record.push(Allowed(BUCKET.key, sent, received))
        elif kind == 1:
            answer = attempt(lambda: limiter.take(WAITING, wait=WAIT))
            received = answered(record, "sync waiting take", sent, DEADLINE + WAIT, answer)
            if received is not None and answer.allowed:
                record.push(Allowed(WAITING.key, sent, received))
        elif kind == 2:
            answer = attempt(lambda: limiter.quota_check(QUOTA_KEY, QUOTA))
            received = answered(record, "sync quota check", sent, DEADLINE, answer)
            if received is not None and answer.allowed:
                record.push(QuotaAllowed(sent, received))
                sent = time.monotonic()
                added = attempt(lambda: limiter.quota_add(QUOTA_KEY, QUOTA, calls=1))
                received = answered(record, "sync quota add", sent, DEADLINE, added)
                record.push(QuotaAdd(sent, time.monotonic(), received is not None))
        elif kind == 3:
            answer = attempt(lambda: limiter.admit([WINDOW], 60))
            received = answered(record, "sync admit", sent, DEADLINE, answer)
            if received is not None and answer.admitted:
                record.push(Admitted(sent, received))
        else:
            sync_lease(limiter, record, rng, lease_id(n, calls, rng), sent)
        time.sleep(rng.randrange(20) / 1000)


def sync_lease(
    limiter: Limiter, record: Record, rng: random.Random, lease: str, sent: float
) -> None:
    """A lease held up to 60 ms, then released, left, or left by an exception."""
    released: Optional[float] = None
    what = "sync lease"
    try:
        with limiter.lease(LEASES[0], LEASES[1], LEASES[2], lease) as guard:
            received = answered(record, what, sent, DEADLINE, guard)
            time.sleep(rng.randrange(60) / 1000)
            released, what = time.monotonic(), "sync release"
            if received is not None:
                record.push(Held(sent, received, released))
            way = rng.randrange(3)
            if way == 0:
                guard.release()
            elif way == 1:
                raise Leaving()
    except Leaving:
        pass
    except QagRefused:  # every slot held: an answer, not a failure
        record.push(Took(what, sent, time.monotonic() - sent, DEADLINE))
    except Exception as error:
        answered(record, what, sent if released is None else released, DEADLINE, error)
        return
    if released is not None:
        record.push(Took("sync release", released, time.monotonic() - released, DEADLINE))


async def async_caller(
    limiter: AsyncLimiter, record: Record, rng: random.Random, n: int, end: float
) -> None:
    """``sync_caller`` as a task."""
    calls = 0
    while time.monotonic() < end:
        calls += 1
        sent = time.monotonic()
        kind = rng.randrange(5)
        if kind == 0:
            answer = await attempt_async(limiter.take(BUCKET))
            received = answered(record, "async take", sent, DEADLINE, answer)
            if received is not None and answer.allowed:
                record.push(Allowed(BUCKET.key, sent, received))
        elif kind == 1:
            answer = await attempt_async(limiter.take(WAITING, wait=WAIT))
            received = answered(record, "async waiting take", sent, DEADLINE + WAIT, answer)
            if received is not None and answer.allowed:
                record.push(Allowed(WAITING.key, sent, received))
        elif kind == 2:
            answer = await attempt_async(limiter.quota_check(QUOTA_KEY, QUOTA))
            received = answered(record, "async quota check", sent, DEADLINE, answer)
            if received is not None and answer.allowed:
                record.push(QuotaAllowed(sent, received))
                sent = time.monotonic()
                added = await attempt_async(limiter.quota_add(QUOTA_KEY, QUOTA, calls=1))
                received = answered(record, "async quota add", sent, DEADLINE, added)
                record.push(QuotaAdd(sent, time.monotonic(), received is not None))
        elif kind == 3:
            answer = await attempt_async(limiter.admit([WINDOW], 60))
            received = answered(record, "async admit", sent, DEADLINE, answer)
            if received is not None and answer.admitted:
                record.push(Admitted(sent, received))
        else:
            await async_lease(limiter, record, rng, lease_id(n, calls, rng), sent)
        await asyncio.sleep(rng.randrange(20) / 1000)


async def async_lease(
    limiter: AsyncLimiter, record: Record, rng: random.Random, lease: str, sent: float
) -> None:
    """``sync_lease`` with ``async with``."""
    released: Optional[float] = None
    what = "async lease"
    try:
        async with limiter.lease(LEASES[0], LEASES[1], LEASES[2], lease) as guard:
            received = answered(record, what, sent, DEADLINE, guard)
            await asyncio.sleep(rng.randrange(60) / 1000)
            released, what = time.monotonic(), "async release"
            if received is not None:
                record.push(Held(sent, received, released))
            way = rng.randrange(3)
            if way == 0:
                await guard.release()
            elif way == 1:
                raise Leaving()
    except Leaving:
        pass
    except QagRefused:  # every slot held: an answer, not a failure
        record.push(Took(what, sent, time.monotonic() - sent, DEADLINE))
    except Exception as error:
        answered(record, what, sent if released is None else released, DEADLINE, error)
        return
    if released is not None:
        record.push(Took("async release", released, time.monotonic() - released, DEADLINE))


async def request(
    http: httpx.AsyncClient, base: str, record: Record, rng: random.Random, end: float
) -> None:
    """An HTTP caller of the gateway, a request of up to 40 ms of work at a time."""
    while time.monotonic() < end:
        work = rng.randrange(40)
        sent = time.monotonic()
        try:
            status = (await http.get(f"{base}&work_ms={work}")).status_code
        except httpx.HTTPError:
            status = 0
        record.push(Response(status, sent, time.monotonic(), work / 1000))
        await asyncio.sleep(rng.randrange(20) / 1000)


def faults(
    start_server: Callable[..., Server],
    server: Server,
    proxy: FaultProxy,
    record: Record,
    seed: int,
    end: float,
) -> Server:
    """The schedule: a fault every 150-500 ms until ``end``; the server as it ends."""
    rng = random.Random(seed)
    port = server.port
    while time.monotonic() < end:
        time.sleep(rng.randrange(150, 500) / 1000)
        at = record.ms(time.monotonic())
        # The last seconds keep the server (no restart, stop or pause): what the network's
        # faults leave held is then still there at the end to be found.
        kinds = 3 if end - time.monotonic() < TAIL else 8
        kind = rng.randrange(kinds)
        if kind == 0:
            delay, lasting = rng.randrange(20, 400), rng.randrange(200, 800)
            proxy.delay(delay / 1000)
            time.sleep(lasting / 1000)
            proxy.delay(0)
            fault = f"replies delayed {delay} ms for {lasting} ms"
        elif kind == 1:
            replies = rng.randrange(1, 4)
            proxy.swallow(replies)
            fault = f"the next {replies} replies swallowed"
        elif kind == 2:
            proxy.reset_all()
            fault = "every connection reset"
        elif kind == 3:
            lasting = rng.randrange(100, 600)
            proxy.refuse(True)
            time.sleep(lasting / 1000)
            proxy.refuse(False)
            fault = f"connections refused for {lasting} ms"
        elif kind == 4:
            ms = rng.randrange(100, 600)
            try:
                server.client(socket_timeout=1).client_pause(ms, all=False)
            except redis.RedisError:
                pass
            fault = f"writes paused {ms} ms"
        elif kind == 5:
            lasting = rng.randrange(100, 700)
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                time.sleep(lasting / 1000)
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            fault = f"the server stopped (SIGSTOP) for {lasting} ms"
        elif kind == 6:
            without_module = rng.random() < 0.3
            began = time.monotonic()
            shut_down(server)
            server = start_server(port=port, with_module=not without_module)
            with record.lock:
                record.restarts.append((began, time.monotonic()))
            fault = "restarted " + ("without the module" if without_module else "with the module")
        else:
            try:
                server.client(socket_timeout=1).script_flush()
            except redis.RedisError:
                pass
            fault = "scripts flushed"
        with record.lock:
            record.faults.append(f"{at:>6} ms: {fault}")
    return server


def shut_down(server: Server) -> None:
    """SHUTDOWN, and the exit waited for. Not ``Server.shutdown``: its client retries
    the connection the server closed, with a back-off of seconds."""
    try:
        server.client().shutdown()
    except redis.ConnectionError:
        pass
    server.process.wait(timeout=60)


def check(record: Record, ended: float, anchor: Tuple[float, float]) -> List[str]:
    """The promises, against what the callers saw; a line per breach."""
    with record.lock:
        seen, restarts = list(record.seen), list(record.restarts)
    starts = [one.sent for one in seen if isinstance(one, (Allowed, Held))]
    if not starts:
        return ["no call was allowed at all"]
    # The spans between restarts: a server's life each.
    lives: List[Tuple[float, float]] = []
    begin = min(starts)
    for down, up in restarts:
        lives.append((begin, down))
        begin = up
    lives.append((begin, ended))

    def life_of(sent: float, received: float) -> Optional[int]:
        for n, (begin, end) in enumerate(lives):
            if sent >= begin and received <= end:
                return n
        return None

    def minute(at: float) -> int:
        return int((anchor[1] + at - anchor[0]) // 60)

    findings = []
    for n, (begin, end) in enumerate(lives):
        span = end - begin + DEADLINE
        ours = [one for one in seen if life_of(*spanned(one)) == n]
        for bucket in (BUCKET, WAITING):
            allowed = sum(
                1 for one in ours if isinstance(one, Allowed) and one.bucket == bucket.key
            )
            most = bucket.count + span * bucket.count / bucket.period
            if allowed > int(most):
                findings.append(
                    f"{bucket.key}: {allowed} allowed in a server's life of {span:.3f} s"
                    f" (at most {most:.1f})"
                )
        served = sum(1 for one in ours if isinstance(one, Response) and one.status == 200)
        most = GATEWAY_BUCKET[0] + span * GATEWAY_BUCKET[0] / GATEWAY_BUCKET[1]
        if served > int(most):
            findings.append(
                f"the gateway served {served} in a server's life of {span:.3f} s (at most {most:.1f})"
            )
        quota_allowed = sum(1 for one in ours if isinstance(one, QuotaAllowed))
        assert QUOTA.calls is not None
        if quota_allowed > QUOTA.calls + CALLERS:
            findings.append(
                f"{quota_allowed} quota checks allowed in a server's life, for a quota of"
                f" {QUOTA.calls} and {CALLERS} callers"
            )
        windows = minute(end + DEADLINE) - minute(begin) + 1
        admitted = sum(1 for one in ours if isinstance(one, Admitted))
        if admitted > WINDOW.rpm * windows:
            findings.append(
                f"{admitted} admitted by a window of {WINDOW.rpm} a minute in a server's life"
                f" of {windows} windows"
            )
        # Leases held at once: the callers' spans lie inside the server's.
        edges = sorted(
            edge
            for one in ours
            if isinstance(one, Held)
            for edge in ((one.received, 1), (one.released, -1))
        )
        live = 0
        for at, change in edges:
            live += change
            if live > LEASES[1]:
                findings.append(
                    f"{live} leases of {LEASES[1]} held at once, {at - begin:.3f} s into a"
                    " server's life"
                )
                break
    for one in seen:
        if isinstance(one, Took) and one.took > QUEUE + one.bound + SLACK:
            findings.append(
                f"a call ({one.what}) took {one.took:.3f} s (its bound {QUEUE:g} s in the"
                f" queue and {one.bound:g} s with the server),"
                f" at {record.ms(one.sent)} ms"
            )
        elif isinstance(one, Failed) and not isinstance(one.error, (QagUnavailable, QagBusy)):
            findings.append(f"a call ({one.what}) met an error no outage explains: {one.error!r}")
        elif isinstance(one, PolicyAnswered):
            findings.append(f"a call ({one.what}) answered by {one.answered_by} under raise")
        elif isinstance(one, Response) and one.status not in (200, 429, 503):
            findings.append(f"the gateway answered {one.status}")
        elif (
            isinstance(one, Response)
            and one.received - one.sent > GATEWAY_REQUEST + one.work + SLACK
        ):
            findings.append(
                f"a request of {one.work * 1000:.0f} ms of work took {one.received - one.sent:.3f} s,"
                f" at {record.ms(one.sent)} ms"
            )
    return findings


def spanned(one: Seen) -> Tuple[float, float]:
    """When a call was sent and answered (a lease's grant); (inf, -inf) for what has no
    span, which lies in no life."""
    if isinstance(one, (Allowed, Held, QuotaAllowed, QuotaAdd, Admitted, Response)):
        return one.sent, one.received
    return float("inf"), float("-inf")


def check_quota_count(record: Record, counted: int) -> List[str]:
    """The quota's count at the end, against the adds of the last server's life: none
    counted twice (an add resent after a dropped connection carries its id), none that
    was answered lost."""
    with record.lock:
        adds = [one for one in record.seen if isinstance(one, QuotaAdd)]
        last = record.restarts[-1] if record.restarts else None
    # Sent to the last server: every add that ended after its restart began (one sent a
    # moment before it answered may have reached it). Answered by it: those sent once it
    # answered (the one before was gone by then).
    sent = sum(1 for add in adds if last is None or add.received >= last[0])
    answered = sum(1 for add in adds if add.counted and (last is None or add.sent >= last[1]))
    findings = []
    if counted > sent:
        findings.append(f"the quota counted {counted} of {sent} adds sent")
    if counted < answered:
        findings.append(f"the quota counted {counted} of {answered} adds answered")
    return findings


def summary(record: Record) -> str:
    """The calls by what they met."""
    with record.lock:
        seen, restarts = list(record.seen), len(record.restarts)
    kinds = Counter(type(one).__name__ for one in seen)
    times = [one.took for one in seen if isinstance(one, Took)]
    statuses = Counter(one.status for one in seen if isinstance(one, Response))
    errors = Counter(type(one.error).__name__ for one in seen if isinstance(one, Failed))
    return (
        f"{len(times)} calls: {kinds['Allowed']} takes allowed, {kinds['Held']} leases held,"
        f" {kinds['QuotaAllowed']} quota checks allowed, {kinds['Admitted']} admitted,"
        f" {kinds['Failed']} failures {dict(errors)}, {restarts} restarts, slowest call"
        f" {max(times, default=0):.3f} s; the gateway's answers {dict(sorted(statuses.items()))}"
    )

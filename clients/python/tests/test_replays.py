"""Request ids, replays and reservations on both limiters, against real servers: a
relay that forwards a call and loses its reply (the call ran), then the limiter's
replay with the same id counts once; a replica promoted between the call and the
replay; calls without an id never sent twice; caller ids checked before anything is
sent; 64 concurrent reservations fitting exactly; a guard left without its commit
releasing its hold at once; partial charges summing exactly."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from conftest import Server, idle, no_retry, retries
from qag_client import AsyncLimiter, Bucket, Limiter, QagUnavailable, Quota, Scope

ORG, KEY = "qag:win:{acme}:org", "qag:win:{acme}:key"


def word(name: str) -> bytes:
    """A command's name as a RESP request carries it (``QAG.TAKE`` is not ``QAG.TAKE2``)."""
    return f"${len(name)}\r\n{name}\r\n".encode()


class Relay:
    """A TCP relay on loopback to a server's port: every connection is forwarded both
    ways; ``lose_reply_of(name)`` makes the next request of that command go through to
    the server and its reply be lost, both sides closed (``then`` runs first, e.g. to
    promote a replica and point the relay at it). ``sent(name)`` counts the requests of
    a command that went through."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self._lose: Optional[bytes] = None
        self._then: Optional[Callable[[], None]] = None
        self._lock = threading.Lock()
        self._requests: List[bytes] = []
        self._sockets: List[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_reply_of(self, name: str, then: Optional[Callable[[], None]] = None) -> None:
        with self._lock:
            self._lose, self._then = word(name), then

    def sent(self, name: str) -> int:
        with self._lock:
            return sum(chunk.count(word(name)) for chunk in self._requests)

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            for sock in self._sockets:
                _close(sock)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:  # the server gone (a test's end): refused as it would be
                _close(client)
                continue
            with self._lock:
                self._sockets += [client, upstream]
            losing = threading.Event()
            threading.Thread(target=self._up, args=(client, upstream, losing), daemon=True).start()
            threading.Thread(
                target=self._down, args=(client, upstream, losing), daemon=True
            ).start()

    def _up(self, client: socket.socket, upstream: socket.socket, losing: threading.Event) -> None:
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            if not data:
                _close(upstream)
                return
            with self._lock:
                self._requests.append(data)
                if self._lose is not None and self._lose in data:
                    self._lose = None
                    losing.set()
            try:
                upstream.sendall(data)
            except OSError:
                _close(client)
                return

    def _down(
        self, client: socket.socket, upstream: socket.socket, losing: threading.Event
    ) -> None:
        while True:
            try:
                data = upstream.recv(65536)
            except OSError:
                data = b""
            if data and losing.is_set():
                with self._lock:
                    then, self._then = self._then, None
                if then is not None:
                    then()
                data = b""  # the reply is lost
            if not data:
                _close(client)
                _close(upstream)
                return
            try:
                client.sendall(data)
            except OSError:
                _close(upstream)
                return


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


@pytest.fixture
def relay() -> Iterator[Callable[[Server], Relay]]:
    made: List[Relay] = []

    def make(server: Server) -> Relay:
        made.append(Relay(server.port))
        return made[-1]

    yield make
    for each in made:
        each.close()


class Through:
    """A server seen through a relay: what ``make_limiter`` needs of a server."""

    def __init__(self, server: Server, relay: Relay) -> None:
        self.port = relay.port
        self.server = server

    def client(self, **options: Any) -> "redis.Redis[bytes]":
        return redis.Redis(port=self.port, **{"retry": no_retry(), **options})

    def async_client(self, **options: Any) -> "redis.asyncio.Redis[bytes]":
        return redis.asyncio.Redis(port=self.port, **{"retry": no_retry(), **options})


def tokens(server: Any, key: str) -> int:
    """A window scope's tokens counted (every window's counters summed)."""
    fields = server.client().hgetall(key)
    return sum(int(value) for name, value in fields.items() if name.startswith(b"tok:"))


def requests(server: Any, key: str) -> int:
    fields = server.client().hgetall(key)
    return sum(int(value) for name, value in fields.items() if name.startswith(b"req:"))


def held(server: Any, key: str) -> int:
    """The tokens a scope's open reservations hold now (its ``holds`` field)."""
    raw = server.client().hget(key, "holds")
    if raw is None:
        return 0
    words = raw.decode().split()
    now_ms = time.time() * 1000
    return sum(int(words[n]) for n in range(0, len(words), 2) if int(words[n + 1]) > now_ms)


def bucket_tokens(server: Any, key: str) -> int:
    """A bucket's whole tokens (refilling meanwhile: at most 10 an hour here)."""
    return math.floor(float(server.client().hget(key, "tokens")))


# A dropped reply: the call ran, its reply was lost; the replay counts once with an id,
# and errs stricter without one.

SCOPES = [Scope(ORG, 0, 10_000), Scope(KEY, 100, 5_000)]
# Each call with an id (None: the limiter's default).
CALLS: Dict[str, Callable[[Any, Optional[str]], Any]] = {
    "QAG.TAKE": lambda limiter, rid: limiter.take(Bucket("qag:b", 10, 3600), request_id=rid),
    "QAG.TAKE2": lambda limiter, rid: limiter.take_pair(
        Bucket("qag:c", 10, 3600), Bucket("qag:k", 10, 3600), request_id=rid
    ),
    "QAG.QUOTA.ADD": lambda limiter, rid: limiter.quota_add(
        "qag:quota:acme", Quota("month"), calls=1, rows=5, request_id=rid
    ),
    "QAG.ADMIT": lambda limiter, rid: limiter.admit(SCOPES, request_id=rid),
    "QAG.RECORD": lambda limiter, rid: limiter.record([ORG, KEY], 300, request_id=rid),
    "QAG.REFUND": lambda limiter, rid: limiter.refund(Bucket("qag:b", 10, 3600), 2, request_id=rid),
}
# What records spend: an id by default.
SPEND = ("QAG.QUOTA.ADD", "QAG.RECORD")


def counted(server: Server, command: str) -> Any:
    """What the command changed, read back."""
    if command == "QAG.TAKE":
        return bucket_tokens(server, "qag:b")
    if command == "QAG.TAKE2":
        return bucket_tokens(server, "qag:c"), bucket_tokens(server, "qag:k")
    if command == "QAG.QUOTA.ADD":
        usage = server.client().execute_command(
            "QAG.QUOTA.ADD", "qag:quota:acme", "PER", "month", "TZ", "UTC", "CALLS", 0, "ROWS", 0
        )
        return usage[:2]
    if command == "QAG.ADMIT":
        return requests(server, ORG), requests(server, KEY)
    if command == "QAG.RECORD":
        return tokens(server, ORG), tokens(server, KEY)
    return bucket_tokens(server, "qag:b")


EXPECTED = {
    "QAG.TAKE": 9.0,
    "QAG.TAKE2": (9.0, 9.0),
    "QAG.QUOTA.ADD": [1, 5],
    "QAG.ADMIT": (1, 1),
    "QAG.RECORD": (300, 300),
    "QAG.REFUND": 9,  # a bucket taken to 7 first
}
# An admission without an id that ran and was replayed: charged twice (stricter by one).
TWICE = {"QAG.TAKE": 8.0, "QAG.TAKE2": (8.0, 8.0), "QAG.ADMIT": (2, 2)}


@pytest.mark.parametrize("command", list(CALLS))
def test_a_lost_reply_is_replayed_with_its_id_and_counts_once(
    start_server: Callable[..., Server],
    make_limiter: Callable[..., Any],
    relay: Callable[[Server], Relay],
    command: str,
) -> None:
    server = start_server()
    through = relay(server)
    limiter = make_limiter(Through(server, through), deadline=2.0)
    if command == "QAG.REFUND":
        limiter.take(Bucket("qag:b", 10, 3600), 3)
    through.lose_reply_of(command)
    answer = CALLS[command](limiter, "gateway-request-7")
    assert through.sent(command) == 2, "sent, then replayed once"
    assert counted(server, command) == EXPECTED[command]
    assert limiter.counts.replays == 1 and limiter.counts.errors == 0
    # The replay answered the first call's reply.
    if command == "QAG.TAKE":
        assert answer.allowed and answer.remaining == 9
    if command == "QAG.ADMIT":
        assert answer.admitted and answer.requests_remaining == 99


# The bucket calls a server without the module answers by script (EVALSHA), each with
# the caller's id.
SCRIPT_CALLS: Dict[str, Callable[[Any, Optional[str]], Any]] = {
    "take": CALLS["QAG.TAKE"],
    "take_pair": CALLS["QAG.TAKE2"],
    "refund": CALLS["QAG.REFUND"],
}


@pytest.mark.parametrize("call", list(SCRIPT_CALLS))
def test_a_lost_reply_of_a_bucket_script_is_replayed_with_its_id_and_counts_once(
    start_server: Callable[..., Server],
    make_limiter: Callable[..., Any],
    relay: Callable[[Server], Relay],
    call: str,
) -> None:
    """Without the module the script remembers the caller's id as the module does: its
    replay after a lost reply answers the first call's reply and changes nothing."""
    server = start_server(with_module=False)
    through = relay(server)
    limiter = make_limiter(Through(server, through), deadline=2.0)
    # The scripts loaded (a lost NOSCRIPT would be no reply of a call that ran).
    limiter.take(Bucket("qag:warm", 10, 3600), request_id="warm")
    limiter.refund(Bucket("qag:warm", 10, 3600), 1, request_id="warm")
    if call == "refund":
        limiter.take(Bucket("qag:b", 10, 3600), 3)
    before = through.sent("EVALSHA")
    through.lose_reply_of("EVALSHA")
    answer = SCRIPT_CALLS[call](limiter, "gateway-request-7")
    assert through.sent("EVALSHA") == before + 2, "sent, then replayed once"
    assert limiter.counts.replays == 1 and limiter.counts.errors == 0
    if call == "take":
        assert bucket_tokens(server, "qag:b") == 9
        assert (answer.allowed, answer.remaining, answer.answered_by) == (True, 9, "script")
    elif call == "take_pair":
        assert (bucket_tokens(server, "qag:c"), bucket_tokens(server, "qag:k")) == (9, 9)
        assert answer.client.answered_by == "script" and answer.key.remaining == 9
    else:
        assert bucket_tokens(server, "qag:b") == 9, "given back once"
        assert (answer.remaining, answer.answered_by) == (9, "script")


@pytest.mark.parametrize("command", list(CALLS))
def test_a_lost_reply_without_a_caller_id_never_grants_more(
    start_server: Callable[..., Server],
    make_limiter: Callable[..., Any],
    relay: Callable[[Server], Relay],
    command: str,
) -> None:
    """The defaults: spend (a quota add, a record) has an id of the limiter's and counts
    once; an admission has none, and its replay charges again; a refund has none and is
    never sent again (twice would give back twice)."""
    server = start_server()
    through = relay(server)
    limiter = make_limiter(Through(server, through), deadline=2.0)
    if command == "QAG.REFUND":
        limiter.take(Bucket("qag:b", 10, 3600), 3)
    through.lose_reply_of(command)
    if command == "QAG.REFUND":
        with pytest.raises(QagUnavailable):
            CALLS[command](limiter, None)
        assert through.sent(command) == 1 and counted(server, command) == EXPECTED[command]
        return
    answer = CALLS[command](limiter, None)
    assert through.sent(command) == 2, "sent, then replayed once"
    assert limiter.counts.replays == 1 and limiter.counts.errors == 0
    if command in SPEND:
        assert counted(server, command) == EXPECTED[command]
        return
    assert counted(server, command) == TWICE[command]
    assert answer.allowed if command != "QAG.ADMIT" else answer.admitted


def test_a_lost_reservation_is_replayed_and_holds_once(
    start_server: Callable[..., Server],
    make_limiter: Callable[..., Any],
    relay: Callable[[Server], Relay],
) -> None:
    server = start_server()
    through = relay(server)
    limiter = make_limiter(Through(server, through), deadline=2.0)
    through.lose_reply_of("QAG.ADMIT")
    with limiter.reserve(SCOPES, 1000) as hold:
        assert hold.admitted and hold.admission.tokens_remaining == 4000
        assert (held(server, ORG), held(server, KEY)) == (1000, 1000)
        assert requests(server, KEY) == 1
        through.lose_reply_of("QAG.RECORD")
        assert hold.commit(800) == 2
    assert through.sent("QAG.ADMIT") == 2 and through.sent("QAG.RECORD") == 2
    assert (held(server, ORG), tokens(server, ORG), tokens(server, KEY)) == (0, 800, 800)
    assert limiter.counts.replays == 2


def test_a_call_without_an_id_is_sent_twice_only_if_it_admits(
    start_server: Callable[..., Server],
    make_limiter: Callable[..., Any],
    relay: Callable[[Server], Relay],
) -> None:
    """A lease (or a refund) without an id: a lost reply is the outage it was, even
    through a client the caller set up to retry (redis-py's own retries never run). An
    admission (the script's take, the module's) is sent once more, and no more: if the
    first ran, the second charges again."""
    server = start_server()
    through = relay(server)
    retrying = {
        "retry": Retry(ExponentialBackoff(), 3),
        "retry_on_error": [redis.exceptions.ConnectionError],
    }
    script = make_limiter(Through(server, through), retrying, backend="script", back_off=0)
    script.take(Bucket("qag:loaded", 10, 3600))  # the script loaded: EVALSHA runs it
    before = through.sent("EVALSHA")
    through.lose_reply_of("EVALSHA")
    assert script.take(Bucket("qag:s", 10, 3600)).remaining == 8
    assert through.sent("EVALSHA") == before + 2 and script.counts.replays == 1
    assert bucket_tokens(server, "qag:s") == 8.0
    module = make_limiter(Through(server, through), retrying, back_off=0)
    through.lose_reply_of("QAG.LEASE")
    with pytest.raises(QagUnavailable):
        with module.lease("qag:running:acme", 2, 10_000, "l1"):
            pass
    assert through.sent("QAG.LEASE") == 1
    # Both tries lost: sent twice, no more.
    through.lose_reply_of("QAG.TAKE")
    with pytest.raises(QagUnavailable):
        _lose_both(through, lambda: module.take(Bucket("qag:t", 10, 3600)))
    assert through.sent("QAG.TAKE") == 2
    assert bucket_tokens(server, "qag:t") == 8.0
    assert module.counts.replays == 1


def _lose_both(through: Relay, call: Callable[[], Any]) -> Any:
    """The first reply lost, and the replay's too (re-armed as the first is lost)."""
    through.lose_reply_of("QAG.TAKE", then=lambda: through.lose_reply_of("QAG.TAKE"))
    return call()


def test_the_limiters_own_pools_never_retry(start_server: Callable[..., Server]) -> None:
    """Whatever the caller's client says, the connections the limiters talk through
    have no retries (redis-py 6 and later retry 3 times by default)."""
    server = start_server()
    retrying = Retry(ExponentialBackoff(), 5)
    errors = [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError]
    sync = Limiter(redis.Redis(port=server.port, retry=retrying, retry_on_error=errors))
    sync.take(Bucket("qag:p", 10, 60))
    pool = sync._shards.all()[0].client.connection_pool
    assert retries(pool.connection_kwargs["retry"]) == 0
    assert retries(pool.make_connection().retry) == 0
    sync.close()

    async def check_async() -> None:
        client = redis.asyncio.Redis(port=server.port, retry=retrying, retry_on_error=errors)
        limiter = AsyncLimiter(client)
        await limiter.take(Bucket("qag:p", 10, 60))
        pool = limiter._shards.all()[0].client.connection_pool
        assert retries(pool.connection_kwargs["retry"]) == 0
        assert retries(pool.make_connection().retry) == 0
        await limiter.aclose()

    asyncio.run(check_async())


def test_a_replica_promoted_between_the_call_and_its_replay_answers_the_replay(
    start_server: Callable[..., Server],
    make_limiter: Callable[..., Any],
    relay: Callable[[Server], Relay],
) -> None:
    primary = start_server()
    replica = start_server(extra=["--replicaof", "127.0.0.1", str(primary.port)])
    deadline = time.monotonic() + 20
    while replica.client().info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica never synced"
        time.sleep(0.05)
    through = relay(primary)

    def promote() -> None:
        # The call ran on the primary and reached the replica; then the replica serves.
        assert primary.client().execute_command("WAIT", 1, 5000) == 1
        replica.client().execute_command("REPLICAOF", "NO", "ONE")
        through.target = replica.port

    limiter = make_limiter(Through(primary, through), deadline=5.0)
    through.lose_reply_of("QAG.TAKE", then=promote)
    decision = limiter.take(Bucket("qag:b", 10, 3600), request_id="gateway-request-9")
    assert decision.allowed and decision.remaining == 9
    assert bucket_tokens(replica, "qag:b") == 9.0
    # And a record, promoted back the other way.
    primary.client().execute_command("REPLICAOF", "127.0.0.1", str(replica.port))
    while primary.client().info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline + 20, "the old primary never synced"
        time.sleep(0.05)
    old, new = replica, primary

    def promote_back() -> None:
        assert old.client().execute_command("WAIT", 1, 5000) == 1
        new.client().execute_command("REPLICAOF", "NO", "ONE")
        through.target = new.port

    through.lose_reply_of("QAG.RECORD", then=promote_back)
    assert limiter.record([ORG, KEY], 250) == 2
    assert (tokens(new, ORG), tokens(new, KEY)) == (250, 250)
    assert through.sent("QAG.TAKE") == 2 and through.sent("QAG.RECORD") == 2


def caught_up(primary: Server, replica: Server) -> None:
    """Waits until ``replica`` has everything ``primary`` wrote (their offsets equal)."""
    deadline = time.monotonic() + 10
    while primary.client().info("replication")["master_repl_offset"] != replica.client().info(
        "replication"
    ).get("slave_repl_offset"):
        assert time.monotonic() < deadline, "the replica never caught up"
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_demoted_primary_is_a_failover_not_an_error(
    start_server: Callable[..., Server], relay: Callable[[Server], Relay], kind: str
) -> None:
    """Issue 34: a manual failover while 50 callers run, the address (a relay, as a DNS
    name or a managed endpoint) moved to the new primary: the old primary, demoted,
    answers READONLY to the calls it held, each is sent once more on a fresh connection
    and answered there. Every call is answered, each counted once (the tokens taken and
    the quota's count are what the callers were told)."""
    primary = start_server()
    replica = start_server(extra=["--replicaof", "127.0.0.1", str(primary.port)])
    deadline = time.monotonic() + 20
    while replica.client().info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica never synced"
        time.sleep(0.05)
    through = relay(primary)
    # A refill of 0.01 a second: what the callers were told is what the bucket lost.
    bucket = Bucket("qag:ratelimit:key:failover", 1_000_000, 10**8)
    quota, quota_key = Quota("day", calls=1_000_000), "qag:quota:failover"
    running = threading.Event()
    running.set()

    def fail_over() -> None:
        time.sleep(0.3)
        # The old primary holds writes while the replica catches up and takes over;
        # then it follows it, and answers the writes it held READONLY.
        primary.client().execute_command("CLIENT", "PAUSE", 5000, "WRITE")
        caught_up(primary, replica)
        replica.client().execute_command("REPLICAOF", "NO", "ONE")
        through.target = replica.port
        primary.client().execute_command("REPLICAOF", "127.0.0.1", str(replica.port))
        primary.client().execute_command("CLIENT", "UNPAUSE")
        time.sleep(0.5)
        running.clear()

    if kind == "sync":
        limiter: Any = Limiter(Through(primary, through).client(), deadline=3.0)

        def caller(_: int) -> Tuple[int, int]:
            taken = added = 0
            while running.is_set():
                decision = limiter.take(bucket)
                assert decision.answered_by == "module"
                taken += decision.allowed
                limiter.quota_add(quota_key, quota, calls=1)
                added += 1
            return taken, added

        with ThreadPoolExecutor(51) as pool:
            failover = pool.submit(fail_over)
            results = list(pool.map(caller, range(50)))
            failover.result()
        counts = limiter.counts
        limiter.close()
    else:

        async def scenario() -> Tuple[List[Tuple[int, int]], Any]:
            limiter = AsyncLimiter(Through(primary, through).async_client(), deadline=3.0)

            async def caller() -> Tuple[int, int]:
                taken = added = 0
                while running.is_set():
                    decision = await limiter.take(bucket)
                    assert decision.answered_by == "module"
                    taken += decision.allowed
                    await limiter.quota_add(quota_key, quota, calls=1)
                    added += 1
                return taken, added

            failover = asyncio.get_running_loop().run_in_executor(None, fail_over)
            results = await asyncio.gather(*(caller() for _ in range(50)))
            await failover
            counts = limiter.counts
            await limiter.aclose()
            return results, counts

        results, counts = asyncio.run(scenario())
    taken = sum(result[0] for result in results)
    added = sum(result[1] for result in results)
    assert (counts.errors, counts.local, counts.forwarded) == (0, 0, 0), counts
    assert 1_000_000 - bucket_tokens(replica, bucket.key) == taken, "each take counted once"
    usage = replica.client().execute_command(
        "QAG.QUOTA.ADD", quota_key, "PER", "day", "TZ", "UTC", "CALLS", 0
    )
    assert usage[0] == added, "each add counted once"
    assert primary.client().info("replication")["role"] == "slave"


# Caller ids.


def test_caller_ids_are_checked_before_anything_is_sent_and_count_once(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    server = start_server()
    limiter = make_limiter(server)
    server.client().config_resetstat()
    bucket = Bucket("qag:b", 10, 3600)
    for bad in ("", "x" * 129, "é" * 65, b"bytes", 7):
        with pytest.raises(ValueError, match="request_id must be a string of 1 to 128 bytes"):
            limiter.take(bucket, request_id=bad)
        with pytest.raises(ValueError, match="request_id"):
            limiter.take_pair(bucket, Bucket("qag:k", 10, 60), request_id=bad)
        with pytest.raises(ValueError, match="request_id"):
            limiter.refund(bucket, 1, request_id=bad)
        with pytest.raises(ValueError, match="request_id"):
            limiter.quota_add("qag:q", Quota("day"), calls=1, request_id=bad)
        with pytest.raises(ValueError, match="request_id"):
            limiter.admit(SCOPES, request_id=bad)
        with pytest.raises(ValueError, match="request_id"):
            limiter.record([ORG], 5, request_id=bad)
        with pytest.raises(ValueError, match="request_id"):
            limiter.reserve(SCOPES, 10, request_id=bad)
    stats = server.client().info("commandstats")
    assert not [name for name in stats if name.startswith(("cmdstat_qag", "cmdstat_eval"))]
    assert not [name for name in stats if name.startswith("cmdstat_command")], stats
    assert limiter.counts.errors == 0
    # One caller id, twice: counted once; 128 bytes are allowed.
    gateway_id = "r" * 128
    first = limiter.take(bucket, request_id=gateway_id)
    again = limiter.take(bucket, request_id=gateway_id)
    assert first == again and first.remaining == 9 and bucket_tokens(server, "qag:b") == 9.0
    # The same id on another command or key is its own call.
    assert limiter.take(Bucket("qag:b2", 10, 3600), request_id=gateway_id).remaining == 9
    assert limiter.record([ORG], 5, request_id=gateway_id) == 1
    assert limiter.record([ORG], 5, request_id=gateway_id) == 1
    assert tokens(server, ORG) == 5
    # No id by default: each call counts.
    assert [limiter.take(bucket).remaining for _ in range(3)] == [8, 7, 6]


# Reservations.


def test_64_concurrent_reservations_fit_exactly_and_release_when_left(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    """64 at once of 100 against a tpm of 1,000: exactly 10 admitted; each commits 40;
    then exactly 6 more fit; guards left without a commit release their holds at once
    (their holds would count until the end of the next hour-long window)."""
    server = start_server()
    limiter = make_limiter(server, deadline=5.0)
    scopes = [Scope(ORG, 0, 1000)]
    is_async = not isinstance(limiter, Limiter)
    first = _reserve_all(limiter, server, scopes, commit=40) if not is_async else None
    if is_async:
        first = limiter.loop.run_until_complete(_reserve_all_async(limiter.limiter, scopes, 40))
    assert first == 10
    assert (held(server, ORG), tokens(server, ORG)) == (0, 400)
    second = (
        _reserve_all(limiter, server, scopes, commit=None)
        if not is_async
        else limiter.loop.run_until_complete(_reserve_all_async(limiter.limiter, scopes, None))
    )
    assert second == 6
    deadline = time.monotonic() + 2
    while held(server, ORG) != 0:
        assert time.monotonic() < deadline, f"still held: {held(server, ORG)}"
        idle(limiter, 0.02)
    assert tokens(server, ORG) == 400
    assert limiter.counts.errors == 0


def _reserve_all(limiter: Any, server: Server, scopes: List[Scope], commit: Optional[int]) -> int:
    """64 threads reserve 100 at once and hold until all have reserved; the admitted
    then commit ``commit`` (None: leave without a commit). The admitted count."""
    everyone = threading.Barrier(64, timeout=30)

    def one(_: int) -> bool:
        with limiter.reserve(scopes, 100, window=3600) as hold:
            everyone.wait()
            if hold.admitted and commit is not None:
                hold.commit(commit)
            return bool(hold.admitted)

    with ThreadPoolExecutor(64) as pool:
        return sum(pool.map(one, range(64)))


async def _reserve_all_async(limiter: Any, scopes: List[Scope], commit: Optional[int]) -> int:
    reserved = 0
    everyone = asyncio.Event()

    async def one() -> bool:
        nonlocal reserved
        async with limiter.reserve(scopes, 100, window=3600) as hold:
            reserved += 1
            if reserved == 64:
                everyone.set()
            await asyncio.wait_for(everyone.wait(), 30)
            if hold.admitted and commit is not None:
                await hold.commit(commit)
            return bool(hold.admitted)

    return sum(await asyncio.gather(*(one() for _ in range(64))))


def test_a_stream_charged_in_five_parts_sums_exactly(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    server = start_server()
    limiter = make_limiter(server)
    with limiter.reserve(SCOPES, 2000, hold_ms=30_000) as hold:
        for part in (120, 80, 300, 1, 99):
            assert hold.charge(part) == 2
        assert hold.charged == 600
        assert (held(server, ORG), tokens(server, ORG)) == (1400, 600)
        assert hold.commit(1750) == 2
        with pytest.raises(RuntimeError, match="after the reservation was committed"):
            hold.commit(1750)
    assert (held(server, ORG), held(server, KEY)) == (0, 0)
    assert (tokens(server, ORG), tokens(server, KEY)) == (1750, 1750)
    # A guard left by an exception commits what it charged.
    with pytest.raises(KeyError):
        with limiter.reserve(SCOPES, 1000) as hold:
            hold.charge(70)
            raise KeyError("the upstream failed")
    deadline = time.monotonic() + 2
    while held(server, ORG) != 0:
        assert time.monotonic() < deadline
        idle(limiter, 0.02)
    assert tokens(server, ORG) == 1820


def test_reservation_arguments_and_refusals(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    server = start_server()
    limiter = make_limiter(server)
    for tokens_asked, hold_ms, text in (
        (0, None, "tokens must be an integer from 1"),
        (5001, None, "above a scope's tpm"),
        (10, 0, "hold_ms must be an integer from 1 to 172800000"),
    ):
        with pytest.raises(ValueError, match=text):
            limiter.reserve(SCOPES, tokens_asked, hold_ms=hold_ms)
    with limiter.reserve(SCOPES, 5000) as full:
        assert full.admitted
        with limiter.reserve(SCOPES, 1) as refused:
            assert not refused.admitted and refused.admission.refused_by == 1
            with pytest.raises(RuntimeError, match="refused"):
                refused.commit(1)
        with pytest.raises(ValueError, match="at least 3"):
            full.charge(3)
            full.commit(2)
        full.commit(3)
    assert (held(server, KEY), tokens(server, KEY)) == (0, 3)


@pytest.mark.parametrize("policy", ["raise", "forward", "local"])
def test_a_reserve_that_met_a_stopped_server_leaves_nothing_held(
    start_server: Callable[..., Server],
    make_limiter: Callable[..., Any],
    stop: Callable[[Server], None],
    policy: str,
) -> None:
    """The ADMIT waits in the stopped server and runs once it continues: the reserve
    that gave up on it releases it in the background (RECORD 0 with its id), under
    every policy; the policy's reservation holds nothing in Redis."""
    server = start_server()
    limiter = make_limiter(server, deadline=0.3, back_off=0.5, on_unavailable=policy)
    assert limiter.admit(SCOPES).admitted  # connected, the module found
    stop(server)
    if policy == "raise":
        with pytest.raises(QagUnavailable):
            with limiter.reserve(SCOPES, 1000):
                pass
    else:
        with limiter.reserve(SCOPES, 1000) as hold:
            assert hold.admitted and hold.answered_by == (
                "forwarded" if policy == "forward" else "local"
            )
            assert hold.charge(100) == (0 if policy == "forward" else 2)
            assert hold.commit(300) == (0 if policy == "forward" else 2)
    os.kill(server.process.pid, signal.SIGCONT)
    deadline = time.monotonic() + 5
    while requests(server, KEY) < 2 or held(server, KEY) != 0:
        assert time.monotonic() < deadline, (requests(server, KEY), held(server, KEY))
        idle(limiter, 0.05)
    assert tokens(server, KEY) == 0  # the policy's counts stay in this process


def test_local_reservations_fit_exactly_and_leave_nothing_held_in_redis(
    start_server: Callable[..., Server], stop: Callable[[Server], None]
) -> None:
    """Reservations the "local" policy answers hold their tokens in this process's
    window: 64 at once while Redis is stopped hold exactly 10 of 100 against a tpm of
    1000, 6 more fit after each commits 40, and one left without a commit gives its hold
    back. The ADMITs that reached the stopped server run when it continues, and are
    released in the background."""
    server = start_server()
    key = "qag:win:{acme}:local"
    scopes = [(key, 0, 1000)]

    async def scenario() -> List[int]:
        limiter = AsyncLimiter(
            server.async_client(),
            deadline=0.3,
            back_off=30.0,
            on_unavailable="local",
            queue_timeout=10.0,  # 64 calls at once on a loaded machine: none QagBusy
        )
        assert (await limiter.admit(scopes)).admitted  # connected, the module found
        stop(server)

        async def reserve_64() -> List[Any]:
            guards = [limiter.reserve(scopes, 100) for _ in range(64)]
            await asyncio.gather(*(guard.__aenter__() for guard in guards))
            assert {guard.answered_by for guard in guards} == {"local"}
            return [guard for guard in guards if guard.admitted]

        fitted = []
        first = await reserve_64()
        fitted.append(len(first))
        for guard in first:
            assert await guard.commit(40) == 1
            await guard.__aexit__(None, None, None)
        more = await reserve_64()
        fitted.append(len(more))
        await more[0].__aexit__(None, None, None)  # left without a commit
        fitted.append(len(await reserve_64()))
        os.kill(server.process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        # Those sent before the back-off (as many as the pool's connections) ran.
        while requests(server, key) < 2 or held(server, key) != 0:
            assert time.monotonic() < deadline, (requests(server, key), held(server, key))
            await asyncio.sleep(0.05)
        await limiter.aclose()
        return fitted

    assert asyncio.run(scenario()) == [10, 6, 1]
    assert tokens(server, key) == 0  # the local counts stay in this process


def test_a_cancelled_fastapi_request_leaves_no_hold(start_server: Callable[..., Server]) -> None:
    """A FastAPI route holding a reservation (behind the middleware, with a slot of the
    key's), its request cancelled mid-way (as a server cancels it when the client goes,
    or a timeout does): what it charged is committed at once, the rest released, and
    the slot freed."""
    import httpx
    from fastapi import Depends, FastAPI

    from qag_client.asgi import KeyLimits, RateLimitMiddleware, query_parameter
    from qag_client.fastapi import Admitted, admitted

    server = start_server()

    async def scenario() -> None:
        limiter = AsyncLimiter(server.async_client())
        app = FastAPI()
        streaming = asyncio.Event()

        @app.get("/v1/complete")
        async def complete(limits: Admitted = Depends(admitted)) -> Dict[str, str]:
            async with limiter.reserve([Scope(KEY, 0, 10_000)], 2000) as hold:
                await hold.charge(150)
                streaming.set()
                await asyncio.sleep(30)  # the model call, cut short by the cancellation
                await hold.commit(1800)
            return {"request_id": limits.request_id}

        limited = RateLimitMiddleware(
            app, limiter, api_key=query_parameter("key"), key_limits=KeyLimits(max_concurrent=2)
        )
        transport = httpx.ASGITransport(app=limited)  # the app runs in the request's task
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            request = asyncio.ensure_future(client.get("/v1/complete?key=acme~a"))
            await asyncio.wait_for(streaming.wait(), 10)
            assert held(server, KEY) == 1850
            assert server.client().execute_command("QAG.LEASES", "qag:running:acme~a") == 1
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
            cancelled = time.monotonic()
            while held(server, KEY) != 0:
                assert time.monotonic() - cancelled < 1, held(server, KEY)
                await asyncio.sleep(0.01)
        assert tokens(server, KEY) == 150
        assert server.client().execute_command("QAG.LEASES", "qag:running:acme~a") == 0
        assert limiter.counts.errors == 0
        await limiter.aclose()

    asyncio.run(scenario())

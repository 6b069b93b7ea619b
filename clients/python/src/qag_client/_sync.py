"""The blocking limiter for ``redis.Redis`` and ``redis.cluster.RedisCluster``: runs the
engine's flows with blocking calls."""

from __future__ import annotations

import logging
import threading
import time
from contextvars import ContextVar
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from . import decisions as d
from .naming import Bucket
from ._engine import (
    Command,
    Engine,
    Flow,
    LeaseAttempt,
    LeaseState,
    Overtaken,
    RunScript,
    T,
    release_delay,
    release_gives_up,
    sort_error,
)
from ._script import TOKEN_BUCKET_LUA, TOKEN_REFUND_LUA

log = logging.getLogger("qag_client")

# The monotonic time by which the running call must end (per thread).
_CALL_DEADLINE: ContextVar[Optional[float]] = ContextVar("qag_call_deadline", default=None)
_BOUNDED: Dict[type, type] = {}
DEFAULT_MAX_CONNECTIONS = 100
# How long a call whose deadline passed while waiting for a connection waits on for the
# verdict of a holder that is past its own deadline.
OVERDUE_GRACE = 0.05


def _time_left() -> Optional[float]:
    deadline = _CALL_DEADLINE.get()
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)


def _bounded(connection_class: type) -> type:
    """``connection_class`` whose connecting (socket and handshake), sending and reading
    are bounded by what is left of the running call's deadline."""
    if connection_class in _BOUNDED:
        return _BOUNDED[connection_class]
    base: Any = connection_class

    class Bounded(base):  # type: ignore[misc]
        def connect(self, *args: Any, **kwargs: Any) -> Any:
            left = _time_left()
            if left is None:
                return super().connect(*args, **kwargs)
            connection: Any = self
            saved = connection.socket_connect_timeout, connection.socket_timeout
            connection.socket_connect_timeout = connection.socket_timeout = left
            try:
                return super().connect(*args, **kwargs)
            finally:
                connection.socket_connect_timeout, connection.socket_timeout = saved

        def send_packed_command(self, *args: Any, **kwargs: Any) -> Any:
            self._bound()
            return super().send_packed_command(*args, **kwargs)

        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            self._bound()
            return super().read_response(*args, **kwargs)

        def _bound(self) -> None:
            sock = getattr(self, "_sock", None)
            if sock is not None:
                left = _time_left()
                sock.settimeout(self.socket_timeout if left is None else left)

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{connection_class.__name__}"
    _BOUNDED[connection_class] = Bounded
    return Bounded


class _Gate:
    """At most ``size`` calls hold a connection of the limiter's pool; the others wait,
    each until its deadline, and while ``still_wanted`` (``interrupt`` wakes them to
    ask again). A wait that ends while a holder is past its own deadline waits a little
    longer for that holder's verdict (a stalled server, soon an outage)."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._holders: List[float] = []  # their deadlines
        self._changed = threading.Condition(threading.Lock())

    def acquire(self, until: float, still_wanted: Callable[[], bool]) -> bool:
        with self._changed:
            grace = until + OVERDUE_GRACE
            while self._free == 0:
                now = time.monotonic()
                if not still_wanted():
                    return False
                if now >= until and not (now < grace and min(self._holders) <= now):
                    return False
                self._changed.wait((until if now < until else grace) - now)
            self._free -= 1
            self._holders.append(until)
            return True

    def release(self, until: float) -> None:
        with self._changed:
            self._free += 1
            self._holders.remove(until)
            self._changed.notify_all()

    def interrupt(self) -> None:
        with self._changed:
            self._changed.notify_all()


def _own_client(
    client: Any, deadline: float, max_connections: int, connected: Callable[[], None]
) -> Tuple[Any, Optional[_Gate]]:
    """The client the limiter talks through, and the gate to its pool. For
    ``redis.Redis``, a blocking pool of its own of ``max_connections`` with the
    client's settings (address, credentials, TLS, database) but the deadline as its
    connect and socket timeouts (and each call bounded by what is left of it), no
    retries (a retry would outlast the deadline) and a hook that tells the limiter of
    every new connection (a reconnect may reach a server restarted with or without the
    module); a call waits at most its deadline for one of them. The caller's client is
    left as it is. A cluster client is used as given (see the README)."""
    if isinstance(client, RedisCluster):
        return client, None
    pool = client.connection_pool
    settings = dict(pool.connection_kwargs)
    user_hook = settings.get("redis_connect_func")

    def on_connect(connection: Any) -> None:
        if user_hook is None:
            connection.on_connect()
        else:
            user_hook(connection)
        connected()

    settings.update(
        socket_timeout=deadline,
        socket_connect_timeout=deadline,
        retry=Retry(NoBackoff(), 0),
        redis_connect_func=on_connect,
    )
    own_pool = redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
        connection_class=_bounded(pool.connection_class),
        max_connections=max_connections,
        timeout=deadline,
        **settings,
    )
    return redis.Redis(connection_pool=own_pool), _Gate(max_connections)


def _pool_size(client: Any, max_connections: Optional[int]) -> int:
    """The limiter's pool size: as given, else the client's pool's (redis-py 6 and later
    default to 100), else 100 (redis-py 5's default of 2^31 is no bound)."""
    if max_connections is not None:
        return max_connections
    pool = getattr(client, "connection_pool", None)
    size = getattr(pool, "max_connections", None)
    if isinstance(size, int) and 1 <= size < 1 << 31:
        return size
    return DEFAULT_MAX_CONNECTIONS


def _check_options(deadline: float, max_connections: int) -> None:
    if not deadline > 0:
        raise ValueError("deadline must be above 0 seconds")
    if isinstance(max_connections, bool) or not (
        isinstance(max_connections, int) and max_connections >= 1
    ):
        raise ValueError("max_connections must be an integer of at least 1")


class Limiter:
    """Rate limiting over a ``redis.Redis`` or ``redis.cluster.RedisCluster`` client.

    ``backend``: "auto" (the module where the server has it, else the script),
    "module" or "script". ``deadline``: seconds a call may take, connecting and
    waiting for a free connection included. ``on_unavailable``: what a call answers
    when Redis fails, and for ``back_off`` seconds after without touching Redis:
    "raise" (QagUnavailable), "forward" (answers "not counted, forwarded") or "local"
    (counted in this process, each limit scaled by ``local_share``).
    ``max_connections``: the size of the limiter's own pool (QagBusy past the
    deadline; default: the client's pool's size, at most 100 where that is unbounded). ``recheck_missing_module``: how long "auto" believes a server has no
    module before asking again.
    """

    def __init__(
        self,
        client: Union["redis.Redis", RedisCluster],
        *,
        backend: str = "auto",
        deadline: float = 0.5,
        on_unavailable: str = "raise",
        back_off: float = 5.0,
        local_share: float = 1.0,
        max_connections: Optional[int] = None,
        recheck_missing_module: float = 10.0,
    ) -> None:
        max_connections = _pool_size(client, max_connections)
        _check_options(deadline, max_connections)
        self._engine = Engine(
            backend, on_unavailable, back_off, local_share, recheck_missing_module
        )
        self._client, self._gate = _own_client(
            client, deadline, max_connections, self._engine.forget_presence
        )
        if self._gate is not None:
            self._engine.on_outage = self._gate.interrupt
        self._cluster = isinstance(client, RedisCluster)
        self._deadline = deadline
        self._max_connections = max_connections
        self._closed = threading.Event()
        self._scripts = {
            "bucket": self._client.register_script(TOKEN_BUCKET_LUA),
            "refund": self._client.register_script(TOKEN_REFUND_LUA),
        }

    def close(self) -> None:
        """Closes the limiter's own connections and stops its background releases."""
        self._closed.set()
        if not self._cluster:
            # A client made on a given pool leaves it open when closed: closed here.
            self._client.connection_pool.disconnect()

    @property
    def counts(self) -> d.Counts:
        """How calls were answered so far: module, script, local, forwarded, errors."""
        return self._engine.counts

    @property
    def backing_off(self) -> bool:
        """True while calls keep to the policy: a back-off runs, or its probe is out."""
        return self._engine.backing_off

    @property
    def counting_locally(self) -> bool:
        """True while calls are counted in this process ("local", a back-off runs)."""
        return self._engine.counting_locally

    @property
    def local_decisions(self) -> int:
        """Calls answered locally since the limiter was made."""
        return self._engine.counts.local

    def take(self, bucket: Bucket, cost: int = 1) -> d.Decision:
        """Takes ``cost`` tokens from the bucket."""
        return self._run(self._engine.take(d.BucketCall.on(bucket, cost)))

    def take_pair(self, client: Bucket, key: Bucket, cost: int = 1) -> d.PairDecision:
        """Both buckets of a request: the client's, then the key's if the client's
        allowed (QAG.TAKE2 with the module: one step)."""
        first, second = d.BucketCall.on(client, cost), d.BucketCall.on(key, cost)
        return self._run(self._engine.take_pair(first, second))

    def peek(self, bucket: Bucket, cost: int = 1) -> d.Decision:
        """What ``take`` would answer, nothing written."""
        return self._run(self._engine.peek(d.BucketCall.on(bucket, cost)))

    def refund(self, bucket: Bucket, n: int) -> d.Refunded:
        """Gives ``n`` tokens back (never above the count; a missing bucket stays
        missing): QAG.REFUND, or lua/token_refund.lua without the module. For a request
        one limit admitted and a later one refused."""
        return self._run(self._engine.refund(d.BucketCall.on(bucket, 1), n))

    def lease(self, key: str, max_slots: int, ttl_ms: int, lease_id: str) -> "Lease":
        """``with limiter.lease(...) as lease:`` holds a slot for the block (see Lease)."""
        d.check_lease(key, max_slots, ttl_ms, lease_id)
        return Lease(self, key, max_slots, ttl_ms, lease_id)

    def renew(self, key: str, lease_id: str, ttl_ms: int) -> bool:
        d.check_id(lease_id)
        d.check_ttl(ttl_ms)
        return self._run(self._engine.renew(key, lease_id, ttl_ms))

    def release(self, key: str, lease_id: str) -> bool:
        d.check_id(lease_id)
        return self._run(self._engine.release(key, lease_id))

    def leases(self, key: str) -> int:
        return self._run(self._engine.leases(key))

    def quota_check(self, key: str, quota: d.Quota) -> d.QuotaDecision:
        return self._run(self._engine.quota_check(key, quota))

    def quota_add(self, key: str, quota: d.Quota, calls: int = 0, rows: int = 0) -> d.QuotaUsage:
        return self._run(self._engine.quota_count("QAG.QUOTA.ADD", key, quota, calls, rows))

    def quota_seed(self, key: str, quota: d.Quota, calls: int = 0, rows: int = 0) -> d.QuotaUsage:
        return self._run(self._engine.quota_count("QAG.QUOTA.SEED", key, quota, calls, rows))

    def admit(
        self, scopes: Sequence[Union[d.Scope, Tuple[str, int, int]]], window: Optional[int] = None
    ) -> d.Admission:
        return self._run(self._engine.admit(scopes, window))

    def record(self, keys: Sequence[str], tokens: int, window: Optional[int] = None) -> int:
        return self._run(self._engine.record(keys, tokens, window))

    def _run(self, flow: Flow[T], routed: bool = True) -> T:
        """Runs a flow within the deadline: waiting for a connection (QagBusy after it),
        connecting, and every round trip (QagUnavailable after it) included. A routed
        call still waiting for a connection when a back-off starts keeps to the policy
        (background work is not routed: it waits on)."""
        deadline = time.monotonic() + self._deadline
        token = _CALL_DEADLINE.set(deadline)
        gated = False
        try:
            request = next(flow)
            if self._gate is not None:
                engine, generation = self._engine, self._engine.generation if routed else -1
                gated = self._gate.acquire(deadline, lambda: not engine.overtaken(generation))
                if gated and engine.overtaken(generation):
                    self._gate.release(deadline)
                    gated = False
                if not gated:
                    flow.throw(Overtaken() if engine.overtaken(generation) else self._busy())
                    raise AssertionError("a flow went on without a connection")
            while True:
                if time.monotonic() >= deadline:
                    request = flow.throw(self._late())
                    continue
                try:
                    reply = self._execute(request)
                except Exception as error:  # every error is sorted, then thrown in
                    sorted_error = sort_error(error)
                    if isinstance(sorted_error, d.QagUnavailable) and time.monotonic() >= deadline:
                        sorted_error = self._late()  # the socket timed out at the deadline
                    request = flow.throw(sorted_error)
                else:
                    request = flow.send(reply)
        except StopIteration as stop:
            answer: T = stop.value
            return answer
        finally:
            if gated:
                assert self._gate is not None
                self._gate.release(deadline)
            flow.close()
            _CALL_DEADLINE.reset(token)

    def _late(self) -> d.QagUnavailable:
        return d.QagUnavailable(f"no answer within the deadline of {self._deadline} s")

    def _busy(self) -> d.QagBusy:
        return d.QagBusy(
            f"no free connection in the limiter's pool of {self._max_connections} "
            f"within the deadline of {self._deadline} s"
        )

    def _execute(self, request: Any) -> Any:
        if isinstance(request, RunScript):
            script = self._scripts[request.script]
            return script(keys=[request.key], args=list(request.arguments))
        assert isinstance(request, Command)
        if not request.probe:
            return self._client.execute_command(*request.words)
        # A bytes name has no response callback in redis-py: the raw reply.
        name, *rest = request.words
        if self._cluster:
            node = self._client.get_random_node().redis_connection
            return node.execute_command(name.encode(), *rest)
        return self._client.execute_command(name.encode(), *rest)

    def _release_later(self, key: str, lease_id: str, started: float, ttl_ms: int) -> None:
        """An acquire may have taken the slot and did not return it: released in a
        daemon thread, retried until it answers 1 or the lease's TTL has passed."""
        threading.Thread(
            target=self._release_until_done,
            args=(key, lease_id, started, ttl_ms),
            name=f"qag-release {lease_id}",
            daemon=True,
        ).start()

    def _release_until_done(self, key: str, lease_id: str, started: float, ttl_ms: int) -> None:
        attempt = 0
        while not self._closed.is_set():
            try:
                if self._run(self._engine.background_release(key, lease_id), False):
                    return
            except (d.QagUnavailable, d.QagBusy):
                self._engine.background_failed()
            except d.QagError as error:  # no point in trying again
                self._engine.background_failed()
                log.warning("qag: the lease %s of %s was not released: %s", lease_id, key, error)
                return
            if release_gives_up(started, ttl_ms, time.monotonic()):
                return
            self._closed.wait(release_delay(attempt))
            attempt += 1


class Lease:
    """A slot of a key, held for a ``with`` block.

    Entering takes the slot (QAG.LEASE) or raises QagRefused. A lease held in Redis is
    renewed every ttl/3 by a daemon thread while the block runs; ``lost`` turns true
    when a renewal finds it gone, or once it could not be confirmed within its TTL
    (``last_error`` says why). Leaving the block releases it, exception or not (during
    a back-off in the background, once Redis answers); a release that fails is counted
    in ``limiter.counts.errors`` and logged, never raised (the TTL frees the slot).
    ``answered_by``: "module", or "local" / "forwarded"
    for a lease the policy answered (nothing in Redis; never renewed, never lost).
    """

    def __init__(
        self, limiter: Limiter, key: str, max_slots: int, ttl_ms: int, lease_id: str
    ) -> None:
        self.key = key
        self.id = lease_id
        self._limiter = limiter
        self._max = max_slots
        self._state = LeaseState(key, lease_id, ttl_ms, time.monotonic())
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def lost(self) -> bool:
        return self._state.lost

    @property
    def last_error(self) -> Optional[d.QagError]:
        """The last renewal's error, if it failed."""
        return self._state.last_error

    @property
    def answered_by(self) -> str:
        return self._state.answered_by

    def __enter__(self) -> "Lease":
        limiter, state = self._limiter, self._state
        state.confirmed_at = started = time.monotonic()
        attempt = LeaseAttempt()
        flow = limiter._engine.lease(self.key, self._max, state.ttl_ms, self.id, attempt)
        try:
            grant = limiter._run(flow)
        except BaseException as error:
            # An outage, or interrupted: the LEASE may have run (an error reply: it did not).
            if attempt.sent and (
                isinstance(error, d.QagUnavailable) or not isinstance(error, d.QagError)
            ):
                limiter._release_later(self.key, self.id, started, state.ttl_ms)
            raise
        if attempt.sent and grant.answered_by != "module":
            # The LEASE met an outage and the policy answered: it may have run.
            limiter._release_later(self.key, self.id, started, state.ttl_ms)
        if not grant.acquired:
            raise d.QagRefused(grant.live, grant.retry_after, grant.answered_by)
        state.answered_by = grant.answered_by
        if state.in_redis:
            self._thread = threading.Thread(
                target=self._renew, name=f"qag-lease {self.id}", daemon=True
            )
            self._thread.start()
        return self

    def release(self) -> bool:
        """Releases the slot now (leaving the block then does nothing): True if a live
        lease was released. Raises what the release met."""
        self._stop_renewals()
        state, limiter = self._state, self._limiter
        state.done = True
        try:
            released = limiter._run(limiter._engine.guard_release(state))
        except d.QagError:
            limiter._engine.background_failed()
            limiter._release_later(self.key, self.id, time.monotonic(), state.ttl_ms)
            raise
        if released is None:
            limiter._release_later(self.key, self.id, time.monotonic(), state.ttl_ms)
            raise d.QagUnavailable("backing off: the lease is released in the background")
        return released is True

    def __exit__(self, *exc_info: Any) -> None:
        self._stop_renewals()
        if self._state.done:
            return
        state, limiter = self._state, self._limiter
        state.done = True
        try:
            if limiter._run(limiter._engine.guard_release(state)) is None:
                # A back-off: released in the background, once Redis answers.
                limiter._release_later(self.key, self.id, time.monotonic(), state.ttl_ms)
        except Exception as error:
            limiter._engine.background_failed()
            log.warning(
                "qag: the lease %s of %s was not released (its TTL frees it): %s",
                self.id,
                self.key,
                error,
            )

    def _stop_renewals(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _renew(self) -> None:
        state, limiter = self._state, self._limiter
        while not state.lost and not self._stop.wait(state.interval):
            sent_at = time.monotonic()
            try:
                held = limiter._run(limiter._engine.renewal(self.key, self.id, state.ttl_ms), False)
            except d.QagError as error:
                limiter._engine.background_failed()
                state.renewal_failed(error, time.monotonic())
            else:
                state.renewed(held, sent_at)
            if state.lost:
                log.warning(
                    "qag: the lease %s of %s is lost: %s",
                    self.id,
                    self.key,
                    state.last_error or "it was gone",
                )


__all__: List[str] = ["Lease", "Limiter"]

"""The asyncio limiter for ``redis.asyncio.Redis`` and its cluster client: runs the
engine's flows with awaits, each round trip bounded by what is left of the call's
deadline."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Callable, Deque, List, Optional, Sequence, Set, Tuple, Union

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.backoff import NoBackoff
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
from ._sync import OVERDUE_GRACE, _check_options, _pool_size

log = logging.getLogger("qag_client")


class _Gate:
    """At most ``size`` calls hold a connection of the limiter's pool; the others wait,
    each until its deadline (a freed place is handed to the longest waiting;
    ``interrupt`` wakes them all to look again). A wait that ends while a holder is
    past its own deadline waits a little longer for that holder's verdict (a stalled
    server, soon an outage)."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._holders: List[float] = []  # their deadlines
        self._waiters: Deque["asyncio.Future[bool]"] = deque()

    def interrupt(self) -> None:
        """Wakes every waiter (``acquire`` answers False) to look again."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(False)

    def overdue(self, now: float) -> bool:
        return bool(self._holders) and min(self._holders) <= now

    async def acquire(self, until: float, deadline: float) -> bool:
        """A place for a call of ``deadline``, or False at ``until`` (loop time) or when
        interrupted."""
        loop = asyncio.get_running_loop()
        if self._free > 0 and not self._waiters:
            self._free -= 1
            self._holders.append(deadline)
            return True
        if until <= loop.time():
            return False
        waiter: "asyncio.Future[bool]" = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_at(until, _expire, waiter)
        try:
            if not await waiter:
                return False
        except BaseException:
            # Cancelled after a place was handed over: hand it on.
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self._holders.append(deadline)
                self.release(deadline)
            raise
        finally:
            timer.cancel()
            try:
                self._waiters.remove(waiter)
            except ValueError:
                pass
        self._holders.append(deadline)
        return True

    def release(self, until: float) -> None:
        self._holders.remove(until)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                return
        self._free += 1


def _expire(waiter: "asyncio.Future[bool]") -> None:
    if not waiter.done():
        waiter.set_result(False)


def _own_client(
    client: Any, deadline: float, max_connections: int, connected: Callable[[], None]
) -> Tuple[Any, Optional[_Gate]]:
    """As the blocking limiter's: for ``redis.asyncio.Redis`` a blocking pool of its own
    of ``max_connections`` with the client's settings, the deadline as connect and
    socket timeouts, no retries and a hook told of every new connection, and the gate
    to it; a cluster client as given."""
    if isinstance(client, RedisCluster):
        return client, None
    pool = client.connection_pool
    settings = dict(pool.connection_kwargs)
    user_hook = settings.get("redis_connect_func")

    async def on_connect(connection: Any) -> None:
        if user_hook is None:
            await connection.on_connect()
        elif asyncio.iscoroutinefunction(user_hook):
            await user_hook(connection)
        else:
            user_hook(connection)
        connected()

    settings.update(
        socket_timeout=deadline,
        socket_connect_timeout=deadline,
        retry=Retry(NoBackoff(), 0),
        redis_connect_func=on_connect,
    )
    own_pool = redis.asyncio.BlockingConnectionPool(
        connection_class=pool.connection_class,
        max_connections=max_connections,
        **{"timeout": deadline, **settings},
    )
    return redis.asyncio.Redis(connection_pool=own_pool), _Gate(max_connections)


class AsyncLimiter:
    """``Limiter`` for asyncio: the same options and answers, every method a
    coroutine. ``aclose()`` closes the limiter's own connections."""

    def __init__(
        self,
        client: Any,
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
        self._background: Set["asyncio.Task[None]"] = set()
        self._scripts = {
            "bucket": self._client.register_script(TOKEN_BUCKET_LUA),
            "refund": self._client.register_script(TOKEN_REFUND_LUA),
        }

    async def aclose(self) -> None:
        """Closes the limiter's own connections and stops its background releases."""
        for task in list(self._background):
            task.cancel()
        if not self._cluster:
            # A client made on a given pool leaves it open when closed: closed here.
            await self._client.connection_pool.disconnect()

    @property
    def counts(self) -> d.Counts:
        return self._engine.counts

    @property
    def backing_off(self) -> bool:
        return self._engine.backing_off

    @property
    def counting_locally(self) -> bool:
        return self._engine.counting_locally

    @property
    def local_decisions(self) -> int:
        return self._engine.counts.local

    async def take(self, bucket: Bucket, cost: int = 1) -> d.Decision:
        """Takes ``cost`` tokens from the bucket."""
        return await self._run(self._engine.take(d.BucketCall.on(bucket, cost)))

    async def take_pair(self, client: Bucket, key: Bucket, cost: int = 1) -> d.PairDecision:
        """Both buckets of a request: the client's, then the key's if the client's
        allowed (QAG.TAKE2 with the module: one step)."""
        first, second = d.BucketCall.on(client, cost), d.BucketCall.on(key, cost)
        return await self._run(self._engine.take_pair(first, second))

    async def peek(self, bucket: Bucket, cost: int = 1) -> d.Decision:
        """What ``take`` would answer, nothing written."""
        return await self._run(self._engine.peek(d.BucketCall.on(bucket, cost)))

    async def refund(self, bucket: Bucket, n: int) -> d.Refunded:
        """Gives ``n`` tokens back (never above the count; a missing bucket stays
        missing): QAG.REFUND, or lua/token_refund.lua without the module. For a request
        one limit admitted and a later one refused."""
        return await self._run(self._engine.refund(d.BucketCall.on(bucket, 1), n))

    def lease(self, key: str, max_slots: int, ttl_ms: int, lease_id: str) -> "AsyncLease":
        """``async with limiter.lease(...) as lease:`` holds a slot for the block."""
        d.check_lease(key, max_slots, ttl_ms, lease_id)
        return AsyncLease(self, key, max_slots, ttl_ms, lease_id)

    async def renew(self, key: str, lease_id: str, ttl_ms: int) -> bool:
        d.check_id(lease_id)
        d.check_ttl(ttl_ms)
        return await self._run(self._engine.renew(key, lease_id, ttl_ms))

    async def release(self, key: str, lease_id: str) -> bool:
        d.check_id(lease_id)
        return await self._run(self._engine.release(key, lease_id))

    async def leases(self, key: str) -> int:
        return await self._run(self._engine.leases(key))

    async def quota_check(self, key: str, quota: d.Quota) -> d.QuotaDecision:
        return await self._run(self._engine.quota_check(key, quota))

    async def quota_add(
        self, key: str, quota: d.Quota, calls: int = 0, rows: int = 0
    ) -> d.QuotaUsage:
        return await self._run(self._engine.quota_count("QAG.QUOTA.ADD", key, quota, calls, rows))

    async def quota_seed(
        self, key: str, quota: d.Quota, calls: int = 0, rows: int = 0
    ) -> d.QuotaUsage:
        return await self._run(self._engine.quota_count("QAG.QUOTA.SEED", key, quota, calls, rows))

    async def admit(
        self, scopes: Sequence[Union[d.Scope, Tuple[str, int, int]]], window: Optional[int] = None
    ) -> d.Admission:
        return await self._run(self._engine.admit(scopes, window))

    async def record(self, keys: Sequence[str], tokens: int, window: Optional[int] = None) -> int:
        return await self._run(self._engine.record(keys, tokens, window))

    async def _run(self, flow: Flow[T], routed: bool = True) -> T:
        """Runs a flow within the deadline: waiting for a connection (QagBusy after it),
        connecting, and every round trip (QagUnavailable after it) included. A routed
        call still waiting for a connection when a back-off starts keeps to the policy
        (background work is not routed: it waits on)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._deadline
        gated = False
        try:
            request = next(flow)
            if self._gate is not None:
                engine, generation = self._engine, self._engine.generation if routed else -1
                gate, grace = self._gate, deadline + OVERDUE_GRACE
                while not (gated or engine.overtaken(generation)):
                    now = loop.time()
                    if now < deadline:
                        gated = await gate.acquire(deadline, deadline)
                    elif now < grace and gate.overdue(now):
                        gated = await gate.acquire(grace, deadline)
                    else:
                        break
                if gated and engine.overtaken(generation):
                    gate.release(deadline)
                    gated = False
                if not gated:
                    flow.throw(Overtaken() if engine.overtaken(generation) else self._busy())
                    raise AssertionError("a flow went on without a connection")
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    request = flow.throw(self._late())
                    continue
                try:
                    reply = await asyncio.wait_for(self._execute(request), left)
                except asyncio.CancelledError:
                    raise
                except asyncio.TimeoutError:
                    request = flow.throw(self._late())
                except Exception as error:  # every error is sorted, then thrown in
                    request = flow.throw(sort_error(error))
                else:
                    request = flow.send(reply)
        except StopIteration as stop:
            answer: T = stop.value
            return answer
        finally:
            if gated:
                assert self._gate is not None
                self._gate.release(deadline)
            flow.close()  # a cancelled call frees its probe slot

    def _late(self) -> d.QagUnavailable:
        return d.QagUnavailable(f"no answer within the deadline of {self._deadline} s")

    def _busy(self) -> d.QagBusy:
        return d.QagBusy(
            f"no free connection in the limiter's pool of {self._max_connections} "
            f"within the deadline of {self._deadline} s"
        )

    async def _execute(self, request: Any) -> Any:
        if isinstance(request, RunScript):
            script = self._scripts[request.script]
            return await script(keys=[request.key], args=list(request.arguments))
        assert isinstance(request, Command)
        if not request.probe:
            return await self._client.execute_command(*request.words)
        # A bytes name has no response callback in redis-py: the raw reply.
        name, *rest = request.words
        if self._cluster:
            await self._client.initialize()  # the cluster client learns its nodes lazily
            node = self._client.get_random_node()
            return await node.execute_command(name.encode(), *rest)
        return await self._client.execute_command(name.encode(), *rest)

    def _release_later(self, key: str, lease_id: str, started: float, ttl_ms: int) -> None:
        """An acquire may have taken the slot and did not return it: released by a task,
        retried until it answers 1 or the lease's TTL has passed."""
        task = asyncio.ensure_future(self._release_until_done(key, lease_id, started, ttl_ms))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_until_done(
        self, key: str, lease_id: str, started: float, ttl_ms: int
    ) -> None:
        attempt = 0
        while True:
            try:
                if await self._run(self._engine.background_release(key, lease_id), False):
                    return
            except (d.QagUnavailable, d.QagBusy):
                self._engine.background_failed()
            except d.QagError as error:  # no point in trying again
                self._engine.background_failed()
                log.warning("qag: the lease %s of %s was not released: %s", lease_id, key, error)
                return
            if release_gives_up(started, ttl_ms, time.monotonic()):
                return
            await asyncio.sleep(release_delay(attempt))
            attempt += 1


class AsyncLease:
    """``Lease`` for asyncio: renewed by a task while the ``async with`` block runs. An
    acquire cancelled after its QAG.LEASE was sent, and a release cancelled on the way
    out, are released by a task of the limiter (bounded by the lease's TTL)."""

    def __init__(
        self, limiter: AsyncLimiter, key: str, max_slots: int, ttl_ms: int, lease_id: str
    ) -> None:
        self.key = key
        self.id = lease_id
        self._limiter = limiter
        self._max = max_slots
        self._state = LeaseState(key, lease_id, ttl_ms, time.monotonic())
        self._task: Optional["asyncio.Task[None]"] = None

    @property
    def lost(self) -> bool:
        return self._state.lost

    @property
    def last_error(self) -> Optional[d.QagError]:
        return self._state.last_error

    @property
    def answered_by(self) -> str:
        return self._state.answered_by

    async def __aenter__(self) -> "AsyncLease":
        limiter, state = self._limiter, self._state
        state.confirmed_at = started = time.monotonic()
        attempt = LeaseAttempt()
        flow = limiter._engine.lease(self.key, self._max, state.ttl_ms, self.id, attempt)
        try:
            grant = await limiter._run(flow)
        except BaseException as error:
            # An outage, or cancelled: the LEASE may have run (an error reply: it did not).
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
            self._task = asyncio.ensure_future(self._renew())
        return self

    async def release(self) -> bool:
        """Releases the slot now (leaving the block then does nothing): True if a live
        lease was released. Raises what the release met."""
        self._stop_renewals()
        state, limiter = self._state, self._limiter
        state.done = True
        try:
            released = await limiter._run(limiter._engine.guard_release(state))
        except d.QagError:
            limiter._engine.background_failed()
            limiter._release_later(self.key, self.id, time.monotonic(), state.ttl_ms)
            raise
        if released is None:
            limiter._release_later(self.key, self.id, time.monotonic(), state.ttl_ms)
            raise d.QagUnavailable("backing off: the lease is released in the background")
        return released is True

    async def __aexit__(self, *exc_info: Any) -> None:
        self._stop_renewals()
        state, limiter = self._state, self._limiter
        if state.done:
            return
        state.done = True
        try:
            if await limiter._run(limiter._engine.guard_release(state)) is None:
                # A back-off: released in the background, once Redis answers.
                limiter._release_later(self.key, self.id, time.monotonic(), state.ttl_ms)
        except asyncio.CancelledError:
            if state.in_redis:  # cancelled on the way out: released in the background
                limiter._release_later(self.key, self.id, time.monotonic(), state.ttl_ms)
            raise
        except Exception as error:
            limiter._engine.background_failed()
            log.warning(
                "qag: the lease %s of %s was not released (its TTL frees it): %s",
                self.id,
                self.key,
                error,
            )

    def _stop_renewals(self) -> None:
        # A renewal in flight may still land; after the release it finds nothing.
        if self._task is not None:
            self._task.cancel()

    async def _renew(self) -> None:
        state, limiter = self._state, self._limiter
        while not state.lost:
            await asyncio.sleep(state.interval)
            sent_at = time.monotonic()
            try:
                held = await limiter._run(
                    limiter._engine.renewal(self.key, self.id, state.ttl_ms), False
                )
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


__all__: List[str] = ["AsyncLease", "AsyncLimiter"]

"""The asyncio limiter for ``redis.asyncio.Redis`` and its cluster client: runs the
engine's flows with awaits, each call bounded by ``asyncio.wait_for``."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from . import decisions as d
from ._engine import (
    Command,
    Engine,
    Flow,
    RunScript,
    T,
    local_pair,
    local_peek,
    local_take,
    sort_error,
)
from ._script import TOKEN_BUCKET_LUA
from .local import LocalBuckets


def _own_client(client: Any, connected: Callable[[], None]) -> Any:
    """As the blocking limiter's: for ``redis.asyncio.Redis`` a pool of its own with the
    client's settings, no retries and a hook told of every new connection; a cluster
    client as given."""
    if isinstance(client, RedisCluster):
        return client
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

    settings.update(retry=Retry(NoBackoff(), 0), redis_connect_func=on_connect)
    own_pool = type(pool)(
        connection_class=pool.connection_class,
        max_connections=pool.max_connections,
        **settings,
    )
    return redis.asyncio.Redis(connection_pool=own_pool)


class AsyncLimiter:
    """``Limiter`` for asyncio: the same options and answers, every method a
    coroutine, ``deadline`` a hard bound on each call (``asyncio.wait_for``).
    ``aclose()`` closes the limiter's own connections."""

    def __init__(
        self,
        client: Any,
        *,
        backend: str = "auto",
        deadline: float = 0.5,
        on_unavailable: str = "raise",
        back_off: float = 5.0,
        recheck_missing_module: float = 10.0,
    ) -> None:
        if not deadline > 0:
            raise ValueError("deadline must be above 0 seconds")
        self._engine = Engine(backend, on_unavailable, back_off, recheck_missing_module)
        self._client = _own_client(client, self._engine.forget_presence)
        self._cluster = isinstance(client, RedisCluster)
        self._deadline = deadline
        self._script = self._client.register_script(TOKEN_BUCKET_LUA)

    async def aclose(self) -> None:
        if not self._cluster:
            # A client made on a given pool leaves it open when closed: closed here.
            await self._client.connection_pool.disconnect()

    @property
    def counting_locally(self) -> bool:
        return self._engine.counting_locally

    @property
    def local_decisions(self) -> int:
        return self._engine.local_decisions

    async def take(self, key: str, count: int, period: float, cost: int = 1) -> d.Decision:
        call = d.BucketCall.of(key, count, period, cost)
        return await self._bucket(lambda: self._engine.take(call), local_take(call))

    async def take_pair(
        self,
        client_key: str,
        client_count: int,
        client_period: float,
        key_key: str,
        key_count: int,
        key_period: float,
        cost: int = 1,
    ) -> d.PairDecision:
        client = d.BucketCall.of(client_key, client_count, client_period, cost)
        key = d.BucketCall.of(key_key, key_count, key_period, cost)
        return await self._bucket(
            lambda: self._engine.take_pair(client, key), local_pair(client, key)
        )

    async def peek(self, key: str, count: int, period: float, cost: int = 1) -> d.Decision:
        call = d.BucketCall.of(key, count, period, cost)
        return await self._bucket(lambda: self._engine.peek(call), local_peek(call))

    def lease(self, key: str, max_slots: int, ttl_ms: int, lease_id: str) -> "AsyncLease":
        """``async with limiter.lease(...) as lease:`` holds a slot for the block."""
        d.check_lease(key, max_slots, ttl_ms, lease_id)
        return AsyncLease(self, key, max_slots, ttl_ms, lease_id)

    async def renew(self, key: str, lease_id: str, ttl_ms: int) -> bool:
        d.check_id(lease_id)
        d.check_ttl(ttl_ms)
        return bool(await self._module(["QAG.RENEW", key, lease_id, ttl_ms]) == 1)

    async def release(self, key: str, lease_id: str) -> bool:
        d.check_id(lease_id)
        return bool(await self._module(["QAG.RELEASE", key, lease_id]) == 1)

    async def leases(self, key: str) -> int:
        return int(await self._module(["QAG.LEASES", key]))

    async def quota_check(
        self, key: str, per: str, tz: str, calls: Optional[int] = None, rows: Optional[int] = None
    ) -> d.QuotaDecision:
        reply = await self._module(d.quota_check_words(key, per, tz, calls, rows))
        return d.quota_decision(reply, calls, rows)

    async def quota_add(
        self, key: str, per: str, tz: str, calls: int = 0, rows: int = 0
    ) -> d.QuotaUsage:
        words = d.quota_count_words("QAG.QUOTA.ADD", key, per, tz, calls, rows)
        return d.quota_usage(await self._module(words))

    async def quota_seed(
        self, key: str, per: str, tz: str, calls: int = 0, rows: int = 0
    ) -> d.QuotaUsage:
        words = d.quota_count_words("QAG.QUOTA.SEED", key, per, tz, calls, rows)
        return d.quota_usage(await self._module(words))

    async def admit(
        self, scopes: Sequence[Union[d.Scope, Tuple[str, int, int]]], window: Optional[int] = None
    ) -> d.Admission:
        return d.admission(await self._module(d.admit_words(scopes, window)))

    async def record(self, keys: Sequence[str], tokens: int, window: Optional[int] = None) -> int:
        return int(await self._module(d.record_words(keys, tokens, window)))

    async def _module(self, words: List[Any]) -> Any:
        return await self._run(self._engine.module_only(words))

    async def _bucket(
        self, flow: Callable[[], Flow[T]], locally: Callable[[LocalBuckets, float], T]
    ) -> T:
        answer = self._engine.local_answer(locally)
        if answer is not None:
            return answer
        try:
            result = await self._run(flow())
        except d.QagUnavailable as error:
            return self._engine.after_failure(error, locally)
        self._engine.after_answer()
        return result

    async def _run(self, flow: Flow[T]) -> T:
        try:
            return await asyncio.wait_for(self._drive(flow), self._deadline)
        except asyncio.TimeoutError:
            self._engine.forget_presence()
            raise d.QagUnavailable(f"no answer within the deadline of {self._deadline} s") from None
        except d.QagUnavailable:
            self._engine.forget_presence()
            raise

    async def _drive(self, flow: Flow[T]) -> T:
        try:
            request = next(flow)
            while True:
                try:
                    reply = await self._execute(request)
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # every error is sorted, then thrown in
                    request = flow.throw(sort_error(error))
                else:
                    request = flow.send(reply)
        except StopIteration as stop:
            answer: T = stop.value
            return answer

    async def _execute(self, request: Any) -> Any:
        if isinstance(request, RunScript):
            return await self._script(keys=[request.key], args=list(request.arguments))
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


class AsyncLease:
    """``Lease`` for asyncio: renewed by a task while the ``async with`` block runs."""

    def __init__(
        self, limiter: AsyncLimiter, key: str, max_slots: int, ttl_ms: int, lease_id: str
    ) -> None:
        self.key = key
        self.id = lease_id
        self._limiter = limiter
        self._max = max_slots
        self._ttl_ms = ttl_ms
        self._lost = False
        self._task: Optional["asyncio.Task[None]"] = None

    @property
    def lost(self) -> bool:
        return self._lost

    async def __aenter__(self) -> "AsyncLease":
        reply = await self._limiter._module(
            ["QAG.LEASE", self.key, self._max, self._ttl_ms, self.id]
        )
        acquired, live, retry_after = d.lease_reply(reply)
        if not acquired:
            raise d.QagRefused(live, retry_after)
        self._task = asyncio.ensure_future(self._renew())
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if not self._lost:
            try:
                await self._limiter.release(self.key, self.id)
            except d.QagError:
                if exc_info[0] is None:
                    raise

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self._ttl_ms / 3000)
            try:
                held = await self._limiter.renew(self.key, self.id, self._ttl_ms)
            except d.QagError:
                continue  # Redis failed this time: two more renewals fit in the TTL.
            if not held:
                self._lost = True
                return

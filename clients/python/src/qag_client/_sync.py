"""The blocking limiter for ``redis.Redis`` and ``redis.cluster.RedisCluster``: runs the
engine's flows with blocking calls."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
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


def _own_client(client: Any, deadline: float, connected: Callable[[], None]) -> Any:
    """The client the limiter talks through. For ``redis.Redis``, a pool of its own with
    the client's settings (address, credentials, TLS, database) but the deadline as its
    socket timeout, no retries (a retry would outlast the deadline) and a hook that
    tells the limiter of every new connection (a reconnect may reach a server restarted
    with or without the module). The caller's client is left as it is. A cluster client
    is used as given (see the README)."""
    if isinstance(client, RedisCluster):
        return client
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
        retry=Retry(NoBackoff(), 0),
        redis_connect_func=on_connect,
    )
    own_pool = type(pool)(
        connection_class=pool.connection_class,
        max_connections=pool.max_connections,
        **settings,
    )
    return redis.Redis(connection_pool=own_pool)


class Limiter:
    """Rate limiting over a ``redis.Redis`` or ``redis.cluster.RedisCluster`` client.

    ``backend``: "auto" (the module where the server has it, else the script),
    "module" or "script". ``deadline``: seconds a call may take (its connections'
    socket timeout, and the bound between a call's round trips).
    ``on_unavailable``: "raise" (QagUnavailable) or "local" (decide token buckets in
    this process for ``back_off`` seconds). ``recheck_missing_module``: how long
    "auto" believes a server has no module before asking again.
    """

    def __init__(
        self,
        client: Union["redis.Redis", RedisCluster],
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
        self._client = _own_client(client, deadline, self._engine.forget_presence)
        self._cluster = isinstance(client, RedisCluster)
        self._deadline = deadline
        self._lock = threading.Lock()
        self._script = self._client.register_script(TOKEN_BUCKET_LUA)

    def close(self) -> None:
        """Closes the limiter's own connections."""
        if not self._cluster:
            # A client made on a given pool leaves it open when closed: closed here.
            self._client.connection_pool.disconnect()

    @property
    def counting_locally(self) -> bool:
        """True while token buckets are decided in this process (a back-off runs)."""
        return self._engine.counting_locally

    @property
    def local_decisions(self) -> int:
        """Bucket decisions made locally since the limiter was made."""
        return self._engine.local_decisions

    def take(self, key: str, count: int, period: float, cost: int = 1) -> d.Decision:
        call = d.BucketCall.of(key, count, period, cost)
        return self._bucket(lambda: self._engine.take(call), local_take(call))

    def take_pair(
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
        return self._bucket(lambda: self._engine.take_pair(client, key), local_pair(client, key))

    def peek(self, key: str, count: int, period: float, cost: int = 1) -> d.Decision:
        call = d.BucketCall.of(key, count, period, cost)
        return self._bucket(lambda: self._engine.peek(call), local_peek(call))

    def lease(self, key: str, max_slots: int, ttl_ms: int, lease_id: str) -> "Lease":
        """``with limiter.lease(...) as lease:`` holds a slot for the block (see Lease)."""
        d.check_lease(key, max_slots, ttl_ms, lease_id)
        return Lease(self, key, max_slots, ttl_ms, lease_id)

    def renew(self, key: str, lease_id: str, ttl_ms: int) -> bool:
        d.check_id(lease_id)
        d.check_ttl(ttl_ms)
        return bool(self._module(["QAG.RENEW", key, lease_id, ttl_ms]) == 1)

    def release(self, key: str, lease_id: str) -> bool:
        d.check_id(lease_id)
        return bool(self._module(["QAG.RELEASE", key, lease_id]) == 1)

    def leases(self, key: str) -> int:
        return int(self._module(["QAG.LEASES", key]))

    def quota_check(
        self, key: str, per: str, tz: str, calls: Optional[int] = None, rows: Optional[int] = None
    ) -> d.QuotaDecision:
        reply = self._module(d.quota_check_words(key, per, tz, calls, rows))
        return d.quota_decision(reply, calls, rows)

    def quota_add(self, key: str, per: str, tz: str, calls: int = 0, rows: int = 0) -> d.QuotaUsage:
        return d.quota_usage(
            self._module(d.quota_count_words("QAG.QUOTA.ADD", key, per, tz, calls, rows))
        )

    def quota_seed(
        self, key: str, per: str, tz: str, calls: int = 0, rows: int = 0
    ) -> d.QuotaUsage:
        return d.quota_usage(
            self._module(d.quota_count_words("QAG.QUOTA.SEED", key, per, tz, calls, rows))
        )

    def admit(
        self, scopes: Sequence[Union[d.Scope, Tuple[str, int, int]]], window: Optional[int] = None
    ) -> d.Admission:
        return d.admission(self._module(d.admit_words(scopes, window)))

    def record(self, keys: Sequence[str], tokens: int, window: Optional[int] = None) -> int:
        return int(self._module(d.record_words(keys, tokens, window)))

    def _module(self, words: List[Any]) -> Any:
        return self._run(self._engine.module_only(words))

    def _bucket(
        self, flow: Callable[[], Flow[T]], locally: Callable[[LocalBuckets, float], T]
    ) -> T:
        with self._lock:
            answer = self._engine.local_answer(locally)
        if answer is not None:
            return answer
        try:
            result = self._run(flow())
        except d.QagUnavailable as error:
            with self._lock:
                return self._engine.after_failure(error, locally)
        with self._lock:
            self._engine.after_answer()
        return result

    def _run(self, flow: Flow[T]) -> T:
        started = time.monotonic()
        try:
            request = next(flow)
            while True:
                if time.monotonic() - started > self._deadline:
                    raise d.QagUnavailable(f"no answer within the deadline of {self._deadline} s")
                try:
                    reply = self._execute(request)
                except Exception as error:  # every error is sorted, then thrown in
                    request = flow.throw(sort_error(error))
                else:
                    request = flow.send(reply)
        except StopIteration as stop:
            answer: T = stop.value
            return answer
        except d.QagUnavailable:
            self._engine.forget_presence()
            raise

    def _execute(self, request: Any) -> Any:
        if isinstance(request, RunScript):
            return self._script(keys=[request.key], args=list(request.arguments))
        assert isinstance(request, Command)
        if not request.probe:
            return self._client.execute_command(*request.words)
        # A bytes name has no response callback in redis-py: the raw reply.
        name, *rest = request.words
        if self._cluster:
            node = self._client.get_random_node().redis_connection
            return node.execute_command(name.encode(), *rest)
        return self._client.execute_command(name.encode(), *rest)


class Lease:
    """A slot of a key, held for a ``with`` block.

    Entering takes the slot (QAG.LEASE) or raises QagRefused; while the block runs a
    daemon thread renews it every ttl/3; ``lost`` turns true if a renewal finds it
    gone (it ran out, or was removed); leaving the block releases it, exception or not.
    """

    def __init__(
        self, limiter: Limiter, key: str, max_slots: int, ttl_ms: int, lease_id: str
    ) -> None:
        self.key = key
        self.id = lease_id
        self._limiter = limiter
        self._max = max_slots
        self._ttl_ms = ttl_ms
        self._stop = threading.Event()
        self._lost = False
        self._thread: Optional[threading.Thread] = None

    @property
    def lost(self) -> bool:
        return self._lost

    def __enter__(self) -> "Lease":
        reply = self._limiter._module(["QAG.LEASE", self.key, self._max, self._ttl_ms, self.id])
        acquired, live, retry_after = d.lease_reply(reply)
        if not acquired:
            raise d.QagRefused(live, retry_after)
        self._thread = threading.Thread(
            target=self._renew, name=f"qag-lease {self.id}", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self._lost:
            try:
                self._limiter.release(self.key, self.id)
            except d.QagError:
                if exc_info[0] is None:
                    raise
                # The block's own exception matters more; the lease runs out by its TTL.

    def _renew(self) -> None:
        every = self._ttl_ms / 3000
        while not self._stop.wait(every):
            try:
                held = self._limiter.renew(self.key, self.id, self._ttl_ms)
            except d.QagError:
                continue  # Redis failed this time: two more renewals fit in the TTL.
            if not held:
                self._lost = True
                return

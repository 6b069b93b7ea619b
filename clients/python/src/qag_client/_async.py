"""The asyncio limiter for ``redis.asyncio.Redis`` and its cluster client: runs the
engine's flows with awaits, each round trip bounded by what is left of the call's
deadline."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from contextvars import ContextVar
from typing import Any, Callable, Deque, List, Optional, Sequence, Set, Tuple, Union

import redis.asyncio
import redis.exceptions
from redis.asyncio.cluster import RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from . import decisions as d
from .naming import Bucket
from ._engine import (
    Command,
    ConnectionDropped,
    Engine,
    Flow,
    HoldState,
    HoldView,
    Attempt,
    LeaseState,
    Overtaken,
    RunScript,
    T,
    release_delay,
    release_gives_up,
    sort_error,
)
from ._cluster import (
    MAX_REDIRECTIONS,
    Shards,
    admit_keys,
    check_cross_slot,
    cross_slot_pair,
    parse_slots,
    redirection_of,
    slot_of,
    try_again,
)
from ._script import TOKEN_BUCKET_LUA, TOKEN_REFUND_LUA
from ._sync import OVERDUE_GRACE, TRY_AGAIN_WAIT, _check_options, _pool_size, probe_time

log = logging.getLogger("qag_client")
# When the running call began, if before its run (it read the slot table first).
_CALL_STARTED: ContextVar[Optional[float]] = ContextVar("qag_async_call_started", default=None)


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
    to it (on a cluster, each node's client is made so)."""
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


class _Node:
    """One server: the limiter's own pool to it, the gate to that pool, its scripts, and
    the engine with the server's state (module presence, back-off, local counts)."""

    def __init__(self, name: str, client: Any, gate: Optional[_Gate], engine: Engine) -> None:
        self.name = name
        self.client = client
        self.gate = gate
        self.engine = engine
        self.scripts = {
            "bucket": client.register_script(TOKEN_BUCKET_LUA),
            "refund": client.register_script(TOKEN_REFUND_LUA),
        }


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
        cross_slot: str = "raise",
    ) -> None:
        max_connections = _pool_size(client, max_connections)
        _check_options(deadline, max_connections)
        check_cross_slot(cross_slot)
        options = (backend, on_unavailable, back_off, local_share, recheck_missing_module)
        Engine(*options)  # the options checked now, not at the first call
        self._deadline = deadline
        self._back_off = back_off
        self._max_connections = max_connections
        self._cross_slot = cross_slot
        self._background: Set["asyncio.Task[None]"] = set()
        cluster = client if isinstance(client, RedisCluster) else None

        def make(name: str) -> _Node:
            engine = Engine(*options)
            base = client if cluster is None else _node_client(cluster, name)
            own, gate = _own_client(base, deadline, max_connections, engine.forget_presence)
            if gate is not None:
                engine.on_outage = gate.interrupt
            node = _Node(name, own, gate, engine)
            engine.start_probe = lambda: self._in_background(self._probe(node))
            return node

        self._shards: Shards[_Node] = Shards(make, cluster is not None)
        self._startup: List[str] = []
        if cluster is not None:
            self._startup = list(cluster.nodes_manager.startup_nodes)

    async def aclose(self) -> None:
        """Closes the limiter's own connections and stops its background releases."""
        for task in list(self._background):
            task.cancel()
        for node in self._shards.all():
            # A client made on a given pool leaves it open when closed: closed here.
            await node.client.connection_pool.disconnect()

    @property
    def counts(self) -> d.Counts:
        return self._shards.counts()

    @property
    def backing_off(self) -> bool:
        return self._shards.backing_off()

    @property
    def counting_locally(self) -> bool:
        return self._shards.counting_locally()

    @property
    def local_decisions(self) -> int:
        return self.counts.local

    async def take(
        self, bucket: Bucket, cost: int = 1, *, request_id: Optional[str] = None
    ) -> d.Decision:
        """Takes ``cost`` tokens from the bucket. ``request_id``: the call's id (1 to 128
        bytes), default a new one: a call whose connection dropped is sent once more
        with it and counts once."""
        call = d.BucketCall.on(bucket, cost)
        rid = d.request_id_of(request_id)
        node = await self._node_for([call.key])
        return await self._run(node, node.engine.take(call, rid))

    async def take_pair(
        self, client: Bucket, key: Bucket, cost: int = 1, *, request_id: Optional[str] = None
    ) -> d.PairDecision:
        """Both buckets of a request: the client's, then the key's if the client's
        allowed (QAG.TAKE2 with the module: one step). On a cluster, buckets in two
        slots are as ``cross_slot`` says (each call with the same id)."""
        first, second = d.BucketCall.on(client, cost), d.BucketCall.on(key, cost)
        rid = d.request_id_of(request_id)
        if self._shards.topology is not None and slot_of(first.key) != slot_of(second.key):
            if self._cross_slot == "raise":
                raise cross_slot_pair(first.key, second.key)
            client_decision = await self.take(client, cost, request_id=rid)
            if not client_decision.allowed:
                return d.PairDecision(client_decision, None)
            key_decision = await self.take(key, cost, request_id=rid)
            if not key_decision.allowed and client_decision.answered_by in ("module", "script"):
                await self._give_back(client, cost, rid)
            return d.PairDecision(client_decision, key_decision)
        node = await self._node_for([first.key, second.key])
        return await self._run(node, node.engine.take_pair(first, second, rid))

    async def _give_back(self, bucket: Bucket, cost: int, request_id: str) -> None:
        """The client bucket's token of a pair the key bucket refused (two calls)."""
        try:
            await self.refund(bucket, cost, request_id=request_id)
        except d.QagError as error:  # counted in errors: the token stays spent
            log.warning("qag: the token of %s was not given back: %s", bucket.key, error)

    async def peek(self, bucket: Bucket, cost: int = 1) -> d.Decision:
        """What ``take`` would answer, nothing written."""
        call = d.BucketCall.on(bucket, cost)
        node = await self._node_for([call.key])
        return await self._run(node, node.engine.peek(call))

    async def refund(
        self, bucket: Bucket, n: int, *, request_id: Optional[str] = None
    ) -> d.Refunded:
        """Gives ``n`` tokens back (never above the count; a missing bucket stays
        missing): QAG.REFUND, or lua/token_refund.lua without the module. For a request
        one limit admitted and a later one refused."""
        call = d.BucketCall.on(bucket, 1)
        call.refund_arguments(n)
        rid = d.request_id_of(request_id)
        node = await self._node_for([call.key])
        return await self._run(node, node.engine.refund(call, n, rid))

    def lease(self, key: str, max_slots: int, ttl_ms: int, lease_id: str) -> "AsyncLease":
        """``async with limiter.lease(...) as lease:`` holds a slot for the block."""
        d.check_lease(key, max_slots, ttl_ms, lease_id)
        return AsyncLease(self, key, max_slots, ttl_ms, lease_id)

    async def renew(self, key: str, lease_id: str, ttl_ms: int) -> bool:
        d.check_id(lease_id)
        d.check_ttl(ttl_ms)
        node = await self._node_for([key])
        return await self._run(node, node.engine.renew(key, lease_id, ttl_ms))

    async def release(self, key: str, lease_id: str) -> bool:
        d.check_id(lease_id)
        node = await self._node_for([key])
        return await self._run(node, node.engine.release(key, lease_id))

    async def leases(self, key: str) -> int:
        node = await self._node_for([key])
        return await self._run(node, node.engine.leases(key))

    async def quota_check(self, key: str, quota: d.Quota) -> d.QuotaDecision:
        node = await self._node_for([key])
        return await self._run(node, node.engine.quota_check(key, quota))

    async def quota_add(
        self,
        key: str,
        quota: d.Quota,
        calls: int = 0,
        rows: int = 0,
        *,
        request_id: Optional[str] = None,
    ) -> d.QuotaUsage:
        d.quota_count_words("QAG.QUOTA.ADD", key, quota, calls, rows)
        rid = d.request_id_of(request_id)
        node = await self._node_for([key])
        flow = node.engine.quota_count("QAG.QUOTA.ADD", key, quota, calls, rows, rid)
        return await self._run(node, flow)

    async def quota_seed(
        self, key: str, quota: d.Quota, calls: int = 0, rows: int = 0
    ) -> d.QuotaUsage:
        node = await self._node_for([key])
        flow = node.engine.quota_count("QAG.QUOTA.SEED", key, quota, calls, rows)
        return await self._run(node, flow)

    async def admit(
        self,
        scopes: Sequence[Union[d.Scope, Tuple[str, int, int]]],
        window: Optional[int] = None,
        *,
        request_id: Optional[str] = None,
    ) -> d.Admission:
        d.admit_words(scopes, window)  # checked before the keys are read
        rid = d.request_id_of(request_id)
        node = await self._node_for(admit_keys(scopes))
        return await self._run(node, node.engine.admit(scopes, window, rid))

    async def record(
        self,
        keys: Sequence[str],
        tokens: int,
        window: Optional[int] = None,
        *,
        request_id: Optional[str] = None,
    ) -> int:
        d.record_words(keys, tokens, window)
        rid = d.request_id_of(request_id)
        node = await self._node_for(list(keys))
        return await self._run(node, node.engine.record(keys, tokens, window, rid))

    def reserve(
        self,
        scopes: Sequence[Union[d.Scope, Tuple[str, int, int]]],
        tokens: int,
        *,
        window: Optional[int] = None,
        hold_ms: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> "AsyncReservation":
        """``async with limiter.reserve(scopes, tokens) as hold:`` admits the request
        holding ``tokens`` on every scope's tpm until ``hold.commit(actual)`` (see
        ``AsyncReservation``)."""
        d.reserve_words(scopes, window, tokens, hold_ms)
        rid = d.request_id_of(request_id)
        chain = [scope if isinstance(scope, d.Scope) else d.Scope(*scope) for scope in scopes]
        return AsyncReservation(self, HoldState(chain, window, tokens, hold_ms, rid, 0.0))

    # Which node.

    async def _node_for(self, keys: Sequence[str]) -> _Node:
        """The node owning the keys' slot (QagCrossSlot across slots); the slot table is
        read first if the limiter has none yet, and refreshed by a task when due."""
        shards = self._shards
        name = shards.owner(keys)
        if name is None:
            # Read within the call's deadline, which counts from here.
            started = asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(self._refresh(), self._deadline)
            except asyncio.TimeoutError:
                pass
            name = shards.owner(keys)
            if name is None:
                raise d.QagUnavailable("no node of the cluster serves the slot of " + keys[0])
            _CALL_STARTED.set(started)
        if shards.topology is not None and shards.start_refresh(time.monotonic()):
            self._in_background(self._refresh(True))
        return shards.node(name)

    async def _refresh(self, started: bool = False) -> None:
        """Reads the slot table (``CLUSTER SLOTS``) from the first node that answers,
        each asked within the deadline."""
        shards = self._shards
        for name in shards.seeds(self._startup):
            try:
                client = shards.node(name).client
                reply = await asyncio.wait_for(
                    client.execute_command(b"CLUSTER", "SLOTS"), self._deadline
                )
                owners = parse_slots(reply, name)
            except Exception:  # that node cannot tell: the next one
                continue
            shards.learned(owners, time.monotonic())
            return
        if started:
            shards.learned(None, time.monotonic())

    def _in_background(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _run(
        self, node: _Node, flow: Flow[T], routed: bool = True, limit: Optional[float] = None
    ) -> T:
        """Runs a flow within the deadline (``limit``: within that many seconds from
        now instead): waiting for a connection (QagBusy after it), connecting, and
        every round trip (QagUnavailable after it) included. A routed call still
        waiting for a connection when a back-off starts keeps to the policy
        (background work is not routed: it waits on)."""
        loop = asyncio.get_running_loop()
        started = _CALL_STARTED.get()
        if started is not None:
            _CALL_STARTED.set(None)
        if limit is not None:
            deadline = loop.time() + limit
        else:
            deadline = (loop.time() if started is None else started) + self._deadline
        gated = False
        gate = node.gate
        try:
            request = next(flow)
            if gate is not None:
                engine, generation = node.engine, node.engine.generation if routed else -1
                grace = deadline + OVERDUE_GRACE
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
                    reply = await asyncio.wait_for(self._execute(node, request, deadline), left)
                except asyncio.CancelledError:
                    raise
                except asyncio.TimeoutError:
                    self._shards.failed()
                    request = flow.throw(self._late())
                except Exception as error:  # every error is sorted, then thrown in
                    sorted_error = sort_error(error)
                    if isinstance(sorted_error, ConnectionDropped):
                        # The server restarted, most likely: its other pooled connections
                        # are dead too, and redis-py 8's asyncio pool hands them out
                        # unchecked. Closed, each reconnects when next taken.
                        await _close_idle(node, deadline - loop.time())
                    if isinstance(sorted_error, d.QagUnavailable):
                        self._shards.failed()
                    request = flow.throw(sorted_error)
                else:
                    request = flow.send(reply)
        except StopIteration as stop:
            answer: T = stop.value
            return answer
        finally:
            if gated:
                assert gate is not None
                gate.release(deadline)
            flow.close()  # a cancelled call frees its probe slot

    async def _probe(self, node: _Node) -> None:
        """The probe after a back-off, as a task of the limiter (``Engine.probe``)."""
        try:
            await self._run(
                node, node.engine.probe(), False, probe_time(self._deadline, self._back_off)
            )
        except d.QagError:  # the probe's outcome is the engine's to keep
            pass

    def _late(self) -> d.QagUnavailable:
        return d.QagUnavailable(f"no answer within the deadline of {self._deadline} s")

    def _busy(self) -> d.QagBusy:
        return d.QagBusy(
            f"no free connection in the limiter's pool of {self._max_connections} "
            f"within the deadline of {self._deadline} s"
        )

    async def _execute(self, node: _Node, request: Any, deadline: float) -> Any:
        """One request on the node; on a cluster, a MOVED or ASK reply is followed (a
        MOVED one also patches the slot table) and TRYAGAIN tried again until the
        deadline (loop time; the caller bounds it all by the deadline too)."""
        loop = asyncio.get_running_loop()
        target, asking, redirections = node, False, 0
        while True:
            try:
                return await _send(target, request, asking)
            except redis.exceptions.ResponseError as error:
                if self._shards.topology is None:
                    raise
                if try_again(error):
                    if loop.time() + TRY_AGAIN_WAIT >= deadline:
                        raise
                    await asyncio.sleep(TRY_AGAIN_WAIT)
                    continue
                moved = redirection_of(error)
                if moved is None:
                    raise
                redirections += 1
                if redirections > MAX_REDIRECTIONS:
                    raise d.QagUnavailable(
                        f"still redirected after {MAX_REDIRECTIONS} redirections"
                    )
                if not moved.ask:
                    self._shards.moved(moved.slot, moved.node)
                target, asking = self._shards.node(moved.node), moved.ask

    def _release_later(self, key: str, lease_id: str, started: float, ttl_ms: int) -> None:
        """An acquire may have taken the slot and did not return it: released by a task,
        retried until it answers 1 or the lease's TTL has passed."""
        self._in_background(self._release_until_done(key, lease_id, started, ttl_ms))

    async def _release_until_done(
        self, key: str, lease_id: str, started: float, ttl_ms: int
    ) -> None:
        attempt = 0
        while True:
            node: Optional[_Node] = None
            try:
                node = await self._node_for([key])
                if await self._run(node, node.engine.background_release(key, lease_id), False):
                    return
            except (d.QagUnavailable, d.QagBusy):
                if node is not None:
                    node.engine.background_failed()
            except d.QagError as error:  # no point in trying again
                if node is not None:
                    node.engine.background_failed()
                log.warning("qag: the lease %s of %s was not released: %s", lease_id, key, error)
                return
            if release_gives_up(started, ttl_ms, time.monotonic()):
                return
            await asyncio.sleep(release_delay(attempt))
            attempt += 1

    def _commit_later(self, hold: HoldState, tokens: int, release: bool = False) -> None:
        """A reservation left without its commit: committed by a task with ``tokens``
        under its id (``release``: a reserve that may have held tokens and returned no
        guard holding them, released after its ADMIT is replayed), untouched by the
        caller's cancellation, each try within the deadline, retried until Redis answers
        or the hold has stopped counting by itself."""
        self._in_background(self._commit_until_done(hold, tokens, release))

    async def _commit_until_done(self, hold: HoldState, tokens: int, release: bool) -> None:
        attempt = 0
        while True:
            node: Optional[_Node] = None
            try:
                node = await self._node_for(hold.keys)
                flow: Flow[int]
                if release:
                    flow = node.engine.background_unreserve(hold, hold.left_ms(time.monotonic()))
                else:
                    flow = node.engine.background_commit(hold, tokens)
                await self._run(node, flow, False)
                return
            except (d.QagUnavailable, d.QagBusy):
                if node is not None:
                    node.engine.background_failed()
            except d.QagModuleRequired:  # Redis restarted without it: nothing is held
                return
            except d.QagError as error:  # no point in trying again
                if node is not None:
                    node.engine.background_failed()
                log.warning("qag: the reservation %s was not committed: %s", hold.id, error)
                return
            if hold.gives_up(time.monotonic()):
                return
            await asyncio.sleep(release_delay(attempt))
            attempt += 1


async def _close_idle(node: _Node, left: float) -> None:
    """Closes the node's pooled connections no call holds, within ``left`` seconds."""
    pool = node.client.connection_pool
    try:
        await asyncio.wait_for(pool.disconnect(inuse_connections=False), max(left, 0.001))
    except (asyncio.TimeoutError, OSError, redis.exceptions.RedisError):
        pass  # those not closed yet fail once more


async def _send(node: _Node, request: Any, asking: bool) -> Any:
    if isinstance(request, RunScript):
        if not asking:
            script = node.scripts[request.script]
            return await script(keys=[request.key], args=list(request.arguments))
        source = node.scripts[request.script].script
        words: Tuple[Any, ...] = ("EVAL", source, 1, request.key, *request.arguments)
    else:
        assert isinstance(request, Command)
        words = request.words
        if request.probe:  # a bytes name has no response callback in redis-py: the raw reply
            words = (words[0].encode(), *words[1:])
        if not asking:
            return await node.client.execute_command(*words)
    # ASK: ASKING, then the request, on one connection.
    pipe = node.client.pipeline(transaction=False)
    pipe.execute_command("ASKING")
    pipe.execute_command(*words)
    return (await pipe.execute())[1]


def _node_client(cluster: RedisCluster, name: str) -> "redis.asyncio.Redis":
    """A client for one node of the cluster with the cluster client's connection
    settings (not connected: the limiter makes its own pool from it)."""
    host, _, port = name.rpartition(":")
    settings = dict(cluster.nodes_manager.connection_kwargs)
    connection_class = settings.pop("connection_class", redis.asyncio.Connection)
    # Only what a connection takes (the cluster client keeps its pool size, its reply
    # callbacks and its own notification handler among them).
    accepted = {
        parameter
        for base in connection_class.__mro__
        if "__init__" in vars(base)
        for parameter in inspect.signature(vars(base)["__init__"]).parameters
    }
    settings = {
        name: value
        for name, value in settings.items()
        if name in accepted and not name.startswith("oss_cluster")
    }
    pool = redis.asyncio.ConnectionPool(
        connection_class=connection_class, host=host, port=int(port), **settings
    )
    return redis.asyncio.Redis(connection_pool=pool)


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
        # The node the lease was taken on (set on entering).
        self._node: Optional[_Node] = None

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
        attempt = Attempt()
        self._node = node = await limiter._node_for([self.key])
        flow = node.engine.lease(self.key, self._max, state.ttl_ms, self.id, attempt)
        try:
            grant = await limiter._run(node, flow)
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
            node = await self._guard_node()
            released = await limiter._run(node, node.engine.guard_release(state))
        except d.QagError:
            self._engine().background_failed()
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
            node = await self._guard_node()
            if await limiter._run(node, node.engine.guard_release(state)) is None:
                # A back-off: released in the background, once Redis answers.
                limiter._release_later(self.key, self.id, time.monotonic(), state.ttl_ms)
        except asyncio.CancelledError:
            if state.in_redis:  # cancelled on the way out: released in the background
                limiter._release_later(self.key, self.id, time.monotonic(), state.ttl_ms)
            raise
        except Exception as error:
            self._engine().background_failed()
            log.warning(
                "qag: the lease %s of %s was not released (its TTL frees it): %s",
                self.id,
                self.key,
                error,
            )

    async def _guard_node(self) -> _Node:
        """A lease the policy answered is given back where it was counted; one held in
        Redis on the node owning its key now."""
        if self._node is not None and not self._state.in_redis:
            return self._node
        return await self._limiter._node_for([self.key])

    def _engine(self) -> Engine:
        assert self._node is not None
        return self._node.engine

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
                node = await limiter._node_for([self.key])
                held = await limiter._run(
                    node, node.engine.renewal(self.key, self.id, state.ttl_ms), False
                )
            except d.QagError as error:
                self._engine().background_failed()
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


class AsyncReservation(HoldView):
    """Tokens held on a chain of scopes for one request, for an ``async with`` block.

    Entering sends QAG.ADMIT ... RESERVE tokens ID id [HOLD ms]: ``admission`` (and
    ``admitted``) says whether the request may go; a refused one holds nothing.
    ``await charge(n)`` pays ``n`` tokens now (QAG.RECORD ... ID id PARTIAL; a stream
    charged as it goes); ``await commit(actual)`` charges the request's whole count
    (partials included) and releases the hold, once. Leaving the block without a
    commit (an exception, a cancellation) commits what was charged, by a task of the
    limiter that the cancellation does not reach (so the hold is released at once,
    not left to expire); so does a reserve cancelled or failed after it was sent
    (committing 0). Under the policy: "forwarded" holds nothing (``charge`` and
    ``commit`` count nothing and answer 0), "local" counts in this process."""

    def __init__(self, limiter: AsyncLimiter, state: HoldState) -> None:
        self._limiter = limiter
        self._state = state
        self._node: Optional[_Node] = None

    async def __aenter__(self) -> "AsyncReservation":
        limiter, state = self._limiter, self._state
        if state.admission is not None or state.attempt.sent:
            raise RuntimeError("a reservation is entered once")
        state.started = time.monotonic()
        self._node = node = await limiter._node_for(state.keys)
        try:
            admission = await limiter._run(node, node.engine.reserve(state))
        except BaseException as error:
            # An outage, or cancelled: the ADMIT may have run (an error reply: it did not).
            if state.attempt.sent and (
                isinstance(error, d.QagUnavailable) or not isinstance(error, d.QagError)
            ):
                limiter._commit_later(state, 0, release=True)
            raise
        if state.attempt.sent and admission.answered_by != "module":
            # The ADMIT met an outage and the policy answered: it may have run.
            limiter._commit_later(state, 0, release=True)
        state.admission = admission
        return self

    async def charge(self, tokens: int) -> int:
        """Pays ``tokens`` now (the hold shrinks by as much): the scopes charged, 0 when
        forwarded. Raises what the call met (the commit still settles the count)."""
        state = self._state
        state.open("charge")
        d.record_words(state.keys, tokens, state.window)
        state.charged += tokens
        return (
            await self._limiter._run(self._guard_node(), self._engine().charge(state, tokens))
        ).scopes

    async def commit(self, actual: int) -> int:
        """Charges ``actual``, the request's whole count (partials included: at least
        what was charged), and releases the hold: the scopes charged (0 when
        forwarded). Once. A commit that met an outage is sent again in the background
        (the same id: it counts once)."""
        state = self._state
        state.open("commit")
        d.record_words(state.keys, actual, state.window)
        if actual < state.charged:
            raise ValueError(
                f"actual is the whole count, partials included: at least {state.charged}"
            )
        state.done = True
        limiter = self._limiter
        try:
            recorded = await limiter._run(self._guard_node(), self._engine().commit(state, actual))
        except BaseException as error:
            if state.in_redis and (
                isinstance(error, d.QagUnavailable) or not isinstance(error, d.QagError)
            ):
                limiter._commit_later(state, actual)
            raise
        if state.in_redis and recorded.answered_by != "module":
            limiter._commit_later(state, actual)
        return recorded.scopes

    async def __aexit__(self, *exc_info: Any) -> None:
        state = self._state
        if state.done or state.admission is None:
            return
        state.done = True
        if state.in_redis:  # not committed: what was charged, in the background
            self._limiter._commit_later(state, state.charged)
        elif state.admission.admitted and state.answered_by == "local":
            self._engine().release_locally(state)

    def _guard_node(self) -> _Node:
        assert self._node is not None
        return self._node

    def _engine(self) -> Engine:
        return self._guard_node().engine


__all__: List[str] = ["AsyncLease", "AsyncLimiter", "AsyncReservation"]

"""The asyncio limiter for ``redis.asyncio.Redis`` and its cluster client: performs the
driver's effects (``_driver``) with awaits, each round trip bounded by what is left of
the call's deadline, and runs background work as tasks of the running loop."""

from __future__ import annotations

import asyncio
import inspect
from collections import deque
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Deque, Dict, List, Optional, Tuple

import redis.asyncio
import redis.asyncio.retry
import redis.exceptions
from redis.asyncio.cluster import RedisCluster

from . import _driver as driver
from ._engine import Request, T

if TYPE_CHECKING:
    from typing import Concatenate, ParamSpec

    P = ParamSpec("P")

# The running round trip (per task: its context is copied into the task that sends).
_ROUND_TRIP: ContextVar[Optional[driver.RoundTrip]] = ContextVar(
    "qag_async_round_trip", default=None
)
_TRACKED: Dict[type, type] = {}
# Turns of the event loop a round trip is given after its deadline for an answer already
# on its way (read from the socket, parsed): a busy loop's delay, not the server's.
LATE_TURNS = 3
# A round trip past its deadline is cancelled up to this many times, this many seconds
# apart (a cancellation the client library swallowed lets it go on), then left to end.
CANCELS = 5
CANCEL_AGAIN = 0.02


def _tracked(connection_class: type) -> type:
    """``connection_class`` that tells the running round trip when its request is on its
    way: its connection being made (the name lookup included), or it sent."""
    if connection_class in _TRACKED:
        return _TRACKED[connection_class]
    base: Any = connection_class

    class Tracked(base):  # type: ignore[misc]
        async def connect(self, *args: Any, **kwargs: Any) -> Any:
            round_trip = _ROUND_TRIP.get()
            if round_trip is not None:
                round_trip.begin(asyncio.get_running_loop().time())
            return await super().connect(*args, **kwargs)

        async def send_packed_command(self, *args: Any, **kwargs: Any) -> Any:
            round_trip = _ROUND_TRIP.get()
            if round_trip is not None:
                round_trip.begin(asyncio.get_running_loop().time())
            if driver.stale(self):  # made before its node was found demoted: made again
                self.qag_epoch = None  # (the handshake's own commands send through here)
                await self.disconnect()
                await self.connect()
            return await super().send_packed_command(*args, **kwargs)

    Tracked.__name__ = Tracked.__qualname__ = f"Tracked{connection_class.__name__}"
    _TRACKED[connection_class] = Tracked
    return Tracked


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

    def acquire_now(self, deadline: float) -> bool:
        """A place if one is free now (none waits for one)."""
        if self._free > 0 and not self._waiters:
            self._free -= 1
            self._holders.append(deadline)
            return True
        return False

    async def acquire(self, until: float, deadline: float) -> bool:
        """A place for a call of ``deadline``, or False at ``until`` (loop time) or when
        interrupted."""
        loop = asyncio.get_running_loop()
        if self.acquire_now(deadline):
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


class _Task:
    """Background work as a task of the running loop, untouched by the cancellation of
    the call that started it; stopping it cancels it."""

    def __init__(self, limiter: "AsyncLimiter", work: driver.Driven[None], name: str) -> None:
        self._task = asyncio.get_running_loop().create_task(limiter._drive(work), name=name)
        limiter._background.add(self)
        self._task.add_done_callback(lambda _: limiter._background.discard(self))

    def stop(self, wait: bool) -> None:
        self._task.cancel()


class AsyncLease(driver.LeaseGuard):
    """``Lease`` for asyncio: renewed by a task while the ``async with`` block runs. An
    acquire cancelled after its QAG.LEASE was sent, and a release that failed or was
    cancelled on the way out, are released by a task of the limiter (bounded by the
    lease's TTL)."""

    _limiter: AsyncLimiter

    async def __aenter__(self) -> "AsyncLease":
        await self._limiter._drive(self._enter())
        return self

    async def release(self) -> bool:
        """Releases the slot now (leaving the block then does nothing): True if a live
        lease was released. Raises what the release met."""
        return await self._limiter._drive(self._release())

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._limiter._drive(self._exit())


class AsyncReservation(driver.ReservationGuard):
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

    _limiter: AsyncLimiter

    async def __aenter__(self) -> "AsyncReservation":
        await self._limiter._drive(self._enter())
        return self

    async def charge(self, tokens: int) -> int:
        """Pays ``tokens`` now (the hold shrinks by as much): the scopes charged, 0 when
        forwarded. Raises what the call met (the commit still settles the count)."""
        return await self._limiter._drive(self._charge(tokens))

    async def commit(self, actual: int) -> int:
        """Charges ``actual``, the request's whole count (partials included: at least
        what was charged), and releases the hold: the scopes charged (0 when
        forwarded). Once. A commit that met an outage is sent again in the background
        (the same id: it counts once)."""
        return await self._limiter._drive(self._commit(actual))

    async def release(self) -> None:
        """Commits what was charged and releases the hold now, if nothing was
        committed (leaving the block then does nothing): the end of a response whose
        handler did not commit. Raises what the commit met (it goes on in the
        background)."""
        await self._limiter._drive(self._release())

    async def __aexit__(self, *exc_info: Any) -> None:
        self._exit()


def _awaiting(
    flow: "Callable[Concatenate[Any, P], driver.Driven[T]]",
) -> "Callable[Concatenate[AsyncLimiter, P], Coroutine[Any, Any, T]]":
    async def call(self: AsyncLimiter, /, *args: "P.args", **kwargs: "P.kwargs") -> T:
        return await self._drive(flow(self, *args, **kwargs))

    driver.named_after(call, flow)
    return call


class AsyncLimiter(driver.Driver["AsyncLease", "AsyncReservation"]):
    """``Limiter`` for asyncio: the same options and answers, every method a
    coroutine. ``aclose()`` closes the limiter's own connections."""

    _cluster_class = RedisCluster
    _worker = _Task
    _lease_guard = AsyncLease
    _reservation_guard = AsyncReservation

    take = _awaiting(driver.Driver._take)
    take_pair = _awaiting(driver.Driver._take_pair)
    take_with_quota = _awaiting(driver.Driver._take_with_quota)
    peek = _awaiting(driver.Driver._peek)
    refund = _awaiting(driver.Driver._refund)
    renew = _awaiting(driver.Driver._renew)
    release = _awaiting(driver.Driver._release)
    leases = _awaiting(driver.Driver._leases)
    quota_check = _awaiting(driver.Driver._quota_check)
    quota_add = _awaiting(driver.Driver._quota_add)
    quota_seed = _awaiting(driver.Driver._quota_seed)
    admit = _awaiting(driver.Driver._admit)
    record = _awaiting(driver.Driver._record)

    async def aclose(self) -> None:
        """Closes the limiter's own connections and stops its background work."""
        self._stop_background()
        for node in self._shards.all():
            # A client made on a given pool leaves it open when closed: closed here.
            await node.client.connection_pool.disconnect()
            await node.wait_client.connection_pool.disconnect()

    async def _drive(self, driven: driver.Driven[T]) -> T:
        """Performs a driven call's effects until it answers; a cancellation is thrown
        in like any error, so the call gives back what it holds."""
        try:
            effect = next(driven)
            while True:
                try:
                    outcome = await self._perform(effect)
                except BaseException as error:  # thrown in: the call decides
                    effect = driven.throw(error)
                else:
                    effect = driven.send(outcome)
        except StopIteration as done:
            answer: T = done.value
            return answer

    async def _perform(self, effect: driver.Effect) -> Any:
        loop = asyncio.get_running_loop()
        if isinstance(effect, driver.Send):
            return await _round_trip(effect, loop)
        if isinstance(effect, driver.Acquire):
            return await _acquire(effect, loop)
        if isinstance(effect, driver.Sleep):
            await asyncio.sleep(effect.seconds)
        elif isinstance(effect, driver.Dropped) and effect.demoted:
            effect.node.epoch.count += 1
        elif isinstance(effect, driver.Dropped):
            # redis-py 8's asyncio pool hands pooled connections out unchecked.
            await _close_idle(effect.node, effect.until - loop.time())
        elif isinstance(effect, driver.Disconnect):
            await effect.node.client.connection_pool.disconnect()
            await effect.node.wait_client.connection_pool.disconnect()
        return None

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _own_client(
        self,
        client: Any,
        deadline: float,
        max_connections: int,
        connected: Callable[[Any], None],
    ) -> Tuple[Any, Any]:
        pool = client.connection_pool
        user_hook = pool.connection_kwargs.get("redis_connect_func")

        async def on_connect(connection: Any) -> None:
            if user_hook is None:
                await connection.on_connect()
            elif asyncio.iscoroutinefunction(user_hook):
                await user_hook(connection)
            else:
                user_hook(connection)
            connected(connection)

        own_pool = redis.asyncio.BlockingConnectionPool(
            connection_class=_tracked(pool.connection_class),
            max_connections=max_connections,
            **{
                "timeout": deadline,
                # redis-py 8 warns of a blocking Retry given to an asyncio client.
                **driver.pool_settings(pool, deadline, on_connect, redis.asyncio.retry.Retry),
            },
        )
        return redis.asyncio.Redis(connection_pool=own_pool), _Gate(max_connections)

    def _node_client(self, cluster: Any, name: str) -> Any:
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


async def _round_trip(effect: driver.Send, loop: asyncio.AbstractEventLoop) -> Any:
    """The request on its call's trip: on its way by the queue time (NotSent if not:
    its connection being made, or it written), then answered by the deadline; at the
    deadline, a few more turns of the loop for an answer already on its way (a busy loop
    is late to read it) before DeadlinePassed."""
    trip = effect.trip
    begun: Optional["asyncio.Future[None]"] = None
    if trip.answer_by is None:
        trip_begun = loop.create_future()
        begun = trip_begun

        def told() -> None:
            if not trip_begun.done():
                trip_begun.set_result(None)

        round_trip = driver.RoundTrip(trip, told)
    else:
        round_trip = driver.RoundTrip(trip)
    token = _ROUND_TRIP.set(round_trip)
    try:
        task = loop.create_task(_send(effect.node, effect.request, effect.asking))
    finally:
        _ROUND_TRIP.reset(token)
    try:
        if begun is not None:  # the call's first request: on its way by the queue time?
            await asyncio.wait(
                (task, begun), timeout=trip.queue_by - loop.time(), return_when="FIRST_COMPLETED"
            )
        if not task.done() and trip.answer_by is not None:
            await asyncio.wait((task,), timeout=trip.answer_by - loop.time())
            for _ in range(LATE_TURNS):
                if task.done():
                    break
                await asyncio.sleep(0)
    except BaseException:
        task.cancel()
        raise
    if task.done() and not task.cancelled():
        return task.result()
    # Its cancellation closes the connection (the client library's): a fresh one next.
    # One redis-py swallows (asyncio.wait_for before Python 3.12 returns an inner
    # future's result when the cancellation comes as it finishes) leaves the task going
    # on, to a late answer: cancelled again, a bounded number of times, and whatever it
    # ends with is past the deadline (found by the fault test: 0.86 s at 0.3).
    for _ in range(CANCELS):
        task.cancel()
        await asyncio.wait((task,), timeout=CANCEL_AGAIN)
        if task.done():
            break
    else:  # left to end: what it ends with is read, never raised
        task.add_done_callback(lambda ended: ended.cancelled() or ended.exception())
    if not round_trip.begun:
        raise driver.NotSent("the deadline passed before the request was on its way")
    raise driver.DeadlinePassed()


async def _acquire(effect: driver.Acquire, loop: asyncio.AbstractEventLoop) -> bool:
    """A place in the node's pool by the call's deadline, or a little after it while a
    holder is overdue; False once the call is no longer wanted."""
    gate, deadline = effect.gate, effect.deadline
    grace, gated = deadline + driver.OVERDUE_GRACE, False
    while not gated and effect.still_wanted():
        now = loop.time()
        if now < deadline:
            gated = await gate.acquire(deadline, deadline)
        elif now < grace and gate.overdue(now):
            gated = await gate.acquire(grace, deadline)
        else:
            break
    return gated


async def _close_idle(node: driver.Node, left: float) -> None:
    """Closes the node's pooled connections no call holds, within ``left`` seconds."""
    pool = node.client.connection_pool
    try:
        await asyncio.wait_for(pool.disconnect(inuse_connections=False), max(left, 0.001))
    except (asyncio.TimeoutError, OSError, redis.exceptions.RedisError):
        pass  # those not closed yet fail once more


async def _send(node: driver.Node, request: Request, asking: bool) -> Any:
    send, reply = node.sending(request, asking)
    return reply(await send())


__all__: List[str] = ["AsyncLease", "AsyncLimiter", "AsyncReservation"]

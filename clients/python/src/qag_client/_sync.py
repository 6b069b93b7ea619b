"""The blocking limiter for ``redis.Redis`` and ``redis.cluster.RedisCluster``: performs
the driver's effects (``_driver``) with blocking calls, and runs background work on
daemon threads."""

from __future__ import annotations

import threading
import time
from contextvars import ContextVar, copy_context
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import redis
import redis.retry
from redis.cluster import RedisCluster

from . import _driver as driver
from ._engine import Request, T

if TYPE_CHECKING:
    from typing import Concatenate, ParamSpec

    P = ParamSpec("P")

# The running round trip (per thread): its call's times, whether it is on its way.
_ROUND_TRIP: ContextVar[Optional[driver.RoundTrip]] = ContextVar("qag_round_trip", default=None)
_BOUNDED: Dict[type, type] = {}


def _time_left() -> Optional[float]:
    round_trip = _ROUND_TRIP.get()
    if round_trip is None:
        return None
    return max(round_trip.trip.due - time.monotonic(), 0.001)


class _Connecting(threading.Thread):
    """A connection's connect on a daemon thread of its own, in the context of the call
    that began it (its round trip): a name lookup has no timeout, so only waiting for
    this thread bounds it. ``error``: what the connect raised."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        super().__init__(name="qag-connect", daemon=True)
        self._connect = connect
        self._context = copy_context()
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self._context.run(self._connect)
        except BaseException as error:  # raised in the waiting call
            self.error = error


def _connect_within(connection: Any, connect: Callable[[], Any]) -> None:
    """Runs ``connect`` (the connection's own), waiting for it no longer than the
    running call's time left (redis-py's TimeoutError past it). One a call stopped
    waiting for runs on, and the connection's next connect waits for it first (a
    connection is connected by one thread at a time)."""
    earlier = connection.qag_connecting
    if earlier is not None:
        earlier.join(_time_left())
        if earlier.is_alive():
            raise redis.exceptions.TimeoutError("Timeout connecting to server")
    connecting = connection.qag_connecting = _Connecting(connect)
    connecting.start()
    connecting.join(_time_left())
    if connecting.is_alive():
        raise redis.exceptions.TimeoutError("Timeout connecting to server")
    connection.qag_connecting = None
    if connecting.error is not None:
        raise connecting.error


def _bounded(connection_class: type) -> type:
    """``connection_class`` whose connecting (the name lookup, the socket and the
    handshake), sending and reading are bounded by what is left of the running call's
    time, and that tells the round trip when its request is on its way: its connection
    being made, or it sent (NotSent if too late)."""
    if connection_class in _BOUNDED:
        return _BOUNDED[connection_class]
    base: Any = connection_class

    class Bounded(base):  # type: ignore[misc]
        # A connect still running for a call that stopped waiting for it.
        qag_connecting: Optional[_Connecting] = None

        def connect(self, *args: Any, **kwargs: Any) -> Any:
            round_trip = _ROUND_TRIP.get()
            if round_trip is None:
                return super().connect(*args, **kwargs)
            round_trip.begin(time.monotonic())
            _connect_within(self, partial(self._connect_timed, super().connect, *args, **kwargs))

        def _connect_timed(self, connect: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
            """``connect`` with the socket's timeouts what is left of the call's time."""
            connection: Any = self
            saved = connection.socket_connect_timeout, connection.socket_timeout
            connection.socket_connect_timeout = connection.socket_timeout = _time_left()
            try:
                connect(*args, **kwargs)
            finally:
                connection.socket_connect_timeout, connection.socket_timeout = saved

        def send_packed_command(self, *args: Any, **kwargs: Any) -> Any:
            round_trip = _ROUND_TRIP.get()
            if round_trip is not None:
                round_trip.begin(time.monotonic())
            if driver.stale(self):  # made before its node was found demoted: made again
                self.qag_epoch = None  # (the handshake's own commands send through here)
                self.disconnect()
                self.connect()
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

    def acquire_now(self, until: float) -> bool:
        """A place if one is free now."""
        with self._changed:
            if self._free == 0:
                return False
            self._free -= 1
            self._holders.append(until)
            return True

    def acquire(self, until: float, still_wanted: Callable[[], bool]) -> bool:
        with self._changed:
            grace = until + driver.OVERDUE_GRACE
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


class _Thread:
    """Background work on a daemon thread of its own; stopping it throws Stopped in at
    its next pause."""

    def __init__(self, limiter: "Limiter", work: driver.Driven[None], name: str) -> None:
        self._limiter = limiter
        self._work = work
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        limiter._background.add(self)
        self._thread.start()

    def _main(self) -> None:
        try:
            self._limiter._drive(self._work, self._stop)
        except driver.Stopped:
            pass
        finally:
            self._limiter._background.discard(self)

    def stop(self, wait: bool) -> None:
        self._stop.set()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()


class Lease(driver.LeaseGuard):
    """A slot of a key, held for a ``with`` block.

    Entering takes the slot (QAG.LEASE) or raises QagRefused. A lease held in Redis is
    renewed every ttl/3 by a daemon thread while the block runs; ``lost`` turns true
    when a renewal finds it gone, or once it could not be confirmed within its TTL
    (``last_error`` says why). Leaving the block releases it, exception or not, within
    a deadline of its own (not a request's); during a back-off, or where that release
    fails (counted in ``limiter.counts.errors`` and logged, never raised), in the
    background, tried again until Redis answers or the TTL has passed.
    ``answered_by``: "module", or "local" / "forwarded"
    for a lease the policy answered (nothing in Redis; never renewed, never lost).
    """

    _limiter: Limiter

    def __enter__(self) -> "Lease":
        self._limiter._drive(self._enter())
        return self

    def release(self) -> bool:
        """Releases the slot now (leaving the block then does nothing): True if a live
        lease was released. Raises what the release met."""
        return self._limiter._drive(self._release())

    def __exit__(self, *exc_info: Any) -> None:
        self._limiter._drive(self._exit())


class Reservation(driver.ReservationGuard):
    """Tokens held on a chain of scopes for one request, for a ``with`` block.

    Entering sends QAG.ADMIT ... RESERVE tokens ID id [HOLD ms]: ``admission`` (and
    ``admitted``) says whether the request may go; a refused one holds nothing.
    ``charge(n)`` pays ``n`` tokens now (QAG.RECORD ... ID id PARTIAL; a stream charged
    as it goes); ``commit(actual)`` charges the request's whole count (partials
    included) and releases the hold, once. Leaving the block without a commit (an
    exception included) commits what was charged, in a daemon thread (so the hold is
    released at once, not left to expire); so does a reserve that failed or was
    interrupted after it was sent (committing 0). Under the policy: "forwarded" holds
    nothing (``charge`` and ``commit`` count nothing and answer 0), "local" counts in
    this process."""

    _limiter: Limiter

    def __enter__(self) -> "Reservation":
        self._limiter._drive(self._enter())
        return self

    def charge(self, tokens: int) -> int:
        """Pays ``tokens`` now (the hold shrinks by as much): the scopes charged, 0 when
        forwarded. Raises what the call met (the commit still settles the count)."""
        return self._limiter._drive(self._charge(tokens))

    def commit(self, actual: int) -> int:
        """Charges ``actual``, the request's whole count (partials included: at least
        what was charged), and releases the hold: the scopes charged (0 when
        forwarded). Once. A commit that met an outage is sent again in the background
        (the same id: it counts once)."""
        return self._limiter._drive(self._commit(actual))

    def release(self) -> None:
        """Commits what was charged and releases the hold now, if nothing was
        committed (leaving the block then does nothing): the end of a response whose
        handler did not commit. Raises what the commit met (it goes on in the
        background)."""
        self._limiter._drive(self._release())

    def __exit__(self, *exc_info: Any) -> None:
        self._exit()


def _blocking(
    flow: "Callable[Concatenate[Any, P], driver.Driven[T]]",
) -> "Callable[Concatenate[Limiter, P], T]":
    def call(self: Limiter, /, *args: "P.args", **kwargs: "P.kwargs") -> T:
        return self._drive(flow(self, *args, **kwargs))

    driver.named_after(call, flow)
    return call


class Limiter(driver.Driver["Lease", "Reservation"]):
    """Rate limiting over a ``redis.Redis`` or ``redis.cluster.RedisCluster`` client.

    ``backend``: "auto" (the module where the server has it, else every family's
    script on the same keys), "module" or "script". ``deadline``: seconds a call may take, connecting and
    waiting for a free connection included. ``on_unavailable``: what a call answers
    when Redis fails, and for ``back_off`` seconds after without touching Redis:
    "raise" (QagUnavailable), "forward" (answers "not counted, forwarded") or "local"
    (counted in this process, each limit scaled by ``local_share``).
    ``max_connections``: the size of the limiter's own pool (per node on a cluster;
    QagBusy past the deadline; default: the client's pool's size, at most 100 where
    that is unbounded). ``recheck_missing_module``: how long "auto" believes a server
    has no module before asking again. ``cross_slot`` (a cluster): a ``take_pair`` whose
    buckets are in different slots raises QagCrossSlot ("raise") or is two calls, the
    client bucket's token given back when the key bucket refuses ("two_calls").
    ``max_waiting``: how many calls may wait at once (``wait=``: each on a connection of
    its own, per node; QagBusy past the queue time).

    On a cluster every call goes to the node owning its keys' slot, on connections of
    the limiter's own made with the cluster client's settings; each node has its own
    state: the module's presence, the back-off and the local counts. A call whose slot
    has no owner once the slot table is read (unserved, or the table unreadable within
    the deadline) is an outage of the calls without an owner: answered by the policy,
    and their back-off keeps the next ones from reading the table on their own time.
    """

    _cluster_class = RedisCluster
    _worker = _Thread
    _lease_guard = Lease
    _reservation_guard = Reservation

    take = _blocking(driver.Driver._take)
    take_pair = _blocking(driver.Driver._take_pair)
    take_with_quota = _blocking(driver.Driver._take_with_quota)
    peek = _blocking(driver.Driver._peek)
    refund = _blocking(driver.Driver._refund)
    renew = _blocking(driver.Driver._renew)
    release = _blocking(driver.Driver._release)
    leases = _blocking(driver.Driver._leases)
    quota_check = _blocking(driver.Driver._quota_check)
    quota_add = _blocking(driver.Driver._quota_add)
    quota_seed = _blocking(driver.Driver._quota_seed)
    admit = _blocking(driver.Driver._admit)
    record = _blocking(driver.Driver._record)

    def close(self) -> None:
        """Closes the limiter's own connections and stops its background work
        (releases, commits, renewals, probes)."""
        self._stop_background()
        for node in self._shards.all():
            # A client made on a given pool leaves it open when closed: closed here.
            node.client.connection_pool.disconnect()
            node.wait_client.connection_pool.disconnect()

    def _drive(self, driven: driver.Driven[T], stop: Optional[threading.Event] = None) -> T:
        """Performs a driven call's effects until it answers (``stop``: background work,
        stopped at its next pause once set)."""
        try:
            effect = next(driven)
            while True:
                try:
                    outcome = self._perform(effect, stop)
                except BaseException as error:  # thrown in: the call decides
                    effect = driven.throw(error)
                else:
                    effect = driven.send(outcome)
        except StopIteration as done:
            answer: T = done.value
            return answer

    def _perform(self, effect: driver.Effect, stop: Optional[threading.Event]) -> Any:
        if isinstance(effect, driver.Send):
            token = _ROUND_TRIP.set(driver.RoundTrip(effect.trip))
            try:
                return _send(effect.node, effect.request, effect.asking)
            finally:
                _ROUND_TRIP.reset(token)
        if isinstance(effect, driver.Acquire):
            return effect.gate.acquire(effect.deadline, effect.still_wanted)
        if isinstance(effect, driver.Sleep):
            if stop is None:
                time.sleep(effect.seconds)
            elif stop.wait(effect.seconds):
                raise driver.Stopped()
        elif isinstance(effect, driver.Disconnect):
            effect.node.client.connection_pool.disconnect()
            effect.node.wait_client.connection_pool.disconnect()
        elif isinstance(effect, driver.Dropped) and effect.demoted:
            effect.node.epoch.count += 1
        # Dropped otherwise: the blocking pool checks a connection before it hands it out.
        return None

    _now = staticmethod(time.monotonic)

    def _own_client(
        self,
        client: Any,
        deadline: float,
        max_connections: int,
        connected: Callable[[Any], None],
    ) -> Tuple[Any, Any]:
        # Each call bounded by what is left of its deadline, and waiting at most its
        # deadline for a connection.
        pool = client.connection_pool
        user_hook = pool.connection_kwargs.get("redis_connect_func")

        def on_connect(connection: Any) -> None:
            if user_hook is None:
                connection.on_connect()
            else:
                user_hook(connection)
            connected(connection)

        own_pool = redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
            connection_class=_bounded(pool.connection_class),
            max_connections=max_connections,
            timeout=deadline,
            **driver.pool_settings(pool, deadline, on_connect, redis.retry.Retry),
        )
        return redis.Redis(connection_pool=own_pool), _Gate(max_connections)

    def _node_client(self, cluster: Any, name: str) -> Any:
        host, _, port = name.rpartition(":")
        return redis.Redis(host=host, port=int(port), **cluster.nodes_manager.connection_kwargs)


def _send(node: driver.Node, request: Request, asking: bool) -> Any:
    send, reply = node.sending(request, asking)
    return reply(send())


__all__: List[str] = ["Lease", "Limiter", "Reservation"]

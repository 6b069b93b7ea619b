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
    SLOTS,
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

log = logging.getLogger("qag_client")

# The monotonic time by which the running call must end (per thread).
_CALL_DEADLINE: ContextVar[Optional[float]] = ContextVar("qag_call_deadline", default=None)
# When the running call began, if before its run (it read the slot table first).
_CALL_STARTED: ContextVar[Optional[float]] = ContextVar("qag_call_started", default=None)
_BOUNDED: Dict[type, type] = {}
DEFAULT_MAX_CONNECTIONS = 100
# How long a call whose deadline passed while waiting for a connection waits on for the
# verdict of a holder that is past its own deadline.
OVERDUE_GRACE = 0.05
# The wait before a request answered TRYAGAIN (a slot in migration) is sent again.
TRY_AGAIN_WAIT = 0.01


def probe_time(deadline: float, back_off: float) -> float:
    """How long the probe after a back-off may take: no request waits for it, so up
    to the back-off (at most 2 s), and never less than a call's deadline."""
    return max(deadline, min(back_off, 2.0))


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
    left as it is. On a cluster, each node's client is made so."""
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


class Limiter:
    """Rate limiting over a ``redis.Redis`` or ``redis.cluster.RedisCluster`` client.

    ``backend``: "auto" (the module where the server has it, else the script),
    "module" or "script". ``deadline``: seconds a call may take, connecting and
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

    On a cluster every call goes to the node owning its keys' slot, on connections of
    the limiter's own made with the cluster client's settings; each node has its own
    state: the module's presence, the back-off and the local counts.
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
        self._closed = threading.Event()
        cluster = client if isinstance(client, RedisCluster) else None

        def make(name: str) -> _Node:
            engine = Engine(*options)
            base = client if cluster is None else _node_client(cluster, name)
            own, gate = _own_client(base, deadline, max_connections, engine.forget_presence)
            if gate is not None:
                engine.on_outage = gate.interrupt
            node = _Node(name, own, gate, engine)
            engine.start_probe = lambda: threading.Thread(
                target=self._probe, args=(node,), daemon=True
            ).start()
            return node

        self._shards: Shards[_Node] = Shards(make, cluster is not None)
        self._startup: List[str] = []
        if cluster is not None:
            manager = cluster.nodes_manager
            self._startup = list(manager.startup_nodes) + list(manager.nodes_cache)
            owners = _slots_cache(manager)
            if owners is not None:
                self._shards.learned(owners, time.monotonic())

    def close(self) -> None:
        """Closes the limiter's own connections and stops its background releases and
        probes."""
        self._closed.set()
        for node in self._shards.all():
            # A client made on a given pool leaves it open when closed: closed here.
            node.client.connection_pool.disconnect()

    @property
    def counts(self) -> d.Counts:
        """How calls were answered so far: module, script, local, forwarded, errors."""
        return self._shards.counts()

    @property
    def backing_off(self) -> bool:
        """True while calls keep to the policy (on a cluster: on some node): a back-off
        runs, or its probe is out."""
        return self._shards.backing_off()

    @property
    def counting_locally(self) -> bool:
        """True while calls are counted in this process ("local", a back-off runs)."""
        return self._shards.counting_locally()

    @property
    def local_decisions(self) -> int:
        """Calls answered locally since the limiter was made."""
        return self.counts.local

    def take(
        self, bucket: Bucket, cost: int = 1, *, request_id: Optional[str] = None
    ) -> d.Decision:
        """Takes ``cost`` tokens from the bucket. ``request_id``: the call's id (1 to 128
        bytes), default a new one: a call whose connection dropped is sent once more
        with it and counts once."""
        call = d.BucketCall.on(bucket, cost)
        rid = d.request_id_of(request_id)
        node = self._node_for([call.key])
        return self._run(node, node.engine.take(call, rid))

    def take_pair(
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
            client_decision = self.take(client, cost, request_id=rid)
            if not client_decision.allowed:
                return d.PairDecision(client_decision, None)
            key_decision = self.take(key, cost, request_id=rid)
            if not key_decision.allowed and client_decision.answered_by in ("module", "script"):
                self._give_back(client, cost, rid)
            return d.PairDecision(client_decision, key_decision)
        node = self._node_for([first.key, second.key])
        return self._run(node, node.engine.take_pair(first, second, rid))

    def _give_back(self, bucket: Bucket, cost: int, request_id: str) -> None:
        """The client bucket's token of a pair the key bucket refused (two calls)."""
        try:
            self.refund(bucket, cost, request_id=request_id)
        except d.QagError as error:  # counted in errors: the token stays spent
            log.warning("qag: the token of %s was not given back: %s", bucket.key, error)

    def peek(self, bucket: Bucket, cost: int = 1) -> d.Decision:
        """What ``take`` would answer, nothing written."""
        call = d.BucketCall.on(bucket, cost)
        node = self._node_for([call.key])
        return self._run(node, node.engine.peek(call))

    def refund(self, bucket: Bucket, n: int, *, request_id: Optional[str] = None) -> d.Refunded:
        """Gives ``n`` tokens back (never above the count; a missing bucket stays
        missing): QAG.REFUND, or lua/token_refund.lua without the module. For a request
        one limit admitted and a later one refused."""
        call = d.BucketCall.on(bucket, 1)
        call.refund_arguments(n)
        rid = d.request_id_of(request_id)
        node = self._node_for([call.key])
        return self._run(node, node.engine.refund(call, n, rid))

    def lease(self, key: str, max_slots: int, ttl_ms: int, lease_id: str) -> "Lease":
        """``with limiter.lease(...) as lease:`` holds a slot for the block (see Lease)."""
        d.check_lease(key, max_slots, ttl_ms, lease_id)
        return Lease(self, key, max_slots, ttl_ms, lease_id)

    def renew(self, key: str, lease_id: str, ttl_ms: int) -> bool:
        d.check_id(lease_id)
        d.check_ttl(ttl_ms)
        node = self._node_for([key])
        return self._run(node, node.engine.renew(key, lease_id, ttl_ms))

    def release(self, key: str, lease_id: str) -> bool:
        d.check_id(lease_id)
        node = self._node_for([key])
        return self._run(node, node.engine.release(key, lease_id))

    def leases(self, key: str) -> int:
        node = self._node_for([key])
        return self._run(node, node.engine.leases(key))

    def quota_check(self, key: str, quota: d.Quota) -> d.QuotaDecision:
        node = self._node_for([key])
        return self._run(node, node.engine.quota_check(key, quota))

    def quota_add(
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
        node = self._node_for([key])
        flow = node.engine.quota_count("QAG.QUOTA.ADD", key, quota, calls, rows, rid)
        return self._run(node, flow)

    def quota_seed(self, key: str, quota: d.Quota, calls: int = 0, rows: int = 0) -> d.QuotaUsage:
        node = self._node_for([key])
        return self._run(node, node.engine.quota_count("QAG.QUOTA.SEED", key, quota, calls, rows))

    def admit(
        self,
        scopes: Sequence[Union[d.Scope, Tuple[str, int, int]]],
        window: Optional[int] = None,
        *,
        request_id: Optional[str] = None,
    ) -> d.Admission:
        d.admit_words(scopes, window)  # checked before the keys are read
        rid = d.request_id_of(request_id)
        node = self._node_for(admit_keys(scopes))
        return self._run(node, node.engine.admit(scopes, window, rid))

    def record(
        self,
        keys: Sequence[str],
        tokens: int,
        window: Optional[int] = None,
        *,
        request_id: Optional[str] = None,
    ) -> int:
        d.record_words(keys, tokens, window)
        rid = d.request_id_of(request_id)
        node = self._node_for(list(keys))
        return self._run(node, node.engine.record(keys, tokens, window, rid))

    def reserve(
        self,
        scopes: Sequence[Union[d.Scope, Tuple[str, int, int]]],
        tokens: int,
        *,
        window: Optional[int] = None,
        hold_ms: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> "Reservation":
        """``with limiter.reserve(scopes, tokens) as hold:`` admits the request holding
        ``tokens`` on every scope's tpm until ``hold.commit(actual)`` (see
        ``Reservation``)."""
        d.reserve_words(scopes, window, tokens, hold_ms)
        rid = d.request_id_of(request_id)
        chain = [scope if isinstance(scope, d.Scope) else d.Scope(*scope) for scope in scopes]
        return Reservation(self, HoldState(chain, window, tokens, hold_ms, rid, 0.0))

    # Which node.

    def _node_for(self, keys: Sequence[str]) -> _Node:
        """The node owning the keys' slot (QagCrossSlot across slots); the slot table is
        read first if the limiter has none yet, and refreshed in the background when
        due."""
        shards = self._shards
        name = shards.owner(keys)
        if name is None:
            # Read within the call's deadline, which counts from here.
            started = time.monotonic()
            token = _CALL_DEADLINE.set(started + self._deadline)
            try:
                self._refresh(until=started + self._deadline)
            finally:
                _CALL_DEADLINE.reset(token)
            name = shards.owner(keys)
            if name is None:
                raise d.QagUnavailable("no node of the cluster serves the slot of " + keys[0])
            _CALL_STARTED.set(started)
        if shards.topology is not None and shards.start_refresh(time.monotonic()):
            threading.Thread(target=self._refresh, args=(True,), daemon=True).start()
        return shards.node(name)

    def _refresh(self, started: bool = False, until: Optional[float] = None) -> None:
        """Reads the slot table (``CLUSTER SLOTS``) from the first node that answers,
        each asked within the deadline (all of them by ``until`` if given)."""
        shards = self._shards
        for name in shards.seeds(self._startup):
            if until is not None and time.monotonic() >= until:
                break
            try:
                reply = shards.node(name).client.execute_command(b"CLUSTER", "SLOTS")
                owners = parse_slots(reply, name)
            except Exception:  # that node cannot tell: the next one
                continue
            shards.learned(owners, time.monotonic())
            return
        if started:
            shards.learned(None, time.monotonic())

    def _run(
        self, node: _Node, flow: Flow[T], routed: bool = True, limit: Optional[float] = None
    ) -> T:
        """Runs a flow within the deadline (``limit``: within that many seconds from
        now instead): waiting for a connection (QagBusy after it), connecting, and
        every round trip (QagUnavailable after it) included. A routed call still
        waiting for a connection when a back-off starts keeps to the policy
        (background work is not routed: it waits on)."""
        started = _CALL_STARTED.get()
        if started is not None:
            _CALL_STARTED.set(None)
        if limit is not None:
            deadline = time.monotonic() + limit
        else:
            deadline = (time.monotonic() if started is None else started) + self._deadline
        token = _CALL_DEADLINE.set(deadline)
        gated = False
        gate = node.gate
        try:
            request = next(flow)
            if gate is not None:
                engine, generation = node.engine, node.engine.generation if routed else -1
                gated = gate.acquire(deadline, lambda: not engine.overtaken(generation))
                if gated and engine.overtaken(generation):
                    gate.release(deadline)
                    gated = False
                if not gated:
                    flow.throw(Overtaken() if engine.overtaken(generation) else self._busy())
                    raise AssertionError("a flow went on without a connection")
            while True:
                if time.monotonic() >= deadline:
                    request = flow.throw(self._late())
                    continue
                try:
                    reply = self._execute(node, request, deadline)
                except Exception as error:  # every error is sorted, then thrown in
                    sorted_error = sort_error(error)
                    if isinstance(sorted_error, d.QagUnavailable):
                        self._shards.failed()
                        if time.monotonic() >= deadline:
                            sorted_error = self._late()  # the socket timed out at the deadline
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
            flow.close()
            _CALL_DEADLINE.reset(token)

    def _probe(self, node: _Node) -> None:
        """The probe after a back-off, on a thread of its own (``Engine.probe``); none
        after ``close()``, and one that ran across it closes what it connected."""
        if self._closed.is_set():
            return
        try:
            self._run(node, node.engine.probe(), False, probe_time(self._deadline, self._back_off))
        except d.QagError:  # the probe's outcome is the engine's to keep
            pass
        if self._closed.is_set():
            node.client.connection_pool.disconnect()

    def _late(self) -> d.QagUnavailable:
        return d.QagUnavailable(f"no answer within the deadline of {self._deadline} s")

    def _busy(self) -> d.QagBusy:
        return d.QagBusy(
            f"no free connection in the limiter's pool of {self._max_connections} "
            f"within the deadline of {self._deadline} s"
        )

    def _execute(self, node: _Node, request: Any, deadline: float) -> Any:
        """One request on the node; on a cluster, a MOVED or ASK reply is followed (a
        MOVED one also patches the slot table) and TRYAGAIN tried again, within the
        deadline."""
        target, asking, redirections = node, False, 0
        while True:
            try:
                return _send(target, request, asking)
            except redis.exceptions.ResponseError as error:
                if self._shards.topology is None:
                    raise
                if try_again(error):
                    if time.monotonic() + TRY_AGAIN_WAIT >= deadline:
                        raise
                    time.sleep(TRY_AGAIN_WAIT)
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
            node: Optional[_Node] = None
            try:
                node = self._node_for([key])
                if self._run(node, node.engine.background_release(key, lease_id), False):
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
            self._closed.wait(release_delay(attempt))
            attempt += 1

    def _commit_later(self, hold: HoldState, tokens: int, release: bool = False) -> None:
        """A reservation left without its commit: committed in a daemon thread with
        ``tokens`` under its id (``release``: a reserve that may have held tokens and
        returned no guard holding them, released after its ADMIT is replayed), each try
        within the deadline, retried until Redis answers or the hold has stopped
        counting by itself."""
        threading.Thread(
            target=self._commit_until_done,
            args=(hold, tokens, release),
            name=f"qag-commit {hold.id}",
            daemon=True,
        ).start()

    def _commit_until_done(self, hold: HoldState, tokens: int, release: bool) -> None:
        attempt = 0
        while not self._closed.is_set():
            node: Optional[_Node] = None
            try:
                node = self._node_for(hold.keys)
                flow: Flow[int]
                if release:
                    flow = node.engine.background_unreserve(hold, hold.left_ms(time.monotonic()))
                else:
                    flow = node.engine.background_commit(hold, tokens)
                self._run(node, flow, False)
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
            self._closed.wait(release_delay(attempt))
            attempt += 1


def _send(node: _Node, request: Any, asking: bool) -> Any:
    if isinstance(request, RunScript):
        if not asking:
            return node.scripts[request.script](keys=[request.key], args=list(request.arguments))
        source = node.scripts[request.script].script
        words: Tuple[Any, ...] = ("EVAL", source, 1, request.key, *request.arguments)
    else:
        assert isinstance(request, Command)
        words = request.words
        if request.probe:  # a bytes name has no response callback in redis-py: the raw reply
            words = (words[0].encode(), *words[1:])
        if not asking:
            return node.client.execute_command(*words)
    # ASK: ASKING, then the request, on one connection.
    pipe = node.client.pipeline(transaction=False)
    pipe.execute_command("ASKING")
    pipe.execute_command(*words)
    return pipe.execute()[1]


def _node_client(cluster: RedisCluster, name: str) -> "redis.Redis":
    """A client for one node of the cluster with the cluster client's settings (not
    connected: the limiter makes its own pool from it)."""
    host, _, port = name.rpartition(":")
    return redis.Redis(host=host, port=int(port), **cluster.nodes_manager.connection_kwargs)


def _slots_cache(manager: Any) -> Optional[List[Optional[str]]]:
    """The slot table the cluster client already read, if it has one."""
    cache = getattr(manager, "slots_cache", None) or {}
    if len(cache) == 0:
        return None
    owners: List[Optional[str]] = [None] * SLOTS
    for slot, nodes in cache.items():
        if nodes and 0 <= slot < SLOTS:
            owners[slot] = nodes[0].name
    return owners


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
        # The node the lease was taken on (set on entering).
        self._node: Optional[_Node] = None

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
        attempt = Attempt()
        self._node = node = limiter._node_for([self.key])
        flow = node.engine.lease(self.key, self._max, state.ttl_ms, self.id, attempt)
        try:
            grant = limiter._run(node, flow)
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
            node = self._guard_node()
            released = limiter._run(node, node.engine.guard_release(state))
        except d.QagError:
            self._engine().background_failed()
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
            node = self._guard_node()
            if limiter._run(node, node.engine.guard_release(state)) is None:
                # A back-off: released in the background, once Redis answers.
                limiter._release_later(self.key, self.id, time.monotonic(), state.ttl_ms)
        except Exception as error:
            self._engine().background_failed()
            log.warning(
                "qag: the lease %s of %s was not released (its TTL frees it): %s",
                self.id,
                self.key,
                error,
            )

    def _guard_node(self) -> _Node:
        """A lease the policy answered is given back where it was counted; one held in
        Redis on the node owning its key now."""
        if self._node is not None and not self._state.in_redis:
            return self._node
        return self._limiter._node_for([self.key])

    def _engine(self) -> Engine:
        assert self._node is not None
        return self._node.engine

    def _stop_renewals(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _renew(self) -> None:
        state, limiter = self._state, self._limiter
        while not state.lost and not self._stop.wait(state.interval):
            sent_at = time.monotonic()
            try:
                node = limiter._node_for([self.key])
                held = limiter._run(
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


class Reservation(HoldView):
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

    def __init__(self, limiter: Limiter, state: HoldState) -> None:
        self._limiter = limiter
        self._state = state
        self._node: Optional[_Node] = None
        self._lock = threading.Lock()

    def __enter__(self) -> "Reservation":
        limiter, state = self._limiter, self._state
        if state.admission is not None or state.attempt.sent:
            raise RuntimeError("a reservation is entered once")
        state.started = time.monotonic()
        self._node = node = limiter._node_for(state.keys)
        try:
            admission = limiter._run(node, node.engine.reserve(state))
        except BaseException as error:
            # An outage, or interrupted: the ADMIT may have run (an error reply: it did not).
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

    def charge(self, tokens: int) -> int:
        """Pays ``tokens`` now (the hold shrinks by as much): the scopes charged, 0 when
        forwarded. Raises what the call met (the commit still settles the count)."""
        state = self._state
        with self._lock:
            state.open("charge")
            d.record_words(state.keys, tokens, state.window)
            state.charged += tokens
        node = self._guard_node()
        return self._limiter._run(node, node.engine.charge(state, tokens)).scopes

    def commit(self, actual: int) -> int:
        """Charges ``actual``, the request's whole count (partials included: at least
        what was charged), and releases the hold: the scopes charged (0 when
        forwarded). Once. A commit that met an outage is sent again in the background
        (the same id: it counts once)."""
        state = self._state
        with self._lock:
            state.open("commit")
            d.record_words(state.keys, actual, state.window)
            if actual < state.charged:
                raise ValueError(
                    f"actual is the whole count, partials included: at least {state.charged}"
                )
            state.done = True
        limiter, node = self._limiter, self._guard_node()
        try:
            recorded = limiter._run(node, node.engine.commit(state, actual))
        except BaseException as error:
            if state.in_redis and (
                isinstance(error, d.QagUnavailable) or not isinstance(error, d.QagError)
            ):
                limiter._commit_later(state, actual)
            raise
        if state.in_redis and recorded.answered_by != "module":
            limiter._commit_later(state, actual)
        return recorded.scopes

    def __exit__(self, *exc_info: Any) -> None:
        state = self._state
        with self._lock:
            if state.done or state.admission is None:
                return
            state.done = True
        if state.in_redis:  # not committed: what was charged, in the background
            self._limiter._commit_later(state, state.charged)
        elif state.admission.admitted and state.answered_by == "local":
            self._guard_node().engine.release_locally(state)

    def _guard_node(self) -> _Node:
        assert self._node is not None
        return self._node


__all__: List[str] = ["Lease", "Limiter", "Reservation"]

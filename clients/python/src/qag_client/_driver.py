"""The limiters, written once: everything ``Limiter`` and ``AsyncLimiter`` (and their
lease and reservation guards) do around the engine's flows, free of how a round trip is
made.

Each public call is a "driven" generator: it runs the engine's flows on the node owning
its keys, within the deadline, and yields an ``Effect`` wherever it must wait on the
world (a request on a connection, a sleep, a place in the pool, closing connections);
the blocking limiter performs each with a blocking call, the asyncio one with an await,
and sends the outcome back in (or throws the error in, a cancellation included). So
the deadline, the pool's back-pressure, redirections, retries, background releases,
commits, renewals and probes are decided here, in one place; ``_sync`` and ``_async``
only perform effects and start background work (a thread, or a task).
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial
from operator import itemgetter
from typing import (
    Any,
    Callable,
    Generator,
    Generic,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Protocol,
    Sequence,
    Set,
    Tuple,
    TypeVar,
    Union,
)

import redis.exceptions

from . import decisions as d
from ._cluster import (
    MAX_REDIRECTIONS,
    NO_OWNER,
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
from ._engine import (
    Attempt,
    Command,
    ConnectionDropped,
    Demoted,
    Engine,
    Flow,
    HoldState,
    HoldView,
    LeaseState,
    Overtaken,
    Pipeline,
    Request,
    RunScript,
    T,
    TimeSpent,
    release_delay,
    release_gives_up,
    sort_error,
    waiting_of,
)
from ._policy import Probe
from ._script import (
    LEASE_LUA,
    QUOTA_LUA,
    TOKEN_BUCKET_IDS_LUA,
    TOKEN_BUCKET_LUA,
    TOKEN_REFUND_IDS_LUA,
    TOKEN_REFUND_LUA,
    WINDOW_LUA,
)
from .naming import Bucket

log = logging.getLogger("qag_client")

DEFAULT_MAX_CONNECTIONS = 100
# How long a call whose deadline passed while waiting for a connection waits on for the
# verdict of a holder that is past its own deadline.
OVERDUE_GRACE = 0.05
# A prober waiting for its next probe looks at least this often (seconds) whether the
# cluster's table still names its node (closing stops it at once).
PROBER_WAKE = 1.0
# The wait before a request answered TRYAGAIN (a slot in migration) is sent again.
TRY_AGAIN_WAIT = 0.01
# The least a spend call's own id is remembered (its KEEP, seconds).
OWN_ID_KEEP = 10


# What a driven call asks of its I/O layer.


class Send(NamedTuple):
    """One request on ``node`` (``asking``: after ASKING, on one connection), on the
    call's ``trip``: on its way (its connection being made, or it written) by its
    ``queue_by`` (else NotSent: the client's own overload), its connecting, sending and
    reading by its ``answer_by`` (else DeadlinePassed: the server's). The reply, or the
    error the client raised."""

    node: "Node"
    request: Request
    asking: bool
    trip: "Trip"


class Sleep(NamedTuple):
    """A pause; in background work, where the limiter's closing throws Stopped in."""

    seconds: float


class Acquire(NamedTuple):
    """A place in one of the node's pools (``gate``: its own, or its pool for waiting
    calls) for a call ending at ``deadline``, where none is free now: True, or False
    when none came free by then (or a little later, while a holder is past its own
    deadline), or as soon as ``still_wanted`` says False."""

    node: "Node"
    deadline: float
    still_wanted: Callable[[], bool]
    gate: Any


class Dropped(NamedTuple):
    """A connection to the node dropped: the server restarted, most likely, so its other
    pooled connections are dead too (closed by ``until`` where the client library would
    hand them out unchecked); ``demoted``: it answered READONLY, a replica now: the
    node's ``Epoch`` moves on, so every connection made before is made again before it
    is next used (by the call that holds it: none is closed under another call)."""

    node: "Node"
    until: float
    demoted: bool = False


class Disconnect(NamedTuple):
    """The node's pooled connections closed (a probe that ran across ``close()``)."""

    node: "Node"


Effect = Union[Send, Sleep, Acquire, Dropped, Disconnect]
# A call of the limiter: yields effects, receives their outcomes, returns its answer.
Driven = Generator[Effect, Any, T]


class DeadlinePassed(TimeoutError):
    """A round trip that the call's deadline cut short, its request on its way (its
    connection being made, or it written): no answer came from the server (an answer
    already on its way when the deadline passed, read by the client's next turns of its
    event loop, is taken: the delay was the client's)."""


class NotSent(d.QagBusy):
    """The call's deadline passed before its request could be on its way (a connection
    being made for it, or it written): this process was too busy (its event loop, its
    threads, its pool), not the server too slow. It starts no back-off and is never
    answered by the policy."""


class Budget:
    """A request's time with the server, shared by every limiter call it makes (the
    middleware's): each call's answers are due within what is left of it, and what a
    call waited on the server is taken from it. So a slow server costs a request one
    deadline, not one a call."""

    def __init__(self, seconds: float) -> None:
        self.left = seconds


# The running request's budget, if its calls share one (``spending``).
_BUDGET: ContextVar[Optional[Budget]] = ContextVar("qag_budget", default=None)


@contextmanager
def spending(budget: Budget) -> Iterator[None]:
    """Every limiter call made inside (in this thread, or this task) spends ``budget``."""
    token = _BUDGET.set(budget)
    try:
        yield
    finally:
        _BUDGET.reset(token)


class Trip:
    """A call's time, on the layer's clock. Each request must be on its way by
    ``queue_by`` (its connection being made, or it written): until then the call waits
    on this process (a place in the pool, the event loop, a thread), and past it has
    waited too long (NotSent). The first request on its way begins the server's time:
    every answer is due by ``answer_by``, ``window`` seconds later (less where the
    request's budget has less left, never past ``latest``), and ``wait`` more for a call
    the server may hold on purpose (``holding``)."""

    def __init__(
        self,
        queue_by: float,
        window: float,
        latest: Optional[float] = None,
        budget: Optional[Budget] = None,
    ) -> None:
        self.queue_by = queue_by
        self.window = window
        self.latest = latest
        self.budget = budget
        self.begun_at: Optional[float] = None
        self.answer_by: Optional[float] = None
        self.wait = 0.0
        # Whether the request's time left this call less than a deadline.
        self.cut = False

    def holding(self, wait: float) -> None:
        """The server may hold the call up to ``wait`` seconds: its answers are due
        that much later, beyond the request's budget too (a wait is no server's
        slowness)."""
        self.window += wait
        self.wait = wait

    @property
    def due(self) -> float:
        """When the call's present wait ends: its answer, or, none on its way yet, the
        first request's leaving."""
        return self.queue_by if self.answer_by is None else self.answer_by

    def begin(self, now: float) -> None:
        """A request is on its way now: its connection is being made, or it is written
        (NotSent if too late for the first)."""
        if self.answer_by is not None:
            return
        if now >= self.queue_by:
            raise NotSent("the deadline passed before the request was on its way")
        window = self.window
        if self.budget is not None:
            window = min(window, self.budget.left + self.wait)
            self.cut = window < self.window
        if window <= self.wait:  # the request waited its whole deadline on the server already
            raise DeadlinePassed("the request's deadline is spent")
        self.begun_at, self.answer_by = now, now + window
        if self.latest is not None:
            self.answer_by = min(self.answer_by, self.latest)

    def ended(self, now: float) -> None:
        """The call is done: what it waited on the server is taken from the budget (but
        for a wait it asked for: the server held it on purpose)."""
        if self.budget is not None and self.begun_at is not None:
            spent = max(now - self.begun_at - self.wait, 0.0)
            self.budget.left = max(self.budget.left - spent, 0.0)


class RoundTrip:
    """One request, kept by the connection it runs on (the layers' connection classes
    tell it when it is on its way: its connection being made, or it written)."""

    def __init__(self, trip: Trip, on_begun: Optional[Callable[[], None]] = None) -> None:
        self.trip = trip
        self.begun = False
        self._on_begun = on_begun

    def begin(self, now: float) -> None:
        if self.begun:
            return
        self.trip.begin(now)
        self.begun = True
        if self._on_begun is not None:
            self._on_begun()


class Stopped(BaseException):
    """Background work stopped: the limiter closed, or the lease left its block. Not an
    Exception, so no handler of a call's errors takes it for one."""


class Background(Protocol):
    """Background work running (a thread, or a task)."""

    def stop(self, wait: bool) -> None:
        """Stops it (``wait``: and waits for it to end where that can block)."""


class Epoch:
    """How many times a node's address was found serving a demoted primary (READONLY):
    a connection made before the last time reaches the old primary, and is made again,
    by the call that holds it, before it sends (``stamp``, ``stale``)."""

    def __init__(self) -> None:
        self.count = 0


def stamp(connection: Any, epoch: Epoch) -> None:
    """Notes, on a connection just made, the epoch it was made in."""
    connection.qag_epoch = (epoch, epoch.count)


def stale(connection: Any) -> bool:
    """Whether a connection was made before its node was last found demoted."""
    made = getattr(connection, "qag_epoch", None)
    return made is not None and made[1] != made[0].count


class Node:
    """One server: the limiter's own client for it and the gate to that client's pool,
    a second client and gate for calls that wait (``wait=``: the server holds such a
    call, and its connection with it), its scripts, the epoch of its connections, and the
    engine with the server's state (module presence, back-off, local counts)."""

    def __init__(
        self,
        name: str,
        clients: Tuple[Tuple[Any, Any], Tuple[Any, Any]],
        engine: Engine,
        epoch: Epoch,
    ) -> None:
        self.name = name
        (self.client, self.gate), (self.wait_client, self.wait_gate) = clients
        self.engine = engine
        self.epoch = epoch
        self.scripts = {
            "bucket": self.client.register_script(TOKEN_BUCKET_LUA),
            "bucket_ids": self.client.register_script(TOKEN_BUCKET_IDS_LUA),
            "refund": self.client.register_script(TOKEN_REFUND_LUA),
            "refund_ids": self.client.register_script(TOKEN_REFUND_IDS_LUA),
            "lease": self.client.register_script(LEASE_LUA),
            "quota": self.client.register_script(QUOTA_LUA),
            "window": self.client.register_script(WINDOW_LUA),
        }

    def sending(
        self, request: Request, asking: bool
    ) -> Tuple[Callable[[], Any], Callable[[Any], Any]]:
        """How ``request`` is sent here: a call that sends it (its reply, or with an
        asyncio client an awaitable of it; nothing is sent before it is called), and what
        its reply is made into. A request the server may hold waits on a connection of
        its own; after ASK, each command after ASKING (it holds for the next one only)."""
        client = self.wait_client if waiting_of(request) else self.client
        if isinstance(request, Pipeline):  # its commands in one round trip
            pipe = client.pipeline(transaction=False)
            for command in request.commands:
                if asking:
                    pipe.execute_command("ASKING")
                pipe.execute_command(*self.words(command))
            return partial(pipe.execute, raise_on_error=False), partial(pipelined, asking=asking)
        if asking:  # ASK: ASKING, then the request, on one connection
            pipe = client.pipeline(transaction=False)
            pipe.execute_command("ASKING")
            pipe.execute_command(*self.words(request))
            return pipe.execute, itemgetter(1)
        if isinstance(request, RunScript):
            script = self.scripts[request.script]
            return partial(script, keys=list(request.keys), args=list(request.arguments)), _itself
        return partial(client.execute_command, *self.words(request)), _itself

    def words(self, request: Request) -> Tuple[Any, ...]:
        """The request as one command: a script as EVAL of its source, a probe's name
        as bytes (redis-py has no reply callback for it then: the raw reply)."""
        if isinstance(request, RunScript):
            source = self.scripts[request.script].script
            keys = request.keys
            return ("EVAL", source, len(keys), *keys, *request.arguments)
        assert isinstance(request, Command)
        if request.probe:
            return (request.words[0].encode(), *request.words[1:])
        return request.words


def _itself(reply: Any) -> Any:
    return reply


def pipelined(replies: List[Any], asking: bool) -> List[Any]:
    """A pipeline's replies (ASKING's left out), error replies in their place, except
    those that concern the round trip, raised for the call to handle as a single
    command's: READONLY (a demoted primary ran nothing), and a redirection or TRYAGAIN."""
    if asking:
        replies = replies[1::2]
    for reply in replies:
        if isinstance(reply, redis.exceptions.ReadOnlyError) or (
            isinstance(reply, redis.exceptions.ResponseError)
            and (redirection_of(reply) is not None or try_again(reply))
        ):
            raise reply
    return replies


def probe_time(deadline: float, back_off: float) -> float:
    """How long the probe after a back-off may take: no request waits for it, so up
    to the back-off (at most 2 s), and never less than a call's deadline."""
    return max(deadline, min(back_off, 2.0))


def pool_size(client: Any, max_connections: Optional[int]) -> int:
    """The limiter's pool size: as given, else the client's pool's (redis-py 6 and later
    default to 100), else 100 (redis-py 5's default of 2^31 is no bound)."""
    if max_connections is not None:
        return max_connections
    pool = getattr(client, "connection_pool", None)
    size = getattr(pool, "max_connections", None)
    if isinstance(size, int) and 1 <= size < 1 << 31:
        return size
    return DEFAULT_MAX_CONNECTIONS


def check_options(deadline: float, max_connections: int, queue_timeout: float) -> None:
    if not deadline > 0:
        raise ValueError("deadline must be above 0 seconds")
    if not queue_timeout > 0:
        raise ValueError("queue_timeout must be above 0 seconds")
    if isinstance(max_connections, bool) or not (
        isinstance(max_connections, int) and max_connections >= 1
    ):
        raise ValueError("max_connections must be an integer of at least 1")


def pool_settings(
    pool: Any, deadline: float, on_connect: Callable[..., Any], retry_class: Any
) -> Any:
    """The settings of the limiter's own pool, made from the caller's client's: its
    address, credentials, TLS and database, but the deadline as connect and socket
    timeouts, no retries (a retry would outlast the deadline; ``retry_class``: the I/O
    layer's ``Retry``), and ``on_connect`` (which tells the limiter of every new
    connection: a reconnect may reach a server restarted with or without the module) run
    where the client's own hook would be."""
    from redis.backoff import NoBackoff

    settings = dict(pool.connection_kwargs)
    settings.update(
        socket_timeout=deadline,
        socket_connect_timeout=deadline,
        retry=retry_class(NoBackoff(), 0),
        redis_connect_func=on_connect,
    )
    return settings


def slots_known(cluster: Any) -> Tuple[List[str], Optional[List[Optional[str]]]]:
    """A cluster client's start-up and known nodes, and the slot table it already read
    (if it has one)."""
    manager = cluster.nodes_manager
    startup = list(manager.startup_nodes) + list(getattr(manager, "nodes_cache", None) or {})
    cache = getattr(manager, "slots_cache", None) or {}
    if len(cache) == 0:
        return startup, None
    owners: List[Optional[str]] = [None] * SLOTS
    for slot, nodes in cache.items():
        if nodes and 0 <= slot < SLOTS:
            owners[slot] = nodes[0].name
    return startup, owners


LeaseT = TypeVar("LeaseT")
ReservationT = TypeVar("ReservationT")
Scopes = Sequence[Union[d.Scope, Tuple[str, int, int]]]


class Driver(Generic[LeaseT, ReservationT]):
    """What both limiters are, but for the I/O: the options, the nodes, and every call
    as a driven generator. A limiter names its public calls after these (``take`` is
    ``_take`` performed), and gives the few things only it can: its clock, its own
    clients and gates, background work, and its guards."""

    # What the limiter's I/O layer gives: the cluster client class it takes, how it runs
    # background work, and its guards.
    _cluster_class: Any
    _worker: Callable[[Any, Driven[None], str], Background]
    _lease_guard: Callable[[Any, str, int, int, str, Optional[float]], LeaseT]
    _reservation_guard: Callable[[Any, HoldState], ReservationT]

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
        queue_timeout: Optional[float] = None,
        max_waiting: int = 100,
    ) -> None:
        max_connections = pool_size(client, max_connections)
        queue_timeout = deadline if queue_timeout is None else queue_timeout
        check_options(deadline, max_connections, queue_timeout)
        if isinstance(max_waiting, bool) or not (isinstance(max_waiting, int) and max_waiting >= 1):
            raise ValueError("max_waiting must be an integer of at least 1")
        check_cross_slot(cross_slot)
        options = (backend, on_unavailable, back_off, local_share, recheck_missing_module)
        Engine(*options)  # the options checked now, not at the first call
        self._deadline = deadline
        self._queue_timeout = queue_timeout
        self._back_off = back_off
        self._max_connections = max_connections
        self._cross_slot = cross_slot
        self._closed = False
        self._background: Set[Background] = set()
        cluster = client if isinstance(client, self._cluster_class) else None

        def make(name: str) -> Node:
            engine = Engine(*options)
            base = client
            if cluster is not None:
                # NO_OWNER sends no call (its probe asks a node of the table): its
                # clients are made as a start-up node's.
                address = self._startup[0] if name == NO_OWNER else name
                base = self._node_client(cluster, address)
            epoch = Epoch()

            def connected(connection: Any) -> None:
                stamp(connection, epoch)
                engine.forget_presence()

            own, gate = self._own_client(base, deadline, max_connections, connected)
            # Waiting calls' connections read for their wait too (each call bounds its own).
            waiting = self._own_client(base, deadline + d.MAX_WAIT, max_waiting, connected)
            engine.on_outage = gate.interrupt
            node = Node(name, ((own, gate), waiting), engine, epoch)

            def start_prober() -> None:
                if not self._closed:  # a closed limiter's calls keep to the policy
                    self._spawn(self._prober(node), f"qag-prober {name}")

            engine.start_prober = start_prober
            return node

        self._shards: Shards[Node] = Shards(make, cluster is not None)
        self._startup: List[str] = []
        if cluster is not None:
            self._startup, owners = slots_known(cluster)
            if owners is not None:
                self._shards.learned(owners, time.monotonic())

    # What only the I/O layer can give.

    def _now(self) -> float:
        """The clock deadlines are on (monotonic seconds)."""
        raise NotImplementedError

    def _own_client(
        self,
        client: Any,
        deadline: float,
        max_connections: int,
        connected: Callable[[Any], None],
    ) -> Tuple[Any, Any]:
        """The client the limiter talks through to one server, made from ``client``'s
        settings (``pool_settings``), with a pool of ``max_connections`` of its own, and
        the gate to that pool; ``connected`` is told of every connection it makes, once
        made. The caller's client is left as it is."""
        raise NotImplementedError

    def _node_client(self, cluster: Any, name: str) -> Any:
        """A client for one node of the cluster with the cluster client's settings (not
        connected: the limiter makes its own pool from it)."""
        raise NotImplementedError

    def _spawn(self, work: Driven[None], name: str) -> Background:
        """Runs ``work`` in the background (``_worker``: a thread, or a task of the
        running loop)."""
        return self._worker(self, work, name)

    # What the limiter reports.

    @property
    def counts(self) -> d.Counts:
        """How calls were answered so far: module, script, local, forwarded, errors."""
        return self._shards.counts()

    @property
    def backing_off(self) -> bool:
        """True while calls keep to the policy (on a cluster: on some node): a back-off
        runs, until its prober finds Redis answering."""
        return self._shards.backing_off()

    @property
    def counting_locally(self) -> bool:
        """True while calls are counted in this process ("local", a back-off runs)."""
        return self._shards.counting_locally()

    @property
    def local_decisions(self) -> int:
        """Calls answered locally since the limiter was made."""
        return self.counts.local

    def _stop_background(self) -> None:
        """Closing: background work stops, and none starts again."""
        self._closed = True
        for work in list(self._background):
            work.stop(False)

    # The calls.

    def _take(
        self,
        bucket: Bucket,
        cost: int = 1,
        *,
        request_id: Optional[str] = None,
        wait: Optional[float] = None,
    ) -> Driven[d.Decision]:
        """Takes ``cost`` tokens from the bucket. ``request_id``: the caller's id for the
        call (1 to 128 bytes; e.g. the gateway's request id, so that its retries of one
        request count once), none by default. A call whose connection dropped is sent
        once more either way: with an id it counts once; without, if the first ran, it
        charges again (stricter by one, never more granted). ``wait``: seconds (0 to
        60) the call may wait for its tokens instead of a refusal (module 0.5.0: held
        by the server and answered when they exist, in arrival order across every
        gateway instance, on a connection of its own; ``waited`` says how long; refused
        at once when they would come later; without the module, answered at once); the
        call's deadline is its wait and the usual deadline."""
        call = d.BucketCall.on(bucket, cost)
        rid = d.caller_id(request_id)
        d.wait_words(wait)

        def flow(node: Node) -> Flow[d.Decision]:
            return node.engine.take(call, rid, wait)

        return (yield from self._call([call.key], flow, wait))

    def _take_pair(
        self,
        client: Bucket,
        key: Bucket,
        cost: int = 1,
        *,
        request_id: Optional[str] = None,
        wait: Optional[float] = None,
    ) -> Driven[d.PairDecision]:
        """Both buckets of a request: the client's, then the key's if the client's
        allowed (QAG.TAKE2 with the module: one step). On a cluster, buckets in two
        slots are as ``cross_slot`` says (each call with the same id). ``request_id``
        as for ``take``; ``wait``: both buckets wait for the later's tokens, charged
        together or not at all."""
        first, second = d.BucketCall.on(client, cost), d.BucketCall.on(key, cost)
        rid = d.caller_id(request_id)
        d.wait_words(wait)
        if self._shards.topology is not None and slot_of(first.key) != slot_of(second.key):
            if self._cross_slot == "raise":
                raise cross_slot_pair(first.key, second.key)
            client_decision = yield from self._take(client, cost, request_id=rid, wait=wait)
            if not client_decision.allowed:
                return d.PairDecision(client_decision, None)
            key_decision = yield from self._take(key, cost, request_id=rid, wait=wait)
            if not key_decision.allowed and client_decision.answered_by in ("module", "script"):
                yield from self._give_back(client, cost, rid)
            return d.PairDecision(client_decision, key_decision)
        keys = [first.key, second.key]

        def flow(node: Node) -> Flow[d.PairDecision]:
            return node.engine.take_pair(first, second, rid, wait)

        return (yield from self._call(keys, flow, wait))

    def _take_with_quota(
        self,
        client: Optional[Bucket],
        key: Optional[Bucket],
        quota_key: str,
        quota: d.Quota,
        cost: int = 1,
        *,
        request_id: Optional[str] = None,
        wait: Optional[float] = None,
    ) -> Driven[d.TakenWithQuota]:
        """A request's buckets (the client's and the key's, either or both) and its
        quota's check (QAG.QUOTA, which counts nothing), in one round trip where they
        can share one: the module, and every key in one cluster slot (else the buckets,
        then the check). The quota is read even when a bucket refused, so a refusal can
        show what is left of it; a refused call is never counted in it. An outage of the
        round trip is answered by the policy for both; a check that fails on its own is
        ``quota_error``, the buckets' decisions standing. ``request_id`` and ``wait``
        (the buckets', the quota never waits) as for ``take``."""
        d.quota_check_words(quota_key, quota)
        d.wait_words(wait)
        first = None if client is None else d.BucketCall.on(client, cost)
        second = None if key is None else d.BucketCall.on(key, cost)
        rid = d.caller_id(request_id)
        keys = [call.key for call in (first, second) if call is not None]
        if not keys:
            return d.TakenWithQuota(None, None, (yield from self._quota_check(quota_key, quota)))
        keys.append(quota_key)
        if self._shards.topology is not None and len({slot_of(k) for k in keys}) > 1:
            client_decision = key_decision = None
            if client is not None and key is not None:
                pair = yield from self._take_pair(client, key, cost, request_id=rid, wait=wait)
                client_decision, key_decision = pair.client, pair.key
            elif client is not None:
                client_decision = yield from self._take(client, cost, request_id=rid, wait=wait)
            elif key is not None:
                key_decision = yield from self._take(key, cost, request_id=rid, wait=wait)
            try:
                checked = yield from self._quota_check(quota_key, quota)
            except d.QagError as error:
                return d.TakenWithQuota(client_decision, key_decision, None, error)
            return d.TakenWithQuota(client_decision, key_decision, checked)
        return (
            yield from self._call(
                keys,
                lambda node: node.engine.take_with_quota(
                    first, second, quota_key, quota, rid, wait
                ),
                wait,
            )
        )

    def _give_back(self, bucket: Bucket, cost: int, request_id: Optional[str]) -> Driven[None]:
        """The client bucket's token of a pair the key bucket refused (two calls)."""
        try:
            yield from self._refund(bucket, cost, request_id=request_id)
        except d.QagError as error:  # counted in errors: the token stays spent
            log.warning("qag: the token of %s was not given back: %s", bucket.key, error)

    def _peek(self, bucket: Bucket, cost: int = 1) -> Driven[d.Decision]:
        """What ``take`` would answer, nothing written."""
        call = d.BucketCall.on(bucket, cost)
        return (yield from self._call([call.key], lambda node: node.engine.peek(call)))

    def _refund(
        self, bucket: Bucket, n: int, *, request_id: Optional[str] = None
    ) -> Driven[d.Refunded]:
        """Gives ``n`` tokens back (never above the count; a missing bucket stays
        missing): QAG.REFUND, or lua/token_refund.lua without the module. For a request
        one limit admitted and a later one refused. ``request_id``: the caller's id (it
        makes the refund replayable: without one, a refund whose connection dropped is
        not sent again, since twice would give back twice)."""
        call = d.BucketCall.on(bucket, 1)
        call.refund_arguments(n)
        rid = d.caller_id(request_id)
        return (yield from self._call([call.key], lambda node: node.engine.refund(call, n, rid)))

    def lease(
        self,
        key: str,
        max_slots: int,
        ttl_ms: int,
        lease_id: str,
        *,
        wait: Optional[float] = None,
    ) -> LeaseT:
        """``with limiter.lease(...) as lease:`` (``async with`` for the asyncio
        limiter) holds a slot for the block (see Lease). ``wait``: seconds (0 to 60) to
        wait for a slot when every one is held (given the first freed, in arrival order;
        ``lease.waited`` says how long), as ``take``'s."""
        d.check_lease(key, max_slots, ttl_ms, lease_id)
        d.wait_words(wait)
        return self._lease_guard(self, key, max_slots, ttl_ms, lease_id, wait)

    def _renew(self, key: str, lease_id: str, ttl_ms: int) -> Driven[bool]:
        d.check_id(lease_id)
        d.check_ttl(ttl_ms)
        return (yield from self._call([key], lambda node: node.engine.renew(key, lease_id, ttl_ms)))

    def _release(self, key: str, lease_id: str) -> Driven[bool]:
        d.check_id(lease_id)
        return (yield from self._call([key], lambda node: node.engine.release(key, lease_id)))

    def _leases(self, key: str) -> Driven[int]:
        return (yield from self._call([key], lambda node: node.engine.leases(key)))

    def _quota_check(self, key: str, quota: d.Quota) -> Driven[d.QuotaDecision]:
        return (yield from self._call([key], lambda node: node.engine.quota_check(key, quota)))

    def _quota_add(
        self,
        key: str,
        quota: d.Quota,
        calls: int = 0,
        rows: int = 0,
        *,
        request_id: Optional[str] = None,
    ) -> Driven[d.QuotaUsage]:
        d.quota_count_words("QAG.QUOTA.ADD", key, quota, calls, rows)
        rid, keep = d.request_id_of(request_id), self._own_keep(request_id)
        return (
            yield from self._call(
                [key],
                lambda node: node.engine.quota_count(
                    "QAG.QUOTA.ADD", key, quota, calls, rows, rid, keep
                ),
            )
        )

    def _quota_seed(
        self, key: str, quota: d.Quota, calls: int = 0, rows: int = 0
    ) -> Driven[d.QuotaUsage]:
        return (
            yield from self._call(
                [key],
                lambda node: node.engine.quota_count("QAG.QUOTA.SEED", key, quota, calls, rows),
            )
        )

    def _admit(
        self, scopes: Scopes, window: Optional[int] = None, *, request_id: Optional[str] = None
    ) -> Driven[d.Admission]:
        """Admits a request on every scope of the chain (QAG.ADMIT). ``request_id`` as
        for ``take``."""
        d.admit_words(scopes, window)  # checked before the keys are read
        rid = d.caller_id(request_id)
        keys = admit_keys(scopes)
        return (yield from self._call(keys, lambda node: node.engine.admit(scopes, window, rid)))

    def _record(
        self,
        keys: Sequence[str],
        tokens: int,
        window: Optional[int] = None,
        *,
        request_id: Optional[str] = None,
    ) -> Driven[int]:
        d.record_words(keys, tokens, window)
        rid, keep = d.request_id_of(request_id), self._own_keep(request_id)
        return (
            yield from self._call(
                list(keys), lambda node: node.engine.record(keys, tokens, window, rid, keep)
            )
        )

    def _own_keep(self, request_id: Optional[str]) -> Optional[int]:
        """The KEEP of the limiter's own id (None: the caller's, remembered ID-SECONDS):
        it is replayed within the call only, so a few seconds more than the call can
        take."""
        if request_id is not None:
            return None
        return min(max(OWN_ID_KEEP, math.ceil(self._queue_timeout + self._deadline) + 1), 86_400)

    def reserve(
        self,
        scopes: Scopes,
        tokens: int,
        *,
        window: Optional[int] = None,
        hold_ms: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> ReservationT:
        """``with limiter.reserve(scopes, tokens) as hold:`` (``async with`` for the
        asyncio limiter) admits the request holding ``tokens`` on every scope's tpm
        until ``hold.commit(actual)`` (see ``Reservation``)."""
        d.reserve_words(scopes, window, tokens, hold_ms)
        rid = d.request_id_of(request_id)
        chain = [scope if isinstance(scope, d.Scope) else d.Scope(*scope) for scope in scopes]
        return self._reservation_guard(self, HoldState(chain, window, tokens, hold_ms, rid, 0.0))

    # How a call runs.

    def _trip(self, limit: Optional[float], routed: bool) -> Trip:
        """A call's time, from now: waiting on this process up to the queue time, then
        the deadline with the server, or what is left of the running request's budget
        (``limit``: that many seconds for both). Background work (not routed) spends no
        request's budget."""
        now = self._now()
        if limit is not None:
            return Trip(now + limit, limit, now + limit)
        budget = _BUDGET.get() if routed else None
        return Trip(now + self._queue_timeout, self._deadline, budget=budget)

    def _call(
        self, keys: Sequence[str], flow: Callable[[Node], Flow[T]], wait: Optional[float] = None
    ) -> Driven[T]:
        """``flow`` on the node owning ``keys``, within the deadline (and ``wait``, for a
        call the server may hold)."""
        node, trip = yield from self._node_for(keys)
        return (yield from self._run(node, flow(node), trip, wait=wait))

    def _node_for(self, keys: Sequence[str], routed: bool = True) -> Driven[Tuple[Node, Trip]]:
        """The node owning the keys' slot (QagCrossSlot across slots), and the call's
        time, begun now: where the slot table names no owner, it is read first, on that
        time (but during a back-off of the calls it did not route: one deadline a
        back-off), and it is refreshed in the background when due. A call whose slot
        still has no owner goes to ``NO_OWNER``, whose policy answers it (background
        work: QagUnavailable, it tries again)."""
        shards = self._shards
        trip = self._trip(None, routed)
        name = shards.owner(keys)
        if name is None and not (routed and shards.node(NO_OWNER).engine.backing_off):
            yield from self._refresh(trip)
            name = shards.owner(keys)
        if shards.topology is not None and shards.start_refresh(time.monotonic()):
            self._spawn(self._refresh(), "qag-slots")
        if name is None:
            if not routed:
                raise d.QagUnavailable("no node of the cluster serves the slot of " + keys[0])
            name = NO_OWNER
        return shards.node(name), trip

    def _refresh(self, trip: Optional[Trip] = None) -> Driven[None]:
        """Reads the slot table (``CLUSTER SLOTS``) from the first node that answers:
        on a call's time if given (what it waits counts as the call's), else each node
        asked within the deadline, in the background."""
        shards = self._shards
        for name in shards.seeds(self._startup):
            now = self._now()
            if trip is not None and now >= trip.due:
                break
            slots = Command(("CLUSTER", "SLOTS"), probe=True)
            asked = trip or Trip(now + self._deadline, self._deadline)
            try:
                reply = yield Send(shards.node(name), slots, False, asked)
                owners = parse_slots(reply, name)
            except Exception:  # that node cannot tell: the next one
                continue
            shards.learned(owners, time.monotonic())
            return
        if trip is None:
            shards.learned(None, time.monotonic())

    def _run(
        self,
        node: Node,
        flow: Flow[T],
        trip: Optional[Trip] = None,
        *,
        routed: bool = True,
        limit: Optional[float] = None,
        wait: Optional[float] = None,
    ) -> Driven[T]:
        """Runs a flow on the call's ``trip`` (a new one if not given; ``limit``: within
        that many seconds from now instead): its requests on their way within the queue
        time (waiting for a place in the pool, for the event loop or a thread: QagBusy
        past it, the client's own overload: no back-off, no policy), their answers
        within the deadline from the first on its way (its connecting, or its writing;
        QagUnavailable past it with no answer on its way: the server's, an outage). A
        routed call still waiting for a connection when a back-off starts keeps to the
        policy (background work is not routed: it waits on). A call the server may hold
        (``wait``) takes a place in the node's pool for waiting calls, and its answers
        are due that much later."""
        if trip is None:
            trip = self._trip(limit, routed)
        queue_by = trip.queue_by
        wait = wait or 0.0
        gate = node.wait_gate if wait else node.gate
        trip.holding(wait)
        gated = False
        try:
            request = next(flow)
            if routed and node.name == NO_OWNER and self._shards.topology is not None:
                # Nothing to send it to: an outage, its policy answers (its back-off starts).
                flow.throw(d.QagUnavailable("no node of the cluster serves the call's slot"))
                raise AssertionError("a flow went on after an outage")
            engine, generation = node.engine, node.engine.generation if routed else -1
            gated = gate.acquire_now(queue_by)
            if not gated:
                still_wanted = lambda: not engine.overtaken(generation)  # noqa: E731
                gated = yield Acquire(node, queue_by, still_wanted, gate)
            if gated and engine.overtaken(generation):
                gate.release(queue_by)
                gated = False
            if not gated:
                flow.throw(Overtaken() if engine.overtaken(generation) else self._busy())
                raise AssertionError("a flow went on without a connection")
            while True:
                if self._now() >= trip.due:
                    late = self._not_sent() if trip.answer_by is None else self._late(trip)
                    request = flow.throw(late)
                    continue
                try:
                    reply = yield from self._execute(node, request, trip)
                except Exception as error:  # every error is sorted, then thrown in
                    sorted_error = sort_error(error)
                    if isinstance(sorted_error, ConnectionDropped):
                        yield Dropped(node, trip.due, isinstance(sorted_error, Demoted))
                    if isinstance(sorted_error, d.QagUnavailable):
                        if isinstance(error, DeadlinePassed) or self._now() >= trip.due:
                            sorted_error = self._late(trip)
                        if not isinstance(sorted_error, TimeSpent):
                            self._shards.failed()
                    request = flow.throw(sorted_error)
                else:
                    request = flow.send(reply)
        except StopIteration as stop:
            answer: T = stop.value
            return answer
        finally:
            trip.ended(self._now())
            if gated:
                gate.release(queue_by)
            flow.close()  # a cancelled call frees its probe slot

    def _execute(self, node: Node, request: Request, trip: Trip) -> Driven[Any]:
        """One request on the node; on a cluster, a MOVED or ASK reply is followed (a
        MOVED one also patches the slot table) and TRYAGAIN tried again, within the
        call's time."""
        target, asking, redirections = node, False, 0
        while True:
            try:
                return (yield Send(target, request, asking, trip))
            except redis.exceptions.ResponseError as error:
                if self._shards.topology is None:
                    raise
                if try_again(error):
                    if self._now() + TRY_AGAIN_WAIT >= trip.due:
                        raise
                    yield Sleep(TRY_AGAIN_WAIT)
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

    def _not_sent(self) -> NotSent:
        return NotSent(
            f"the call could not be sent within the queue time of {self._queue_timeout} s: "
            "this process is overloaded (its event loop, threads or pool)"
        )

    def _late(self, trip: Trip) -> d.QagUnavailable:
        if trip.cut:
            return TimeSpent("no answer within what was left of the request's time")
        return d.QagUnavailable(f"no answer within the deadline of {self._deadline} s")

    def _busy(self) -> d.QagBusy:
        return d.QagBusy(
            f"no free connection in the limiter's pool of {self._max_connections} "
            f"within the queue time of {self._queue_timeout} s"
        )

    # Background work.

    def _prober(self, node: Node) -> Driven[None]:
        """The back-off's prober (``Engine.probe`` when each probe is due, each in its
        own time), until a probe answers, the limiter closes, or the cluster's table no
        longer names the node; one that ran across closing closes what it connected."""
        engine = node.engine
        ended = False
        server = node
        try:
            while not self._closed:
                if node.name != NO_OWNER and not self._shards.names(node.name):
                    # A node the cluster's table no longer names (failed over, removed):
                    # never probed again, its back-off forgotten with it (else the limiter
                    # would say it backs off for as long as the node stays down).
                    engine.forget_back_off()
                    ended = True
                    return
                step = engine.prober_step()
                if step is Probe.END:
                    ended = True
                    return
                if step is not Probe.NOW:
                    yield Sleep(min(step, PROBER_WAKE))
                    continue
                if node.name == NO_OWNER and self._shards.topology is not None:
                    # The calls no node serves are probed on a node of the table, or a
                    # start-up one.
                    server = self._shards.node(self._shards.seeds(self._startup)[0])
                limit = probe_time(self._deadline, self._back_off)
                try:
                    ended = yield from self._run(server, engine.probe(), routed=False, limit=limit)
                except d.QagError:  # the probe's outcome is the engine's to keep
                    pass
                if ended:
                    return
        finally:
            if not ended:
                engine.prober_stopped()
        yield Disconnect(server)

    def _release_later(self, key: str, lease_id: str, started: float, ttl_ms: int) -> None:
        """An acquire may have taken the slot and did not return it: released in the
        background, retried until it answers 1 or the lease's TTL has passed."""
        work = self._release_until_done(key, lease_id, started, ttl_ms)
        self._spawn(work, f"qag-release {lease_id}")

    def _release_until_done(
        self, key: str, lease_id: str, started: float, ttl_ms: int
    ) -> Driven[None]:
        attempt = 0
        while not self._closed:
            node: Optional[Node] = None
            try:
                node, at = yield from self._node_for([key], routed=False)
                flow = node.engine.background_release(key, lease_id)
                if (yield from self._run(node, flow, at, routed=False)):
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
            yield Sleep(release_delay(attempt))
            attempt += 1

    def _commit_later(self, hold: HoldState, tokens: int, release: bool = False) -> None:
        """A reservation left without its commit: committed in the background with
        ``tokens`` under its id (``release``: a reserve that may have held tokens and
        returned no guard holding them, released after its ADMIT is replayed), untouched
        by the caller's cancellation, each try within the deadline, retried until Redis
        answers or the hold has stopped counting by itself."""
        self._spawn(self._commit_until_done(hold, tokens, release), f"qag-commit {hold.id}")

    def _commit_until_done(self, hold: HoldState, tokens: int, release: bool) -> Driven[None]:
        attempt = 0
        while not self._closed:
            node: Optional[Node] = None
            try:
                node, at = yield from self._node_for(hold.keys, routed=False)
                flow: Flow[int]
                if release:
                    flow = node.engine.background_unreserve(hold, hold.left_ms(time.monotonic()))
                else:
                    flow = node.engine.background_commit(hold, tokens)
                yield from self._run(node, flow, at, routed=False)
                return
            except (d.QagUnavailable, d.QagBusy):
                if node is not None:
                    node.engine.background_failed()
            except d.QagModuleRequired:  # the "module" backend, and Redis restarted without it
                return
            except d.QagError as error:  # no point in trying again
                if node is not None:
                    node.engine.background_failed()
                log.warning("qag: the reservation %s was not committed: %s", hold.id, error)
                return
            if hold.gives_up(time.monotonic()):
                return
            yield Sleep(release_delay(attempt))
            attempt += 1


def _interrupted(error: BaseException) -> bool:
    """An outage, or the call interrupted (cancelled, KeyboardInterrupt): what it sent
    may have run. An error reply says it did not."""
    return isinstance(error, d.QagUnavailable) or not isinstance(error, d.QagError)


class LeaseGuard:
    """What a lease guard (``Lease``, ``AsyncLease``) does, driven: taking the slot,
    renewing it in the background while held, releasing it."""

    def __init__(
        self,
        limiter: Driver[Any, Any],
        key: str,
        max_slots: int,
        ttl_ms: int,
        lease_id: str,
        wait: Optional[float] = None,
    ) -> None:
        self.key = key
        self.id = lease_id
        self._limiter = limiter
        self._max = max_slots
        self._wait = wait
        # Seconds the server held the LEASE for a slot (``wait=``).
        self.waited = 0.0
        self._state = LeaseState(key, lease_id, ttl_ms, time.monotonic())
        self._renewals: Optional[Background] = None
        # The node the lease was taken on (set on entering).
        self._node: Optional[Node] = None
        self._live = 0

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

    @property
    def live(self) -> int:
        """The key's live leases when this one was taken, this one included (0 for a
        slot the "forward" policy answered: nothing was counted)."""
        return self._live

    def _enter(self) -> Driven[None]:
        limiter, state = self._limiter, self._state
        state.confirmed_at = started = time.monotonic()
        attempt = Attempt()
        node, at = yield from limiter._node_for([self.key])
        self._node = node
        flow = node.engine.lease(self.key, self._max, state.ttl_ms, self.id, attempt, self._wait)
        try:
            grant = yield from limiter._run(node, flow, at, wait=self._wait)
        except BaseException as error:
            if attempt.sent and _interrupted(error):
                limiter._release_later(self.key, self.id, started, state.ttl_ms)
            raise
        if attempt.sent and grant.answered_by not in ("module", "script"):
            # The LEASE met an outage and the policy answered: it may have run.
            limiter._release_later(self.key, self.id, started, state.ttl_ms)
        self.waited = grant.waited
        if not grant.acquired:
            raise d.QagRefused(grant.live, grant.retry_after, grant.answered_by, grant.waited)
        state.answered_by = grant.answered_by
        self._live = grant.live
        if state.in_redis:
            self._renewals = limiter._spawn(self._renewing(), f"qag-lease {self.id}")

    def _release(self) -> Driven[bool]:
        released = yield from self._give_back()
        if released is None:
            raise d.QagUnavailable("backing off: the lease is released in the background")
        return released

    def _abandon(self) -> None:
        """Left without its exit (the request interrupted before it could release the
        slot): its renewals stop and the slot is released in the background."""
        self._stop_renewals()
        state = self._state
        if state.done:
            return
        state.done = True
        if state.in_redis:
            self._limiter._release_later(self.key, self.id, time.monotonic(), state.ttl_ms)

    def _exit(self) -> Driven[None]:
        if self._state.done:
            self._stop_renewals()
            return
        try:
            yield from self._give_back()
        except d.QagError as error:
            log.warning(
                "qag: the lease %s of %s was not released now (it is in the background): %s",
                self.id,
                self.key,
                error,
            )

    def _give_back(self) -> Driven[Optional[bool]]:
        """Releases the slot now, on a time of its own (what is left of a request's
        deadline may be nothing): whether a live lease was released; None during a
        back-off. A slot not released now (a back-off, the release failed: its error
        raised, or interrupted) is released in the background, tried again until Redis
        answers or the lease's TTL has passed."""
        self._stop_renewals()
        state, limiter = self._state, self._limiter
        state.done = True
        try:
            node, at = yield from self._guard_node()
            released = yield from limiter._run(node, node.engine.guard_release(state), at)
        except BaseException as error:
            if isinstance(error, d.QagError):
                self._engine().background_failed()
            if state.in_redis:
                limiter._release_later(self.key, self.id, time.monotonic(), state.ttl_ms)
            raise
        if released is None:
            limiter._release_later(self.key, self.id, time.monotonic(), state.ttl_ms)
        return released

    def _guard_node(self) -> Driven[Tuple[Node, Trip]]:
        """A lease the policy answered is given back where it was counted; one held in
        Redis on the node owning its key now. Either on a time of its own, as
        background work's (spending no request's budget)."""
        if self._node is not None and not self._state.in_redis:
            return self._node, self._limiter._trip(None, False)
        return (yield from self._limiter._node_for([self.key], routed=False))

    def _engine(self) -> Engine:
        assert self._node is not None
        return self._node.engine

    def _stop_renewals(self) -> None:
        # A renewal in flight may still land; after the release it finds nothing.
        if self._renewals is not None:
            self._renewals.stop(True)

    def _renewing(self) -> Driven[None]:
        state, limiter = self._state, self._limiter
        while not (state.lost or limiter._closed):
            yield Sleep(state.interval)
            sent_at = time.monotonic()
            try:
                node, at = yield from limiter._node_for([self.key], routed=False)
                renewal = node.engine.renewal(self.key, self.id, state.ttl_ms)
                held = yield from limiter._run(node, renewal, at, routed=False)
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


class ReservationGuard(HoldView):
    """What a reservation guard (``Reservation``, ``AsyncReservation``) does, driven:
    the ADMIT ... RESERVE, its charges and its commit, and the commit in the background
    of one left without."""

    def __init__(self, limiter: Driver[Any, Any], state: HoldState) -> None:
        self._limiter = limiter
        self._state = state
        self._node: Optional[Node] = None
        # A blocking reservation may be charged from several threads.
        self._lock = threading.Lock()

    def _enter(self) -> Driven[None]:
        limiter, state = self._limiter, self._state
        if state.admission is not None or state.attempt.sent:
            raise RuntimeError("a reservation is entered once")
        state.started = time.monotonic()
        node, at = yield from limiter._node_for(state.keys)
        self._node = node
        try:
            admission = yield from limiter._run(node, node.engine.reserve(state), at)
        except BaseException as error:
            if state.attempt.sent and _interrupted(error):
                limiter._commit_later(state, 0, release=True)
            raise
        if state.attempt.sent and admission.answered_by not in ("module", "script"):
            # The ADMIT met an outage and the policy answered: it may have run.
            limiter._commit_later(state, 0, release=True)
        state.admission = admission

    def _charge(self, tokens: int) -> Driven[int]:
        state = self._state
        with self._lock:
            state.open("charge")
            d.record_words(state.keys, tokens, state.window)
            state.charged += tokens
        node = self._guard_node()
        return (yield from self._limiter._run(node, node.engine.charge(state, tokens))).scopes

    def _commit(self, actual: int) -> Driven[int]:
        state = self._state
        with self._lock:
            state.open("commit")
            d.record_words(state.keys, actual, state.window)
            if actual < state.charged:
                raise ValueError(
                    f"actual is the whole count, partials included: at least {state.charged}"
                )
            state.done = True
        return (yield from self._send_commit(actual))

    def _send_commit(self, actual: int) -> Driven[int]:
        state = self._state
        limiter, node = self._limiter, self._guard_node()
        try:
            recorded = yield from limiter._run(node, node.engine.commit(state, actual))
        except BaseException as error:
            if state.in_redis and _interrupted(error):
                limiter._commit_later(state, actual)
            raise
        if state.in_redis and recorded.answered_by not in ("module", "script"):
            limiter._commit_later(state, actual)
        return recorded.scopes

    def _release(self) -> Driven[None]:
        """Commits what was charged and releases the hold now, if it is still open."""
        state = self._state
        with self._lock:
            if state.done or state.admission is None or not state.admission.admitted:
                return
            state.done = True
        yield from self._send_commit(state.charged)

    def _exit(self) -> None:
        state = self._state
        with self._lock:
            if state.done or state.admission is None:
                return
            state.done = True
        if state.in_redis:  # not committed: what was charged, in the background
            self._limiter._commit_later(state, state.charged)
        elif state.admission.admitted and state.answered_by == "local":
            self._guard_node().engine.release_locally(state)

    def _guard_node(self) -> Node:
        assert self._node is not None
        return self._node


def named_after(call: Any, flow: Callable[..., Any]) -> None:
    """Gives a limiter's public call (``call``, which performs the Driver method
    ``flow``, named as it with a leading underscore) the method's public name,
    docstring and parameters."""
    call.__name__ = call.__qualname__ = flow.__name__.lstrip("_")
    call.__doc__ = flow.__doc__
    call.__signature__ = inspect.signature(flow).replace(return_annotation=inspect.Signature.empty)

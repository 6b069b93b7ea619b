"""What both limiters decide, free of I/O: which path a call takes (the module's command,
or the family's script on the same keys),
what to do with each reply or error, and what answers when Redis fails (the policy,
through ``_policy.Outage``: one place for every family).

A call is a generator (a "flow") that yields requests (a command, or the script on a
key) and receives their replies, or has the error thrown in, already sorted into this
package's exceptions. The driver (``_driver``) runs flows on a node within a call's
deadline, for both limiters; neither decides anything itself. Clocks are arguments.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import (
    Any,
    Callable,
    Generator,
    Generic,
    List,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

from . import decisions as d
from ._policy import POLICIES, Outage, Probe, Route, Tally
from .decisions import (
    Admission,
    BucketCall,
    Decision,
    LeaseGrant,
    PairDecision,
    Quota,
    QagBusy,
    QagError,
    QagModuleRequired,
    QagPermissionError,
    QagServerError,
    QagUnavailable,
    QuotaDecision,
    QuotaUsage,
    Refunded,
    Scope,
    TakenWithQuota,
)
from .local import LocalBuckets, LocalState, period, share_of

log = logging.getLogger("qag_client")

BACKENDS = ("auto", "module", "script")
DEFAULT_WINDOW = 60


class UnknownCommand(QagError):
    """The server does not have the command: the module is missing there."""


class ConnectionDropped(QagUnavailable):
    """The connection failed otherwise than by a timeout (reset, closed, broken pipe,
    refused): whether a command sent on it ran is unknown, and no time has run out. A
    command with an id is sent once more; any other fails as an outage."""


class Demoted(ConnectionDropped):
    """The server answered READONLY: it is a replica now (a failover demoted the primary
    this connection reached), and the command did not run. Any command is sent once
    more, on a fresh connection (which may reach the new primary)."""


@dataclass(frozen=True)
class Command:
    words: Tuple[Any, ...]
    # Asked of any node, unparsed by the client library (COMMAND INFO's nil entry
    # would break redis-py's parser).
    probe: bool = False
    # Seconds the server may hold it (its WAIT): sent on a connection of its own, its
    # deadline that much longer.
    wait: float = 0.0


@dataclass(frozen=True)
class RunScript:
    keys: Tuple[str, ...]
    arguments: Tuple[Any, ...]
    # "bucket" (lua/token_bucket.lua), "refund" (lua/token_refund.lua), each with "_ids"
    # for a call with a request id (lua/request_ids.lua and lua/bucket_ids.lua first),
    # "lease" (lua/lease.lua), "quota" or "window" (lua/request_ids.lua then
    # lua/quota.lua or lua/window.lua).
    script: str = "bucket"


@dataclass(frozen=True)
class Pipeline:
    """Commands sent together, in one round trip: the reply is a list, each command's
    error reply in its place as the exception the client library made of it."""

    commands: Tuple[Command, ...]


Request = Any  # Command | RunScript | Pipeline


def waiting_of(request: Request) -> float:
    """How long the server may hold a request (its commands' WAIT), in seconds."""
    if isinstance(request, Command):
        return request.wait
    if isinstance(request, Pipeline):
        return max((command.wait for command in request.commands), default=0.0)
    return 0.0


T = TypeVar("T")
# A call: yields requests, receives their replies, returns its answer.
Flow = Generator[Request, Any, T]

# redis-py's words for a pool with no free connection (ConnectionPool, and
# BlockingConnectionPool after its timeout): back-pressure, not an outage.
_POOL_EXHAUSTED = ("Too many connections", "No connection available.")
# redis-py's words (a plain RedisError, not a reply) for a pooled connection already
# closed under it (5.0's ensure_connection reading a closed buffer): the connection
# dropped, as redis-py 6 and later say with an OSError.
_CLOSED_UNDER_IT = ("Buffer is closed.",)


def sort_error(error: BaseException) -> BaseException:
    """An error a request raised as this package's exception, with the error as its
    cause."""
    sorted_error = _sorted(error)
    if sorted_error is not error and sorted_error.__cause__ is None:
        sorted_error.__cause__ = error
    return sorted_error


def _sorted(error: BaseException) -> BaseException:
    import redis.exceptions as errors

    text = str(error)
    if isinstance(error, QagError):
        return error
    if isinstance(error, errors.NoPermissionError) or text.startswith("NOPERM"):
        return QagPermissionError(text)
    if isinstance(error, errors.ReadOnlyError) or text.startswith("READONLY"):
        return Demoted(text)
    # A waiting call let go as its primary became a replica (Redis 8), not an admin's
    # CLIENT UNBLOCK: a demotion, as READONLY is (the Rust fault test found it there).
    if text.startswith("UNBLOCKED") and "instance state changed" in text:
        return Demoted(text)
    if isinstance(error, errors.MaxConnectionsError) or (
        isinstance(error, errors.ConnectionError) and text in _POOL_EXHAUSTED
    ):
        return QagBusy(text)
    if isinstance(error, (errors.TimeoutError, TimeoutError)):
        return QagUnavailable(text or type(error).__name__)
    if isinstance(error, (errors.ConnectionError, ConnectionError, EOFError)) and not isinstance(
        error, (errors.BusyLoadingError, errors.AuthenticationError)
    ):
        return ConnectionDropped(text or type(error).__name__)
    if isinstance(
        error,
        (
            errors.ConnectionError,
            errors.TimeoutError,
            errors.ClusterDownError,
            errors.MasterDownError,
            errors.TryAgainError,
            errors.RedisClusterException,  # no reachable node, no node for the slot
            errors.BusyLoadingError,
            TimeoutError,
            OSError,
        ),
    ):
        return QagUnavailable(text or type(error).__name__)
    lowered = text.lower()
    # The server's "unknown command", and redis-py's cluster client's own
    # "... command doesn't exist in Redis commands" for a command no node knows.
    if "unknown command" in lowered or "command doesn't exist" in lowered:
        return UnknownCommand(text)
    if type(error) is errors.RedisError and text in _CLOSED_UNDER_IT:
        return ConnectionDropped(text)
    if isinstance(error, errors.RedisError):
        if text.startswith(("LOADING", "CLUSTERDOWN", "MASTERDOWN", "TRYAGAIN")):
            return QagUnavailable(text)
        return QagServerError(text)
    if type(error).__module__.split(".")[0] == "redis":  # none of redis-py's reaches the caller
        return QagServerError(f"{type(error).__name__}: {text}")
    # Anything else redis-py raised from its connection handling (e.g. AttributeError
    # on a connection closed under it while the cluster fails over): the connection
    # failed, not the call.
    return ConnectionDropped(f"the connection failed: {type(error).__name__}: {text}")


class TimeSpent(QagUnavailable):
    """No answer within what was left of the call's request's time, less than a
    deadline: a slow request, not yet an outage (a call with a whole deadline says
    that). The policy answers it; no back-off starts."""


class Overtaken(QagError):
    """A back-off began while the call waited for a connection: the call keeps to the
    policy, as every call of the back-off does, without touching Redis."""


@dataclass(frozen=True)
class Fallback(Generic[T]):
    """A family's answers when Redis is left alone: forwarded (None: raises under
    "forward" too), and local from the local state, the wall clock and the share."""

    forwarded: Optional[Callable[[], T]]
    local: Callable[[LocalState, float, float], T]


@dataclass
class Attempt:
    """Whether a call sent its command (QAG.LEASE, QAG.ADMIT ... RESERVE): if it did and
    did not come back with what it took held in Redis, that is given back in the
    background."""

    sent: bool = False


@dataclass(frozen=True)
class Recorded:
    """A reservation's charge or commit: the scopes charged, and how it was answered."""

    scopes: int
    answered_by: str


class HoldState:
    """A reservation guard's state: its chain, id and tokens, how its ADMIT was
    answered, what the caller charged so far (every ``charge``, whatever its outcome:
    the tokens it used), and whether it is done (committed, or left). Times are
    monotonic seconds."""

    def __init__(
        self,
        chain: List[Scope],
        window: Optional[int],
        tokens: int,
        hold_ms: Optional[int],
        request_id: str,
        started: float,
    ) -> None:
        self.chain = chain
        self.keys = [scope.key for scope in chain]
        self.window = window
        self.tokens = tokens
        self.hold_ms = hold_ms
        self.id = request_id
        self.started = started
        self.attempt = Attempt()
        self.admission: Optional[Admission] = None
        self.charged = 0
        self.done = False

    @property
    def answered_by(self) -> str:
        return "module" if self.admission is None else self.admission.answered_by

    @property
    def in_redis(self) -> bool:
        """Tokens are held in Redis under the id."""
        return (
            self.admission is not None
            and self.admission.admitted
            and self.answered_by in ("module", "script")
        )

    def open(self, action: str) -> None:
        """A charge or commit is allowed now (else RuntimeError: a bug of the caller's)."""
        if self.admission is None:
            raise RuntimeError(f"{action} before the reservation was entered")
        if not self.admission.admitted:
            raise RuntimeError(f"{action} on a refused reservation: nothing is held")
        if self.done:
            raise RuntimeError(f"{action} after the reservation was committed or left")

    def left_ms(self, now: float) -> int:
        """What is left of the hold's time: it stops counting by itself at ``hold_ms``,
        and at the latest at the end of the window after the one it was taken in (two
        windows from its start)."""
        window = float(self.window or DEFAULT_WINDOW)
        lasts = 2 * window if self.hold_ms is None else min(self.hold_ms / 1000, 2 * window)
        return math.floor((self.started + lasts - now) * 1000)

    def gives_up(self, now: float) -> bool:
        """A background commit stops trying once the hold has stopped counting."""
        return self.left_ms(now) <= 0


class HoldView:
    """What a reservation guard (sync or async) shows of its state."""

    _state: HoldState

    @property
    def request_id(self) -> str:
        return self._state.id

    @property
    def admission(self) -> Admission:
        if self._state.admission is None:
            raise RuntimeError("the reservation was not entered")
        return self._state.admission

    @property
    def admitted(self) -> bool:
        return self.admission.admitted

    @property
    def answered_by(self) -> str:
        return self._state.answered_by

    @property
    def charged(self) -> int:
        """The tokens charged so far (every ``charge``)."""
        return self._state.charged


class LeaseState:
    """A lease guard's state: how it was answered, when Redis last confirmed it, and
    whether it is lost (a renewal found it gone, or it could not be confirmed within
    its TTL). Times are monotonic seconds."""

    def __init__(self, key: str, lease_id: str, ttl_ms: int, started: float) -> None:
        self.key = key
        self.id = lease_id
        self.ttl_ms = ttl_ms
        self.answered_by = "module"
        # The lease was taken no earlier than the acquire began.
        self.confirmed_at = started
        self.lost = False
        self.last_error: Optional[QagError] = None
        self.done = False

    @property
    def interval(self) -> float:
        """Renewals run every third of the TTL."""
        return self.ttl_ms / 3000

    @property
    def in_redis(self) -> bool:
        return self.answered_by in ("module", "script")

    def renewed(self, held: bool, sent_at: float) -> None:
        if held:
            self.confirmed_at = sent_at
        else:
            self.lost = True

    def renewal_failed(self, error: QagError, now: float) -> None:
        """Lost once the next renewal would come too late to find it live."""
        self.last_error = error
        if now - self.confirmed_at + self.interval >= self.ttl_ms / 1000:
            self.lost = True


def release_delay(attempt: int) -> float:
    """The wait before a background release's next try: 100 ms, doubling, at most 1 s."""
    return float(min(0.1 * 2**attempt, 1.0))


def release_gives_up(started: float, ttl_ms: int, now: float) -> bool:
    """A background release stops trying once the lease's TTL has passed since the
    acquire began: the lease has run out by itself."""
    return now - started >= ttl_ms / 1000


@dataclass
class Engine:
    backend: str = "auto"
    on_unavailable: str = "raise"
    back_off: float = 5.0
    local_share: float = 1.0
    recheck_missing_module: float = 10.0
    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    # "unknown", "present" or "missing".
    presence: str = "unknown"
    # Whether the server's module takes KEEP after an id (None: not known yet).
    keeps: Optional[bool] = None
    missing_since: float = 0.0
    local: LocalState = field(default_factory=LocalState)
    tally: Tally = field(default_factory=Tally)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}")
        if self.on_unavailable not in POLICIES:
            raise ValueError(f"on_unavailable must be one of {', '.join(POLICIES)}")
        if not (isinstance(self.back_off, (int, float)) and 0 <= self.back_off < math.inf):
            raise ValueError("back_off must be a number of seconds, at least 0")
        if not (isinstance(self.local_share, (int, float)) and 0 < self.local_share <= 1):
            raise ValueError("local_share must be above 0 and at most 1")
        if not self.recheck_missing_module >= 0:
            raise ValueError("recheck_missing_module must be at least 0")
        self.outage = Outage(float(self.back_off))
        # The blocking limiter runs flows on many threads.
        self._lock = threading.Lock()
        # Told when an outage starts a back-off (the driver wakes calls waiting for a
        # connection: they keep to the policy instead).
        self.on_outage: Callable[[], None] = lambda: None
        # Runs the back-off's prober in the background (a task, or a thread): every
        # driver sets it.
        self.start_prober: Callable[[], None] = lambda: None

    # What the limiter reports.

    @property
    def backing_off(self) -> bool:
        """No call goes to Redis now: a back-off runs (its probe due or out included)."""
        with self._lock:
            return self.outage.backing_off

    @property
    def counting_locally(self) -> bool:
        return self.on_unavailable == "local" and self.backing_off

    @property
    def counts(self) -> d.Counts:
        with self._lock:
            return self.tally.snapshot()

    @property
    def generation(self) -> int:
        """Outages so far (a call notes it when routed)."""
        with self._lock:
            return self.outage.generation

    def overtaken(self, generation: int) -> bool:
        """A back-off started after a call noted ``generation`` (-1: a call the
        back-off does not concern): the call keeps to the policy rather than go on to
        Redis."""
        if generation < 0:
            return False
        with self._lock:
            return self.outage.generation != generation and self.outage.backing_off

    def background_failed(self) -> None:
        """A background release or renewal failed."""
        with self._lock:
            self.tally.errors += 1

    def _sent(self, request: Request, replayable: bool) -> Flow[Any]:
        """A request's reply. A ``replayable`` one whose connection dropped (its outcome
        unknown) is sent once more, on a fresh connection within the same deadline: a
        command with an id (the module answers a call that ran with its first reply,
        so it counts once), one that only reads, and an admission without an id (a
        take, a pair, an ADMIT: if the first ran, the replay charges again, erring
        stricter by one, never granting more). A restarted server drops every pooled
        connection at once, and redis-py 8's asyncio pool hands them out unchecked: one
        dropped connection is no outage. The replay's failure is the call's; any other
        write without an id (a refund: twice would give back twice) is never sent
        again, but after READONLY (a demoted primary: it did not run), when every
        request is."""
        try:
            return (yield request)
        except ConnectionDropped as dropped:
            if not (replayable or isinstance(dropped, Demoted)):
                raise
            with self._lock:
                self.tally.replays += 1
            return (yield request)

    # The policy: one place for every family.

    def _routed(self, in_redis: Flow[T], fallback: Fallback[T]) -> Flow[T]:
        """``in_redis`` unless the policy answers: during a back-off (no request at
        all) or after the call met an outage. The outage that starts a back-off starts
        its prober (``prober``), which probes Redis in its own time whether calls come or
        not: a request never waits for a probe (in a process busy answering a flood of
        requests by the policy, what is left of a request's deadline was too little for
        one, and one failed probe kept the back-off going long after Redis was back), and
        the first burst after a quiet period finds Redis answering if it is back."""
        with self._lock:
            route = self.outage.route()
            generation = self.outage.generation
        if route is Route.START_PROBER:
            self._start_prober()
        if route is not Route.REDIS:
            return self._by_policy(fallback, None)
        try:
            answer = yield from in_redis
        except TimeSpent as error:
            return self._by_policy(fallback, error)
        except QagUnavailable as error:
            with self._lock:
                self.presence = "unknown"  # a restart or failover: ask the next server
                started = self.outage.failed(False, self.monotonic(), str(error))
            if started:
                self._start_prober()
            self.on_outage()
            return self._by_policy(fallback, error)
        except Overtaken:
            return self._by_policy(fallback, None)
        except QagBusy:
            with self._lock:
                self.tally.errors += 1
            raise
        except QagError:  # an error reply: Redis answered
            self._answered(False, generation)
            with self._lock:
                self.tally.errors += 1
            raise
        self._answered(False, generation)
        with self._lock:
            self.tally.count(getattr(answer, "answered_by", "module"))
        return answer

    def _start_prober(self) -> None:
        """Starts the back-off's prober; one that cannot start (no thread to be had)
        leaves the next call to try again, and the call keeps to the policy."""
        try:
            self.start_prober()
        except Exception as error:
            with self._lock:
                self.outage.prober_stopped()
            log.warning("qag: the back-off's prober did not start: %s", error)

    def prober_step(self) -> Union[Probe, float]:
        """The back-off's prober's next step: probe now, end, or wait that long."""
        with self._lock:
            return self.outage.prober_step(self.monotonic())

    def prober_stopped(self) -> None:
        with self._lock:
            self.outage.prober_stopped()

    def forget_back_off(self) -> None:
        """Its node left the cluster's table: its back-off and local counts go with it."""
        with self._lock:
            self.outage.forget()
            self.local.clear()

    def probe(self) -> Flow[bool]:
        """One probe of the back-off's prober: PING, which a server still loading its
        data or a replica cut off from its primary refuses (LOADING, MASTERDOWN: an
        outage, as the calls would meet), then, with the "auto" backend, whether it has
        the module (COMMAND INFO, which such a server answers), so a restart that brought
        or took the module is seen at once. An answer, even an error reply, ends the
        back-off (True: the prober ends); an outage puts the next probe twice as far off;
        so does a probe that found no free connection (the process's own load)."""
        with self._lock:
            generation = self.outage.generation
        try:
            yield from self._sent(Command(("PING",), probe=True), True)
            if self.backend == "auto":
                self.forget_presence()
                yield from self.path()
        except QagUnavailable as error:
            with self._lock:
                self.presence = "unknown"
                self.outage.failed(True, self.monotonic(), str(error))
            self.on_outage()
            return False
        except QagBusy:
            with self._lock:
                self.outage.deferred(self.monotonic())
            return False
        except QagError:
            pass  # an error reply: Redis answered
        self._answered(True, generation)
        return True

    def _answered(self, probe: bool, generation: int) -> None:
        with self._lock:
            if self.outage.answered(probe, generation):
                self.local.clear()

    def _by_policy(self, fallback: Fallback[T], error: Optional[QagUnavailable]) -> T:
        with self._lock:
            if self.on_unavailable == "forward" and fallback.forwarded is not None:
                self.tally.forwarded += 1
                return fallback.forwarded()
            if self.on_unavailable == "local":
                self.tally.local += 1
                return fallback.local(self.local, self.wall(), self.local_share)
            self.tally.errors += 1
            if error is None:
                error = QagUnavailable(self.outage.backing_off_message())
        raise error

    def _unrouted(self, in_redis: Flow[T]) -> Flow[T]:
        """Background work (renewals, releases after a failed acquire): always to
        Redis, whatever the back-off; starts and ends none."""
        try:
            return (yield from in_redis)
        except QagUnavailable:
            self.presence = "unknown"
            raise

    # Which path: module or script.

    def path(self) -> Flow[str]:
        if self.backend != "auto":
            return self.backend
        if self.presence == "present":
            return "module"
        if (
            self.presence == "missing"
            and self.monotonic() - self.missing_since < self.recheck_missing_module
        ):
            return "script"
        try:
            entries = yield from self._sent(
                Command(("COMMAND", "INFO", "qag.take"), probe=True), True
            )
        except QagPermissionError:
            # A user without COMMAND: the module's command is tried; its answer tells.
            entries = [["qag.take"]]
        if not isinstance(entries, list):
            raise QagServerError(f"a COMMAND INFO reply, got {entries!r}")
        if any(entry is not None for entry in entries):
            self.presence = "present"
            return "module"
        self.note_missing()
        return "script"

    def forget_presence(self) -> None:
        """A new connection, or a failed one: the next call asks the server again."""
        self.presence = "unknown"
        self.keeps = None

    def note_missing(self) -> None:
        self.presence = "missing"
        self.missing_since = self.monotonic()

    def _module_failed(self) -> None:
        """The module's command is unknown: "auto" goes on with the script."""
        self.note_missing()
        if self.backend != "auto":
            raise QagModuleRequired("the qag module is required and the server does not have it")

    # Token buckets.

    def take(
        self, call: BucketCall, request_id: Optional[str], wait: Optional[float] = None
    ) -> Flow[Decision]:
        return self._routed(
            self._take(call, request_id, wait), Fallback(call.forwarded, _local_take(call))
        )

    def take_pair(
        self,
        client: BucketCall,
        key: BucketCall,
        request_id: Optional[str],
        wait: Optional[float] = None,
    ) -> Flow[PairDecision]:
        def forwarded() -> PairDecision:
            return PairDecision(client.forwarded(), key.forwarded())

        def local(state: LocalState, now: float, share: float) -> PairDecision:
            client_decision = _local_take(client)(state, now, share)
            if not client_decision.allowed:
                return PairDecision(client_decision, None)
            return PairDecision(client_decision, _local_take(key)(state, now, share))

        return self._routed(
            self._take_pair(client, key, request_id, wait), Fallback(forwarded, local)
        )

    def peek(self, call: BucketCall) -> Flow[Decision]:
        def local(state: LocalState, now: float, share: float) -> Decision:
            count = share_of(call.count, share)
            reply = state.buckets.peek(call.key, count, call.period, call.cost, now)
            return call.decision(reply, "local")

        return self._routed(self._peek(call), Fallback(call.forwarded, local))

    def refund(self, call: BucketCall, n: int, request_id: Optional[str]) -> Flow[Refunded]:
        arguments = call.refund_arguments(n)

        def local(state: LocalState, now: float, share: float) -> Refunded:
            count = share_of(call.count, share)
            return Refunded(state.buckets.refund(call.key, count, call.period, n, now), "local")

        return self._routed(
            self._refund(call, arguments, request_id),
            Fallback(lambda: Refunded(call.count, "forwarded"), local),
        )

    def _refund(
        self, call: BucketCall, arguments: Tuple[Any, ...], request_id: Optional[str]
    ) -> Flow[Refunded]:
        if (yield from self.path()) == "module":
            try:
                command = Command(_with_id(("QAG.REFUND", call.key, *arguments), request_id))
                reply = yield from self._sent(command, request_id is not None)
                return self._saw_refund(call, call.refunded(reply, "module"))
            except UnknownCommand:
                self._module_failed()
        try:
            # Resent after a dropped connection only with an id: twice without one would
            # give back twice.
            name = "refund" if request_id is None else "refund_ids"
            script = RunScript((call.key,), (*arguments, *_script_id(request_id)), name)
            reply = yield from self._sent(script, request_id is not None)
        except UnknownCommand as error:
            raise QagServerError(str(error)) from error
        return self._saw_refund(call, call.refunded(reply, "script"))

    def _take(
        self, call: BucketCall, request_id: Optional[str], wait: Optional[float] = None
    ) -> Flow[Decision]:
        if (yield from self.path()) == "module":
            try:
                words = _with_id(("QAG.TAKE", call.key, *call.arguments()), request_id)
                command = _waiting(words, wait)
                reply = yield from self._sent(command, True)
                return self._saw(call, call.decision(reply, "module"))
            except UnknownCommand:
                self._module_failed()
        return (yield from self._script(call, request_id))

    def _take_pair(
        self,
        client: BucketCall,
        key: BucketCall,
        request_id: Optional[str],
        wait: Optional[float] = None,
    ) -> Flow[PairDecision]:
        if (yield from self.path()) == "module":
            try:
                pair = ("QAG.TAKE2", client.key, client.count, client.period_text, key.key)
                command = _waiting(_with_id((*pair, *key.arguments()), request_id), wait)
                reply = yield from self._sent(command, True)
                return self._pair_decided(client, key, reply)
            except UnknownCommand:
                self._module_failed()
        return (yield from self._pair_by_script(client, key, request_id))

    def _pair_decided(
        self, client: BucketCall, key: BucketCall, reply: Any, by: str = "module"
    ) -> PairDecision:
        """QAG.TAKE2's reply (or its script's) as both decisions (the key's None when
        not counted)."""
        if not isinstance(reply, list) or len(reply) != 2:
            raise QagServerError(f"a QAG.TAKE2 reply, got {reply!r}")
        client_decision = self._saw(client, client.decision(reply[0], by))
        if reply[1] is None:
            return PairDecision(client_decision, None)
        return PairDecision(client_decision, self._saw(key, key.decision(reply[1], by)))

    def take_with_quota(
        self,
        client: Optional[BucketCall],
        key: Optional[BucketCall],
        quota_key: str,
        quota: Quota,
        request_id: Optional[str],
        wait: Optional[float] = None,
    ) -> Flow[TakenWithQuota]:
        """A request's buckets (either or both) and its quota's check, in one round trip
        with the module (QAG.TAKE2 or QAG.TAKE, and QAG.QUOTA pipelined); without it the
        buckets by script, then the check. An outage of the round trip is answered by
        the policy for both; the check's own failure is ``quota_error``."""
        check = self._quota_fallback(quota_key, quota)

        def forwarded() -> TakenWithQuota:
            assert check.forwarded is not None
            return TakenWithQuota(
                None if client is None else client.forwarded(),
                None if key is None else key.forwarded(),
                check.forwarded(),
            )

        def local(state: LocalState, now: float, share: float) -> TakenWithQuota:
            client_decision = None if client is None else _local_take(client)(state, now, share)
            key_decision = None
            if key is not None and (client_decision is None or client_decision.allowed):
                key_decision = _local_take(key)(state, now, share)
            return TakenWithQuota(client_decision, key_decision, check.local(state, now, share))

        return self._routed(
            self._take_with_quota(client, key, quota_key, quota, request_id, wait),
            Fallback(forwarded, local),
        )

    def _take_with_quota(
        self,
        client: Optional[BucketCall],
        key: Optional[BucketCall],
        quota_key: str,
        quota: Quota,
        request_id: Optional[str],
        wait: Optional[float] = None,
    ) -> Flow[TakenWithQuota]:
        # One bucket (QAG.TAKE), or both (QAG.TAKE2: alone is None).
        alone = key if client is None else client if key is None else None
        if alone is None:
            assert client is not None and key is not None
            pair = ("QAG.TAKE2", client.key, client.count, client.period_text, key.key)
            take = _with_id((*pair, *key.arguments()), request_id)
        else:
            take = _with_id(("QAG.TAKE", alone.key, *alone.arguments()), request_id)
        if (yield from self.path()) == "module":
            check = Command(tuple(d.quota_check_words(quota_key, quota)))
            # Replayed as an admission and a read are.
            replies = yield from self._sent(Pipeline((_waiting(take, wait), check)), True)
            if not isinstance(replies, list) or len(replies) != 2:
                raise QagServerError(f"a pipeline of two replies, got {replies!r}")
            taken, checked = replies
            if not isinstance(taken, BaseException):
                if alone is None:
                    assert client is not None and key is not None
                    pair_decision = self._pair_decided(client, key, taken)
                    decisions: Tuple[Optional[Decision], Optional[Decision]]
                    decisions = (pair_decision.client, pair_decision.key)
                else:
                    decision = self._saw(alone, alone.decision(taken, "module"))
                    decisions = (decision, None) if client is not None else (None, decision)
                if isinstance(checked, BaseException):
                    error = sort_error(checked)
                    if isinstance(error, UnknownCommand):
                        error = QagModuleRequired(str(error))
                    if not isinstance(error, QagError):
                        raise error
                    return TakenWithQuota(decisions[0], decisions[1], None, error)
                checked_quota = self._quota_checked(quota_key, quota, checked)
                return TakenWithQuota(decisions[0], decisions[1], checked_quota)
            error = sort_error(taken)
            if not isinstance(error, UnknownCommand):
                raise error
            self._module_failed()  # nothing ran: the script takes
        client_decision: Optional[Decision] = None
        key_decision: Optional[Decision] = None
        if alone is None:
            assert client is not None and key is not None
            pair_decision = yield from self._pair_by_script(client, key, request_id)
            client_decision, key_decision = pair_decision.client, pair_decision.key
        elif client is not None:
            client_decision = yield from self._script(alone, request_id)
        else:
            key_decision = yield from self._script(alone, request_id)
        try:
            # Its own round trip: what it meets is the check's; the buckets' answers stand.
            quota_decision = yield from self._quota_check(quota_key, quota)
        except QagError as failed:
            return TakenWithQuota(client_decision, key_decision, None, failed)
        return TakenWithQuota(client_decision, key_decision, quota_decision)

    def _peek(self, call: BucketCall) -> Flow[Decision]:
        if (yield from self.path()) == "module":
            try:
                peek = Command(("QAG.PEEK", call.key, *call.arguments()))
                reply = yield from self._sent(peek, True)
                return self._saw(call, call.decision(reply, "module"))
            except UnknownCommand:
                self._module_failed()
        # Without the module: the hash and the server's clock, computed with the
        # script's arithmetic.
        from .local import take

        fields = yield from self._sent(Command(("HMGET", call.key, "tokens", "ts")), True)
        seconds, micros = yield from self._sent(Command(("TIME",)), True)
        now = int(seconds) + int(micros) / 1e6
        reply, _ = take(call.count, call.period, call.cost, _stored(fields), now)
        return self._saw(call, call.decision(reply, "script"))

    def _script(self, call: BucketCall, request_id: Optional[str]) -> Flow[Decision]:
        """The script's take, sent once more after a dropped connection: with the
        caller's id a replay, answered as the first call was; without one an admission,
        stricter by one if the first ran, as the module's without an id."""
        arguments = (call.count, call.period_text, call.cost, *_script_id(request_id))
        try:
            reply = yield from self._sent(
                RunScript((call.key,), arguments, _bucket_script(request_id)), True
            )
        except UnknownCommand as error:
            raise QagServerError(str(error)) from error
        return self._saw(call, call.decision(reply, "script"))

    def _pair_by_script(
        self, client: BucketCall, key: BucketCall, request_id: Optional[str]
    ) -> Flow[PairDecision]:
        """QAG.TAKE2's twin: both buckets in one call, atomic as TAKE2 is (the keys are
        on one server, or in one cluster slot: see ``take_pair``)."""
        limits = (client.count, client.period_text, key.count, key.period_text)
        arguments = (*limits, client.cost, *_script_id(request_id))
        script = RunScript((client.key, key.key), arguments, _bucket_script(request_id))
        try:
            reply = yield from self._sent(script, True)
        except UnknownCommand as error:
            raise QagServerError(str(error)) from error
        return self._pair_decided(client, key, reply, "script")

    # Redis's last word on each key, where local counting would begin.

    def _saw(self, call: BucketCall, decision: Decision) -> Decision:
        with self._lock:
            self.local.buckets.saw(
                call.key, call.count, call.period, decision.remaining, self.wall()
            )
        return decision

    def _saw_refund(self, call: BucketCall, refunded: Refunded) -> Refunded:
        with self._lock:
            self.local.buckets.saw(
                call.key, call.count, call.period, refunded.remaining, self.wall()
            )
        return refunded

    def _family(
        self, module: Callable[[], Flow[Any]], script: Callable[[], Flow[Any]]
    ) -> Flow[Tuple[Any, str]]:
        """A family's call: ``module``'s request where this node has the module (until it
        answers "unknown command": "auto" goes on with the script, "module" raises
        QagModuleRequired), else ``script``'s, the family's script on the same keys,
        which answers the same; the reply and which answered."""
        if (yield from self.path()) == "module":
            try:
                return (yield from module()), "module"
            except UnknownCommand:
                self._module_failed()
        try:
            return (yield from script()), "script"
        except UnknownCommand as error:
            raise QagServerError(str(error)) from error

    def _either(
        self,
        words: List[Any],
        script: RunScript,
        attempt: Optional[Attempt] = None,
        replayable: bool = False,
        wait: Optional[float] = None,
    ) -> Flow[Tuple[Any, str]]:
        """The module's command ``words``, or ``script`` (``replayable``: it carries an
        id, only reads, or admits: see ``_sent``); ``attempt`` notes that it was sent;
        ``wait``: the server may hold the command that long (its words end with WAIT;
        the script answers at once)."""

        def sent(request: Request) -> Callable[[], Flow[Any]]:
            def flow() -> Flow[Any]:
                if attempt is not None:
                    attempt.sent = True
                return (yield from self._sent(request, replayable))

            return flow

        command = Command(tuple(words), wait=wait or 0.0)
        return (yield from self._family(sent(command), sent(script)))

    def _spend(
        self, words: List[Any], keep: Optional[int], script: Callable[[str], Flow[Any]]
    ) -> Flow[Tuple[Any, str]]:
        """A spend call whose words end with its id: with ``keep`` (the limiter's own id,
        replayed only within the call), ``KEEP keep`` after it, so the key remembers the
        id seconds, not ID-SECONDS. A module older than KEEP refuses it, writing
        nothing: the call is sent again without, and this server is not asked again.
        The script's flow (``script``, given the KEEP's text, "" for none) takes it
        always."""

        def module() -> Flow[Any]:
            if keep is None or self.keeps is False:
                return (yield from self._sent(Command(tuple(words)), True))
            try:
                reply = yield from self._sent(Command((*words, "KEEP", keep)), True)
            except QagServerError as error:
                # An older module reads KEEP as a word of the command's own.
                refused = ("syntax error", "wrong number of arguments", "numscopes does not match")
                if self.keeps is not None or not any(words in str(error) for words in refused):
                    raise
                self.keeps = False
                return (yield from self._sent(Command(tuple(words)), True))
            self.keeps = True
            return reply

        def by_script() -> Flow[Any]:
            return (yield from script("" if keep is None else str(keep)))

        return (yield from self._family(module, by_script))

    # Leases.

    def lease(
        self,
        key: str,
        max_slots: int,
        ttl_ms: int,
        lease_id: str,
        attempt: Attempt,
        wait: Optional[float] = None,
    ) -> Flow[LeaseGrant]:
        def in_redis() -> Flow[LeaseGrant]:
            words = ["QAG.LEASE", key, max_slots, ttl_ms, lease_id, *d.wait_words(wait)]
            script = RunScript((key,), ("acquire", max_slots, ttl_ms, lease_id), "lease")
            reply, by = yield from self._either(words, script, attempt, wait=wait)
            grant = replace(d.lease_grant(reply), answered_by=by)
            with self._lock:
                self.local.leases.saw(key, grant.live, ttl_ms, self.wall())
            return grant

        def local(state: LocalState, now: float, share: float) -> LeaseGrant:
            return state.leases.acquire(key, lease_id, max_slots, share, now)

        return self._routed(
            in_redis(), Fallback(lambda: LeaseGrant(True, 0, 0, "forwarded"), local)
        )

    def renew(self, key: str, lease_id: str, ttl_ms: int) -> Flow[bool]:
        return self._routed(
            self._renew(key, lease_id, ttl_ms),
            Fallback(lambda: True, lambda state, _, __: state.leases.holds(key, lease_id)),
        )

    def release(self, key: str, lease_id: str) -> Flow[bool]:
        return self._routed(
            self._release(key, lease_id),
            Fallback(lambda: False, lambda state, _, __: state.leases.release(key, lease_id)),
        )

    def leases(self, key: str) -> Flow[int]:
        def in_redis() -> Flow[int]:
            script = RunScript((key,), ("count",), "lease")
            reply, _ = yield from self._either(["QAG.LEASES", key], script, replayable=True)
            return int(reply)

        return self._routed(
            in_redis(), Fallback(None, lambda state, now, share: state.leases.live(key, share, now))
        )

    def guard_release(self, lease: LeaseState) -> Flow[Optional[bool]]:
        """A guard's release: a local lease is given back here, a forwarded one has
        nothing to give back (it counts as held to the end: True); a lease held in
        Redis is released there, straight (never answered by the policy, which would
        say False for a slot still held), except during a back-off: None, and the
        driver releases it in the background."""
        if lease.answered_by == "forwarded":
            return True
        if lease.answered_by == "local":
            with self._lock:
                return self.local.leases.release(lease.key, lease.id)
        if self.backing_off:
            return None
        return (yield from self._unrouted(self._release(lease.key, lease.id)))

    def renewal(self, key: str, lease_id: str, ttl_ms: int) -> Flow[bool]:
        """A guard's renewal, in the background."""
        return self._unrouted(self._renew(key, lease_id, ttl_ms))

    def background_release(self, key: str, lease_id: str) -> Flow[bool]:
        """A release after an acquire that may have taken the slot and did not return
        it, in the background."""
        return self._unrouted(self._release(key, lease_id))

    def _renew(self, key: str, lease_id: str, ttl_ms: int) -> Flow[bool]:
        script = RunScript((key,), ("renew", lease_id, ttl_ms), "lease")
        reply, _ = yield from self._either(["QAG.RENEW", key, lease_id, ttl_ms], script)
        return bool(reply == 1)

    def _release(self, key: str, lease_id: str) -> Flow[bool]:
        script = RunScript((key,), ("release", lease_id), "lease")
        reply, _ = yield from self._either(["QAG.RELEASE", key, lease_id], script)
        return bool(reply == 1)

    # Quotas.

    def quota_check(self, key: str, quota: Quota) -> Flow[QuotaDecision]:
        return self._routed(self._quota_check(key, quota), self._quota_fallback(key, quota))

    def _quota_check(self, key: str, quota: Quota) -> Flow[QuotaDecision]:
        words = d.quota_check_words(key, quota)
        calls, rows = quota.calls, quota.rows
        limits = ("" if calls is None else calls, "" if rows is None else rows)

        def module() -> Flow[Any]:
            return (yield from self._sent(Command(tuple(words)), True))

        def by_script() -> Flow[Any]:
            return (yield from self._quota_script("check", key, quota.per, quota.tz, limits, True))

        reply, by = yield from self._family(module, by_script)
        return self._quota_checked(key, quota, reply, by)

    def _quota_checked(
        self, key: str, quota: Quota, reply: Any, answered_by: str = "module"
    ) -> QuotaDecision:
        """QAG.QUOTA's reply (or the script's) as a decision, noted as Redis's last word
        on the quota."""
        decision = d.quota_decision(reply, quota.calls, quota.rows)
        decision = replace(decision, answered_by=answered_by)
        with self._lock:
            self.local.quotas.saw_check(key, decision)
        return decision

    def _quota_fallback(self, key: str, quota: Quota) -> Fallback[QuotaDecision]:
        per, tz, calls, rows = quota.per, quota.tz, quota.calls, quota.rows

        def forwarded() -> QuotaDecision:
            return QuotaDecision(True, calls, None, rows, None, 0, "forwarded")

        def local(state: LocalState, now: float, share: float) -> QuotaDecision:
            return state.quotas.check(key, per, tz, calls, rows, now, share)

        return Fallback(forwarded, local)

    def quota_count(
        self,
        command: str,
        key: str,
        quota: Quota,
        calls: int,
        rows: int,
        request_id: Optional[str] = None,
        keep: Optional[int] = None,
    ) -> Flow[QuotaUsage]:
        """QAG.QUOTA.ADD (with its id, and ``keep``: the limiter's own id's KEEP) or
        QAG.QUOTA.SEED (none: a seed counts the same however often it runs)."""
        words = d.quota_count_words(command, key, quota, calls, rows)
        if request_id is not None:
            words += ["ID", request_id]
        per, tz = quota.per, quota.tz

        def in_redis() -> Flow[QuotaUsage]:
            counts = (calls, rows)
            if request_id is None:

                def module() -> Flow[Any]:
                    return (yield from self._sent(Command(tuple(words)), False))

                def seed() -> Flow[Any]:
                    return (yield from self._quota_script("seed", key, per, tz, counts, False))

                reply, by = yield from self._family(module, seed)
            else:

                def add(keep_text: str) -> Flow[Any]:
                    tail = (*counts, request_id, keep_text)
                    return (yield from self._quota_script("add", key, per, tz, tail, True))

                reply, by = yield from self._spend(words, keep, add)
            usage = replace(d.quota_usage(reply), answered_by=by)
            with self._lock:
                self.local.quotas.saw(key, usage.calls, usage.rows, usage.resets_at)
            return usage

        def local(state: LocalState, now: float, _: float) -> QuotaUsage:
            if command == "QAG.QUOTA.ADD":
                return state.quotas.add(key, per, tz, calls, rows, now)
            return state.quotas.seed(key, per, tz, calls, rows, now)

        return self._routed(in_redis(), Fallback(lambda: QuotaUsage(0, 0, 0, "forwarded"), local))

    def _quota_script(
        self, op: str, key: str, per: str, tz: str, tail: Tuple[Any, ...], replayable: bool
    ) -> Flow[Any]:
        """lua/quota.lua's ``op`` on ``key``, given the calendar period of this process's
        clock, then ``tail``; where that period is not the server's (a period ended
        between the two clocks), the script answers the server's clock, and is sent
        again with that clock's period: the server's, as the module's."""
        clock = self.wall()
        for _ in range(PERIOD_TRIES):
            request = RunScript((key,), (op, *period_arguments(per, tz, clock), *tail), "quota")
            reply = yield from self._sent(request, replayable)
            server = server_clock(reply)
            if server is None:
                return reply
            clock = server
        raise QagServerError("the server's clock left every calendar period it was given")

    # Sliding windows.

    def admit(
        self,
        scopes: Sequence[Union[Scope, Tuple[str, int, int]]],
        window: Optional[int],
        request_id: Optional[str],
    ) -> Flow[Admission]:
        chain = _chain(scopes)
        words, script = admit_call(chain, window, 0, None, request_id)
        return self._admit(chain, window, words, script, None)

    def _admit(
        self,
        chain: List[Scope],
        window: Optional[int],
        words: List[Any],
        script: RunScript,
        hold: Optional[HoldState],
    ) -> Flow[Admission]:
        """QAG.ADMIT's words with their id (``hold``: a reservation's), or its script, or
        the policy's admission: forwarded, or admitted by the local windows (a
        reservation's tokens held there, as Redis would hold them)."""
        attempt = None if hold is None else hold.attempt

        def in_redis() -> Flow[Admission]:
            reply, by = yield from self._either(words, script, attempt, replayable=True)
            admission = replace(d.admission(reply), answered_by=by)
            with self._lock:
                self.local.windows.saw(chain, window or DEFAULT_WINDOW, self.wall(), admission)
            return admission

        def forwarded() -> Admission:
            return Admission(True, None, 0, None, None, "forwarded")

        def local(state: LocalState, now: float, share: float) -> Admission:
            held = None
            if hold is not None:
                until = now + hold.left_ms(self.monotonic()) / 1000
                held = (hold.id, hold.tokens, until)
            return state.windows.admit(chain, window or DEFAULT_WINDOW, now, share, held)

        return self._routed(in_redis(), Fallback(forwarded, local))

    def record(
        self,
        keys: Sequence[str],
        tokens: int,
        window: Optional[int],
        request_id: str,
        keep: Optional[int] = None,
    ) -> Flow[int]:
        words, script = record_call(keys, tokens, window, request_id)

        def by_script(keep_text: str) -> Flow[Any]:
            return (yield from self._sent(script(keep_text), True))

        def in_redis() -> Flow[int]:
            reply, _ = yield from self._spend(words, keep, by_script)
            return int(reply)

        def local(state: LocalState, now: float, share: float) -> int:
            return state.windows.record(keys, tokens, window or DEFAULT_WINDOW, now, share)

        return self._routed(in_redis(), Fallback(lambda: 0, local))

    # Reservations: QAG.ADMIT ... RESERVE, charged and committed by QAG.RECORD ... ID.

    def reserve(self, hold: HoldState) -> Flow[Admission]:
        words, script = admit_call(hold.chain, hold.window, hold.tokens, hold.hold_ms, hold.id)
        return self._admit(hold.chain, hold.window, words, script, hold)

    def charge(self, hold: HoldState, tokens: int) -> Flow[Recorded]:
        """A partial charge (``ID id PARTIAL``: never a replay, and the commit settles
        however often it ran, so it is sent again after a dropped connection too)."""
        words, script = record_call(hold.keys, tokens, hold.window, hold.id, partial=True)
        return self._hold_record(hold, words, script(""), tokens, tokens)

    def commit(self, hold: HoldState, tokens: int) -> Flow[Recorded]:
        """The commit: ``tokens`` is the whole count, partials included."""
        words, script = record_call(hold.keys, tokens, hold.window, hold.id)
        return self._hold_record(hold, words, script(""), max(tokens - hold.charged, 0), None)

    def _hold_record(
        self,
        hold: HoldState,
        words: List[Any],
        script: RunScript,
        unpaid: int,
        released: Optional[int],
    ) -> Flow[Recorded]:
        """A charge or commit: nothing for a forwarded reservation, the local windows'
        for a local one (its hold shrunk by ``released``, None: ended), else to Redis,
        answered by the policy when it fails (``unpaid``: what the local windows count
        then)."""
        window = hold.window or DEFAULT_WINDOW
        if hold.answered_by == "forwarded":
            return Recorded(0, "forwarded")
        if hold.answered_by == "local":
            with self._lock:
                now = self.wall()
                windows = self.local.windows
                windows.release(hold.keys, hold.id, released)
                recorded = windows.record(hold.keys, unpaid, window, now, self.local_share)
                return Recorded(recorded, "local")

        def in_redis() -> Flow[Recorded]:
            reply, by = yield from self._either(words, script, replayable=True)
            return Recorded(int(reply), by)

        def local(state: LocalState, now: float, share: float) -> Recorded:
            return Recorded(state.windows.record(hold.keys, unpaid, window, now, share), "local")

        forwarded = Fallback(lambda: Recorded(0, "forwarded"), local)
        return (yield from self._routed(in_redis(), forwarded))

    def release_locally(self, hold: HoldState) -> None:
        """A local reservation left without a commit: its hold ends (what it charged is
        counted already)."""
        with self._lock:
            self.local.windows.release(hold.keys, hold.id)

    def background_commit(self, hold: HoldState, tokens: int) -> Flow[int]:
        """A commit in the background (a guard left without one: what it charged; a
        reserve that may have held tokens and did not return them: 0): always to Redis,
        with the reservation's id."""
        words, script = record_call(hold.keys, tokens, hold.window, hold.id)
        return self._unrouted(self._record_int(words, script("")))

    def background_unreserve(self, hold: HoldState, left_ms: int) -> Flow[int]:
        """The release of a reserve that may have held tokens and returned no guard
        holding them (timed out, cancelled, answered by the policy after it was sent):
        its ADMIT replayed first, then a commit of 0. A replay of one that ran answers
        its reply; one still on its way then arrives as a replay, so the release never
        overtakes it (a RECORD before its ADMIT would be a plain record, and the hold
        would count until it expires). The replay holds for ``left_ms`` at most: on a
        server that lost the first ADMIT it makes a hold of its own, which must not
        outlive the one it stands for."""
        admit = admit_call(hold.chain, hold.window, hold.tokens, max(left_ms, 1), hold.id)
        words, script = record_call(hold.keys, 0, hold.window, hold.id)
        return self._unrouted(self._admit_then(admit, words, script("")))

    def _admit_then(
        self, admit: Tuple[List[Any], RunScript], words: List[Any], script: RunScript
    ) -> Flow[int]:
        yield from self._either(*admit, replayable=True)
        return (yield from self._record_int(words, script))

    def _record_int(self, words: List[Any], script: RunScript) -> Flow[int]:
        reply, _ = yield from self._either(words, script, replayable=True)
        return int(reply)


def admit_call(
    chain: List[Scope],
    window: Optional[int],
    reserve: int,
    hold_ms: Optional[int],
    request_id: Optional[str],
) -> Tuple[List[Any], RunScript]:
    """QAG.ADMIT's words (``ID request_id`` last; with ``RESERVE reserve [HOLD hold_ms]``
    when ``reserve`` is above 0), and lua/window.lua's admit of the same."""
    if reserve > 0:
        words = d.reserve_words(chain, window, reserve, hold_ms)
    else:
        words = d.admit_words(chain, window)
    limits = [limit for scope in chain for limit in (scope.rpm, scope.tpm)]
    options = (reserve, "" if hold_ms is None else hold_ms, request_id or "", "")
    arguments = ("admit", window or DEFAULT_WINDOW, *limits, *options)
    script = RunScript(tuple(scope.key for scope in chain), arguments, "window")
    return list(_with_id(words, request_id)), script


def record_call(
    keys: Sequence[str],
    tokens: int,
    window: Optional[int],
    request_id: str,
    partial: bool = False,
) -> Tuple[List[Any], Callable[[str], RunScript]]:
    """QAG.RECORD's words (``ID request_id [PARTIAL]`` last), and lua/window.lua's record
    of the same, given its KEEP ("" for none)."""
    words = d.record_words(keys, tokens, window) + ["ID", request_id]
    if partial:
        words.append("PARTIAL")

    def script(keep: str) -> RunScript:
        arguments = (window or DEFAULT_WINDOW, tokens, request_id, keep, "1" if partial else "")
        return RunScript(tuple(keys), ("record", *arguments), "window")

    return words, script


# How often a quota call is sent to the script with the period of the server's clock it
# answered: once is the rule; a period that ended meanwhile takes one more.
PERIOD_TRIES = 3


def period_arguments(per: str, tz: str, now: float) -> Tuple[Any, ...]:
    """What lua/quota.lua is given of the calendar for the clock ``now``: the period's
    label, start and end, and the next period's label and end (counted into when the key
    holds it), as the module computes them (``local.period``)."""
    current = period(per, tz, now)
    following = None if current is None else period(per, tz, current[2])
    if current is None or following is None:
        raise QagServerError(
            "ERR TZ must be a known IANA time zone name, e.g. Europe/Berlin or UTC"
        )
    label, start, end = current
    return (label, start, end, following[0], following[2])


def server_clock(reply: Any) -> Optional[float]:
    """The server's clock (Unix seconds) in the script's answer to a period that is not
    the server's: ``["period", seconds, microseconds]``; None for any other reply."""
    if not isinstance(reply, list) or len(reply) != 3 or reply[0] not in (b"period", "period"):
        return None
    return int(reply[1]) + int(reply[2]) / 1e6


def _waiting(words: Tuple[Any, ...], wait: Optional[float]) -> Command:
    """A command that may wait ``wait`` seconds for its turn: ``WAIT ms`` after its
    words, sent on a connection of its own (None: at once, as always)."""
    return Command((*words, *d.wait_words(wait)), wait=wait or 0.0)


def _with_id(words: Sequence[Any], request_id: Optional[str]) -> Tuple[Any, ...]:
    """A command's words, with ``ID request_id`` last when the call has an id."""
    return (*words, "ID", request_id) if request_id is not None else tuple(words)


def _script_id(request_id: Optional[str]) -> Tuple[str, ...]:
    """A bucket script's id and KEEP (none: "") after its other arguments, for the
    script that remembers it (``_bucket_script``)."""
    return () if request_id is None else (request_id, "")


def _bucket_script(request_id: Optional[str]) -> str:
    """The token-bucket script: with a request id, the one that remembers it."""
    return "bucket" if request_id is None else "bucket_ids"


def _chain(scopes: Sequence[Union[Scope, Tuple[str, int, int]]]) -> List[Scope]:
    return [scope if isinstance(scope, Scope) else Scope(*scope) for scope in scopes]


def _stored(fields: Any) -> Optional[Tuple[float, float]]:
    """Both fields read as the script reads them (a finite number each), else None."""
    if not isinstance(fields, list) or len(fields) != 2:
        raise QagServerError(f"an HMGET reply, got {fields!r}")
    values = []
    for raw in fields:
        try:
            value = float(raw.strip()) if raw is not None else math.nan
        except (TypeError, ValueError):
            return None
        if not math.isfinite(value):
            return None
        values.append(value)
    return values[0], values[1]


def _local_take(call: BucketCall) -> Callable[[LocalState, float, float], Decision]:
    """The bucket counted locally: this process's share of the count, refilled over the
    same period, in the limiter's one set of local buckets."""

    def decide(state: LocalState, now: float, share: float) -> Decision:
        buckets: LocalBuckets = state.buckets
        reply = buckets.take(call.key, share_of(call.count, share), call.period, call.cost, now)
        return call.decision(reply, "local")

    return decide

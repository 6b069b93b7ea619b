"""The limiting step of a gateway, as ADR 0032 and ADR 0011 give it, free of I/O and of
any web framework: what the ASGI middleware (``qag_client.asgi``) and the WSGI one
(``qag_client.wsgi``) both do with a request, in one place (the Rust client's
``tower.rs`` does the same).

1. the client's bucket, keyed by the caller's address: a refusal answers 429
   ``rate_limited`` and the key's bucket is not touched;
2. the key's bucket: 429 ``rate_limited`` ("for this API key"), the client's token
   given back;
3. the key's quota: 429 ``quota_exceeded``, both tokens given back;
4. the key's concurrency slot: 429 ``too_many_concurrent``, both tokens given back;
5. a window chain, for a model API (``window=``): the request's estimate of tokens
   held on every scope (QAG.ADMIT ... RESERVE), 429 ``rate_limited`` naming
   ``requests`` or ``tokens``, the tokens and the slot given back.

The buckets and the quota's check go in one round trip where they can share one
(``take_with_quota``), so a bucket's refusal shows the quota too. A limit in shadow is
asked and counted as usual, but its refusals are let through: logged (a line a second
at most) and counted (``limit_counts``), never answered 429.

Like the limiters' flows, each step is a generator that yields ``Call``s (a limiter
method and its arguments) and receives their answers, or has the limiter's error
thrown in; the middleware runs it with awaits or blocking calls.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Generator,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)
from urllib.parse import parse_qs

from ._driver import Budget, spending
from ._policy import LogEvery
from .answers import Refusal
from .decisions import (
    Admission,
    Decision,
    QagBusy,
    QagError,
    QagRefused,
    Quota,
    QuotaDecision,
    Scope,
    TakenWithQuota,
    new_id,
    reserve_words,
    wait_words,
)
from .headers import headers
from .naming import Bucket

log = logging.getLogger("qag_client")

Rate = Tuple[int, float]

# The limits the middleware asks, in the order it asks them.
LIMITS = ("client", "key", "quota", "concurrency", "window")


@dataclass(frozen=True)
class LimitCounts:
    """How a limit answered since the middleware was made (decisions the "forward"
    policy answered counted nothing and are left out); ``refused`` counts, for a limit
    in shadow, the refusals it let through."""

    allowed: int
    refused: int
    shadow: bool


class LimitState:
    """One limit's counts and, in shadow, the pace of its log lines."""

    def __init__(self, shadow: bool) -> None:
        self.shadow = shadow
        self.allowed = 0
        self.refused = 0
        # Refusals let through in shadow: one line a second.
        self.shadow_log = LogEvery()
        self.lock = threading.Lock()

    def count(self, allowed: bool) -> None:
        with self.lock:
            if allowed:
                self.allowed += 1
            else:
                self.refused += 1

    def counts(self) -> LimitCounts:
        with self.lock:
            return LimitCounts(self.allowed, self.refused, self.shadow)


@dataclass(frozen=True)
class KeyLimits:
    """A key's own limits (ADR 0011: keys have their own); None where it has none of
    that kind: its bucket (``count`` per ``period`` seconds), how many of its requests
    may run at once, its quota."""

    bucket: Optional[Rate] = None
    max_concurrent: Optional[int] = None
    quota: Optional[Quota] = None


@dataclass(frozen=True)
class WindowLimit:
    """A request's window chain, for a model API: the scopes it is counted in (e.g. its
    organisation's, its key's, its model's: ``Scope(key, rpm, tpm)`` or
    ``(key, rpm, tpm)``), the tokens held for it until it commits its actual count (its
    estimate: e.g. the prompt's tokens plus ``max_tokens``; admitted only if they fit on
    every scope beside what is counted and held), the window's seconds (None: 60) and
    how long the hold may count at most (None: until the end of the next window)."""

    scopes: Sequence[Union[Scope, Tuple[str, int, int]]]
    estimate: int
    window: Optional[int] = None
    hold_ms: Optional[int] = None

    @cached_property  # asked several times a request: made once
    def chain(self) -> List[Scope]:
        return [scope if isinstance(scope, Scope) else Scope(*scope) for scope in self.scopes]

    @property
    def tokens(self) -> int:
        """The tokens to hold: the estimate, at least 1 (a reservation holds some)."""
        return max(self.estimate, 1)

    def never_fits(self) -> bool:
        """The estimate is above a scope's tokens per window: no wait lets it in."""
        return any(0 < scope.tpm < self.tokens for scope in self.chain)


class RequestParts:
    """What the extractors see of a request, the same under ASGI and WSGI: the peer's
    address, the header fields (lowercase names; the first of repeated ones), the query
    parameters (the first value of each), and the raw ASGI scope or WSGI environ."""

    def __init__(
        self,
        raw: Mapping[str, Any],
        peer: Optional[str],
        header_list: Callable[[], Dict[str, str]],
        query_string: str,
    ) -> None:
        self.raw = raw
        self.peer = peer
        self._header_list = header_list
        self._query_string = query_string

    @cached_property
    def headers(self) -> Dict[str, str]:
        return self._header_list()

    @cached_property
    def query(self) -> Dict[str, str]:
        return {
            name: values[0]
            for name, values in parse_qs(self._query_string, keep_blank_values=True).items()
        }


Extract = Callable[[RequestParts], Optional[str]]
# A request's window chain, from its parts and its API key (None: it has none).
WindowOf = Callable[[RequestParts, Optional[str]], Optional[WindowLimit]]


def query_parameter(name: str) -> Extract:
    """An extractor: the query parameter ``name`` (e.g. ``?key=acme~partner``)."""
    return lambda parts: parts.query.get(name) or None


def header(name: str) -> Extract:
    """An extractor: the header field ``name`` (e.g. ``x-api-key``)."""
    lowered = name.lower()
    return lambda parts: parts.headers.get(lowered) or None


def _peer(parts: RequestParts) -> Optional[str]:
    return parts.peer


@dataclass(frozen=True)
class Config:
    """The middleware's configuration (the same options under ASGI and WSGI)."""

    client_bucket: Optional[Rate] = None
    client_address: Extract = _peer
    api_key: Extract = lambda _: None
    key_limits: Callable[[str], KeyLimits] = lambda _: KeyLimits()
    lease_ttl_ms: int = 30_000
    draft_headers: bool = True
    back_off: float = 5.0
    # The limiter's deadline: what every request's calls may wait on Redis, together.
    deadline: float = 0.5
    # Requests answered 503 because a limit could not be asked: one line a second.
    unavailable_log: LogEvery = field(default_factory=LogEvery, compare=False)
    unavailable_log_lock: threading.Lock = field(default_factory=threading.Lock, compare=False)
    # Each limit's counts, and whether it is in shadow (by name, LIMITS).
    limit_states: Dict[str, LimitState] = field(default_factory=dict, compare=False)
    # Seconds a request may wait for a limit's turn (WAIT), by limit.
    waits: Dict[str, float] = field(default_factory=dict)
    window: Optional[WindowOf] = None

    @staticmethod
    def of(
        limiter: Any,
        client_bucket: Optional[Rate],
        client_address: Optional[Extract],
        trusted_proxy_header: Optional[str],
        api_key: Optional[Extract],
        key_limits: Union[KeyLimits, Callable[[str], KeyLimits], None],
        lease_ttl_ms: int,
        draft_headers: bool,
        shadow: Iterable[str] = (),
        wait: Optional[Dict[str, float]] = None,
        window: Optional[WindowOf] = None,
    ) -> "Config":
        address = client_address or _peer
        if trusted_proxy_header is not None:
            address = _forwarded(trusted_proxy_header.lower(), address)
        if key_limits is None:
            key_limits = KeyLimits()
        if isinstance(key_limits, KeyLimits):
            fixed = key_limits
            limits_of: Callable[[str], KeyLimits] = lambda _: fixed
        else:
            limits_of = key_limits
        if not (isinstance(lease_ttl_ms, int) and lease_ttl_ms > 0):
            raise ValueError("lease_ttl_ms must be a positive integer")
        shadowed: FrozenSet[str] = frozenset((shadow,) if isinstance(shadow, str) else shadow)
        if not shadowed <= set(LIMITS):
            raise ValueError(f"shadow takes limits of {', '.join(LIMITS)}")
        waits = dict(wait or {})
        if not set(waits) <= {"client", "key", "concurrency"}:
            raise ValueError("wait takes limits of client, key, concurrency")
        for seconds in waits.values():
            wait_words(seconds)
        return Config(
            client_bucket,
            address,
            api_key or (lambda _: None),
            limits_of,
            lease_ttl_ms,
            draft_headers,
            limiter._back_off,
            limiter._deadline,
            limit_states={limit: LimitState(limit in shadowed) for limit in LIMITS},
            waits=waits,
            window=window,
        )

    def limit_counts(self, limit: str) -> LimitCounts:
        return self.limit_states[limit].counts()


def _forwarded(name: str, otherwise: Extract) -> Extract:
    """The first entry of a header a trusted proxy sets (as ``x-forwarded-for`` lists
    them), else ``otherwise``."""

    def address(parts: RequestParts) -> Optional[str]:
        first = parts.headers.get(name, "").split(",")[0].strip()
        return first or otherwise(parts)

    return address


class ReportRows:
    """Rows a handler reports for the key's quota: added with the call when the
    response starts, and what is reported while it streams when it ends."""

    def __init__(self) -> None:
        self._rows = 0
        self._lock = threading.Lock()

    def add(self, rows: int) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError("rows must be an integer of at least 0")
        with self._lock:
            self._rows += rows

    def take(self) -> int:
        with self._lock:
            rows, self._rows = self._rows, 0
            return rows


@dataclass
class Admitted:
    """What the middleware decided, for the handler: the decisions (None where not
    counted; ``quota`` is the check before the call), ``rows.add(n)`` to report rows
    for the key's quota, and ``window``: the tokens the request holds on its window
    chain (an entered ``AsyncReservation`` under ASGI, ``Reservation`` under WSGI), if
    it asked one and was admitted (a refusal a window in shadow let through holds
    none): ``charge(n)`` as the response streams, ``commit(actual)`` at its end; left
    uncommitted, what was charged is committed when the response ends."""

    request_id: str
    api_key: Optional[str]
    client: Optional[Decision]
    key: Optional[Decision]
    quota: Optional[QuotaDecision]
    rows: ReportRows = field(default_factory=ReportRows)
    window: Any = None


@dataclass(frozen=True)
class Call:
    """A limiter call for the driver: ``method`` of the limiter with ``arguments`` (and
    ``wait=`` when it may wait); "lease" takes a slot (the guard's enter) and answers
    the guard, "lease_exit" leaves it; "reserve" enters a reservation (``WindowLimit``)
    and answers the guard, "reserve_end" commits what it charged if it is still open."""

    method: str
    arguments: Tuple[Any, ...]
    wait: Optional[float] = None

    @property
    def options(self) -> Dict[str, Any]:
        return {} if self.wait is None else {"wait": self.wait}


Step = Generator[Call, Any, Any]
Fields = List[Tuple[str, str]]


class Limiting:
    """One request on its way through the limits."""

    def __init__(self, config: Config, parts: RequestParts) -> None:
        self.config = config
        # What its calls may wait on Redis, all of them together: one deadline.
        self.budget = Budget(config.deadline)
        # Its own id (its slot's lease id; its request id where none was given): this
        # process's, never a caller's text, so two requests can never share a slot.
        self.id = new_id()
        given = parts.headers.get("x-request-id", "")
        self.request_id = given if 0 < len(given) <= 128 else self.id
        self.api_key = config.api_key(parts)
        self.limits = KeyLimits() if self.api_key is None else config.key_limits(self.api_key)
        self.client_bucket: Optional[Bucket] = None
        if config.client_bucket is not None:
            address = config.client_address(parts) or "unknown"
            count, period = config.client_bucket
            self.client_bucket = Bucket.named("client", count, period, address)
        self.key_bucket: Optional[Bucket] = None
        if self.api_key is not None and self.limits.bucket is not None:
            count, period = self.limits.bucket
            self.key_bucket = Bucket.named("key", count, period, self.api_key)
        self.quota_key: Optional[str] = None
        if self.api_key is not None and self.limits.quota is not None:
            self.quota_key = f"qag:quota:{self.api_key}"
        self.client: Optional[Decision] = None
        self.key: Optional[Decision] = None
        self.quota: Optional[QuotaDecision] = None
        # The key's slots and the live leases when the request asked for one.
        self.slots: Optional[Tuple[int, int]] = None
        # The slot refused (and enforced).
        self.lease_refused: Optional[QagRefused] = None
        # The clock (Unix seconds) a quota's refusal was decided by, for its fields:
        # their ``t`` is then its ``retry-after``.
        self.refused_at: Optional[int] = None
        # Seconds the request waited for its slot (WAIT).
        self.slot_waited = 0.0
        self.lease: Any = None
        self.window_limit = None if config.window is None else config.window(parts, self.api_key)
        # Its scopes, made before anything is taken (a bad one raises here), and what
        # the module would refuse of it (a 503 when it is asked, as in the Rust client).
        self.window_chain: List[Scope] = []
        self.window_invalid: Optional[str] = None
        if self.window_limit is not None:
            self.window_chain = self.window_limit.chain
            if not self.window_limit.never_fits():
                try:
                    limit = self.window_limit
                    reserve_words(self.window_chain, limit.window, limit.tokens, limit.hold_ms)
                except ValueError as invalid:
                    self.window_invalid = f"the window limit is invalid: {invalid}"
        # The chain's answer, once asked, and the reservation holding its tokens.
        self.chain: Optional[Admission] = None
        self.hold: Any = None
        self.admitted: Optional[Admitted] = None
        # The fields the response started with (the call counted in the quota then).
        self._started: Optional[Fields] = None
        self._ended = False

    def admit(self) -> Step:
        """Asks every limit in order; a refusal gives back what the earlier ones took.
        Returns the ``Admitted`` or the ``Refusal``."""
        try:
            return (yield from self._admit())
        except QagError as error:
            # A limit could not be asked: 503 under "raise" (the other policies answer
            # an outage) or for an error no policy answers; what was taken goes back.
            with self.config.unavailable_log_lock:
                left_out = self.config.unavailable_log.due(time.monotonic())
            if left_out is not None:
                log.warning(
                    "qag: request %s answered 503, a limit could not be asked: %s%s",
                    self.request_id,
                    error,
                    f" ({left_out} more since the last such line)" if left_out else "",
                )
            yield from self._give_back()
            return Refusal("unavailable", max(int(self.config.back_off), 1))
        except BaseException:
            # Interrupted (cancelled) after the slot was taken: released in the background.
            lease, self.lease = self.lease, None
            if lease is not None:
                lease._abandon()
            raise

    def _admit(self) -> Step:
        client_bucket, key_bucket, quota = self.client_bucket, self.key_bucket, self.limits.quota
        taken: Optional[TakenWithQuota] = None
        waits = self.config.waits
        # The buckets, taken together, wait up to the longer of their waits.
        wait = max((waits[side] for side in ("client", "key") if side in waits), default=None)
        if self.quota_key is not None and quota is not None:
            taken = yield from _asked(
                Call("take_with_quota", (client_bucket, key_bucket, self.quota_key, quota), wait)
            )
            self.client, self.key = taken.client, taken.key
            # Whatever the buckets say: a refusal shows what is left of the quota.
            self.quota = taken.quota
        elif client_bucket is not None and key_bucket is not None:
            pair = yield from _asked(Call("take_pair", (client_bucket, key_bucket), wait))
            self.client, self.key = pair.client, pair.key
        elif client_bucket is not None:
            self.client = yield from _asked(Call("take", (client_bucket,), wait))
        elif key_bucket is not None:
            self.key = yield from _asked(Call("take", (key_bucket,), wait))
        self._count("client", self.client)
        if self.client is not None and not self.client.allowed:
            if not self._shadowed("client"):
                return Refusal("client", self.client.retry_after)
            if key_bucket is not None and self.key is None:
                # Let through: the key's bucket, which QAG.TAKE2 leaves alone behind a
                # refusing client bucket, is taken on its own.
                self.key = yield Call("take", (key_bucket,))
        self._count("key", self.key)
        if self.key is not None and not self.key.allowed and not self._shadowed("key"):
            yield from self._give_back()
            return Refusal("key", self.key.retry_after)
        if taken is not None:
            check = taken.quota
            if check is None:
                assert taken.quota_error is not None
                raise taken.quota_error
            self._count("quota", check)
            if not check.allowed and not self._shadowed("quota"):
                yield from self._give_back()
                exceeded = "calls" if check.calls_remaining == 0 else "rows"
                self.refused_at = now = int(time.time())
                return Refusal("quota", max(check.resets_at - now, 0), exceeded, check.resets_at)
        if self.api_key is not None and self.limits.max_concurrent is not None:
            slots = f"qag:running:{self.api_key}"
            max_slots = self.limits.max_concurrent
            try:
                self.lease = yield from _asked(
                    Call(
                        "lease",
                        (slots, max_slots, self.config.lease_ttl_ms, self.id),
                        waits.get("concurrency"),
                    )
                )
            except QagRefused as refused:
                self.slot_waited = refused.waited
                self._count("concurrency", refused)
                self.slots = (max_slots, refused.live)
                if not self._shadowed("concurrency"):
                    self.lease_refused = refused
                    yield from self._give_back()
                    return Refusal("concurrency")
            else:
                self.slot_waited = self.lease.waited
                self._count("concurrency", self.lease)
                if self.lease.answered_by != "forwarded":
                    self.slots = (max_slots, self.lease.live)
        if self.window_limit is not None and self.window_limit.never_fits():
            self.config.limit_states["window"].count(False)
            if not self._shadowed("window"):
                yield from self._give_back()
                return Refusal("window", None, "tokens")
        elif self.window_limit is not None:
            if self.window_invalid is not None:
                raise QagError(self.window_invalid)
            hold = yield Call("reserve", (self.window_limit,))
            self.chain = admission = hold.admission
            self._count("window", admission)
            if not admission.admitted and not self._shadowed("window"):
                yield from self._give_back()
                # None left, or the estimate does not fit beside what is counted.
                exceeded = "requests" if admission.requests_remaining == 0 else "tokens"
                return Refusal("window", admission.retry_after, exceeded)
            # A refusal the window in shadow let through holds nothing: no hold.
            self.hold = hold if admission.admitted else None
        self.admitted = Admitted(
            self.request_id, self.api_key, self.client, self.key, self.quota, window=self.hold
        )
        return self.admitted

    def _count(self, limit: str, decision: Any) -> None:
        """Counts a limit's decision (a Decision, QuotaDecision, Lease, QagRefused or
        Admission); a forwarded one counted nothing."""
        if decision is None or decision.answered_by == "forwarded":
            return
        if isinstance(decision, Admission):
            allowed = decision.admitted
        else:
            allowed = not isinstance(decision, QagRefused) and getattr(decision, "allowed", True)
        self.config.limit_states[limit].count(allowed)

    def _shadowed(self, limit: str) -> bool:
        """A limit refused: True if it is in shadow (the refusal logged, a line a second
        at most, and let through)."""
        state = self.config.limit_states[limit]
        if not state.shadow:
            return False
        with state.lock:
            left_out = state.shadow_log.due(time.monotonic())
        if left_out is not None:
            log.warning(
                "qag: shadow: the %s limit refused request %s and let it through%s",
                limit,
                self.request_id,
                f" ({left_out} more since the last such line)" if left_out else "",
            )
        return True

    def _give_back(self) -> Step:
        """Gives back what the earlier limits took for a request a later limit refused:
        its slot, and the tokens the buckets took from Redis (the headers then show what
        the buckets hold after it). Only Redis's: a forwarded take took nothing, and a
        local one is not worth a token that a refund to Redis (or to a local bucket
        cleared since) would mint."""
        lease, self.lease = self.lease, None
        if lease is not None:
            yield Call("lease_exit", (lease,))
        for bucket, side in ((self.client_bucket, "client"), (self.key_bucket, "key")):
            taken: Optional[Decision] = getattr(self, side)
            if bucket is None or taken is None or not taken.allowed:
                continue
            if taken.answered_by not in ("module", "script"):
                continue
            try:
                refunded = yield Call("refund", (bucket, 1))
            except QagError as error:
                log.warning("qag: refund to %s failed: %s", bucket.key, error)
                continue
            setattr(self, side, _with_remaining(taken, refunded.remaining))

    def _headers(self, quota: Optional[QuotaDecision]) -> Fields:
        return headers(
            self.client,
            self.key,
            quota,
            self.lease_refused,
            now=self.refused_at,
            draft=self.config.draft_headers,
            slots=self.slots,
            chain=None if self.chain is None else (self.window_chain, self.chain),
            window=None if self.window_limit is None else self.window_limit.window,
            slot_waited=self.slot_waited,
        )

    def refused(self, refusal: Refusal) -> Tuple[int, Fields, bytes]:
        """The refusal's status, header fields and body."""
        fields = [pair for pair in self._headers(self.quota) if pair[0] != "retry-after"]
        seconds = refusal.seconds
        if seconds is not None:
            fields.append(("retry-after", str(seconds)))
        body = refusal.body(self.request_id).encode()
        fields += [("content-type", "application/json"), ("content-length", str(len(body)))]
        return refusal.status, fields, body

    def started(self) -> Step:
        """The response starts: the call and the rows reported so far are added to the
        quota; returns the header fields to add to the response. Once: a response
        started again (a WSGI app replacing it, ``exc_info``) gets the same fields."""
        if self._started is not None:
            return self._started
        quota_after = self.quota
        quota = self.limits.quota
        if self.quota_key is not None and quota is not None and self.admitted is not None:
            rows = self.admitted.rows.take()
            try:
                usage = yield Call("quota_add", (self.quota_key, quota, 1, rows))
            except QagError as error:
                log.warning("qag: quota add for %s failed: %s", self.quota_key, error)
            else:
                if self.quota is not None:
                    quota_after = self.quota.after(usage)
        # Admitted: a refusal a limit in shadow let through asks no wait.
        self._started = [pair for pair in self._headers(quota_after) if pair[0] != "retry-after"]
        return self._started

    def ended(self) -> Step:
        """The response ended (its last body message, the client gone, or the app
        failed): the slot is released, rows reported while it streamed are added.
        Once only."""
        if self._ended:
            return None
        self._ended = True
        hold, self.hold = self.hold, None
        lease, self.lease = self.lease, None
        try:
            if lease is not None:
                yield Call("lease_exit", (lease,))
            if hold is not None:
                try:
                    yield Call("reserve_end", (hold,))
                except QagError as error:  # the commit goes on in the background
                    log.warning("qag: committing a window's hold failed: %s", error)
        finally:
            if hold is not None:
                # Interrupted before its end (cancelled): what was charged is committed
                # in the background (nothing if it was committed).
                hold._exit()
        quota = self.limits.quota
        if self.quota_key is not None and quota is not None and self.admitted is not None:
            late = self.admitted.rows.take()
            if late:
                try:
                    yield Call("quota_add", (self.quota_key, quota, 0, late))
                except QagError as error:
                    log.warning("qag: adding %d rows to %s failed: %s", late, self.quota_key, error)
        return None


def _with_remaining(decision: Decision, remaining: int) -> Decision:
    from dataclasses import replace

    return replace(decision, remaining=remaining)


def _asked(call: Call) -> Step:
    """``call``, asked again at once without its wait when this process has no
    connection for waiting calls free (``QagBusy``: ``max_waiting`` calls wait already),
    as the server answers a call beyond its ``MAX-WAITERS``: a 200 or a 429 then, not a
    503."""
    try:
        return (yield call)
    except QagBusy:
        if call.wait is None:
            raise
        return (yield Call(call.method, call.arguments))


def _reservation(limiter: Any, limit: WindowLimit) -> Any:
    """The reservation guard of ``limit``, not entered."""
    return limiter.reserve(limit.chain, limit.tokens, window=limit.window, hold_ms=limit.hold_ms)


def drive_sync(limiter: Any, step: Step, budget: Budget) -> Any:
    """Runs a step with the blocking ``Limiter``, its calls spending the request's
    ``budget``."""
    with spending(budget):
        return _drive_sync(limiter, step)


def _drive_sync(limiter: Any, step: Step) -> Any:
    reply: Any = None
    error: Optional[QagError] = None
    while True:
        try:
            call = step.send(reply) if error is None else step.throw(error)
        except StopIteration as stop:
            return stop.value
        reply, error = None, None
        try:
            if call.method == "lease":
                guard = limiter.lease(*call.arguments, **call.options)
                reply = guard.__enter__()
            elif call.method == "lease_exit":
                call.arguments[0].__exit__(None, None, None)
            elif call.method == "reserve":
                reply = _reservation(limiter, call.arguments[0]).__enter__()
            elif call.method == "reserve_end":
                call.arguments[0].release()
            else:
                reply = getattr(limiter, call.method)(*call.arguments, **call.options)
        except QagError as failed:
            error = failed
        except BaseException:
            step.close()  # its ``finally`` blocks run now, not when it is collected
            raise


async def drive_async(limiter: Any, step: Step, budget: Budget) -> Any:
    """Runs a step with the ``AsyncLimiter``, its calls spending the request's
    ``budget``."""
    with spending(budget):
        return await _drive_async(limiter, step)


async def _drive_async(limiter: Any, step: Step) -> Any:
    reply: Any = None
    error: Optional[QagError] = None
    while True:
        try:
            call = step.send(reply) if error is None else step.throw(error)
        except StopIteration as stop:
            return stop.value
        reply, error = None, None
        try:
            if call.method == "lease":
                guard = limiter.lease(*call.arguments, **call.options)
                reply = await guard.__aenter__()
            elif call.method == "lease_exit":
                await call.arguments[0].__aexit__(None, None, None)
            elif call.method == "reserve":
                reply = await _reservation(limiter, call.arguments[0]).__aenter__()
            elif call.method == "reserve_end":
                await call.arguments[0].release()
            else:
                reply = await getattr(limiter, call.method)(*call.arguments, **call.options)
        except QagError as failed:
            error = failed
        except BaseException:
            step.close()  # its ``finally`` blocks run now, not when it is collected
            raise

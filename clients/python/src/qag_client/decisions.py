"""What the limiter answers, as plain values; the checks of arguments before anything
is sent; and the exceptions. No I/O here."""

from __future__ import annotations

import itertools
import math
import os
import secrets
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

if TYPE_CHECKING:
    from .naming import Bucket

COUNT_MAX = 1 << 53
COST_MAX = (1 << 63) - 1
PERIOD_MIN = 1e-6
PERIOD_MAX = 1e10
LEASE_MAX_SLOTS = 1_000_000
LEASE_MAX_TTL_MS = 7 * 24 * 3600 * 1000
LEASE_MAX_ID_BYTES = 256
SCOPES_MAX = 64
WINDOW_MAX = 86400
INT64_MAX = (1 << 63) - 1
REQUEST_ID_MAX_BYTES = 128
HOLD_MAX_MS = 172_800_000


class QagError(Exception):
    """Every error of this package."""


class QagUnavailable(QagError):
    """Redis could not be reached, dropped the connection, is not serving (loading,
    cluster down), or did not answer within the per-call deadline (whether it ran the
    command is then unknown); or, under ``on_unavailable="raise"``, a back-off after
    such a failure is running and Redis was left alone. The only error that starts a
    back-off."""


class QagBusy(QagError):
    """No connection of the limiter's own pool came free within the deadline: the
    process has more calls in flight than ``max_connections``. Back-pressure, not an
    outage: it starts no back-off and is never answered by the policy."""


class QagPermissionError(QagError):
    """The server refused the command for this user (NOPERM): a configuration error,
    never read as a missing module."""


class QagModuleRequired(QagError):
    """The backend is "module" and the server does not have the module (with "auto"
    and "script", every family's script answers instead)."""


class QagServerError(QagError):
    """Any other error reply (WRONGTYPE, CROSSSLOT, OOM, ...) or a reply of an
    unexpected shape."""


class QagCrossSlot(QagServerError):
    """On a cluster, the keys of one call are in different slots: raised before anything
    is sent (the module would answer CROSSSLOT, the script would run them apart). Give
    the keys a common hash tag; for a bucket pair, or make the limiter with
    ``cross_slot="two_calls"``."""


class QagRefused(QagError):
    """A lease was refused: every slot of the key is held (``live`` leases; in this
    process's count when ``answered_by`` is "local"). ``headers(lease=...)`` renders it
    as ``retry-after: 1``."""

    def __init__(
        self,
        live: int,
        retry_after: Optional[int],
        answered_by: str = "module",
        waited: float = 0.0,
    ) -> None:
        wait = "never" if retry_after is None else f"{retry_after} s"
        super().__init__(f"every slot is held ({live} live); retry after {wait}")
        self.live = live
        self.retry_after = retry_after
        self.answered_by = answered_by
        # Seconds the call waited for a slot (``wait=``) before it was refused.
        self.waited = waited


ANSWERED_BY = ("module", "script", "local", "forwarded")


@dataclass(frozen=True)
class Counts:
    """How the limiter's calls were answered since it was made, for metrics: by the
    module, by the script, locally, forwarded; ``errors``: calls that raised, and
    background releases and renewals that failed."""

    module: int = 0
    script: int = 0
    local: int = 0
    forwarded: int = 0
    errors: int = 0
    # Calls sent once more, with their id, after their connection dropped.
    replays: int = 0


@dataclass(frozen=True)
class Decision:
    """One token bucket's answer. ``retry_after`` is 0 when allowed, else whole seconds
    until the cost fits, or None when it never fits (a cost above the count).
    ``answered_by`` is "module", "script" (without the module), "local" (counted in
    this process after Redis failed) or "forwarded" (not counted: Redis failed and the
    request goes through; ``remaining`` is then the limit)."""

    allowed: bool
    limit: int
    period: float
    remaining: int
    retry_after: Optional[int]
    answered_by: str = "module"
    # Seconds the server held the call for its tokens (``wait=``): 0 when answered at once.
    waited: float = 0.0

    @property
    def backend(self) -> str:
        """The former name of ``answered_by``."""
        return self.answered_by

    def seconds_to_full(self) -> int:
        """Seconds until the bucket is full again, as far as its whole tokens tell."""
        if self.limit <= 0:  # only a Decision made by hand: the library's have a count
            return 0
        missing = max(self.limit - self.remaining, 0)
        return math.ceil(missing * self.period / self.limit)


@dataclass(frozen=True)
class PairDecision:
    """Both buckets of a request; ``key`` is None when the client bucket refused (the
    key bucket was not counted)."""

    client: Decision
    key: Optional[Decision]

    @property
    def allowed(self) -> bool:
        return self.client.allowed and self.key is not None and self.key.allowed

    @property
    def refused_by(self) -> Optional[str]:
        """ "client" or "key": the bucket that refused, if one did."""
        if not self.client.allowed:
            return "client"
        if self.key is not None and not self.key.allowed:
            return "key"
        return None

    @property
    def retry_after(self) -> Optional[int]:
        """The refusing bucket's wait (None: never fits), 0 when allowed."""
        if self.refused_by == "client":
            return self.client.retry_after
        if self.refused_by == "key" and self.key is not None:
            return self.key.retry_after
        return 0

    @property
    def answered_by(self) -> str:
        return self.client.answered_by

    @property
    def backend(self) -> str:
        """The former name of ``answered_by``."""
        return self.answered_by


@dataclass(frozen=True)
class Refunded:
    """What a refund left: the bucket's whole tokens after it (its count when
    forwarded: nothing was given back)."""

    remaining: int
    answered_by: str = "module"


@dataclass(frozen=True)
class Quota:
    """A quota described once, for its check, add and seed: a calendar ``per`` ("day"
    or "month") in the IANA zone ``tz``, with a calls limit, a rows limit or both (None:
    no limit of that kind; a check needs one)."""

    per: str
    tz: str = "UTC"
    calls: Optional[int] = None
    rows: Optional[int] = None


@dataclass(frozen=True)
class QuotaUsage:
    """The period's counts after QAG.QUOTA.ADD or QAG.QUOTA.SEED (0 when forwarded:
    nothing was counted)."""

    calls: int
    rows: int
    resets_at: int
    answered_by: str = "module"


@dataclass(frozen=True)
class QuotaDecision:
    """QAG.QUOTA's answer, with the limits it was checked against; ``resets_at`` is the
    period's end in Unix seconds. Forwarded: allowed, remaining None."""

    allowed: bool
    calls_limit: Optional[int]
    calls_remaining: Optional[int]
    rows_limit: Optional[int]
    rows_remaining: Optional[int]
    resets_at: int
    answered_by: str = "module"

    def after(self, usage: QuotaUsage) -> "QuotaDecision":
        """The check as it stands after the call's counts were added: what remains is
        the limit less the usage QAG.QUOTA.ADD answered (so the last call a quota allows
        renders 0 left), ``resets_at`` the usage's, ``allowed`` unchanged. A forwarded
        usage (nothing counted) changes nothing."""
        if usage.answered_by == "forwarded":
            return self

        def left(limit: Optional[int], used: int) -> Optional[int]:
            return None if limit is None else max(limit - used, 0)

        return replace(
            self,
            calls_remaining=left(self.calls_limit, usage.calls),
            rows_remaining=left(self.rows_limit, usage.rows),
            resets_at=usage.resets_at,
        )


@dataclass(frozen=True)
class TakenWithQuota:
    """A request's buckets and its quota's check, asked together (``take_with_quota``):
    ``client`` and ``key`` the buckets' decisions (None where no bucket was given, and
    the key's when the client's refused: not counted), ``quota`` the check (it counts
    nothing), or None and ``quota_error`` the error the check met. A request a bucket
    refused is answered by that refusal whatever the check says."""

    client: Optional[Decision]
    key: Optional[Decision]
    quota: Optional[QuotaDecision]
    quota_error: Optional[QagError] = None

    @property
    def buckets_allowed(self) -> bool:
        return all(d.allowed for d in (self.client, self.key) if d is not None)

    @property
    def answered_by(self) -> str:
        for decision in (self.client, self.key, self.quota):
            if decision is not None:
                return decision.answered_by
        return "module"


@dataclass(frozen=True)
class Scope:
    """One scope of a sliding-window chain: its key, requests and tokens per window
    (0: no limit of that kind)."""

    key: str
    rpm: int
    tpm: int


@dataclass(frozen=True)
class Admission:
    """QAG.ADMIT's answer; ``refused_by`` is the 0-based index of the refusing scope;
    remaining counts are None where no scope limits that kind."""

    admitted: bool
    refused_by: Optional[int]
    # Whole seconds (0 when admitted); None: never (the module's replies always wait).
    retry_after: Optional[int]
    requests_remaining: Optional[int]
    tokens_remaining: Optional[int]
    answered_by: str = "module"


@dataclass(frozen=True)
class LeaseGrant:
    """QAG.LEASE's answer (or the policy's): taken or not, the live leases, the wait."""

    acquired: bool
    live: int
    retry_after: Optional[int]
    answered_by: str = "module"
    # Seconds the server held the call for a slot (``wait=``).
    waited: float = 0.0


# The longest a call may wait (``wait=``), as the module bounds WAIT.
MAX_WAIT = 60.0


def wait_words(wait: Optional[float]) -> Tuple[object, ...]:
    """``WAIT ms`` for a call that may wait ``wait`` seconds for its turn (None: it
    answers at once); checked before anything is sent."""
    if wait is None:
        return ()
    if (
        isinstance(wait, bool)
        or not isinstance(wait, (int, float))
        or not 0 <= wait <= MAX_WAIT  # NaN fails too
    ):
        raise ValueError(f"wait must be a number of seconds from 0 to {MAX_WAIT:g}")
    return ("WAIT", min(math.ceil(wait * 1000), int(MAX_WAIT * 1000)))


def _integer(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high}")
    return value


def _text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


def period_text(period: object) -> str:
    """Checks a bucket period and writes it as the module and the script read it
    back: the shortest exact decimal."""
    if isinstance(period, bool) or not isinstance(period, (int, float)):
        raise ValueError("period must be a number of seconds")
    value = float(period)
    if not (math.isfinite(value) and PERIOD_MIN <= value <= PERIOD_MAX):
        raise ValueError("period must be a number from 0.000001 to 10000000000")
    text = repr(value)
    return text[:-2] if text.endswith(".0") else text


@dataclass(frozen=True)
class BucketCall:
    """A bucket call's arguments, checked as the module checks them."""

    key: str
    count: int
    period: float
    cost: int
    period_text: str

    @staticmethod
    def on(bucket: "Bucket", cost: int) -> "BucketCall":
        """A call on a described bucket."""
        return BucketCall.of(bucket.key, bucket.count, bucket.period, cost)

    @staticmethod
    def of(key: str, count: int, period: float, cost: int) -> "BucketCall":
        """Checks in the module's order: key, count, period, cost."""
        key = _text("key", key)
        count = _integer("count", count, 1, COUNT_MAX)
        text = period_text(period)
        cost = _integer("cost", cost, 1, COST_MAX)
        return BucketCall(key, count, float(period), cost, text)

    def arguments(self) -> Tuple[object, ...]:
        """count, period and, unless the default 1, COST n."""
        base: Tuple[object, ...] = (self.count, self.period_text)
        return base if self.cost == 1 else base + ("COST", self.cost)

    def decision(self, reply: object, answered_by: str) -> Decision:
        """A decision from QAG.TAKE's (or the script's) reply, ``[allowed, left,
        retry]``, or with WAIT ``[allowed, left, retry, waited_ms]``."""
        values, waited = _waited(reply, 3, "a bucket reply")
        allowed, left, retry = values
        if allowed not in (0, 1) or left < 0 or retry < -1:
            raise QagServerError(f"a bucket reply, got {reply!r}")
        wait = None if retry == -1 else retry
        return Decision(bool(allowed), self.count, self.period, left, wait, answered_by, waited)

    def refund_arguments(self, n: int) -> Tuple[object, ...]:
        """QAG.REFUND's (and the refund script's) count, period and n."""
        return (self.count, self.period_text, _integer("n", n, 1, INT64_MAX))

    def refunded(self, reply: object, answered_by: str) -> Refunded:
        if isinstance(reply, bool) or not isinstance(reply, int) or reply < 0:
            raise QagServerError(f"a QAG.REFUND reply, got {reply!r}")
        return Refunded(reply, answered_by)

    def forwarded(self) -> Decision:
        """Not counted: the request goes through."""
        return Decision(True, self.count, self.period, self.count, 0, "forwarded")


class _RequestIds:
    """This process's ids (the package's only source of them: its calls' default request
    ids, the middleware's requests and their lease ids): ``<16 hex chars chosen at random
    once>-<a counter>``, e.g. ``9f86d081884c7d65-42``: no system call an id, and unique
    across a fleet with high probability. A forked child (a worker forked after the
    package was imported) chooses its own prefix."""

    def __init__(self) -> None:
        self.restart()
        os.register_at_fork(after_in_child=self.restart)

    def restart(self) -> None:
        self.prefix = secrets.token_hex(8)
        self.counter = itertools.count(1)

    def next(self) -> str:
        return f"{self.prefix}-{next(self.counter)}"


_REQUEST_IDS = _RequestIds()


def new_id() -> str:
    """A new id of this process's, unique across a fleet and its forked workers."""
    return _REQUEST_IDS.next()


def request_id_of(given: Optional[str]) -> str:
    """The id a call that records spend sends (a quota add, a record, a reservation):
    the caller's (checked: 1 to 128 bytes in UTF-8), else a new one of this process's,
    so that a replay counts once."""
    checked = caller_id(given)
    return new_id() if checked is None else checked


def caller_id(given: Optional[str]) -> Optional[str]:
    """The caller's id, checked (1 to 128 bytes in UTF-8), or None. An admission (a
    take, a pair, a refund, an ADMIT) sends only the caller's: an id costs the key
    memory and the server CPU, and what it would save, a replay's second charge, errs
    stricter by one."""
    if given is None:
        return None
    if not isinstance(given, str) or not 1 <= len(given.encode()) <= REQUEST_ID_MAX_BYTES:
        raise ValueError(f"request_id must be a string of 1 to {REQUEST_ID_MAX_BYTES} bytes")
    return given


def check_lease(key: str, max_slots: int, ttl_ms: int, lease_id: str) -> None:
    _text("key", key)
    _integer("max", max_slots, 1, LEASE_MAX_SLOTS)
    check_ttl(ttl_ms)
    check_id(lease_id)


def check_ttl(ttl_ms: int) -> None:
    _integer("ttl_ms", ttl_ms, 1, LEASE_MAX_TTL_MS)


def check_id(lease_id: str) -> None:
    _text("id", lease_id)
    if len(lease_id.encode()) > LEASE_MAX_ID_BYTES:
        raise ValueError(f"id must be at most {LEASE_MAX_ID_BYTES} bytes")


def quota_words(per: str, tz: str) -> List[object]:
    if per not in ("day", "month"):
        raise ValueError("PER must be day or month")
    return ["PER", per, "TZ", _text("tz", tz)]


def check_quota(quota: object) -> "Quota":
    if not isinstance(quota, Quota):
        raise ValueError("quota must be a Quota(per, tz, calls, rows)")
    return quota


def quota_check_words(key: str, quota: Quota) -> List[object]:
    quota = check_quota(quota)
    calls, rows = quota.calls, quota.rows
    words: List[object] = ["QAG.QUOTA", _text("key", key), *quota_words(quota.per, quota.tz)]
    if calls is None and rows is None:
        raise ValueError("missing CALLS or ROWS")
    if calls is not None:
        words += ["CALLS", _integer("calls", calls, 0, INT64_MAX)]
    if rows is not None:
        words += ["ROWS", _integer("rows", rows, 0, INT64_MAX)]
    return words


def quota_count_words(command: str, key: str, quota: Quota, calls: int, rows: int) -> List[object]:
    quota = check_quota(quota)
    return [
        command,
        _text("key", key),
        *quota_words(quota.per, quota.tz),
        "CALLS",
        _integer("calls", calls, 0, INT64_MAX),
        "ROWS",
        _integer("rows", rows, 0, INT64_MAX),
    ]


def _window_words(window: Optional[int]) -> List[object]:
    return [] if window is None else ["WINDOW", _integer("WINDOW", window, 1, WINDOW_MAX)]


def admit_words(
    scopes: Sequence[Union[Scope, Tuple[str, int, int]]], window: Optional[int]
) -> List[object]:
    chain = [scope if isinstance(scope, Scope) else Scope(*scope) for scope in scopes]
    _integer("numscopes", len(chain), 1, SCOPES_MAX)
    keys = [_text("key", scope.key) for scope in chain]
    if len(set(keys)) != len(keys):
        raise ValueError("each scope must have its own key")
    words: List[object] = ["QAG.ADMIT", len(chain)]
    for scope in chain:
        words += [
            scope.key,
            _integer("rpm", scope.rpm, 0, INT64_MAX),
            _integer("tpm", scope.tpm, 0, INT64_MAX),
        ]
    return words + _window_words(window)


def record_words(keys: Sequence[str], tokens: int, window: Optional[int]) -> List[object]:
    _integer("numscopes", len(keys), 1, SCOPES_MAX)
    checked = [_text("key", key) for key in keys]
    if len(set(checked)) != len(checked):
        raise ValueError("each scope must have its own key")
    tokens = _integer("tokens", tokens, 0, INT64_MAX)
    return ["QAG.RECORD", len(checked), *checked, tokens] + _window_words(window)


def reserve_words(
    scopes: Sequence[Union[Scope, Tuple[str, int, int]]],
    window: Optional[int],
    tokens: int,
    hold_ms: Optional[int],
) -> List[object]:
    """QAG.ADMIT ... RESERVE tokens [HOLD ms], before its ID: checked as the module
    checks them (a reservation above a scope's tpm could never be admitted)."""
    words = admit_words(scopes, window)
    tokens = _integer("tokens", tokens, 1, INT64_MAX)
    limits = [scope.tpm if isinstance(scope, Scope) else scope[2] for scope in scopes]
    if any(0 < tpm < tokens for tpm in limits):
        raise ValueError("tokens is above a scope's tpm: it could never be admitted")
    words += ["RESERVE", tokens]
    if hold_ms is not None:
        words += ["HOLD", _integer("hold_ms", hold_ms, 1, HOLD_MAX_MS)]
    return words


def _integers(reply: object, length: int, what: str) -> List[int]:
    if (
        not isinstance(reply, (list, tuple))
        or len(reply) != length
        or not all(isinstance(value, int) for value in reply)
    ):
        raise QagServerError(f"{what} of {length} integers, got {reply!r}")
    return list(reply)


def _waited(reply: object, length: int, what: str) -> Tuple[List[int], float]:
    """A reply of ``length`` integers, and with WAIT one more, the milliseconds the
    call waited (as seconds)."""
    if isinstance(reply, (list, tuple)) and len(reply) == length + 1:
        values = _integers(reply, length + 1, what)
        if values[length] < 0:
            raise QagServerError(f"{what}, got {reply!r}")
        return values[:length], values[length] / 1000
    return _integers(reply, length, what), 0.0


def _non_negative(value: Optional[int]) -> Optional[int]:
    if value is not None and (not isinstance(value, int) or value < 0):
        raise QagServerError(f"a count of at least 0, got {value!r}")
    return value


def quota_decision(reply: object, calls: Optional[int], rows: Optional[int]) -> QuotaDecision:
    if not isinstance(reply, (list, tuple)) or len(reply) != 4 or reply[0] not in (0, 1):
        raise QagServerError(f"a QAG.QUOTA reply, got {reply!r}")
    if not isinstance(reply[3], int):
        raise QagServerError(f"a QAG.QUOTA reply, got {reply!r}")
    return QuotaDecision(
        allowed=reply[0] == 1,
        calls_limit=calls,
        calls_remaining=_non_negative(reply[1]),
        rows_limit=rows,
        rows_remaining=_non_negative(reply[2]),
        resets_at=reply[3],
    )


def quota_usage(reply: object) -> QuotaUsage:
    calls, rows, resets_at = _integers(reply, 3, "a QAG.QUOTA.ADD reply")
    if calls < 0 or rows < 0:
        raise QagServerError(f"a QAG.QUOTA.ADD reply, got {reply!r}")
    return QuotaUsage(calls, rows, resets_at)


def admission(reply: object) -> Admission:
    admitted, scope, retry, requests, tokens = _integers(reply, 5, "a QAG.ADMIT reply")
    if admitted not in (0, 1) or scope < 0 or retry < 0 or min(requests, tokens) < -1:
        raise QagServerError(f"a QAG.ADMIT reply, got {reply!r}")
    return Admission(
        admitted=admitted == 1,
        refused_by=scope - 1 if scope else None,
        retry_after=retry,
        requests_remaining=None if requests == -1 else requests,
        tokens_remaining=None if tokens == -1 else tokens,
    )


def lease_grant(reply: object) -> LeaseGrant:
    (acquired, live, retry), waited = _waited(reply, 3, "a QAG.LEASE reply")
    retry_after = None if retry == -1 else max(retry, 0)
    return LeaseGrant(acquired == 1, max(live, 0), retry_after, "module", waited)

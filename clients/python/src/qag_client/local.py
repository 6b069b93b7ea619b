"""Counting in this process's memory, for the back-off after Redis failed
(``on_unavailable="local"``): token buckets (counted with the script's arithmetic, step
for step in doubles; the Rust client uses qag-core's; both are tested against
``clients/shared_cases.json``), leases, quotas and fixed windows aligned to the clock.
Each starts from what Redis last answered for its key (``saw``: the tokens left and
when, the live leases, the counts, what a window had left), refilled by the clock from
there; only a key this process never saw answered starts as a fresh one (a full bucket,
no lease, nothing counted). Every limit, and what Redis said is left of it, is scaled
by the process's share (``local_share``), so one process never grants more than its
share of what was left plus what refills, and a fleet of N processes with a share of
1/N stays within the limit during an outage. Plain code: the clock is an argument."""

from __future__ import annotations

import calendar
import math
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Callable, Dict, Generic, List, Optional, Sequence, Set, Tuple, TypeVar

from .decisions import Admission, LeaseGrant, QuotaDecision, QuotaUsage, Scope

# Keys tracked per kind (buckets, leases, quotas, windows: each of their maps), the
# least recently written going first above it (a key gone reads as never seen); each
# write drops a few stale ones first (a full bucket reads as a missing one; a lease run
# out, a window or quota past its period counts nothing).
PRUNE_ABOVE = 100_000
# The most entries one write to a ``Recent`` map looks at for stale ones.
PRUNE_STEP = 64

V = TypeVar("V")


def share_of(limit: int, share: float) -> int:
    """A process's part of a limit: ``max(1, floor(limit * share))``."""
    return max(1, min(limit, math.floor(limit * share)))


def _lua_max(a: float, b: float) -> float:
    return b if b > a else a


def _lua_min(a: float, b: float) -> float:
    return b if b < a else a


def take(
    count: int, period: float, cost: int, stored: Optional[Tuple[float, float]], now: float
) -> Tuple[List[int], Tuple[float, float]]:
    """The script on one bucket: the reply ``[allowed, left, retry]`` and the state
    ``(tokens, ts)`` to keep. ``stored`` is None for a missing bucket."""
    tokens, ts = stored if stored is not None else (float(count), now)
    rate = count / period
    elapsed = _lua_max(0.0, now - ts)
    tokens = _lua_min(float(count), tokens + elapsed * rate)
    if cost > count:
        allowed, retry = 0, -1
    elif tokens >= cost:
        tokens -= cost
        allowed, retry = 1, 0
    else:
        allowed, retry = 0, math.ceil((cost - tokens) / rate)
    return [allowed, math.floor(tokens), retry], (tokens, _lua_max(ts, now))


def refund(
    count: int, period: float, n: int, stored: Optional[Tuple[float, float]], now: float
) -> Tuple[int, Optional[Tuple[float, float]]]:
    """lua/token_refund.lua on one bucket: the tokens left and the state to keep (None:
    a missing bucket is full, nothing is written). Refilled to now as a take of nothing
    refills it, then ``n`` added, never above the count."""
    if stored is None:
        return count, None
    _, (tokens, ts) = take(count, period, 0, stored, now)
    tokens = _lua_min(float(count), tokens + n)
    return math.floor(tokens), (tokens, ts)


class Recent(Generic[V]):
    """Entries by key, the most recently written last, bounded: each write drops the
    oldest entries ``stale`` says are over (looking at most at ``PRUNE_STEP``, up to the
    first that is not), then the oldest beyond ``keep`` entries. So no write does more
    than a few steps, however many keys are tracked."""

    def __init__(self, stale: Callable[[V, float], bool], keep: int = PRUNE_ABOVE) -> None:
        self._entries: "OrderedDict[str, V]" = OrderedDict()
        self._stale = stale
        self._keep = keep

    def get(self, key: str) -> Optional[V]:
        return self._entries.get(key)

    def put(self, key: str, entry: V, now: float) -> None:
        entries = self._entries
        entries[key] = entry
        entries.move_to_end(key)
        for _ in range(PRUNE_STEP):
            oldest = next(iter(entries), None)
            if oldest is None or not self._stale(entries[oldest], now):
                break
            del entries[oldest]
        while len(entries) > self._keep:
            entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries


# A bucket: (tokens, ts), its count and its period.
_Bucket = Tuple[Tuple[float, float], int, float]


def _full(entry: _Bucket, now: float) -> bool:
    """A bucket refilled to its count: it says nothing a missing one would not."""
    (tokens, ts), count, period = entry
    return tokens + max(now - ts, 0.0) * count / period >= count


class LocalBuckets:
    """Buckets counted in this process (``count``: this process's share of the limit).
    One starts from Redis's last word on it (``saw``): that share of the tokens it said
    were left, at the time it said so; else full."""

    def __init__(self) -> None:
        self._buckets: Recent[_Bucket] = Recent(_full)
        # Redis's last word on each bucket: kept through outages, never cleared.
        self._seen: Recent[_Bucket] = Recent(_full)

    def saw(self, key: str, count: int, period: float, left: int, now: float) -> None:
        """Redis answered that ``left`` whole tokens of ``count`` are left at ``now``."""
        self._seen.put(key, ((float(left), now), count, period), now)

    def take(self, key: str, count: int, period: float, cost: int, now: float) -> List[int]:
        reply, state = take(count, period, cost, self._stored(key, count), now)
        self._buckets.put(key, (state, count, period), now)
        return reply

    def refund(self, key: str, count: int, period: float, n: int, now: float) -> int:
        left, state = refund(count, period, n, self._stored(key, count), now)
        if state is not None:
            self._buckets.put(key, (state, count, period), now)
        return left

    def peek(self, key: str, count: int, period: float, cost: int, now: float) -> List[int]:
        return take(count, period, cost, self._stored(key, count), now)[0]

    def clear(self) -> None:
        """Redis answers again: what is counted here goes (its last words stay)."""
        self._buckets.clear()

    def __len__(self) -> int:
        return len(self._buckets)

    def _stored(self, key: str, count: int) -> Optional[Tuple[float, float]]:
        """The bucket as counted here, else as Redis last left it (scaled to ``count``,
        this process's share), else None: a missing bucket, full."""
        entry = self._buckets.get(key)
        if entry is not None:
            return entry[0]
        seen = self._seen.get(key)
        if seen is None:
            return None
        (left, at), full, _ = seen
        return min(float(count), left * count / full), at


def _run_out(seen: Tuple[int, float], now: float) -> bool:
    """Leases Redis said were live that would all have run out by now."""
    return seen[1] <= now


class LocalLeases:
    """Live leases per key taken in this process (ids, so a retried id counts once),
    beside those Redis last said were live (``saw``): this process's share of them
    holds slots until they would have run out."""

    def __init__(self) -> None:
        self._held: Dict[str, Set[str]] = {}
        # key -> (live, until: Unix seconds), Redis's last word.
        self._seen: Recent[Tuple[int, float]] = Recent(_run_out)

    def saw(self, key: str, live: int, ttl_ms: int, now: float) -> None:
        """Redis answered that ``live`` leases are held at ``now``, each for ``ttl_ms``
        at most from then."""
        self._seen.put(key, (live, now + ttl_ms / 1000), now)

    def _taken_before(self, key: str, share: float, now: float) -> int:
        """This process's share of the leases Redis last said were live, while they
        may still be (rounded up)."""
        seen = self._seen.get(key)
        if seen is None or seen[1] <= now:
            return 0
        return math.ceil(seen[0] * share)

    def acquire(
        self, key: str, lease_id: str, max_slots: int, share: float, now: float
    ) -> LeaseGrant:
        local_max = share_of(max_slots, share)
        held = self._held.get(key, set())
        taken = self._taken_before(key, share, now)
        if lease_id in held or taken + len(held) < local_max:
            held.add(lease_id)
            self._held[key] = held  # a key is kept while it holds a lease
            return LeaseGrant(True, taken + len(held), 0, "local")
        return LeaseGrant(False, taken + len(held), 1, "local")

    def release(self, key: str, lease_id: str) -> bool:
        held = self._held.get(key)
        if held is None or lease_id not in held:
            return False
        held.discard(lease_id)
        if not held:
            del self._held[key]
        return True

    def holds(self, key: str, lease_id: str) -> bool:
        return lease_id in self._held.get(key, ())

    def live(self, key: str, share: float, now: float) -> int:
        return self._taken_before(key, share, now) + len(self._held.get(key, ()))

    def clear(self) -> None:
        self._held.clear()


def period(per: str, tz: str, now: float) -> Optional[Tuple[str, int, int]]:
    """The day or month that holds ``now`` in zone ``tz``, as the module computes it
    (core/src/quota.rs): its label (``2026-11-29``, ``2026-11``), start and end in Unix
    seconds, a day beginning at its first instant (midnight, or the end of a
    daylight-saving gap at midnight); None where this machine has no such zone (the
    zone database is the system's, or the tzdata package's)."""
    try:
        from zoneinfo import ZoneInfo

        zone = ZoneInfo(tz)
        local = datetime.fromtimestamp(now, zone)
    except Exception:  # an unknown zone, no zone database here, a clock out of range
        return None
    if per == "day":
        first = datetime(local.year, local.month, local.day)
        label = f"{local.year:04}-{local.month:02}-{local.day:02}"
        after = first + timedelta(days=1)
    else:
        first = datetime(local.year, local.month, 1)
        label = f"{local.year:04}-{local.month:02}"
        after = first + timedelta(days=calendar.monthrange(local.year, local.month)[1])
    start, end = (int(day.replace(tzinfo=zone).timestamp()) for day in (first, after))
    return label, start, end


def period_end(per: str, tz: str, now: float) -> int:
    """The end of the day or month that holds ``now`` in zone ``tz``, in Unix seconds
    (0 where this machine has no such zone): for a quota this process never saw."""
    found = period(per, tz, now)
    return 0 if found is None else found[2]


@dataclass
class _QuotaCounts:
    resets_at: int
    calls: int = 0
    rows: int = 0
    added_calls: int = 0
    added_rows: int = 0


class LocalQuotas:
    """What this process knows of each quota key: the counts Redis last answered for a
    period (kept from every quota reply, the most recently used keys first, bounded),
    and what it added locally since."""

    def __init__(self, keep: int = PRUNE_ABOVE) -> None:
        self._keys: "OrderedDict[str, _QuotaCounts]" = OrderedDict()
        self._keep = keep

    def saw(self, key: str, calls: Optional[int], rows: Optional[int], resets_at: int) -> None:
        """Redis answered these counts (None: not told) for the period ending at
        ``resets_at``."""
        known = self._keys.get(key)
        if known is None or known.resets_at != resets_at:
            known = _QuotaCounts(resets_at)
        if calls is not None:
            known.calls = calls
        if rows is not None:
            known.rows = rows
        self._remember(key, known)

    def saw_check(self, key: str, decision: QuotaDecision) -> None:
        """A check's remaining counts, read back as counts (a limit reached reads as the
        limit)."""

        def used(limit: Optional[int], remaining: Optional[int]) -> Optional[int]:
            return None if limit is None or remaining is None else limit - remaining

        self.saw(
            key,
            used(decision.calls_limit, decision.calls_remaining),
            used(decision.rows_limit, decision.rows_remaining),
            decision.resets_at,
        )

    def check(
        self,
        key: str,
        per: str,
        tz: str,
        calls: Optional[int],
        rows: Optional[int],
        now: float,
        share: float,
    ) -> QuotaDecision:
        """Allowed while this process's adds are below its allowance of what was left:
        ``floor((limit - last count seen) * share)``. Remembers nothing new."""
        known = self._keys.get(key)
        if known is None or (known.resets_at and now >= known.resets_at):
            known = _QuotaCounts(period_end(per, tz, now))
        allowed = True
        remaining: List[Optional[int]] = []
        for limit, seen, added in (
            (calls, known.calls, known.added_calls),
            (rows, known.rows, known.added_rows),
        ):
            if limit is None:
                remaining.append(None)
                continue
            allowance = max(math.floor((limit - seen) * share), 0)
            allowed = allowed and added < allowance
            remaining.append(max(allowance - added, 0))
        return QuotaDecision(
            allowed, calls, remaining[0], rows, remaining[1], known.resets_at, "local"
        )

    def add(self, key: str, per: str, tz: str, calls: int, rows: int, now: float) -> QuotaUsage:
        known = self._current(key, per, tz, now)
        known.added_calls += calls
        known.added_rows += rows
        return self._usage(known)

    def seed(self, key: str, per: str, tz: str, calls: int, rows: int, now: float) -> QuotaUsage:
        """As QAG.QUOTA.SEED: each count becomes the larger of what is known and the seed."""
        known = self._current(key, per, tz, now)
        known.calls = max(known.calls, calls - known.added_calls)
        known.rows = max(known.rows, rows - known.added_rows)
        return self._usage(known)

    def forget_adds(self) -> None:
        """Redis answers again: what it says from now on counts, not the local adds."""
        for known in self._keys.values():
            known.added_calls = known.added_rows = 0

    def __len__(self) -> int:
        return len(self._keys)

    def _current(self, key: str, per: str, tz: str, now: float) -> _QuotaCounts:
        known = self._keys.get(key)
        if known is None or (known.resets_at and now >= known.resets_at):
            known = _QuotaCounts(period_end(per, tz, now))  # a new period starts at zero
        self._remember(key, known)
        return known

    def _remember(self, key: str, known: _QuotaCounts) -> None:
        self._keys[key] = known
        self._keys.move_to_end(key)
        while len(self._keys) > self._keep:
            self._keys.popitem(last=False)

    @staticmethod
    def _usage(known: _QuotaCounts) -> QuotaUsage:
        return QuotaUsage(
            known.calls + known.added_calls, known.rows + known.added_rows, known.resets_at, "local"
        )


# A scope's window: (window length, window number, requests, tokens).
_Window = Tuple[int, int, int, int]


def _window_over(entry: _Window, now: float) -> bool:
    """The entry's own window has passed (whatever the length of the call's)."""
    length, number, _, _ = entry
    return now >= (number + 1) * length


class LocalWindows:
    """Requests and tokens per scope key in fixed windows of the call's length, aligned
    to the clock (window n holds [n * window, (n + 1) * window)). A scope's window
    starts from what Redis last said was used of it (``saw``: its limit less the least
    left over the chain, which is at most what it has left; this process's share of
    that), else from nothing."""

    def __init__(self) -> None:
        # key -> its window as counted here.
        self._scopes: Recent[_Window] = Recent(_window_over)
        # key -> reservation id -> (tokens held, until: Unix seconds)
        self._holds: Dict[str, Dict[str, Tuple[int, float]]] = {}
        # key -> its window as Redis last said it (requests and tokens used).
        self._seen: Recent[_Window] = Recent(_window_over)

    def saw(self, scopes: Sequence[Scope], window: int, now: float, admission: Admission) -> None:
        """Redis admitted (or refused) a request on ``scopes``: what it said was left,
        the least over the chain, is at most what each scope has left (so a scope that
        had more left begins stricter than it was)."""
        number = math.floor(now / window)
        for scope in scopes:
            used = []
            for limit, left in (
                (scope.rpm, admission.requests_remaining),
                (scope.tpm, admission.tokens_remaining),
            ):
                used.append(max(limit - left, 0) if limit and left is not None else 0)
            self._seen.put(scope.key, (window, number, used[0], used[1]), now)

    def _held(self, key: str, now: float) -> int:
        """The tokens the key's open reservations hold (those past their time dropped)."""
        holds = self._holds.get(key)
        if not holds:
            return 0
        for hold_id in [hold_id for hold_id, (_, until) in holds.items() if until <= now]:
            del holds[hold_id]
        if not holds:
            del self._holds[key]
        return sum(tokens for tokens, _ in holds.values())

    def _counts(self, key: str, window: int, now: float) -> Tuple[int, int]:
        entry = self._scopes.get(key)
        if entry is None or entry[0] != window or entry[1] != math.floor(now / window):
            return 0, 0
        return entry[2], entry[3]

    def _begin(self, key: str, window: int, now: float, share: float) -> None:
        """A scope not counted here in this window yet begins from Redis's last word on
        it in this window: this process's share of what was used."""
        number = math.floor(now / window)
        entry = self._scopes.get(key)
        if entry is not None and entry[0] == window and entry[1] == number:
            return
        seen = self._seen.get(key)
        if seen is not None and seen[0] == window and seen[1] == number:
            used = (math.ceil(seen[2] * share), math.ceil(seen[3] * share))
            self._scopes.put(key, (window, number, *used), now)

    def _add(self, key: str, window: int, now: float, requests: int, tokens: int) -> None:
        counted, charged = self._counts(key, window, now)
        number = math.floor(now / window)
        self._scopes.put(key, (window, number, counted + requests, charged + tokens), now)

    def admit(
        self,
        scopes: Sequence[Scope],
        window: int,
        now: float,
        share: float,
        hold: Optional[Tuple[str, int, float]] = None,
    ) -> Admission:
        """As QAG.ADMIT on this process's counts, every limit scaled by ``share``; with
        ``hold`` (reservation id, tokens, until: Unix seconds), as QAG.ADMIT ... RESERVE:
        admitted only if the tokens fit beside what is counted and held, then held on
        every scope until released or until then."""
        reserve = 0 if hold is None else hold[1]
        for scope in scopes:
            self._begin(scope.key, window, now, share)
        limits = [
            (
                scope.key,
                share_of(scope.rpm, share) if scope.rpm else 0,
                share_of(scope.tpm, share) if scope.tpm else 0,
            )
            for scope in scopes
        ]
        refused_by: Optional[int] = None
        for index, (key, rpm, tpm) in enumerate(limits):
            requests, tokens = self._counts(key, window, now)
            tokens += self._held(key, now)
            over = tokens + reserve > tpm if reserve else tokens >= tpm
            if (rpm and requests + 1 > rpm) or (tpm and over):
                refused_by = index
                break
        if refused_by is None:
            for key, _, _ in limits:
                self._add(key, window, now, 1, 0)
                if hold is not None and reserve:
                    self._holds.setdefault(key, {})[hold[0]] = (reserve, hold[2])
        requests_left: Optional[int] = None
        tokens_left: Optional[int] = None
        for key, rpm, tpm in limits:
            requests, tokens = self._counts(key, window, now)
            if rpm:
                left = max(rpm - requests, 0)
                requests_left = left if requests_left is None else min(requests_left, left)
            if tpm:
                left = max(tpm - tokens - self._held(key, now), 0)
                tokens_left = left if tokens_left is None else min(tokens_left, left)
        retry = 0
        if refused_by is not None:
            retry = max(math.ceil((math.floor(now / window) + 1) * window - now), 1)
        return Admission(refused_by is None, refused_by, retry, requests_left, tokens_left, "local")

    def record(
        self, keys: Sequence[str], tokens: int, window: int, now: float, share: float
    ) -> int:
        for key in keys:
            self._begin(key, window, now, share)
            self._add(key, window, now, 0, tokens)
        return len(keys)

    def release(self, keys: Sequence[str], hold_id: str, tokens: Optional[int] = None) -> None:
        """Shrinks reservation ``hold_id``'s hold by ``tokens`` on every scope (a partial
        charge), or (None) ends it."""
        for key in keys:
            holds = self._holds.get(key, {})
            if hold_id not in holds:
                continue
            held, until = holds[hold_id]
            if tokens is None or tokens >= held:
                del holds[hold_id]
            else:
                holds[hold_id] = (held - tokens, until)
            if not holds:
                self._holds.pop(key, None)

    def clear(self) -> None:
        self._scopes.clear()
        self._holds.clear()


class LocalState:
    """Everything one limiter counts locally. Buckets, leases and windows live through a
    back-off and are dropped when Redis has answered again; what Redis last said of each
    key is kept (local decisions start from it), the local adds dropped."""

    def __init__(self) -> None:
        self.buckets = LocalBuckets()
        self.leases = LocalLeases()
        self.quotas = LocalQuotas()
        self.windows = LocalWindows()

    def clear(self) -> None:
        self.buckets.clear()
        self.leases.clear()
        self.quotas.forget_adds()
        self.windows.clear()

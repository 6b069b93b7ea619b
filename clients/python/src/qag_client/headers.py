"""The response header fields for a request's decisions: the same fields, values and
order as the Rust client's ``Headers`` (both are tested against
``clients/shared_cases.json``). See docs/clients.md (Response headers) for each field: the buckets'
``x-ratelimit-*``, the quota's ``x-quota-*``, a window chain's OpenAI-style
``x-ratelimit-*-requests`` and ``-tokens``, draft-ietf-httpapi-ratelimit-headers-11's
``ratelimit-policy`` and ``ratelimit`` (one item per limit), and ``retry-after``."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from .decisions import Admission, Decision, QagRefused, QuotaDecision, Scope

# A window chain's default window, as QAG.ADMIT's.
DEFAULT_WINDOW = 60

# The fields of a window chain's requests, then tokens: limit, remaining, reset.
_WINDOW_FIELDS = (
    ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"),
    ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"),
)


@dataclass(frozen=True)
class _Limit:
    name: str
    quota: int
    unit: str
    window: Optional[int]
    remaining: int
    # Seconds until it is restored; None for a slot held (no window).
    reset: Optional[int]
    refused: bool
    # The wait until it lets the request through when refused; None: never.
    wait: Optional[int]

    def restrictiveness(self) -> Tuple[int, int, int]:
        """The most restrictive limit sorts first: one that never fits, then the
        longest wait, then the fewest remaining (a tie: the one restored later)."""
        if self.refused and self.wait is None:
            return (0, 0, 0)
        if self.refused:
            return (1, -(self.wait or 0), 0)
        return (2, self.remaining, -(self.reset or 0))

    def policy_item(self) -> str:
        item = f'"{self.name}";q={self.quota};qu="{self.unit}"'
        return item if self.window is None else f"{item};w={self.window}"

    def service_item(self) -> str:
        item = f'"{self.name}";r={self.remaining}'
        return item if self.reset is None else f"{item};t={self.reset}"


def _bucket(name: str, decision: Decision) -> _Limit:
    refused = not decision.allowed
    wait = None if decision.retry_after is None else max(decision.retry_after, 1)
    reset = wait if refused and wait is not None else decision.seconds_to_full()
    return _Limit(
        name=name,
        quota=decision.limit,
        unit="requests",
        window=max(math.ceil(decision.period), 1),
        remaining=decision.remaining,
        reset=reset,
        refused=refused,
        wait=wait,
    )


def _quota(
    name: str,
    unit: str,
    limit: Optional[int],
    remaining: Optional[int],
    decision: QuotaDecision,
    now: int,
) -> Optional[_Limit]:
    if limit is None or remaining is None:
        return None
    refused = not decision.allowed and remaining == 0
    reset = max(decision.resets_at - now, 0)
    if refused:
        reset = max(reset, 1)
    return _Limit(name, limit, unit, None, remaining, reset, refused, reset)


def _slots(max_slots: int, live: int, refused: bool) -> _Limit:
    # A slot may be released at any time: ask again in a second.
    remaining = 0 if refused else max(max_slots - live, 0)
    reset = 1 if refused else None
    return _Limit(
        "concurrency", max_slots, "concurrent-requests", None, remaining, reset, refused, 1
    )


def go_duration(millis: int) -> str:
    """A duration as Go's ``time.Duration`` writes it, which OpenAI's reset fields use:
    ``0s``, ``12ms``, ``1s``, ``1.5s``, ``1m30s``, ``6m0s``, ``2h0m0s``."""
    if millis == 0:
        return "0s"
    if millis < 1000:
        return f"{millis}ms"
    hours, minutes, milli = millis // 3_600_000, millis // 60_000 % 60, millis % 60_000
    seconds = f"{milli // 1000}.{milli % 1000:03d}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{seconds}s"
    if minutes:
        return f"{minutes}m{seconds}s"
    return f"{seconds}s"


def _window_kind(
    limits: Sequence[int], remaining: Optional[int], window: int, now_ms: int
) -> Optional[Tuple[str, str, str]]:
    """One kind of a window chain (requests or tokens): the least limit of that kind,
    the least left (QAG.ADMIT's), and the time until what counts has stopped counting:
    what is counted in the current window counts, less and less, until the end of the
    next one."""
    limited = [limit for limit in limits if limit > 0]
    if not limited:
        return None
    limit = min(limited)
    left = limit if remaining is None else min(remaining, limit)
    length = window * 1000
    reset = 0 if left == limit else (now_ms // length + 2) * length - now_ms
    return str(limit), str(left), go_duration(max(reset, 0))


Chain = Tuple[Sequence[Union[Scope, Tuple[str, int, int]]], Admission]


def headers(
    client: Optional[Decision] = None,
    key: Optional[Decision] = None,
    quota: Optional[QuotaDecision] = None,
    lease: Optional[QagRefused] = None,
    *,
    now: Optional[float] = None,
    draft: bool = True,
    slots: Optional[Tuple[int, int]] = None,
    chain: Optional[Chain] = None,
    window: Optional[int] = None,
    slot_waited: float = 0.0,
) -> List[Tuple[str, str]]:
    """The header fields for a request's decisions, as (lowercase name, value) pairs.

    ``quota``: the check, or after the call ``check.after(usage)`` so that the fields
    count the call itself; ``lease``: a refused lease (``retry-after: 1`` unless another
    refusal waits longer); ``slots``: the key's concurrency limit and the live leases
    when the request asked (``(max_slots, live)``, its own included if it took one: the
    draft's "concurrency" item); ``chain``: a window chain's scopes and its admission
    (``admit``'s answer or a reservation's), ``window`` its seconds (None: 60), for the
    ``x-ratelimit-*-requests`` and ``-tokens`` fields; ``now`` in Unix seconds (default:
    this machine's clock); ``draft=False`` leaves out ``ratelimit-policy`` and
    ``ratelimit``; ``slot_waited``: the seconds the request waited for its slot (with
    its buckets' ``waited``, the ``server-timing`` field ``qag-wait;dur=<ms>``).
    Decisions answered "forwarded" counted nothing and render nothing."""
    now_ms = round((time.time() if now is None else now) * 1000)
    now_s = now_ms // 1000
    client, key = (None if d is None or d.answered_by == "forwarded" else d for d in (client, key))
    if quota is not None and quota.answered_by == "forwarded":
        quota = None
    if chain is not None and chain[1].answered_by == "forwarded":
        chain = None
    fields: List[Tuple[str, str]] = []
    limits: List[_Limit] = []
    # Waits of refusals no draft item stands for (a window chain's, a lease's without
    # ``slots``).
    waits: List[Optional[int]] = []
    if client is not None:
        fields.append(("x-ratelimit-limit", str(client.limit)))
        fields.append(("x-ratelimit-remaining", str(client.remaining)))
        limits.append(_bucket("client", client))
    if key is not None:
        fields.append(("x-ratelimit-key-limit", str(key.limit)))
        fields.append(("x-ratelimit-key-remaining", str(key.remaining)))
        limits.append(_bucket("key", key))
    if quota is not None:
        if quota.calls_remaining is not None:
            fields.append(("x-quota-remaining-calls", str(quota.calls_remaining)))
        if quota.rows_remaining is not None:
            fields.append(("x-quota-remaining-rows", str(quota.rows_remaining)))
        fields.append(("x-quota-reset", str(quota.resets_at)))
        for name, unit, limit, remaining in (
            ("calls", "requests", quota.calls_limit, quota.calls_remaining),
            ("rows", "rows", quota.rows_limit, quota.rows_remaining),
        ):
            entry = _quota(name, unit, limit, remaining, quota, now_s)
            if entry is not None:
                limits.append(entry)
    if slots is not None:
        limits.append(_slots(slots[0], slots[1], lease is not None))
    elif lease is not None:
        waits.append(1)  # a slot may be released at any time
    if chain is not None:
        scopes = [scope if isinstance(scope, Scope) else Scope(*scope) for scope in chain[0]]
        admission = chain[1]
        length = max(window or DEFAULT_WINDOW, 1)
        kinds = (
            _window_kind([s.rpm for s in scopes], admission.requests_remaining, length, now_ms),
            _window_kind([s.tpm for s in scopes], admission.tokens_remaining, length, now_ms),
        )
        # OpenAI's order: both limits, both remaining, both resets.
        for part in range(3):
            for kind, names in zip(kinds, _WINDOW_FIELDS):
                if kind is not None:
                    fields.append((names[part], kind[part]))
        if not admission.admitted:
            retry = admission.retry_after
            waits.append(None if retry is None else max(retry, 1))
    waits = [limit.wait for limit in limits if limit.refused] + waits
    if limits and draft:
        fields.append(("ratelimit-policy", ", ".join(limit.policy_item() for limit in limits)))
        ordered = sorted(limits, key=_Limit.restrictiveness)
        fields.append(("ratelimit", ", ".join(limit.service_item() for limit in ordered)))
    # How long the server held the request (WAIT): its buckets' wait (one, taken
    # together) and its slot's.
    buckets = max((decision.waited for decision in (client, key) if decision), default=0.0)
    waited = round((buckets + slot_waited) * 1000)
    if waited > 0:
        fields.append(("server-timing", f"qag-wait;dur={waited}"))
    if waits and all(wait is not None for wait in waits):
        fields.append(("retry-after", str(max(wait or 1 for wait in waits))))
    return fields

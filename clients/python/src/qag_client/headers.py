"""The response header fields for a request's decisions: the same fields, values and
order as the Rust client's ``headers()`` (both are tested against
``clients/shared_cases.json``). See the README's "From a gateway" for each field."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

from .decisions import Decision, QagRefused, QuotaDecision


@dataclass(frozen=True)
class _Limit:
    name: str
    quota: int
    window: Optional[int]
    remaining: int
    reset: int
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
        return (2, self.remaining, -self.reset)


def _bucket(name: str, decision: Decision) -> _Limit:
    wait = decision.retry_after
    reset = wait if not decision.allowed and wait is not None else decision.seconds_to_full()
    return _Limit(
        name=name,
        quota=decision.limit,
        window=max(math.ceil(decision.period), 1),
        remaining=decision.remaining,
        reset=reset,
        refused=not decision.allowed,
        wait=wait,
    )


def _quota(
    name: str, limit: Optional[int], remaining: Optional[int], decision: QuotaDecision, now: int
) -> Optional[_Limit]:
    if limit is None or remaining is None:
        return None
    reset = max(decision.resets_at - now, 0)
    refused = not decision.allowed and remaining == 0
    return _Limit(name, limit, None, remaining, reset, refused, max(reset, 1))


def headers(
    client: Optional[Decision] = None,
    key: Optional[Decision] = None,
    quota: Optional[QuotaDecision] = None,
    lease: Optional[QagRefused] = None,
    *,
    now: Optional[int] = None,
    draft: bool = True,
) -> List[Tuple[str, str]]:
    """The header fields for a request's decisions, as (lowercase name, value) pairs.

    ``quota``: the check, or after the call ``check.after(usage)`` so that the fields
    count the call itself; ``lease``: a refused lease (``retry-after: 1`` unless another
    refusal waits longer); ``now`` in Unix seconds (default: this machine's clock), for
    the time left in a quota's period; ``draft=False`` leaves out ``ratelimit-policy``
    and ``ratelimit``. Decisions answered "forwarded" counted nothing and render
    nothing."""
    now = int(time.time()) if now is None else now
    client, key = (None if d is None or d.answered_by == "forwarded" else d for d in (client, key))
    if quota is not None and quota.answered_by == "forwarded":
        quota = None
    fields: List[Tuple[str, str]] = []
    limits: List[_Limit] = []
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
        for name, limit, remaining in (
            ("calls", quota.calls_limit, quota.calls_remaining),
            ("rows", quota.rows_limit, quota.rows_remaining),
        ):
            entry = _quota(name, limit, remaining, quota, now)
            if entry is not None:
                limits.append(entry)
    if limits and draft:
        fields.append(
            (
                "ratelimit-policy",
                ", ".join(
                    f'"{limit.name}";q={limit.quota}'
                    + (f";w={limit.window}" if limit.window else "")
                    for limit in limits
                ),
            )
        )
        tightest = min(limits, key=_Limit.restrictiveness)
        fields.append(("ratelimit", f'"{tightest.name}";r={tightest.remaining};t={tightest.reset}'))
    waits = [limit.wait for limit in limits if limit.refused]
    if lease is not None:
        waits.append(1)  # a slot may be released at any time
    if waits and all(wait is not None for wait in waits):
        fields.append(("retry-after", str(max(max(wait or 1 for wait in waits), 1))))
    return fields

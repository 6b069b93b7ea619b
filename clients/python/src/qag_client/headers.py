"""The response header fields for a request's decisions: the same fields, values and
order as the Rust client's ``headers()`` (both are tested against
``clients/shared_cases.json``). See the README's "From a gateway" for each field."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .decisions import Decision, QuotaDecision


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
    wait = decision.retry_after if decision.retry_after >= 0 else None
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
    now: Optional[int] = None,
) -> Dict[str, str]:
    """The header fields for a request's decisions; ``now`` in Unix seconds (default:
    this machine's clock), for the time left in a quota's period."""
    now = int(time.time()) if now is None else now
    fields: Dict[str, str] = {}
    limits: List[_Limit] = []
    if client is not None:
        fields["X-RateLimit-Limit"] = str(client.limit)
        fields["X-RateLimit-Remaining"] = str(client.remaining)
        limits.append(_bucket("client", client))
    if key is not None:
        fields["X-RateLimit-Key-Limit"] = str(key.limit)
        fields["X-RateLimit-Key-Remaining"] = str(key.remaining)
        limits.append(_bucket("key", key))
    if quota is not None:
        if quota.calls_remaining is not None:
            fields["X-Quota-Remaining-Calls"] = str(quota.calls_remaining)
        if quota.rows_remaining is not None:
            fields["X-Quota-Remaining-Rows"] = str(quota.rows_remaining)
        fields["X-Quota-Reset"] = str(quota.resets_at)
        for name, limit, remaining in (
            ("calls", quota.calls_limit, quota.calls_remaining),
            ("rows", quota.rows_limit, quota.rows_remaining),
        ):
            entry = _quota(name, limit, remaining, quota, now)
            if entry is not None:
                limits.append(entry)
    if not limits:
        return fields
    fields["RateLimit-Policy"] = ", ".join(
        f'"{limit.name}";q={limit.quota}' + (f";w={limit.window}" if limit.window else "")
        for limit in limits
    )
    tightest = min(limits, key=_Limit.restrictiveness)
    fields["RateLimit"] = f'"{tightest.name}";r={tightest.remaining};t={tightest.reset}'
    refusals = [limit for limit in limits if limit.refused]
    if refusals and all(limit.wait is not None for limit in refusals):
        fields["Retry-After"] = str(max(max(limit.wait or 1 for limit in refusals), 1))
    return fields

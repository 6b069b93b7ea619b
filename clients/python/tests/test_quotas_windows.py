"""Quotas and sliding windows, typed, on both limiters; module only."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from conftest import Server
from qag_client import QagModuleRequired, QagServerError, Scope


def test_quota_check_add_seed(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    server = start_server()
    limiter = make_limiter(server)
    before = limiter.quota_check("qag:q", "month", "Europe/Berlin", calls=2, rows=1000)
    assert before.allowed and (before.calls_remaining, before.rows_remaining) == (2, 1000)
    assert (before.calls_limit, before.rows_limit) == (2, 1000)
    usage = limiter.quota_add("qag:q", "month", "Europe/Berlin", calls=1, rows=250)
    assert (usage.calls, usage.rows, usage.resets_at) == (1, 250, before.resets_at)
    seeded = limiter.quota_seed("qag:q", "month", "Europe/Berlin", calls=2, rows=100)
    assert (seeded.calls, seeded.rows) == (2, 250)
    after = limiter.quota_check("qag:q", "month", "Europe/Berlin", calls=2)
    assert not after.allowed and after.calls_remaining == 0 and after.rows_remaining is None
    with pytest.raises(QagServerError, match="TZ must be a known IANA time zone"):
        limiter.quota_check("qag:q", "day", "Mars/Olympus", calls=1)


def test_admit_and_record(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    server = start_server()
    limiter = make_limiter(server)
    scopes = [Scope("qag:win:{a}:org", 100, 0), ("qag:win:{a}:key", 1, 1000)]
    first = limiter.admit(scopes)
    assert first.admitted and (first.requests_remaining, first.tokens_remaining) == (0, 1000)
    second = limiter.admit(scopes, window=60)
    assert not second.admitted and second.refused_by == 1 and second.retry_after >= 1
    assert limiter.record(["qag:win:{a}:org", "qag:win:{a}:key"], 700) == 2
    script_only = make_limiter(server, backend="script")
    with pytest.raises(QagModuleRequired):
        script_only.record(["qag:win:{a}:org"], 1)

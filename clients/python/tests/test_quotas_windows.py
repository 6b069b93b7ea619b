"""Quotas and sliding windows, typed, on both limiters, by the module and by the scripts
on the same keys. Quota and lease headers from real replies. A request's buckets and
quota check in one round trip."""

from __future__ import annotations

from typing import Any, Callable, List

import pytest

from conftest import Server
from qag_client import Bucket, Limiter, QagRefused, QagServerError, Quota, Scope, headers
from qag_client._driver import Send
from qag_client._engine import Pipeline


def test_quota_check_add_seed(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    server = start_server()
    limiter = make_limiter(server)
    before = limiter.quota_check("qag:q", Quota("month", "Europe/Berlin", calls=2, rows=1000))
    assert before.allowed and (before.calls_remaining, before.rows_remaining) == (2, 1000)
    assert (before.calls_limit, before.rows_limit) == (2, 1000)
    usage = limiter.quota_add("qag:q", Quota("month", "Europe/Berlin"), calls=1, rows=250)
    assert (usage.calls, usage.rows, usage.resets_at) == (1, 250, before.resets_at)
    seeded = limiter.quota_seed("qag:q", Quota("month", "Europe/Berlin"), calls=2, rows=100)
    assert (seeded.calls, seeded.rows) == (2, 250)
    after = limiter.quota_check("qag:q", Quota("month", "Europe/Berlin", calls=2))
    assert not after.allowed and after.calls_remaining == 0 and after.rows_remaining is None
    with pytest.raises(QagServerError, match="TZ must be a known IANA time zone"):
        limiter.quota_check("qag:q", Quota("day", "Mars/Olympus", calls=1))


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
    # The scripts count on the same keys: the module's request refuses the script's.
    script_only = make_limiter(server, backend="script")
    assert script_only.record(["qag:win:{a}:org", "qag:win:{a}:key"], 1) == 2
    third = script_only.admit(scopes)
    assert (third.admitted, third.refused_by, third.answered_by) == (False, 1, "script")
    fields = server.client().hgetall("qag:win:{a}:key")
    assert sum(int(v) for k, v in fields.items() if k.startswith(b"tok:")) == 701
    check = script_only.quota_check("qag:q", Quota("day", "UTC", calls=1))
    assert (check.allowed, check.calls_remaining, check.answered_by) == (True, 1, "script")
    with script_only.lease("qag:run", 1, 5000, "s1") as lease:
        assert lease.answered_by == "script"
        assert limiter.leases("qag:run") == 1
    assert script_only.leases("qag:run") == 0


def test_quota_headers_count_the_call_itself(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    """Check before, add after, render from the add's usage: a quota of 3 calls says 2,
    1, 0 left, then refuses."""
    server = start_server()
    limiter = make_limiter(server)
    rendered = []
    for _ in range(4):
        check = limiter.quota_check("qag:quota:acme~bot", Quota("month", "Europe/Berlin", calls=3))
        if not check.allowed:
            rendered.append(dict(headers(quota=check)))
            break
        usage = limiter.quota_add("qag:quota:acme~bot", Quota("month", "Europe/Berlin"), calls=1)
        assert usage.answered_by == "module"
        rendered.append(dict(headers(quota=check.after(usage))))
    assert [fields["x-quota-remaining-calls"] for fields in rendered] == ["2", "1", "0", "0"]
    assert ["retry-after" in fields for fields in rendered] == [False, False, False, True]
    assert all(fields["ratelimit-policy"] == '"calls";q=3;qu="requests"' for fields in rendered)


def test_a_refused_lease_renders_retry_after_one(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    server = start_server()
    limiter = make_limiter(server)
    key = limiter.take(Bucket("qag:ratelimit:key:60/60:acme~bot", 60, 60))
    with limiter.lease("qag:running:acme~bot", 1, 10_000, "q1"):
        with pytest.raises(QagRefused) as refused:
            with limiter.lease("qag:running:acme~bot", 1, 10_000, "q2"):
                pass
    fields = headers(key=key, lease=refused.value, draft=False)
    assert fields == [
        ("x-ratelimit-key-limit", "60"),
        ("x-ratelimit-key-remaining", "59"),
        ("retry-after", "1"),
    ]


def test_spend_through_the_defaults_remembers_its_own_ids_seconds_not_minutes(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    """Issue 37: a quota add and a record through the defaults send the limiter's own id
    with KEEP (it is replayed within the call only), so a hot key remembers its ids for
    seconds; a caller's id is remembered ID-SECONDS (300), for the gateway's retries."""
    server = start_server()
    raw = server.client()
    limiter = make_limiter(server)
    limiter.quota_add("qag:quota:k", Quota("month"), calls=1)
    limiter.record(["qag:win:{k}:key"], 5)
    limiter.quota_add("qag:quota:mine", Quota("month"), calls=1, request_id="gateway-7")
    now_ms = int(raw.time()[0]) * 1000

    def forgotten_in(key: str) -> int:
        [record] = [value for name, value in raw.hgetall(key).items() if name.startswith(b"id:")]
        return int(record.split(b" ")[0]) - now_ms

    assert forgotten_in("qag:quota:k") <= 12_000
    assert forgotten_in("qag:win:{k}:key") <= 12_000
    assert 290_000 <= forgotten_in("qag:quota:mine") <= 301_000


def test_the_buckets_and_the_quota_check_share_a_round_trip(
    start_server: Callable[..., Server],
    make_limiter: Callable[..., Any],
    stop: Callable[[Server], None],
) -> None:
    """Issue 35: a bucket that refuses still shows the quota, read counting nothing; a
    check that fails on its own leaves the buckets' answer standing; without the module
    the buckets and the check go by script; an outage is answered by the policy for both."""
    server = start_server()
    raw = server.client()
    limiter = make_limiter(server)
    client = Bucket.named("client", 1, 3600, "203.0.113.9")
    key = Bucket.named("key", 10, 3600, "acme~r")
    quota = Quota("day", calls=5)
    first = limiter.take_with_quota(client, key, "qag:quota:acme~r", quota)
    assert first.buckets_allowed and first.answered_by == "module"
    assert first.quota is not None and first.quota.calls_remaining == 5
    refused = limiter.take_with_quota(client, key, "qag:quota:acme~r", quota)
    assert not refused.buckets_allowed and refused.key is None
    assert refused.quota is not None and refused.quota.calls_remaining == 5
    assert not raw.exists("qag:quota:acme~r")
    raw.set("qag:quota:acme~r", "x")  # a key of another type: the check's own error
    refused = limiter.take_with_quota(client, key, "qag:quota:acme~r", quota)
    assert refused.client is not None and not refused.client.allowed
    assert refused.quota is None and isinstance(refused.quota_error, QagServerError)
    raw.delete("qag:quota:acme~r")
    alone = limiter.take_with_quota(None, key, "qag:quota:acme~r", quota)
    assert alone.client is None and alone.key is not None and alone.key.remaining == 8

    bare = start_server(with_module=False)
    taken = make_limiter(bare).take_with_quota(client, key, "qag:quota:acme~r", quota)
    assert taken.client is not None and taken.client.answered_by == "script"
    assert taken.quota is not None and taken.quota.answered_by == "script"
    assert taken.quota.calls_remaining == 5

    local = make_limiter(server, on_unavailable="local")
    stop(server)
    taken = local.take_with_quota(None, key, "qag:quota:acme~l", quota)
    assert taken.key is not None and taken.key.answered_by == "local"
    assert taken.quota is not None and taken.quota.answered_by == "local"


def test_one_round_trip_for_both(start_server: Callable[..., Server]) -> None:
    server = start_server()
    limiter = Limiter(server.client())
    sent: List[Any] = []
    perform = limiter._perform

    def counted(effect: Any, stop: Any = None) -> Any:
        if isinstance(effect, Send) and not getattr(effect.request, "probe", False):
            sent.append(effect.request)
        return perform(effect, stop)

    limiter._perform = counted  # type: ignore[method-assign]
    client = Bucket.named("client", 20, 1, "203.0.113.9")
    key = Bucket.named("key", 100, 60, "acme~one")
    limiter.take_with_quota(client, key, "qag:quota:acme~one", Quota("day", calls=5))
    assert len(sent) == 1 and isinstance(sent[0], Pipeline), sent
    assert [command.words[0] for command in sent[0].commands] == ["QAG.TAKE2", "QAG.QUOTA"]
    limiter.close()

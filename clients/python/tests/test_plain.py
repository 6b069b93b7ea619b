"""The plain code, without Redis: the shared cases both clients must agree on, the
packaged script, and arguments refused before anything is sent."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from conftest import REPOSITORY
from qag_client import Decision, Limiter, QuotaDecision, bucket_key, headers
from qag_client.local import LocalBuckets

CASES = json.loads((REPOSITORY / "clients/shared_cases.json").read_text())


def test_the_packaged_script_is_the_repositorys_byte_for_byte() -> None:
    packaged = resources.files("qag_client").joinpath("token_bucket.lua").read_bytes()
    assert packaged == (REPOSITORY / "lua/token_bucket.lua").read_bytes()


@pytest.mark.parametrize("case", CASES["bucket_keys"], ids=lambda case: case["key"])
def test_bucket_names(case: dict) -> None:
    name = bucket_key(
        case["scope"], case["count"], case["period"], case["client"], case["hash_tag"]
    )
    assert name == case["key"]


def _bucket(value: dict | None) -> Decision | None:
    return None if value is None else Decision(backend="module", **value)


@pytest.mark.parametrize("case", CASES["headers"], ids=lambda case: case["name"])
def test_header_fields(case: dict) -> None:
    quota = None if case["quota"] is None else QuotaDecision(**case["quota"])
    fields = headers(_bucket(case["client"]), _bucket(case["key"]), quota, now=case["now"])
    assert [list(pair) for pair in fields.items()] == case["headers"]


@pytest.mark.parametrize("case", CASES["local_buckets"], ids=lambda case: case["name"])
def test_local_bucket_arithmetic(case: dict) -> None:
    local = LocalBuckets()
    for step in case["steps"]:
        reply = local.take("k", case["count"], case["period"], step["cost"], step["now"])
        assert reply == step["reply"], step


def test_local_buckets_forget_full_ones_when_many() -> None:
    import qag_client.local as local_module

    local = LocalBuckets()
    for n in range(local_module.PRUNE_ABOVE):
        local.take(str(n), 5, 60.0, 1, 1000.0)
    local.take("late", 5, 60.0, 1, 1000.0)
    assert len(local) == local_module.PRUNE_ABOVE + 1
    local.take("later", 5, 60.0, 1, 1012.0)
    assert len(local) == 1


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda l: l.take("k", 0, 60), "count must be an integer from 1 to 9007199254740992"),
        (lambda l: l.take("k", 2**53 + 1, 60), "count must be an integer"),
        (lambda l: l.take("k", 5, float("nan")), "period must be a number from 0.000001"),
        (lambda l: l.take("k", 5, 1e11), "period must be a number"),
        (lambda l: l.take("k", 5, 60, cost=0), "cost must be an integer from 1"),
        (lambda l: l.take("k", True, 60), "count must be an integer"),
        (lambda l: l.take("", 5, 60), "key must be a non-empty string"),
        (lambda l: l.take_pair("c", 5, 60, "k", 5, -1), "period must be a number"),
        (lambda l: l.lease("k", 0, 1000, "q"), "max must be an integer from 1 to 1000000"),
        (lambda l: l.lease("k", 1, 0, "q"), "ttl_ms must be an integer from 1"),
        (lambda l: l.lease("k", 1, 1000, "x" * 257), "id must be at most 256 bytes"),
        (lambda l: l.quota_check("k", "week", "UTC", calls=1), "PER must be day or month"),
        (lambda l: l.quota_check("k", "day", "UTC"), "missing CALLS or ROWS"),
        (lambda l: l.quota_add("k", "day", "UTC", calls=-1), "calls must be an integer from 0"),
        (lambda l: l.admit([]), "numscopes must be an integer from 1 to 64"),
        (lambda l: l.admit([("a", 1, 1), ("a", 1, 1)]), "each scope must have its own key"),
        (lambda l: l.admit([("a", 1, 1)], window=0), "WINDOW must be an integer from 1"),
        (lambda l: l.record(["a"], -5), "tokens must be an integer from 0"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_sent(call, message: str) -> None:
    import redis

    # Nothing listens on port 1: a call that sent anything would fail otherwise.
    limiter = Limiter(redis.Redis(port=1))
    with pytest.raises(ValueError, match=message):
        call(limiter)


def test_unknown_options_are_refused() -> None:
    import redis

    with pytest.raises(ValueError, match="backend must be one of"):
        Limiter(redis.Redis(port=1), backend="lua")
    with pytest.raises(ValueError, match="on_unavailable must be one of"):
        Limiter(redis.Redis(port=1), on_unavailable="open")

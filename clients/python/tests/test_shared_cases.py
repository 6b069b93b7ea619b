"""The cases both clients are tested against (clients/shared_cases.json; the Rust
client's are clients/rust/tests/shared_cases.rs): bucket names, header fields, and
local bucket arithmetic."""

from __future__ import annotations

import json
from typing import Optional

import pytest

from conftest import REPOSITORY
from qag_client import (
    Admission,
    Decision,
    QagRefused,
    QuotaDecision,
    QuotaUsage,
    bucket_key,
    headers,
)
from qag_client.answers import Refusal
from qag_client.local import LocalBuckets, period

CASES = json.loads((REPOSITORY / "clients/shared_cases.json").read_text())


@pytest.mark.parametrize("case", CASES["bucket_keys"], ids=lambda case: case["key"])
def test_bucket_names(case: dict) -> None:
    name = bucket_key(
        case["scope"], case["count"], case["period"], case["client"], case["hash_tag"]
    )
    assert name == case["key"]


def _bucket(value: Optional[dict]) -> Optional[Decision]:
    if value is None:
        return None
    # The cases write "never fits" as -1 (Rust's RetryAfter::Never, Python's None).
    retry = value["retry_after"]
    fields = {name: value for name, value in value.items() if name != "waited_ms"}
    waited = value.get("waited_ms", 0) / 1000
    return Decision(**{**fields, "retry_after": None if retry == -1 else retry, "waited": waited})


@pytest.mark.parametrize("case", CASES["headers"], ids=lambda case: case["name"])
def test_header_fields(case: dict) -> None:
    quota = None if case["quota"] is None else QuotaDecision(**case["quota"])
    if quota is not None and case.get("quota_usage") is not None:
        quota = quota.after(QuotaUsage(**case["quota_usage"]))
    lease = case.get("lease")
    refused = None if lease is None else QagRefused(lease["live"], lease["retry_after"])
    slots = case.get("slots")
    window = case.get("window")
    chain = None
    if window is not None:
        chain = ([tuple(scope) for scope in window["scopes"]], Admission(**window["admission"]))
    fields = headers(
        _bucket(case["client"]),
        _bucket(case["key"]),
        quota,
        refused,
        now=case["now_ms"] / 1000 if "now_ms" in case else case["now"],
        draft=case.get("draft", True),
        slots=None if slots is None else (slots["max"], slots["live"]),
        chain=chain,
        window=None if window is None else window["seconds"],
        slot_waited=case.get("slot_waited_ms", 0) / 1000,
    )
    assert [list(pair) for pair in fields] == case["headers"]
    for name, _ in fields:
        assert name == name.lower()


@pytest.mark.parametrize("case", CASES["local_buckets"], ids=lambda case: case["name"])
def test_local_bucket_arithmetic(case: dict) -> None:
    local = LocalBuckets()
    for step in case["steps"]:
        reply = local.take("k", case["count"], case["period"], step["cost"], step["now"])
        assert reply == step["reply"], step


@pytest.mark.parametrize("case", CASES["answers"], ids=lambda case: case["name"])
def test_refusal_answers(case: dict) -> None:
    fields = dict(case["refusal"])
    kind = fields.pop("kind")
    retry = fields.pop("retry_after", 0)
    refusal = Refusal(kind, None if retry == -1 else retry, **fields)
    assert refusal.status == case["status"]
    assert (None if refusal.seconds is None else str(refusal.seconds)) == case["retry_after"]
    assert refusal.body(case["request_id"]) == case["body"]


@pytest.mark.parametrize(
    "case", CASES["quota_periods"], ids=lambda case: f"{case['tz']} {case['label']}"
)
def test_quota_periods(case: dict) -> None:
    """The calendar periods given to lua/quota.lua, as the module computes them."""
    found = period(case["per"], case["tz"], case["now"])
    assert found == (case["label"], case["start"], case["end"])

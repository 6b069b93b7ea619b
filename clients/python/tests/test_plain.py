"""The plain code, without Redis: the packaged script, arguments refused before
anything is sent, the outage policy's back-off and probe, and local counting of every
family (the cases shared with the Rust client are in test_shared_cases.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from importlib import resources
from typing import Any, Callable, List, Tuple

import pytest

from conftest import REPOSITORY
from qag_client import Bucket, Limiter, QagServerError, QagUnavailable, Quota, Scope
from qag_client._driver import Budget
from qag_client._engine import admit_call, period_arguments, record_call, server_clock
from qag_client._gateway import Config, KeyLimits, Limiting, RequestParts, WindowLimit, drive_async
from qag_client.decisions import Admission
from qag_client.local import LocalBuckets, LocalQuotas


def test_the_packaged_script_is_the_repositorys_byte_for_byte() -> None:
    scripts = sorted(path.name for path in (REPOSITORY / "lua").glob("*.lua"))
    assert scripts == [
        "bucket_ids.lua",
        "lease.lua",
        "quota.lua",
        "request_ids.lua",
        "token_bucket.lua",
        "token_refund.lua",
        "window.lua",
    ]
    for name in scripts:
        packaged = resources.files("qag_client").joinpath(name).read_bytes()
        assert packaged == (REPOSITORY / "lua" / name).read_bytes(), name


def test_the_script_is_given_the_period_and_the_next() -> None:
    # 2026-03-28 12:00 in Berlin: the next day is 23 hours long (the clocks go forward).
    assert period_arguments("day", "Europe/Berlin", 1_774_695_600) == (
        "2026-03-28",
        1774652400,
        1774738800,
        "2026-03-29",
        1774821600,
    )
    with pytest.raises(QagServerError, match="TZ must be a known IANA time zone"):
        period_arguments("day", "Mars/Olympus", 1_774_695_600)
    assert server_clock([b"period", b"1796320454", b"78"]) == 1796320454.000078
    for other in ([1, 2, 3], [b"other", b"1", b"1"], 1, None):
        assert server_clock(other) is None


def test_window_calls_as_the_module_and_the_script_take_them() -> None:
    chain = [Scope("a", 1, 100), Scope("b", 0, 50)]
    words, script = admit_call(chain, 30, 40, 500, "r1")
    head = ["QAG.ADMIT", 2, "a", 1, 100, "b", 0, 50]
    assert words == head + ["WINDOW", 30, "RESERVE", 40, "HOLD", 500, "ID", "r1"]
    assert script.keys == ("a", "b")
    assert script.arguments == ("admit", 30, 1, 100, 0, 50, 40, 500, "r1", "")
    words, script = admit_call(chain, None, 0, None, None)
    assert words == head
    assert script.arguments == ("admit", 60, 1, 100, 0, 50, 0, "", "", "")
    words, make = record_call(["a", "b"], 7, None, "r1", partial=True)
    assert words == ["QAG.RECORD", 2, "a", "b", 7, "ID", "r1", "PARTIAL"]
    assert make("3").arguments == ("record", 60, 7, "r1", "3", "1")


def test_local_refunds_refill_first_and_never_write_a_missing_bucket() -> None:
    local = LocalBuckets()
    assert local.refund("missing", 5, 60.0, 2, 1000.0) == 5
    assert len(local) == 0, "a missing bucket is full: nothing kept"
    local.take("k", 5, 60.0, 4, 1000.0)  # 1 left at t=1000
    # 12 s later 1 more refilled (5 per 60 s), then 2 given back.
    assert local.refund("k", 5, 60.0, 2, 1012.0) == 4
    assert local.refund("k", 5, 60.0, 100, 1012.0) == 5, "never above the count"


def test_sorted_errors_keep_their_cause() -> None:
    import redis.exceptions as errors

    from qag_client._engine import sort_error

    cause = errors.ConnectionError("Connection refused")
    sorted_error = sort_error(cause)
    assert sorted_error.__cause__ is cause


def test_local_buckets_are_bounded_and_forget_full_ones_a_few_at_a_time() -> None:
    import qag_client.local as local_module

    local = LocalBuckets()
    for n in range(local_module.PRUNE_ABOVE + 10):
        local.take(str(n), 5, 60.0, 1, 1000.0)
    assert len(local) == local_module.PRUNE_ABOVE, "the oldest went"
    # Refilled ones go a few a write, never all at once (no write rebuilds the map).
    local.take("later", 5, 60.0, 1, 1012.0)
    assert len(local) == local_module.PRUNE_ABOVE + 1 - local_module.PRUNE_STEP


def test_a_local_quota_check_remembers_no_key() -> None:
    quotas = LocalQuotas()
    for n in range(1000):
        assert quotas.check(str(n), "month", "UTC", 10, None, 1_800_000_000.0, 1.0).allowed
    assert len(quotas) == 0
    quotas.add("q", "month", "UTC", 1, 0, 1_800_000_000.0)
    assert len(quotas) == 1


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda l: l.take(Bucket("k", 0, 60)),
            "count must be an integer from 1 to 9007199254740992",
        ),
        (lambda l: l.take(Bucket("k", 2**53 + 1, 60)), "count must be an integer"),
        (lambda l: l.take(Bucket("k", 5, float("nan"))), "period must be a number from 0.000001"),
        (lambda l: l.take(Bucket("k", 5, 1e11)), "period must be a number"),
        (lambda l: l.take(Bucket("k", 5, 60), cost=0), "cost must be an integer from 1"),
        (lambda l: l.take(Bucket("k", True, 60)), "count must be an integer"),
        (lambda l: l.take(Bucket("", 5, 60)), "key must be a non-empty string"),
        (lambda l: l.take_pair(Bucket("c", 5, 60), Bucket("k", 5, -1)), "period must be a number"),
        (lambda l: l.lease("k", 0, 1000, "q"), "max must be an integer from 1 to 1000000"),
        (lambda l: l.lease("k", 1, 0, "q"), "ttl_ms must be an integer from 1"),
        (lambda l: l.lease("k", 1, 1000, "x" * 257), "id must be at most 256 bytes"),
        (lambda l: l.quota_check("k", Quota("week", "UTC", calls=1)), "PER must be day or month"),
        (lambda l: l.quota_check("k", Quota("day", "UTC")), "missing CALLS or ROWS"),
        (
            lambda l: l.quota_add("k", Quota("day", "UTC"), calls=-1),
            "calls must be an integer from 0",
        ),
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


def test_bad_options_are_refused() -> None:
    import redis

    for options, message in [
        ({"local_share": 0}, "local_share must be above 0 and at most 1"),
        ({"local_share": 1.5}, "local_share must be above 0"),
        ({"back_off": -1}, "back_off must be a number of seconds, at least 0"),
        ({"max_connections": 0}, "max_connections must be an integer of at least 1"),
        ({"deadline": 0}, "deadline must be above 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            Limiter(redis.Redis(port=1), **options)


def test_a_back_off_is_probed_by_its_prober_and_only_the_probe_ends_it() -> None:
    from qag_client._policy import Outage, Probe, Route

    outage = Outage(5.0)
    assert outage.route() is Route.REDIS
    old = outage.generation  # a call sent before the outage
    assert outage.failed(False, 1.0, "refused"), "the outage starts the prober"
    # Calls keep to the policy whenever they come; the prober probes without them, the
    # first probe soon: a restart measured in milliseconds costs 0.1 s.
    assert outage.backing_off and outage.route() is Route.POLICY
    assert outage.prober_step(1.0) == pytest.approx(0.1)
    assert not outage.answered(False, old), "a call sent before it does not end it"
    assert not outage.failed(False, 1.05, "refused"), "one sent before it: nothing moves"
    assert outage.prober_step(1.1) is Probe.NOW
    # Each failed probe doubles the wait before the next, up to back_off.
    at = 1.1
    for wait in (0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0):
        assert not outage.failed(True, at, "timeout")
        assert outage.prober_step(at + wait - 0.01) == pytest.approx(0.01)
        assert outage.prober_step(at + wait) is Probe.NOW, wait
        at += wait
    outage.deferred(at)  # no free connection: the next one later still
    assert outage.prober_step(at) == pytest.approx(5.0)
    # Long after, with no call meanwhile, the next probe is due at once.
    assert outage.prober_step(at + 3600) is Probe.NOW
    assert outage.answered(True, outage.generation), "the probe answered: local state dropped"
    assert outage.route() is Route.REDIS and not outage.backing_off
    assert outage.prober_step(at) is Probe.END
    # A new outage starts from the first probe's wait again, with a prober of its own.
    assert outage.failed(False, 100.0, "refused")
    assert outage.prober_step(100.0) == pytest.approx(0.1)
    outage.prober_stopped()  # its limiter closed, or its task cancelled
    assert outage.route() is Route.START_PROBER, "the next call starts another"
    assert outage.route() is Route.POLICY

    never = Outage(0.0)
    generation = never.generation
    assert not never.failed(False, 1.0, "refused")
    assert never.route() is Route.REDIS
    assert not never.answered(False, generation)
    assert never.answered(False, never.generation), "the first call sent after it answered"
    assert not never.answered(False, never.generation)


def test_one_prober_a_back_off_in_every_order_of_its_events() -> None:
    """The events of a back-off's life, in every order up to 6 of them: the flag that says
    a prober runs is true exactly while one runs (so at most one does), and a back-off
    without one gets one at the next call."""
    from qag_client._policy import Outage, Probe, Route

    events = (
        "call fails",
        "call",
        "step",
        "probe fails",
        "probe busy",
        "probe answers",
        "stop",
        "node forgotten",
    )

    def run(schedule: Tuple[str, ...]) -> None:
        outage = Outage(5.0)
        probers, probing = 0, False
        for n, event in enumerate(schedule):
            now = n * 0.1
            if event == "call fails":
                probers += outage.failed(False, now, "refused")
            elif event == "call":
                route = outage.route()
                probers += route is Route.START_PROBER
                assert (route is Route.REDIS) == (not outage.backing_off)
            elif event == "step" and probers == 1 and not probing:
                step = outage.prober_step(now)
                if step is Probe.END:
                    probers = 0
                elif step is Probe.NOW:
                    probing = True
                else:
                    assert 0 < step <= 5.0
            elif event == "probe fails" and probing:
                assert not outage.failed(True, now, "timeout")
                probing = False
            elif event == "probe busy" and probing:
                outage.deferred(now)
                probing = False
            elif event == "probe answers" and probing:
                assert outage.answered(True, outage.generation)
                probers, probing = 0, False  # it ends at once
            elif event == "stop" and probers == 1:
                outage.prober_stopped()
                probers, probing = 0, False
            elif event == "node forgotten" and probers == 1 and not probing:
                outage.forget()
                probers = 0
            assert probers <= 1 and outage.prober == (probers == 1), schedule
            if outage.backing_off and probers == 0:
                assert outage.route() is Route.START_PROBER, schedule
                probers = 1

    tried = 0
    for length in range(1, 7):
        for schedule in itertools.product(events, repeat=length):
            run(schedule)
            tried += 1
    assert tried == sum(8**n for n in range(1, 7))


def test_a_repeated_log_line_is_written_once_a_second_with_what_it_left_out() -> None:
    from qag_client._policy import LogEvery

    log = LogEvery()
    assert log.due(100.0) == 0
    assert [log.due(100.0 + t) for t in (0.1, 0.5, 0.99)] == [None, None, None]
    assert log.due(101.0) == 3, "a second later: the three left out"
    assert log.due(101.5) is None
    assert log.due(105.0) == 1


def test_errors_sorted_busy_apart_from_outages() -> None:
    import redis.exceptions as errors

    from qag_client import QagBusy, QagUnavailable
    from qag_client._engine import sort_error

    assert isinstance(sort_error(errors.MaxConnectionsError("Too many connections")), QagBusy)
    assert isinstance(sort_error(errors.ConnectionError("No connection available.")), QagBusy)
    for error in [
        errors.ConnectionError("Connection refused"),
        errors.TimeoutError("Timeout reading from socket"),
        errors.BusyLoadingError("LOADING Redis is loading the dataset in memory"),
        errors.ResponseError("MASTERDOWN Link with MASTER is down"),
        errors.ResponseError("CLUSTERDOWN The cluster is down"),
        errors.ResponseError("TRYAGAIN Multiple keys request during rehashing of slot"),
        # redis-py's race on a connection closed under it during a failover.
        AttributeError("'NoneType' object has no attribute 'writelines'"),
        # redis-py 5.0's pooled connection closed under it (found by the fault test:
        # it was a QagServerError, answered by no policy).
        errors.RedisError("Buffer is closed."),
        # A waiter let go by its primary's demotion (Redis 8).
        errors.ResponseError(
            "UNBLOCKED force unblock from blocking operation, instance state changed"
            " (master -> replica?)"
        ),
    ]:
        assert isinstance(sort_error(error), QagUnavailable), error
    assert not isinstance(sort_error(errors.ResponseError("Buffer is closed.")), QagUnavailable)
    unblocked = errors.ResponseError("UNBLOCKED client unblocked via CLIENT UNBLOCK")
    assert not isinstance(sort_error(unblocked), QagUnavailable)


def test_local_leases_quotas_and_windows_count_this_processs_share() -> None:
    from qag_client import Scope
    from qag_client.local import LocalState, share_of

    assert (share_of(10, 0.5), share_of(3, 0.25), share_of(1, 0.01), share_of(7, 1.0)) == (
        5,
        1,
        1,
        7,
    )
    state = LocalState()
    grants = [state.leases.acquire("k", f"q{n}", 4, 0.5, 100.0) for n in range(3)]
    assert [(g.acquired, g.live, g.retry_after) for g in grants] == [
        (True, 1, 0),
        (True, 2, 0),
        (False, 2, 1),
    ]
    assert state.leases.acquire("k", "q1", 4, 0.5, 100.0).acquired, "a retried id counts once"
    assert state.leases.release("k", "q0") and not state.leases.release("k", "q0")
    assert state.leases.live("k", 0.5, 100.0) == 1

    now = 1_800_000_000.0
    state.quotas.saw("qag:q", 90, None, int(now) + 3600)  # 90 of 100 calls used
    checks = []
    for _ in range(6):
        check = state.quotas.check("qag:q", "month", "UTC", 100, None, now, 0.5)
        checks.append((check.allowed, check.calls_remaining, check.answered_by))
        if check.allowed:
            usage = state.quotas.add("qag:q", "month", "UTC", 1, 10, now)
    assert checks == [(True, 5, "local"), (True, 4, "local"), (True, 3, "local"),
                      (True, 2, "local"), (True, 1, "local"), (False, 0, "local")]  # fmt: skip
    assert (usage.calls, usage.rows, usage.answered_by) == (95, 50, "local")
    seeded = state.quotas.seed("qag:q", "month", "UTC", 120, 0, now)
    assert (seeded.calls, seeded.rows) == (120, 50)
    later = state.quotas.check("qag:q", "month", "UTC", 100, None, now + 3600, 1.0)
    assert later.allowed and later.calls_remaining == 100, "a new period starts at zero"
    assert later.resets_at == 1_801_440_000  # 2027-02-01 00:00 UTC
    state.clear()
    assert state.quotas.check("qag:q", "month", "UTC", 100, None, now + 3600, 1.0).allowed

    scopes = [Scope("org", 10, 0), Scope("key", 4, 100)]
    admitted = [state.windows.admit(scopes, 60, 1200.5, 0.5).admitted for _ in range(3)]
    assert admitted == [True, True, False]
    refused = state.windows.admit(scopes, 60, 1230.0, 0.5)
    assert (refused.refused_by, refused.retry_after, refused.requests_remaining) == (1, 30, 0)
    assert state.windows.admit(scopes, 60, 1260.0, 0.5).admitted, "the next window"
    assert state.windows.record(["org", "key"], 60, 60, 1261.0, 0.5) == 2
    full = state.windows.admit(scopes, 60, 1262.0, 0.5)
    assert not full.admitted and full.tokens_remaining == 0


def drive(flow: Any, answer: Callable[[Any, int], Any]) -> Tuple[Any, List[Any]]:
    """Runs an engine flow against ``answer(request, n)`` (a reply, or an exception to
    throw in): its answer, or the error it raised, and the requests it made."""
    sent: List[Any] = []
    try:
        request = next(flow)
        while True:
            sent.append(request)
            outcome = answer(request, len(sent))
            if isinstance(outcome, BaseException):
                request = flow.throw(outcome)
            else:
                request = flow.send(outcome)
    except StopIteration as stop:
        return stop.value, sent
    except Exception as raised:  # the flow's own error
        return raised, sent


def module_engine(**options: Any) -> Any:
    from qag_client._engine import Engine

    engine = Engine(**options)
    engine.presence = "present"
    return engine


def test_a_prober_that_cannot_start_leaves_the_next_call_to_try_again() -> None:
    """The outage starts the back-off's prober; one that cannot start (no thread to be
    had) is not left marked running, or no probe would ever end the back-off."""
    from qag_client._policy import Route
    from qag_client.decisions import BucketCall

    engine = module_engine()
    started: List[str] = []

    def refused() -> None:
        started.append("tried")
        raise RuntimeError("can't start new thread")

    engine.start_prober = refused
    call = BucketCall.on(Bucket("k", 5, 60), 1)
    failed, _ = drive(engine.take(call, None), lambda _, n: QagUnavailable("refused"))
    assert isinstance(failed, QagUnavailable), "the policy's answer, not the thread's error"
    assert started == ["tried"] and engine.backing_off
    assert engine.outage.route() is Route.START_PROBER, "the next call tries again"


def test_a_dropped_connection_replays_a_call_with_an_id_once() -> None:
    from qag_client._engine import ConnectionDropped
    from qag_client.decisions import BucketCall

    call = BucketCall.on(Bucket("k", 5, 60), 1)
    dropped = ConnectionDropped("Connection closed by server.")
    engine = module_engine()
    answer, sent = drive(engine.take(call, "r-1"), lambda _, n: dropped if n == 1 else [1, 4, 0])
    assert answer.allowed and answer.remaining == 4
    assert [request.words for request in sent] == [("QAG.TAKE", "k", 5, "60", "ID", "r-1")] * 2
    assert engine.counts.replays == 1 and engine.counts.module == 1
    # Dropped twice: the replay's failure is the call's, an outage (no third try).
    engine = module_engine()
    failed, sent = drive(engine.take(call, "r-2"), lambda _, n: dropped)
    assert isinstance(failed, QagUnavailable) and len(sent) == 2 and engine.backing_off
    # A timeout is no dropped connection: no time is left, nothing sent again.
    engine = module_engine()
    late, sent = drive(engine.take(call, "r-3"), lambda _, n: QagUnavailable("deadline"))
    assert isinstance(late, QagUnavailable) and len(sent) == 1
    # Without an id, an admission is sent again too (the script's take included).
    engine = module_engine()
    answer, sent = drive(engine.take(call, None), lambda _, n: dropped if n == 1 else [1, 3, 0])
    assert answer.remaining == 3
    assert [request.words for request in sent] == [("QAG.TAKE", "k", 5, "60")] * 2
    engine = module_engine(backend="script")
    failed, sent = drive(engine.take(call, None), lambda _, n: dropped)
    assert isinstance(failed, QagUnavailable) and len(sent) == 2
    # A refund without one is not: twice would give back twice.
    engine = module_engine()
    failed, sent = drive(engine.refund(call, 1, None), lambda _, n: dropped)
    assert isinstance(failed, QagUnavailable) and len(sent) == 1
    # A lease neither.
    from qag_client._engine import Attempt

    engine = module_engine()
    failed, sent = drive(engine.lease("l", 2, 1000, "a", Attempt()), lambda _, n: dropped)
    assert isinstance(failed, QagUnavailable) and len(sent) == 1


def test_every_counting_call_ends_with_its_id() -> None:
    from qag_client._engine import HoldState
    from qag_client.decisions import BucketCall

    engine = module_engine()
    call = BucketCall.on(Bucket("k", 5, 60), 2)

    def words(flow: Any, reply: Any) -> Tuple[Any, ...]:
        _, sent = drive(flow, lambda _, n: reply)
        return tuple(sent[0].words)

    assert words(engine.take(call, "i"), [1, 3, 0])[-2:] == ("ID", "i")
    assert words(engine.take_pair(call, call, "i"), [[1, 3, 0], [1, 3, 0]])[-2:] == ("ID", "i")
    assert words(engine.refund(call, 1, "i"), 5)[-2:] == ("ID", "i")
    # An admission sends only a caller's id: none of the limiter's own.
    assert words(engine.take(call, None), [1, 3, 0]) == ("QAG.TAKE", "k", 5, "60", "COST", 2)
    assert "ID" not in words(engine.take_pair(call, call, None), [[1, 3, 0], [1, 3, 0]])
    assert "ID" not in words(engine.refund(call, 1, None), 5)
    assert "ID" not in words(engine.admit([("w", 1, 0)], None, None), [1, 0, 0, 0, -1])
    quota = Quota("day", calls=5)
    assert words(engine.quota_count("QAG.QUOTA.ADD", "q", quota, 1, 0, "i"), [1, 0, 9])[-2:] == (
        "ID",
        "i",
    )
    assert "ID" not in words(engine.quota_count("QAG.QUOTA.SEED", "q", quota, 1, 0), [1, 0, 9])
    assert words(engine.admit([("w", 1, 0)], None, "i"), [1, 0, 0, 0, -1])[-2:] == ("ID", "i")
    assert words(engine.record(["w"], 5, 30, "i"), 1) == (
        "QAG.RECORD", 1, "w", 5, "WINDOW", 30, "ID", "i"
    )  # fmt: skip
    hold = HoldState([Scope("w", 0, 100)], None, 40, 5000, "h", 0.0)
    assert words(engine.reserve(hold), [1, 0, 0, -1, 60]) == (
        "QAG.ADMIT", 1, "w", 0, 100, "RESERVE", 40, "HOLD", 5000, "ID", "h"
    )  # fmt: skip
    assert words(engine.charge(hold, 7), 1)[-3:] == ("ID", "h", "PARTIAL")
    assert words(engine.commit(hold, 9), 1)[-2:] == ("ID", "h")
    assert words(engine.background_commit(hold, 0), 1) == ("QAG.RECORD", 1, "w", 0, "ID", "h")
    # A reserve that returned no guard: its ADMIT replayed (holding what is left of its
    # time at most), then released.
    _, sent = drive(engine.background_unreserve(hold, 1234), lambda _, n: [1, 0, 0, -1, 60])
    assert [request.words for request in sent] == [
        ("QAG.ADMIT", 1, "w", 0, 100, "RESERVE", 40, "HOLD", 1234, "ID", "h"),
        ("QAG.RECORD", 1, "w", 0, "ID", "h"),
    ]
    assert hold.left_ms(0.0) == 5000 and hold.left_ms(4.0) == 1000


def test_default_ids_and_caller_ids() -> None:
    from qag_client.decisions import request_id_of

    first, second = request_id_of(None), request_id_of(None)
    prefix, _, count = first.partition("-")
    assert len(prefix) == 16 and all(c in "0123456789abcdef" for c in prefix)
    assert second == f"{prefix}-{int(count) + 1}"
    assert request_id_of("x" * 128) == "x" * 128
    for bad in ("", "x" * 129, "é" * 65, b"x", 5):
        with pytest.raises(ValueError, match="request_id must be a string of 1 to 128 bytes"):
            request_id_of(bad)  # type: ignore[arg-type]


def test_a_holds_state_and_when_its_background_commit_gives_up() -> None:
    from qag_client._engine import HoldState
    from qag_client.decisions import Admission

    hold = HoldState([Scope("w", 0, 100)], 10, 40, None, "h", 100.0)
    with pytest.raises(RuntimeError, match="before the reservation was entered"):
        hold.open("commit")
    hold.admission = Admission(False, 0, 3, 0, 0)
    with pytest.raises(RuntimeError, match="refused"):
        hold.open("charge")
    assert not hold.in_redis
    hold.admission = Admission(True, None, 0, 5, 60)
    hold.open("charge")
    assert hold.in_redis
    hold.done = True
    with pytest.raises(RuntimeError, match="after the reservation was committed"):
        hold.open("commit")
    # Two windows at the latest, or the hold's own time when shorter.
    assert not hold.gives_up(119.9) and hold.gives_up(120.0)
    short = HoldState([Scope("w", 0, 100)], 10, 40, 3000, "h", 100.0)
    assert not short.gives_up(102.9) and short.gives_up(103.0)
    # Forwarded: nothing held, charge and commit count nothing without a request.
    engine = module_engine()
    hold.admission = Admission(True, None, 0, None, None, "forwarded")
    recorded, sent = drive(engine.commit(hold, 9), lambda _, n: 1)
    assert (recorded.scopes, recorded.answered_by, sent) == (0, "forwarded", [])


def test_local_windows_hold_reservations_until_released_or_their_time() -> None:
    from qag_client.local import LocalWindows

    windows = LocalWindows()
    scopes = [Scope("org", 0, 1000), Scope("key", 0, 300)]
    now = 6000.0  # the start of a window of 60 s

    def reserve(hold_id: str, tokens: int, until: float = now + 120) -> bool:
        return windows.admit(scopes, 60, now, 1.0, (hold_id, tokens, until)).admitted

    assert reserve("a", 200) and reserve("b", 100)
    assert not reserve("c", 1), "the key's 300 are held"
    assert windows.admit(scopes, 60, now, 1.0).tokens_remaining == 0
    windows.release(["org", "key"], "a", 50)  # a partial charge: the hold shrinks
    windows.record(["org", "key"], 50, 60, now, 1.0)  # and the charge counts
    assert not reserve("c", 1), "150 held and 50 counted beside 100"
    windows.release(["org", "key"], "b")  # a commit ends its hold
    assert reserve("c", 100)
    windows.release(["org", "key"], "unknown")  # nothing to release: nothing changes
    assert not reserve("d", 1)
    # Past its time a hold stops counting by itself.
    assert windows.admit(scopes, 60, now + 121, 1.0).tokens_remaining == 300


def test_local_counting_begins_from_what_redis_last_said() -> None:
    """A bucket, a lease count and a window drained in Redis are not counted from fresh
    the moment Redis stops answering (issue 34): each begins from Redis's last word,
    this process's share of it, refilled by the clock from then; a key never seen
    starts fresh."""
    from qag_client import Admission, Scope
    from qag_client.local import LocalState

    state = LocalState()
    now = 1_800_000_000.0
    # 60 of 60 taken: Redis said 0 left. A minute later 1 token has refilled (60/hour).
    state.buckets.saw("qag:b", 60, 3600, 0, now)
    allowed = [state.buckets.take("qag:b", 60, 3600, 1, now + 60)[0] for _ in range(5)]
    assert allowed == [1, 0, 0, 0, 0]
    assert state.buckets.take("qag:fresh", 60, 3600, 1, now)[1] == 59, "never seen: full"
    # Half the fleet's share: half of what was left.
    state.buckets.saw("qag:half", 60, 3600, 20, now)
    assert state.buckets.take("qag:half", 30, 3600, 1, now) == [1, 9, 0]
    # Counting here ends when Redis answers again; its last word stays.
    state.clear()
    assert state.buckets.peek("qag:b", 60, 3600, 1, now + 60)[0] == 1
    # Leases: 4 of 4 live, each for 30 s at most.
    state.leases.saw("qag:running:k", 4, 30_000, now)
    assert not state.leases.acquire("qag:running:k", "new", 4, 1.0, now + 1).acquired
    assert state.leases.live("qag:running:k", 1.0, now + 1) == 4
    assert state.leases.acquire("qag:running:k", "new", 4, 1.0, now + 30).acquired, "run out"
    # A window: the chain had 3 requests and 0 tokens left of rpm 10 / tpm 1000.
    scopes = [Scope("org", 10, 1000)]
    said = Admission(True, None, 0, 3, 0, "module")
    state.windows.saw(scopes, 60, now, said)
    assert not state.windows.admit(scopes, 60, now + 1, 1.0).admitted, "no tokens left"
    state.windows.clear()
    state.windows.saw([Scope("org", 10, 0)], 60, now, Admission(True, None, 0, 3, None, "module"))
    admitted = [
        state.windows.admit([Scope("org", 10, 0)], 60, now + 1, 1.0).admitted for _ in range(5)
    ]
    assert admitted == [True, True, True, False, False]
    # The next window begins from nothing.
    assert state.windows.admit([Scope("org", 10, 0)], 60, now + 60, 1.0).admitted


def test_a_spend_calls_own_id_is_kept_briefly_and_an_older_module_is_asked_without() -> None:
    from qag_client import QagServerError

    engine = module_engine()
    quota = Quota("day", calls=5)
    flow = engine.quota_count("QAG.QUOTA.ADD", "q", quota, 1, 0, "i", 10)
    _, sent = drive(flow, lambda _, n: [1, 0, 9])
    assert sent[0].words[-4:] == ("ID", "i", "KEEP", 10)
    # A module older than KEEP refuses it, writing nothing: sent again without, and
    # that server is not asked with KEEP again (until a new connection).
    older = QagServerError("ERR syntax error: expected WINDOW seconds, ID request-id or PARTIAL")
    engine = module_engine()
    answer, sent = drive(
        engine.record(["w"], 5, None, "j", 10), lambda _, n: older if n == 1 else 1
    )
    assert answer == 1 and [request.words[-2:] for request in sent] == [("KEEP", 10), ("ID", "j")]
    _, sent = drive(engine.record(["w"], 5, None, "k", 10), lambda _, n: 1)
    assert sent[0].words[-2:] == ("ID", "k")
    engine.forget_presence()  # a new connection: asked again
    engine.presence = "present"
    _, sent = drive(engine.record(["w"], 5, None, "l", 10), lambda _, n: 1)
    assert sent[0].words[-2:] == ("KEEP", 10)
    # Any other error is the call's.
    wrong = QagServerError("WRONGTYPE Operation against a key holding the wrong kind of value")
    failed, sent = drive(module_engine().record(["w"], 5, None, "m", 10), lambda _, n: wrong)
    assert failed is wrong and len(sent) == 1


class _Guard:
    """A lease or reservation guard of the fake limiter below: records what was done."""

    def __init__(self, done: List[str], name: str, cancel_on: str = "") -> None:
        self.done, self.name, self.cancel_on = done, name, cancel_on
        self.waited, self.live, self.answered_by = 0.0, 1, "module"
        self.admission = Admission(True, None, 0, 10, 100)

    async def __aenter__(self) -> "_Guard":
        if self.cancel_on == "enter":
            raise asyncio.CancelledError
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.done.append(f"{self.name} exit")

    async def release(self) -> None:
        if self.cancel_on == "release":
            raise asyncio.CancelledError
        self.done.append(f"{self.name} release")

    def _abandon(self) -> None:
        self.done.append(f"{self.name} abandoned")

    def _exit(self) -> None:
        self.done.append(f"{self.name} left")


class _Limiter:
    """What the gateway's steps ask of a limiter, answered by guards that record."""

    _back_off, _deadline = 5.0, 0.5

    def __init__(self, cancel_on: str) -> None:
        self.done: List[str] = []
        self.cancel_on = cancel_on

    def lease(self, *arguments: Any, **options: Any) -> _Guard:
        return _Guard(self.done, "lease")

    def reserve(self, *arguments: Any, **options: Any) -> _Guard:
        return _Guard(self.done, "hold", self.cancel_on)


def _limiting(limiter: _Limiter) -> Tuple[Limiting, Budget]:
    window = lambda parts, key: WindowLimit([("w", 0, 1000)], 10)  # noqa: E731
    config = Config.of(
        limiter, None, None, None, lambda parts: "acme~x", KeyLimits(max_concurrent=2), 1000, True
    )
    config = dataclasses.replace(config, window=window)
    request = Limiting(config, RequestParts({}, None, dict, ""))
    return request, request.budget


def test_a_request_interrupted_while_its_window_is_asked_leaves_its_slot() -> None:
    """Cancelled while the window's reservation is entered, after the slot was taken:
    the slot is released in the background, not left renewing."""
    limiter = _Limiter("enter")
    request, budget = _limiting(limiter)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(drive_async(limiter, request.admit(), budget))
    assert limiter.done == ["lease abandoned"]


def test_a_request_interrupted_at_its_end_releases_its_slot_and_its_hold() -> None:
    """Cancelled while the window's hold is released at the response's end: the slot
    was released first, and the hold is committed in the background."""
    limiter = _Limiter("release")
    request, budget = _limiting(limiter)
    admitted = asyncio.run(drive_async(limiter, request.admit(), budget))
    assert admitted.window is not None
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(drive_async(limiter, request.ended(), budget))
    assert limiter.done == ["lease exit", "hold left"]


def test_ids_made_after_a_fork_are_the_childs_own() -> None:
    """A worker forked after the package was imported (gunicorn --preload, uWSGI) makes
    ids of its own: its requests' (the middleware's, its slots' lease ids) and its
    calls' default ids never repeat its parent's or a sibling's."""
    import os

    from qag_client.decisions import request_id_of

    def ids() -> List[str]:
        request = Limiting(Config(), RequestParts({}, None, dict, ""))
        return [request.id, request_id_of(None)]

    ids()  # the parent made ids before forking
    made: List[str] = []
    for _ in range(2):
        reader, writer = os.pipe()
        child = os.fork()
        if child == 0:  # the worker: reports its ids and ends
            try:
                os.write(writer, " ".join(ids()).encode())
            finally:
                os._exit(0)
        os.close(writer)
        with os.fdopen(reader) as pipe:
            made += pipe.read().split()
        os.waitpid(child, 0)
    made += ids()
    assert len(made) == 6 and len(set(made)) == 6, made


def test_local_windows_keep_each_scopes_last_word_for_its_own_window() -> None:
    """100,000 scopes of 60 s tracked: an answer Redis gives costs the same however many
    are tracked (no rebuild of the map under the lock), and one on a chain of 1 s drops
    no scope's last word before its own window has passed (a scope Redis said had
    nothing left is not admitted locally)."""
    import time

    import qag_client.local as local_module
    from qag_client.local import LocalWindows

    windows = LocalWindows()
    now = 1_800_000_000.0  # the start of a window of 60 s
    drained = Admission(True, None, 0, 0, None, "module")  # 0 requests left
    many = local_module.PRUNE_ABOVE
    for n in range(many):
        windows.saw([Scope(f"scope{n}", 12, 0)], 60, now, drained)
    started = time.perf_counter()
    for n in range(20):
        windows.saw([Scope(f"more{n}", 12, 0)], 60, now + 1, drained)
    per_answer = (time.perf_counter() - started) / 20
    windows.saw([Scope("fast", 5, 0)], 1, now + 2, drained)
    newest = Scope(f"scope{many - 1}", 12, 0)
    admitted = [windows.admit([newest], 60, now + 3, 1.0).admitted for _ in range(12)]
    assert admitted.count(True) == 0, admitted
    assert per_answer < 0.002, f"{per_answer * 1000:.1f} ms an answer"


def test_local_windows_stay_bounded() -> None:
    """Scopes past their own window are dropped as answers come (a few at a time), and
    the map never holds more than its bound: the oldest go first."""
    import qag_client.local as local_module
    from qag_client.local import LocalWindows

    windows = LocalWindows()
    now = 1_800_000_000.0
    said = Admission(True, None, 0, 3, None, "module")
    many = local_module.PRUNE_ABOVE
    for n in range(many + 10):
        windows.saw([Scope(f"scope{n}", 12, 0)], 60, now, said)
    assert len(windows._seen) == many
    assert "scope9" not in windows._seen and "scope10" in windows._seen
    for n in range(100):  # a window later: the stale go, a few an answer
        windows.saw([Scope(f"later{n}", 12, 0)], 60, now + 60, said)
    assert len(windows._seen) < many - 5000


def test_a_refused_local_lease_keeps_nothing() -> None:
    """Leases refused locally (every slot held, as Redis last said) on many keys keep
    nothing of them: memory grows with the leases held, not the keys asked."""
    from qag_client.local import LocalLeases

    leases = LocalLeases()
    now = 1_800_000_000.0
    for n in range(1000):
        leases.saw(f"qag:running:{n}", 1, 30_000, now)
        assert not leases.acquire(f"qag:running:{n}", "q", 1, 1.0, now + 1).acquired
    assert leases._held == {}
    assert leases.acquire("qag:running:free", "q", 1, 1.0, now).acquired
    assert list(leases._held) == ["qag:running:free"]


def test_a_round_trip_past_its_deadline_never_takes_a_late_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the fault test (Python 3.11): redis-py swallowed the cancellation at the
    deadline (asyncio.wait_for before 3.12 returns its inner future's result when the
    cancellation comes as it finishes), the round trip went on, and its late answer was
    taken as if in time (0.86 s at a 0.3 s deadline). It is cancelled again, and what it
    ends with is past the deadline."""
    from qag_client import _async, _driver

    async def swallowing(*_: Any) -> str:
        round_trip = _async._ROUND_TRIP.get()
        assert round_trip is not None
        round_trip.begin(asyncio.get_running_loop().time())
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            pass  # as asyncio.wait_for may before Python 3.12
        await asyncio.sleep(0.01)
        return "late"

    monkeypatch.setattr(_async, "_send", swallowing)

    async def run() -> float:
        loop = asyncio.get_running_loop()
        trip = _driver.Trip(loop.time() + 0.1, 0.1)
        started = loop.time()
        with pytest.raises(_driver.DeadlinePassed):
            await _async._round_trip(_driver.Send(Any, Any, False, trip), loop)
        return loop.time() - started

    assert asyncio.run(run()) < 0.3

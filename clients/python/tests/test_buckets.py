"""Token buckets through Limiter and AsyncLimiter (each test runs on both) on real
servers with and without the module: module and script answer alike call by call and
keep one budget; "auto" follows a server restarted without and with the module; a
NOPERM stays a permission error."""

from __future__ import annotations

from typing import Any, Callable, List

import pytest

from conftest import Server
from qag_client import (
    TOKEN_BUCKET_LUA,
    Bucket,
    QagModuleRequired,
    QagPermissionError,
    QagUnavailable,
    Quota,
    Refunded,
)

# A bucket too slow to refill within a test: replies depend on the calls alone.
COUNT, PERIOD = 5, 36000.0
COSTS = [1, 2, 1, 3, 1, 9, 1, 1]


def reply_of(decision: Any) -> List[int]:
    # The script's reply: -1 for "never fits" (None in a Decision).
    retry = -1 if decision.retry_after is None else decision.retry_after
    return [int(decision.allowed), decision.remaining, retry]


def test_module_and_script_answer_as_the_raw_command_and_the_script(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    server = start_server()
    raw = server.client()
    sha = raw.script_load(TOKEN_BUCKET_LUA)
    module = make_limiter(server, backend="module")
    script = make_limiter(server, backend="script")
    auto = make_limiter(server)
    for n, cost in enumerate(COSTS):
        by_module = module.take(Bucket("qag:m", COUNT, PERIOD), cost)
        by_auto = auto.take(Bucket("qag:a", COUNT, PERIOD), cost)
        by_script = script.take(Bucket("qag:s", COUNT, PERIOD), cost)
        raw_module = raw.execute_command("QAG.TAKE", "qag:rm", COUNT, PERIOD, "COST", cost)
        raw_script = raw.evalsha(sha, 1, "qag:rs", COUNT, PERIOD, cost)
        assert raw_module == raw_script, n
        for decision in (by_module, by_auto, by_script):
            assert reply_of(decision) == raw_module, (n, decision)
            assert (decision.limit, decision.period) == (COUNT, PERIOD)
        assert (by_module.answered_by, by_auto.answered_by, by_script.answered_by) == (
            "module",
            "module",
            "script",
        )
    for key in ("qag:m", "qag:a", "qag:s", "qag:rm", "qag:rs"):
        # The script's fields and nothing else: a take sends no id of the limiter's.
        assert sorted(raw.hkeys(key)) == [b"tokens", b"ts"], key
        assert raw.pttl(key) > 0, key
    peeked = module.peek(Bucket("qag:m", COUNT, PERIOD))
    fallback = script.peek(Bucket("qag:m", COUNT, PERIOD))
    assert reply_of(peeked) == reply_of(fallback)
    assert fallback.answered_by == "script"
    assert reply_of(script.peek(Bucket("qag:absent", COUNT, PERIOD), 6)) == [0, 5, -1]


def test_without_the_module_auto_runs_the_script_and_module_is_an_error(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    server = start_server(with_module=False)
    auto = make_limiter(server)
    module = make_limiter(server, backend="module")
    for left in reversed(range(COUNT)):
        decision = auto.take(Bucket("qag:k", COUNT, PERIOD))
        assert (decision.allowed, decision.remaining, decision.answered_by) == (
            True,
            left,
            "script",
        )
    assert not auto.take(Bucket("qag:k", COUNT, PERIOD)).allowed
    with pytest.raises(QagModuleRequired):
        module.take(Bucket("qag:k", COUNT, PERIOD))
    # Every family: the scripts where the module is missing, QagModuleRequired for "module".
    usage = auto.quota_add("qag:q", Quota("day", "UTC"), calls=1)
    assert (usage.calls, usage.answered_by) == (1, "script")
    with pytest.raises(QagModuleRequired):
        module.quota_add("qag:q", Quota("day", "UTC"), calls=1)


def test_pairs_by_module_and_by_script_agree_and_leave_a_refused_key_alone(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    server = start_server()
    raw = server.client()
    module = make_limiter(server, backend="module")
    script = make_limiter(server, backend="script")

    def shape(pair: Any) -> tuple:
        key_left = None if pair.key is None else pair.key.remaining
        return (pair.allowed, pair.refused_by, pair.client.remaining, key_left, pair.retry_after)

    for n in range(6):
        by_module = module.take_pair(Bucket("qag:mc", 3, PERIOD), Bucket("qag:mk", 5, PERIOD))
        by_script = script.take_pair(Bucket("qag:sc", 3, PERIOD), Bucket("qag:sk", 5, PERIOD))
        assert shape(by_module) == shape(by_script), n
        assert (by_module.answered_by, by_script.answered_by) == ("module", "script")
        if n >= 3:
            assert by_module.refused_by == "client" and by_module.key is None
    for key in ("qag:mk", "qag:sk"):
        assert 2.0 <= float(raw.hget(key, "tokens")) < 2.01, key


def test_one_bucket_through_module_and_script_refuses_where_the_module_alone_does(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    server = start_server()
    module = make_limiter(server, backend="module")
    script = make_limiter(server, backend="script")
    mixed, alone = [], []
    for n in range(8):
        through = module if n % 2 == 0 else script
        mixed.append(through.take(Bucket("qag:shared", COUNT, PERIOD)))
        alone.append(module.take(Bucket("qag:alone", COUNT, PERIOD)))
    assert [(d.allowed, d.remaining) for d in mixed] == [(d.allowed, d.remaining) for d in alone]
    assert [d.allowed for d in mixed].index(False) == COUNT


@pytest.mark.parametrize("with_module", [True, False])
def test_a_user_with_only_the_module_commands(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any], with_module: bool
) -> None:
    server = start_server(with_module=with_module)
    admin = server.client()
    grants = ["+qag.take", "+qag.take2"] if with_module else []
    admin.execute_command("ACL", "SETUSER", "gateway", "on", ">secret", "~qag:*", *grants)
    login = {"username": "gateway", "password": "secret"}
    auto = make_limiter(server, login)
    script = make_limiter(server, login, backend="script")
    if with_module:
        assert auto.take(Bucket("qag:k", COUNT, PERIOD)).answered_by == "module"
        assert auto.take_pair(Bucket("qag:{t}c", 3, 1), Bucket("qag:{t}k", 5, 60)).allowed
    else:
        # COMMAND is not granted either: the module command is tried, is unknown, and
        # the script is refused: a permission error, not a missing module.
        with pytest.raises(QagPermissionError):
            auto.take(Bucket("qag:k", COUNT, PERIOD))
    with pytest.raises(QagPermissionError):
        script.take(Bucket("qag:k", COUNT, PERIOD))


def test_auto_follows_a_restart_without_and_with_the_module(
    start_server: Callable[..., Server],
    make_limiter: Callable[..., Any],
    temp_directory: Any,
) -> None:
    persisted = {"directory": temp_directory, "extra": ["--appendonly", "yes"]}
    server = start_server(**persisted)
    port = server.port
    # Believe a missing module for long: only the failed call may make it ask again.
    # No back-off: every call goes to the server it reaches.
    auto = make_limiter(server, recheck_missing_module=3600, back_off=0)
    seen = []

    def take() -> None:
        try:
            decision = auto.take(Bucket("qag:k", 10, PERIOD))
            seen.append((decision.answered_by, decision.remaining))
        except QagUnavailable:
            # The first call after a restart may find its connection dropped.
            pass

    for _ in range(2):
        take()
    server.shutdown()
    server = start_server(with_module=False, port=port, **persisted)
    for _ in range(3):
        take()
    server.shutdown()
    start_server(port=port, **persisted)
    for _ in range(3):
        take()
    remaining = [left for _, left in seen]
    assert all(a == b + 1 for a, b in zip(remaining, remaining[1:])), seen
    assert seen[0] == ("module", 9), seen
    backends = [backend for backend, _ in seen]
    assert "script" in backends and backends[-1] == "module", seen
    switches = sum(1 for a, b in zip(backends, backends[1:]) if a != b)
    assert switches == 2, seen


@pytest.mark.parametrize("with_module", [True, False], ids=["module", "script"])
def test_refunds_give_tokens_back_and_leave_a_missing_bucket_missing(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any], with_module: bool
) -> None:
    server = start_server(with_module=with_module)
    raw = server.client()
    limiter = make_limiter(server)
    by = "module" if with_module else "script"
    missing = Bucket("qag:missing", COUNT, PERIOD)
    assert limiter.refund(missing, 2) == Refunded(COUNT, by)
    # A missing bucket stays missing: nothing is written (a refund sends no id of its own).
    assert raw.exists("qag:missing") == 0
    bucket = Bucket("qag:r", COUNT, PERIOD)
    assert limiter.take(bucket, 4).remaining == 1
    assert limiter.refund(bucket, 2) == Refunded(3, by)
    assert limiter.refund(bucket, 100) == Refunded(COUNT, by), "never above the count"
    assert limiter.take(bucket, COUNT).allowed
    with pytest.raises(ValueError, match="n must be an integer from 1"):
        limiter.refund(bucket, 0)


@pytest.mark.parametrize("policy", ["local", "forward"])
def test_refunds_while_redis_is_down_follow_the_policy(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any], policy: str
) -> None:
    server = start_server()
    limiter = make_limiter(server, on_unavailable=policy)
    server.kill()
    bucket = Bucket("qag:r", COUNT, PERIOD)
    if policy == "forward":
        assert limiter.refund(bucket, 1) == Refunded(COUNT, "forwarded")
        return
    assert limiter.take(bucket, 3).answered_by == "local"
    assert limiter.refund(bucket, 1) == Refunded(3, "local")


def test_300_takes_through_the_defaults_cost_what_a_plain_bucket_costs(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    """An admission sends no id of the limiter's (issue 37): 300 takes and pairs leave
    their buckets as 300 plain QAG.TAKEs do, where remembering an id a take made one
    bucket 16 KB; a caller's id is still remembered."""
    server = start_server()
    raw = server.client()
    limiter = make_limiter(server)
    plain, through, pair = ("qag:plain", "qag:defaults", "qag:pair")
    for _ in range(300):
        raw.execute_command("QAG.TAKE", plain, 1000, 3600)
        assert limiter.take(Bucket(through, 1000, 3600)).allowed
        assert limiter.take_pair(Bucket(pair, 1000, 3600), Bucket(through + "2", 1000, 3600))
    limiter.refund(Bucket(through, 1000, 3600), 1)
    assert limiter.admit([("qag:window", 0, 0)]).admitted
    for key in (through, pair, through + "2"):
        assert sorted(raw.hkeys(key)) == [b"tokens", b"ts"], key
        assert raw.memory_usage(key) <= 2 * raw.memory_usage(plain), key
    assert all(not name.startswith(b"id:") for name in raw.hkeys("qag:window"))
    limiter.take(Bucket(through, 1000, 3600), request_id="gateway-request-1")
    assert b"id:take:gateway-request-1" in raw.hkeys(through)

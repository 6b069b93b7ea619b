"""A server that stops answering (SIGSTOP), on both limiters: QagUnavailable within the
deadline plus 100 ms; with on_unavailable="local", local decisions during the back-off
without touching Redis (a bucket of 5 refuses the sixth), Redis's again after it."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable, Iterator

import pytest

from conftest import Server
from qag_client import QagUnavailable

DEADLINE = 0.5
BACK_OFF = 2.0


@pytest.fixture
def stop() -> Iterator[Callable[[Server], None]]:
    stopped = []

    def stop_server(server: Server) -> None:
        os.kill(server.process.pid, signal.SIGSTOP)
        stopped.append(server)

    yield stop_server
    for server in stopped:  # continued however the test ends
        os.kill(server.process.pid, signal.SIGCONT)


def take_calls(server: Server) -> int:
    stats = server.client().info("commandstats")
    return int(stats.get("cmdstat_qag.take", {}).get("calls", 0))


def test_a_stopped_server(
    start_server: Callable[..., Server],
    make_limiter: Callable[..., Any],
    stop: Callable[[Server], None],
) -> None:
    server = start_server()
    strict = make_limiter(server)
    local = make_limiter(server, on_unavailable="local", back_off=BACK_OFF)
    for limiter in (strict, local):
        assert limiter.take("qag:warm", 5, 3600).backend == "module"

    stop(server)
    started = time.monotonic()
    with pytest.raises(QagUnavailable):
        strict.take("qag:strict", 5, 3600)
    waited = time.monotonic() - started
    assert DEADLINE - 0.01 <= waited < DEADLINE + 0.1, waited

    decisions = []
    for n in range(6):
        started = time.monotonic()
        decision = local.take("qag:local", 5, 3600)
        decisions.append((decision.allowed, decision.remaining, decision.backend))
        if n:
            assert time.monotonic() - started < 0.05, "a call in the back-off waited on Redis"
    assert decisions == [(True, 4, "local"), (True, 3, "local"), (True, 2, "local"),
                         (True, 1, "local"), (True, 0, "local"), (False, 0, "local")]  # fmt: skip
    assert local.counting_locally and local.local_decisions == 6
    pair = local.take_pair("qag:local", 5, 3600, "qag:other", 5, 3600)
    assert pair.backend == "local" and pair.refused_by == "client" and pair.key is None

    os.kill(server.process.pid, signal.SIGCONT)
    until = time.monotonic() + BACK_OFF + 1
    while local.counting_locally:
        assert time.monotonic() < until, "the back-off never ended"
        time.sleep(0.02)
    assert local.take("qag:local", 5, 3600).backend == "module"
    assert local.local_decisions == 7
    assert strict.take("qag:strict", 5, 3600).backend == "module"
    # Redis saw the warm-up calls, the two sent before their deadlines passed (run
    # once it continued), and the two after: none of the back-off's.
    assert take_calls(server) == 6

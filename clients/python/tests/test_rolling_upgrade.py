"""A rolling upgrade under a running limiter: a primary without the module served by
the scripts, its replica with the module promoted (the limiter's address moved to it, as
a managed service's endpoint moves), and the reverse, a node restarted without the
module. Every family carries over exactly: a held lease stays held and renewed, quota
counts, window counters and an open reservation's hold go on from where they were,
whichever answers."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable, List, Tuple

import redis

from conftest import Server, idle
from qag_client import Bucket, Quota, Scope

TTL_MS = 6000
QUOTA = Quota("month", "Europe/Berlin", calls=10)
SCOPES = [Scope("qag:win:{acme}:org", 100, 10_000), Scope("qag:win:{acme}:key", 5, 5_000)]
KEYS = [scope.key for scope in SCOPES]
# An hour's windows: no window ends within the test (its figures stay exact).
WINDOW = 3600


class Endpoint:
    """A TCP address that forwards to a server's port, and can be moved to another one
    (its connections cut, as a failover cuts them)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.open: List[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return
            self.open += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()

    def move_to(self, port: int) -> None:
        """New connections go to ``port``; the open ones are cut."""
        self.target = port
        for connection in self.open:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.open.clear()

    def close(self) -> None:
        self.listener.close()
        self.move_to(0)


class Address:
    """Where a limiter connects: ``make_limiter`` asks it for its clients."""

    def __init__(self, port: int) -> None:
        self.port = port

    client = Server.client
    async_client = Server.async_client


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(16 * 1024):
            sink.sendall(data)
    except OSError:
        pass
    try:
        sink.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def window_counts(server: Server, key: str) -> Tuple[int, int, int]:
    """A window scope's requests and tokens counted, and tokens held now."""
    fields = server.client().hgetall(key)
    requests = sum(int(value) for name, value in fields.items() if name.startswith(b"req:"))
    tokens = sum(int(value) for name, value in fields.items() if name.startswith(b"tok:"))
    words = fields.get(b"holds", b"").decode().split()
    now_ms = time.time() * 1000
    held = sum(int(words[n]) for n in range(0, len(words), 2) if int(words[n + 1]) > now_ms)
    return requests, tokens, held


def drive(limiter: Any, by: str) -> Tuple[Any, Any, Any]:
    """Every family's state, with a lease held and a reservation open (both entered,
    returned to be left by ``carry_on``: the lease's guard and what entering it gave, and
    the reservation), each answered by ``by``."""
    bucket = Bucket("qag:b", 10, 3600)
    for left in (9, 8, 7):
        decision = limiter.take(bucket)
        assert (decision.remaining, decision.answered_by) == (left, by)
    guard = limiter.lease("qag:run", 2, TTL_MS, "a")
    lease = guard.__enter__()
    assert lease.answered_by == by
    usage = limiter.quota_add("qag:q", QUOTA, calls=3)
    assert (usage.calls, usage.answered_by) == (3, by)
    admitted = limiter.admit(SCOPES, window=WINDOW)
    assert (admitted.requests_remaining, admitted.answered_by) == (4, by)
    assert limiter.record(KEYS, 700, window=WINDOW) == 2
    hold = limiter.reserve(SCOPES, 4000, window=WINDOW)
    hold.__enter__()
    assert (hold.admitted, hold.answered_by) == (True, by)
    hold.charge(500)
    return guard, lease, hold


def carry_on(limiter: Any, server: Server, before: Tuple[Any, Any, Any], by: str) -> None:
    """The second node goes on exactly from the first's state, answered by ``by``."""
    guard, lease, hold = before
    # The lease held across the switch: still one live lease there, renewed, not lost.
    idle(limiter, 0.2)
    assert limiter.leases("qag:run") == 1
    assert limiter.renew("qag:run", "a", TTL_MS)
    assert not lease.lost, lease.last_error
    decision = limiter.take(Bucket("qag:b", 10, 3600))
    assert (decision.remaining, decision.answered_by) == (6, by)
    checked = limiter.quota_check("qag:q", QUOTA)
    assert (checked.calls_remaining, checked.answered_by) == (7, by)
    # 1200 counted (700 and a partial 500) and 3500 still held of 5000: 300 left.
    admitted = limiter.admit(SCOPES, window=WINDOW)
    assert (admitted.requests_remaining, admitted.tokens_remaining, admitted.answered_by) == (
        2,
        300,
        by,
    )
    assert window_counts(server, KEYS[1]) == (3, 1200, 3500)
    # The commit settles on the new node: 1600 in all, 500 paid, the hold released.
    hold.commit(1600)
    hold.__exit__(None, None, None)
    assert window_counts(server, KEYS[1]) == (3, 2300, 0)
    guard.__exit__(None, None, None)
    assert limiter.leases("qag:run") == 0


def test_a_replica_with_the_module_promoted_carries_the_scripts_state_over(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    primary = start_server(with_module=False)
    replica = start_server(extra=["--replicaof", "127.0.0.1", str(primary.port)])
    linked = time.monotonic() + 20
    while replica.client().info("replication").get("master_link_status") != "up":
        assert time.monotonic() < linked, "the replica never linked"
        time.sleep(0.02)
    endpoint = Endpoint(primary.port)
    try:
        # A server found without the module is asked again after this long (the default
        # is 10 s): the calls after the move are the module's within the test.
        limiter = make_limiter(Address(endpoint.port), recheck_missing_module=0.2)
        before = drive(limiter, "script")
        assert primary.client().execute_command("WAIT", 1, 5000) == 1
        replica.client().execute_command("REPLICAOF", "NO", "ONE")
        endpoint.move_to(replica.port)
        primary.kill()
        carry_on(limiter, replica, before, "module")
    finally:
        endpoint.close()


def test_a_node_restarted_without_the_module_carries_its_state_over(
    start_server: Callable[..., Server], make_limiter: Callable[..., Any]
) -> None:
    server = start_server()
    limiter = make_limiter(server)
    before = drive(limiter, "module")
    # Saved and stopped, then started without the module on the same port and data.
    try:
        server.client().shutdown(save=True)
    except redis.exceptions.ConnectionError:
        pass
    server.process.wait()
    restarted = start_server(with_module=False, port=server.port, directory=server.directory)
    carry_on(limiter, restarted, before, "script")

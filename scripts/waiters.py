#!/usr/bin/env python3
"""What waiting clients cost a server (docs/buckets.md): starts a server with the module
on a free loopback port, keeps N clients waiting (`QAG.LEASE ... WAIT 60000` on a key
whose one slot is held, each on a connection of its own: they wait the whole minute,
where a bucket's waiters would be served as its tokens come), and reports used_memory
per waiter and the latency of another client's calls (PING and QAG.TAKE) while they
wait, against the same calls before; then closes the waiters and checks none is left.
Then N waiters on one bucket (`QAG.TAKE ... WAIT 60000`, its tokens all due within the
minute), half of them (every other one) closed at once: how long another client's PING
waited at most while the server gave their charges back and moved the rest sooner.

    scripts/waiters.py [N] [server binary]      (default 10000, redis-server)

Needs the module built (target/release/libqag.so, or the one QAG_MODULE names) and the
Python client's .venv (scripts/python-env.sh) for redis-py."""

import asyncio
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
MODULE = Path(os.environ.get("QAG_MODULE", ROOT / "target" / "release" / "libqag.so"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def latencies(client: "redis.Redis[bytes]", words: list, n: int = 2000) -> tuple:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        client.execute_command(*words)
        times.append((time.perf_counter() - started) * 1e6)
    times.sort()
    return statistics.median(times), times[int(n * 0.99)]


async def connect(port: int, n: int, command: bytes) -> list:
    """N connections, each sending `command`; returns their writers."""
    writers = []
    for start in range(0, n, 500):
        batch = await asyncio.gather(
            *(asyncio.open_connection("127.0.0.1", port) for _ in range(start, min(n, start + 500)))
        )
        for _, writer in batch:
            writer.write(command)
            writers.append(writer)
        await asyncio.gather(*(writer.drain() for _, writer in batch))
    return writers


async def close(writers: list) -> None:
    for writer in writers:
        writer.close()
    await asyncio.gather(*(writer.wait_closed() for writer in writers))


WAITING = b"*7\r\n$9\r\nQAG.LEASE\r\n$1\r\nl\r\n$1\r\n1\r\n$5\r\n60000\r\n$1\r\nw\r\n$4\r\nWAIT\r\n$5\r\n60000\r\n"


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    server = sys.argv[2] if len(sys.argv) > 2 else "redis-server"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 1024), hard))
    port = free_port()
    directory = tempfile.mkdtemp(prefix="qag-waiters-")
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", directory,
         "--maxclients", str(n + 100), "--loadmodule", str(MODULE), "MAX-WAITERS", str(n + 1)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        # One slot, held: every waiter waits its minute.
        client.execute_command("QAG.LEASE", "l", 1, 600000, "holder")
        client.execute_command("QAG.TAKE", "other", 1000000, 1)
        idle = {"PING": latencies(client, ["PING"]), "TAKE": latencies(client, ["QAG.TAKE", "other", 1000000, 1])}
        before = client.info("memory")["used_memory"]
        clients_before = client.info("clients")["connected_clients"]
        loop = asyncio.new_event_loop()
        # What as many connections cost that wait for nothing (each sent a PING).
        writers = loop.run_until_complete(connect(port, n, b"*1\r\n$4\r\nPING\r\n"))
        while client.info("clients")["connected_clients"] < clients_before + n:
            time.sleep(0.05)
        idle_connections = client.info("memory")["used_memory"]
        loop.run_until_complete(close(writers))
        while client.info("clients")["connected_clients"] > clients_before:
            time.sleep(0.05)
        writers = loop.run_until_complete(connect(port, n, WAITING))
        while client.info("qag")["qag_waiters"] < n:
            time.sleep(0.05)
        waiting = client.info("memory")["used_memory"]
        busy = {"PING": latencies(client, ["PING"]), "TAKE": latencies(client, ["QAG.TAKE", "other", 1000000, 1])}
        loop.run_until_complete(close(writers))
        while client.info("qag")["qag_waiters"] > 0 or client.info("clients")["connected_clients"] > clients_before:
            time.sleep(0.05)
        print(f"{n} waiters on {server}: used_memory {before} -> {waiting} bytes, "
              f"{(waiting - before) / n:.0f} bytes a waiting client, its connection included; "
              f"as many connections waiting for nothing: {(idle_connections - before) / n:.0f} bytes each, "
              f"so the wait itself costs {(waiting - idle_connections) / n:.0f}")  # fmt: skip
        for name in idle:
            print(f"  {name}: p50/p99 {idle[name][0]:.0f}/{idle[name][1]:.0f} us idle, "
                  f"{busy[name][0]:.0f}/{busy[name][1]:.0f} us with {n} waiting")  # fmt: skip
        info = client.info("qag")
        print(f"  closed: wait_given_back {info['qag_wait_given_back']}, waiters {info['qag_waiters']}, "
              f"leases {client.execute_command('QAG.LEASES', 'l')} (the holder's only)")  # fmt: skip
        give_backs(client, port, n, loop)
        loop.close()
    finally:
        process.kill()
        process.wait()


def resp(*words: object) -> bytes:
    """One command's bytes."""
    parts = [str(w).encode() for w in words]
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def give_backs(client: "redis.Redis[bytes]", port: int, n: int, loop: asyncio.AbstractEventLoop) -> None:
    """N waiters on one bucket, every other one closed at once; the longest PING meanwhile."""
    import threading

    # n tokens a 20 s, drained; all of them owed first by a waiter of their own (20 s:
    # nobody else is served before); the last waiter's token within 40 s.
    client.execute_command("QAG.TAKE", "b", n, 20, "COST", n)
    first = loop.run_until_complete(
        connect(port, 1, resp("QAG.TAKE", "b", n, 20, "COST", n, "WAIT", 60000))
    )
    while client.info("qag")["qag_waiters"] < 1:
        time.sleep(0.05)
    given = client.info("qag")["qag_wait_given_back"]
    writers = loop.run_until_complete(connect(port, n, resp("QAG.TAKE", "b", n, 20, "WAIT", 60000)))
    while client.info("qag")["qag_waiters"] < n + 1:
        time.sleep(0.05)
    stalls: list = []
    pinging = True

    def ping() -> None:
        other = redis.Redis(port=port)
        while pinging:
            started = time.perf_counter()
            other.ping()
            stalls.append(time.perf_counter() - started)

    thread = threading.Thread(target=ping)
    thread.start()
    time.sleep(0.2)
    started = time.perf_counter()
    closed = writers[::2]
    loop.run_until_complete(close(closed))
    while client.info("qag")["qag_wait_given_back"] < given + len(closed):
        time.sleep(0.01)
    done = time.perf_counter() - started
    time.sleep(0.2)
    pinging = False
    thread.join()
    print(f"  {n} waiters on a bucket, {len(closed)} closed at once: given back within {done:.2f} s, "
          f"another client's longest PING {max(stalls) * 1e3:.1f} ms (p50 {statistics.median(stalls) * 1e6:.0f} us)")  # fmt: skip
    loop.run_until_complete(close(writers[1::2] + first))


if __name__ == "__main__":
    main()

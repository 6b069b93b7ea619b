#!/usr/bin/env python3
"""What request ids cost a server's memory (docs/replays.md, issue 37). Each part on a
server of its own, started with the module on a free loopback port:

- hot keys: MEMORY USAGE (SAMPLES 0: every field counted) of a key with ID-MAX ids
  beside the same key without, for a bucket (a caller's ids, 36-byte UUIDs), a quota
  and a window (the limiter's own ids, KEEP 10), the calls made through the Python client;
- 100,000 keys: a gateway's requests at a steady rate through the Python client's
  defaults (per request a take of its key's bucket and a quota add of its key's quota:
  the limiter's own id, KEEP 10), each request's key drawn at random, against the same
  requests sent as plain commands (no ids), and with a caller's id on the quota add
  (remembered ID-SECONDS): used_memory over the empty server's, keys, ids remembered;
- cold keys: quota keys each called once a round, rounds further apart than the id's
  KEEP, so that every earlier id of a key is forgotten when it is called again (a key
  called less often than its KEEP); forgotten ids go only when a call looks through its
  key's ids (docs/replays.md), so this is what such keys hold after many calls. The
  calls are the clients' words, sent with KEEP 1 and rounds 1.1 s apart (the clients
  send KEEP 10: the same for a key called less often than every 10 s, sooner).

    scripts/ids_memory.py [--keys 100000] [--rate 2000] [--seconds 100]
                          [--cold-keys 1000] [--rounds 200] [--server redis-server]
                          [--parts hot,keys,cold]

Needs the module built (target/release/libqag.so) and the Python client's .venv
(scripts/python-env.sh): run it with .venv/bin/python."""

import argparse
import random
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List

import redis

from qag_client import Bucket, Limiter, Quota

ROOT = Path(__file__).resolve().parent.parent
MODULE = ROOT / "target" / "release" / "libqag.so"
BUCKET = (100, 60)  # a key's bucket: 100 calls a minute
QUOTA = Quota("month", "UTC", calls=10**9)
QUOTA_WORDS = ["PER", "month", "TZ", "UTC"]
WINDOW = 60
ID_MAX = 1000  # the module's default


class Server:
    def __init__(self, binary: str) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self.directory = tempfile.mkdtemp(prefix="qag-ids-")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.directory, "--loadmodule", str(MODULE)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.raw = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                self.raw.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        self.version = self.raw.info("server")["redis_version"]

    def used_memory(self) -> int:
        return int(self.raw.info("memory")["used_memory"])

    def usage(self, key: str) -> int:
        return int(self.raw.execute_command("MEMORY", "USAGE", key, "SAMPLES", 0))

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def hot(binary: str) -> None:
    print("## A hot key: MEMORY USAGE with ID-MAX ids (SAMPLES 0)\n")
    server = Server(binary)
    limiter = Limiter(server.raw)
    bucket, plain_bucket = Bucket("qag:hot:b", 10**9, 60), Bucket("qag:hot:pb", 10**9, 60)
    scopes = ["qag:hot:w"]
    limiter.take(plain_bucket)
    limiter.admit([("qag:hot:pw", 0, 10**9)], WINDOW)
    server.raw.execute_command("QAG.RECORD", 1, "qag:hot:pw", 1, "WINDOW", WINDOW)
    server.raw.execute_command("QAG.QUOTA.ADD", "qag:hot:pq", *QUOTA_WORDS, "CALLS", 1, "ROWS", 0)
    limiter.admit([(scopes[0], 0, 10**9)], WINDOW)
    for _ in range(ID_MAX):
        limiter.take(bucket, request_id=str(uuid.uuid4()))
        limiter.quota_add("qag:hot:q", QUOTA, 1, 0)
        limiter.record(scopes, 1, WINDOW)
    print("| key | without ids | with ids | ids | bytes an id |")
    print("|---|---:|---:|---:|---:|")
    for label, plain, key in (
        ("bucket, a caller's ids (36-byte UUIDs)", "qag:hot:pb", "qag:hot:b"),
        ("quota, the limiter's own ids (KEEP 10)", "qag:hot:pq", "qag:hot:q"),
        ("window, the limiter's own ids (KEEP 10)", "qag:hot:pw", "qag:hot:w"),
    ):
        ids = sum(1 for name in server.raw.hkeys(key) if name.startswith(b"id:"))
        before, after = server.usage(plain), server.usage(key)
        print(f"| {label} | {before:,} | {after:,} | {ids:,} | {(after - before) / ids:.0f} |")
    example = next(n for n in server.raw.hkeys("qag:hot:q") if n.startswith(b"id:"))
    print(
        f"\n(redis {server.version}; a quota id: {example.decode()} = "
        f"{server.raw.hget('qag:hot:q', example).decode()})\n"
    )
    limiter.close()
    server.stop()


def requests(args: argparse.Namespace, way: str, binary: str) -> Dict[str, Any]:
    """A gateway's requests on args.keys keys at args.rate a second, one of three ways."""
    server = Server(binary)
    limiter = Limiter(server.raw)
    raw = server.raw
    empty = server.used_memory()

    def defaults(k: int, n: int) -> None:
        limiter.take(Bucket(f"qag:b:{k}", *BUCKET))
        limiter.quota_add(f"qag:q:{k}", QUOTA, 1, 0)

    def plain(k: int, n: int) -> None:
        raw.execute_command("QAG.TAKE", f"qag:b:{k}", *BUCKET)
        raw.execute_command("QAG.QUOTA.ADD", f"qag:q:{k}", *QUOTA_WORDS, "CALLS", 1, "ROWS", 0)

    def caller(k: int, n: int) -> None:
        limiter.take(Bucket(f"qag:b:{k}", *BUCKET))
        # The limiter's own id's shape, given as a caller's: remembered ID-SECONDS, no KEEP.
        limiter.quota_add(f"qag:q:{k}", QUOTA, 1, 0, request_id=f"9f86d081884c7d65-{n}")

    send: Callable[[int, int], None] = {"defaults": defaults, "plain": plain, "caller": caller}[way]
    draw = random.Random(37)
    started = time.monotonic()
    total = int(args.rate * args.seconds)
    peak = 0
    for n in range(total):
        due = started + n / args.rate
        late = due - time.monotonic()
        if late > 0:
            time.sleep(late)
        send(draw.randrange(args.keys), n)
        if n % args.rate == 0:
            peak = max(peak, server.used_memory())
    took = time.monotonic() - started
    used = server.used_memory()
    ids, quota_keys = 0, 0
    for start in range(0, args.keys, 1000):
        pipe = raw.pipeline(transaction=False)
        for k in range(start, min(args.keys, start + 1000)):
            pipe.hkeys(f"qag:q:{k}")
        for fields in pipe.execute():
            quota_keys += 1 if fields else 0
            ids += sum(1 for name in fields if name.startswith(b"id:"))
    result = {
        "way": way,
        "requests": total,
        "rate": total / took,
        "keys": raw.dbsize(),
        "quota_keys": quota_keys,
        "ids": ids,
        "used": used - empty,
        "peak": max(peak, used) - empty,
        "version": server.version,
    }
    limiter.close()
    server.stop()
    return result


def keys(args: argparse.Namespace, binary: str) -> None:
    print(f"## {args.keys:,} keys, {args.rate:,} requests a second for {args.seconds} s\n")
    results = [requests(args, way, binary) for way in ("plain", "defaults", "caller")]
    plain = results[0]["used"]
    print(
        "| requests sent | requests/s | keys | quota keys | ids held | used_memory "
        "over the empty server's | peak | × plain |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    labels = {
        "plain": "plain QAG.TAKE and QAG.QUOTA.ADD (no ids)",
        "defaults": "the client's defaults (the quota add's own id, KEEP 10)",
        "caller": "the same ids given as a caller's (remembered ID-SECONDS, no KEEP)",
    }
    for r in results:
        print(
            f"| {labels[r['way']]} | {r['rate']:,.0f} | {r['keys']:,} | {r['quota_keys']:,} | "
            f"{r['ids']:,} | {r['used'] / 2**20:.1f} MiB | {r['peak'] / 2**20:.1f} MiB | "
            f"{r['used'] / plain:.2f}× |"
        )
    print(f"\n(redis {results[0]['version']}; {results[0]['requests']:,} requests each way)\n")


def cold(args: argparse.Namespace, binary: str) -> None:
    print(
        f"## Cold keys: {args.cold_keys:,} quota keys, each called once a round, "
        f"rounds 1.1 s apart, KEEP 1\n"
    )
    server = Server(binary)
    raw = server.raw
    plain = "qag:cold:plain"
    raw.execute_command("QAG.QUOTA.ADD", plain, *QUOTA_WORDS, "CALLS", 1, "ROWS", 0)
    marks = {10, 50, 100, 200, 500, 1000}
    print(
        "| calls a key | ids a key: mean | median | p99 | most | MEMORY USAGE: mean | "
        "× a key without ids |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    counter = 0
    for round_ in range(1, args.rounds + 1):
        started = time.monotonic()
        pipe = raw.pipeline(transaction=False)
        for k in range(args.cold_keys):
            counter += 1
            pipe.execute_command(
                "QAG.QUOTA.ADD",
                f"qag:cold:{k}",
                *QUOTA_WORDS,
                "CALLS",
                1,
                "ROWS",
                0,
                "ID",
                f"9f86d081884c7d65-{counter}",
                "KEEP",
                1,
            )
        pipe.execute()
        if round_ in marks or round_ == args.rounds:
            pipe = raw.pipeline(transaction=False)
            for k in range(args.cold_keys):
                pipe.hlen(f"qag:cold:{k}")
                pipe.execute_command("MEMORY", "USAGE", f"qag:cold:{k}", "SAMPLES", 0)
            replies = pipe.execute()
            ids = sorted(int(n) - 3 for n in replies[0::2])  # a quota's period, calls, rows
            usage = statistics.mean(int(u) for u in replies[1::2])
            print(
                f"| {round_} | {statistics.mean(ids):.0f} | {ids[len(ids) // 2]} | "
                f"{ids[int(len(ids) * 0.99)]} | {ids[-1]} | {usage:,.0f} | "
                f"{usage / server.usage(plain):.1f}× |",
                flush=True,
            )
        time.sleep(max(0.0, 1.1 - (time.monotonic() - started)))
    print(f"\n(redis {server.version}; a key without ids: {server.usage(plain)} bytes)\n")
    server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--rate", type=int, default=2000)
    parser.add_argument("--seconds", type=int, default=100)
    parser.add_argument("--cold-keys", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--server", default="redis-server")
    parser.add_argument("--parts", default="hot,keys,cold")
    args = parser.parse_args()
    parts: Dict[str, Callable[[], None]] = {
        "hot": lambda: hot(args.server),
        "keys": lambda: keys(args, args.server),
        "cold": lambda: cold(args, args.server),
    }
    chosen: List[str] = args.parts.split(",")
    for part in chosen:
        parts[part]()


if __name__ == "__main__":
    main()

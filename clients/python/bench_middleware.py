"""The ASGI middleware's CPU per request against the same calls written by hand in an
ASGI app (take_pair, quota check, lease, the app, quota add, headers, release), both
driven in-process through httpx.ASGITransport against a real Redis with the module.
Not run by the tests.

    REDIS_SERVER=$(which redis-server) .venv/bin/python clients/python/bench_middleware.py \
        [--requests 2000] [--rounds 5]

Prints this process's CPU (time.process_time) per request for each way, alternating
rounds, and the middleware's difference on the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Dict, List, MutableMapping

import httpx
import redis
import redis.asyncio

from qag_client import AsyncLimiter, Bucket, QagRefused, Quota, headers
from qag_client.asgi import KeyLimits, RateLimitMiddleware, query_parameter

REPOSITORY = Path(__file__).resolve().parents[2]
CLIENT = (1_000_000_000, 1.0)
KEY = (1_000_000_000, 3600.0)
QUOTA = Quota("month", "UTC", calls=10**15)
SLOTS = 1_000_000

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


async def handler(scope: Scope, receive: Receive, send: Send) -> None:
    body = b'{"rows":[]}'
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def by_hand(limiter: AsyncLimiter) -> Any:
    counter = [0]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        key = scope["query_string"].decode().partition("key=")[2]
        address = scope["client"][0]
        client = Bucket.named("client", CLIENT[0], CLIENT[1], address)
        per_key = Bucket.named("key", KEY[0], KEY[1], key)
        pair = await limiter.take_pair(client, per_key)
        quota_key = f"qag:quota:{key}"
        check = await limiter.quota_check(quota_key, QUOTA)
        assert pair.allowed and check.allowed
        counter[0] += 1
        try:
            async with limiter.lease(f"qag:running:{key}", SLOTS, 30_000, f"hand-{counter[0]}"):

                async def send_with_headers(message: MutableMapping[str, Any]) -> None:
                    if message["type"] == "http.response.start":
                        usage = await limiter.quota_add(quota_key, QUOTA, 1, 0)
                        fields = headers(pair.client, pair.key, check.after(usage))
                        message = dict(message)
                        message["headers"] = list(message["headers"]) + [
                            (n.encode(), v.encode()) for n, v in fields
                        ]
                    await send(message)

                await handler(scope, receive, send_with_headers)
        except QagRefused:
            raise AssertionError("refused")

    return app


def through_middleware(limiter: AsyncLimiter) -> Any:
    return RateLimitMiddleware(
        handler,
        limiter,
        client_bucket=CLIENT,
        api_key=query_parameter("key"),
        key_limits=KeyLimits(bucket=KEY, max_concurrent=SLOTS, quota=QUOTA),
    )


async def run(app: Any, requests: int) -> float:
    transport = httpx.ASGITransport(app=app, client=("203.0.113.9", 1234))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        for _ in range(50):  # warm
            await client.get("/v1/query?key=acme~bench")
        started = time.process_time()
        for _ in range(requests):
            response = await client.get("/v1/query?key=acme~bench")
            assert response.status_code == 200, response.text
            assert "x-quota-remaining-calls" in response.headers
        return (time.process_time() - started) / requests


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    port = free_port()
    directory = tempfile.mkdtemp(prefix="qag-bench-")
    module = os.environ.get("QAG_MODULE", str(REPOSITORY / "target/release/libqag.so"))
    server = subprocess.Popen(
        [os.environ.get("REDIS_SERVER", "redis-server"), "--port", str(port),
         "--bind", "127.0.0.1", "--save", "", "--dir", directory, "--loadmodule", module],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while True:
            if server.poll() is not None:  # e.g. no module at that path
                raise SystemExit(f"{server.args[0]} exited ({server.returncode}), module {module}")
            try:
                redis.Redis(port=port).ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)

        async def rounds() -> Dict[str, List[float]]:
            limiter = AsyncLimiter(redis.asyncio.Redis(port=port))
            ways = {"hand": by_hand(limiter), "middleware": through_middleware(limiter)}
            seconds: Dict[str, List[float]] = {name: [] for name in ways}
            for _ in range(args.rounds):
                for name, app in ways.items():
                    seconds[name].append(await run(app, args.requests))
            await limiter.aclose()
            return seconds

        seconds = asyncio.run(rounds())
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(directory, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    for name, values in seconds.items():
        rounded = ", ".join(f"{value * 1e6:.0f}" for value in values)
        print(f"{name}: median {medians[name] * 1e6:.0f} µs CPU per request ({rounded})")
    print(f"middleware vs hand: {(medians['middleware'] / medians['hand'] - 1) * 100:+.1f} %")


if __name__ == "__main__":
    main()

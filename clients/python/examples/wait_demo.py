"""Why a gateway waits: an upstream that answers 429 above 10 calls a second (a model
provider's hard rate limit), behind a gateway, driven by 50 concurrent callers. Three
runs, each ``--seconds`` long:

- ``none``: the gateway forwards every call: the upstream refuses what is over its rate.
- ``take``: the gateway takes from a qag bucket of 10 a second (QAG.TAKE) first: it
  answers 429 itself for what is over, and the upstream refuses nothing.
- ``wait``: the same bucket with a wait (QAG.TAKE … WAIT): every call is delayed to its
  turn, in arrival order across callers, and answered; none refused anywhere.

python clients/python/examples/wait_demo.py --redis redis://127.0.0.1:6379/ \
  [--callers 50] [--seconds 20] [--wait-ms 10000] [--runs none,take,wait]

Prints one line a run: calls served, refused by the gateway, refused by the upstream,
and the served calls' latency (p50, p99, max). The Rust twin is
clients/rust/examples/wait_demo.rs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import List, Optional

import redis.asyncio

from qag_client import AsyncLimiter, Bucket


class Upstream:
    """The upstream's own limit: 10 calls a second, a burst of 10 (a token bucket)."""

    RATE = 10.0

    def __init__(self) -> None:
        self.tokens = self.RATE
        self.at = time.monotonic()

    def call(self) -> bool:
        """True: served; False: 429."""
        now = time.monotonic()
        self.tokens = min(self.tokens + (now - self.at) * self.RATE, self.RATE)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


@dataclass
class Tally:
    served: int = 0
    gateway_429: int = 0
    upstream_429: int = 0
    latencies: List[float] = field(default_factory=list)
    took: float = 0.0


async def drive(
    limiter: Optional[AsyncLimiter], wait: Optional[float], bucket: Bucket, args: argparse.Namespace
) -> Tally:
    """``--callers`` callers, each calling again as soon as it is answered (after the
    ``retry-after`` of a 429), for ``--seconds``; the calls under way then are finished."""
    upstream, tally = Upstream(), Tally()
    started = time.monotonic()
    until = started + args.seconds

    async def caller() -> None:
        while time.monotonic() < until:
            called = time.monotonic()
            if limiter is not None:
                decision = await limiter.take(bucket, 1, wait=wait)
                if not decision.allowed:
                    tally.gateway_429 += 1
                    # A caller told to retry after a while does.
                    await asyncio.sleep(max(decision.retry_after or 1, 1))
                    continue
            if upstream.call():
                tally.served += 1
                tally.latencies.append(time.monotonic() - called)
            else:
                tally.upstream_429 += 1
                # The upstream's 429 says `retry-after: 1`.
                await asyncio.sleep(1)

    await asyncio.gather(*(caller() for _ in range(args.callers)))
    tally.took = time.monotonic() - started
    return tally


def report(name: str, tally: Tally, callers: int) -> None:
    every = max(tally.served + tally.gateway_429 + tally.upstream_429, 1)
    latencies = sorted(tally.latencies)

    def at(share: float) -> int:
        if not latencies:
            return 0
        return round(1000 * latencies[min(int(len(latencies) * share), len(latencies) - 1)])

    print(
        f"{name}: {callers} callers, {tally.took:.1f} s: {tally.served} served "
        f"({tally.served / max(tally.took, 0.001):.1f}/s), {tally.gateway_429} refused by "
        f"the gateway ({100 * tally.gateway_429 / every:.0f}%), {tally.upstream_429} refused "
        f"by the upstream ({100 * tally.upstream_429 / every:.0f}%); served in p50 {at(0.5)} "
        f"ms, p99 {at(0.99)} ms, max {round(1000 * latencies[-1]) if latencies else 0} ms",
        flush=True,
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/")
    parser.add_argument("--callers", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--wait-ms", type=int, default=10_000)
    parser.add_argument("--runs", default="none,take,wait")
    args = parser.parse_args()
    runs = args.runs.split(",")
    for run in runs:
        if run not in ("none", "take", "wait"):
            parser.error(f"--runs: none, take or wait, not {run}")
    limiter = AsyncLimiter(redis.asyncio.Redis.from_url(args.redis), max_waiting=args.callers)
    # The gateway's bucket: the upstream's rate, one call at a time (a burst of 1), so
    # its calls reach the upstream spaced out, never more than it serves.
    bucket = Bucket(f"qag:demo:upstream:{os.getpid()}", 1, 0.1)
    try:
        for run in runs:
            gateway = None if run == "none" else limiter
            wait = args.wait_ms / 1000 if run == "wait" else None
            report(run, await drive(gateway, wait, bucket, args), args.callers)
            # The next run starts from a full bucket and a rested upstream.
            await asyncio.sleep(0.2)
    finally:
        await limiter.aclose()


if __name__ == "__main__":
    asyncio.run(main())

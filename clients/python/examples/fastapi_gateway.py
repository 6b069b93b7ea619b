"""A gateway on FastAPI, limited by qag's ASGI middleware: the address's bucket, the
key's bucket, its quota of calls (and rows) and its concurrent queries, with the answers
of ADR 0032; and a model call's window chain: its estimate of tokens held, charged as it
streams and committed.

python clients/python/examples/fastapi_gateway.py --redis redis://127.0.0.1:6379/ \
  --listen 127.0.0.1:8080 [--client-limit 20/1] [--key-limit 60/60] [--max-concurrent 4] \
  [--quota-calls 100000] [--quota-rows N] [--quota-per month --quota-tz Europe/Berlin] \
  [--policy raise|forward|local] [--back-off 5] [--tpm 100000] [--rpm 0] \
  [--shadow key,quota,window,...] [--wait 500 [--max-waiting 100]]

GET /v1/query?key=K[&work_ms=N][&chunks=N][&rows=N]: a small JSON body after work_ms, or
a body streamed in `chunks` pieces over work_ms; `rows` are reported for the key's rows
quota.
GET /v1/complete?key=K&estimate=N&tokens=N[&parts=N][&work_ms=N]: a model call under the
key's tokens (--tpm) and requests (--rpm, 0: none) a minute: the middleware holds
`estimate` tokens at admission (its window option), the handler charges the response's
`tokens` in `parts` while it runs over work_ms and commits them at the end (a caller
gone first: what was charged is committed); its answers carry the OpenAI-style
x-ratelimit-*-requests and -tokens fields of that window.
GET /limits (not limited): how each limit answered, {"key": {"allowed": N, "refused": N,
"shadow": false}, ...}: the numbers to watch for a limit in --shadow.
--wait MS: a request waits up to MS milliseconds for its buckets' tokens and its slot
instead of a 429 (its server-timing says how long); at most --max-waiting wait at once,
a request beyond them is answered at once.
"""

import argparse
import asyncio
import contextlib
import socket
from typing import Any, AsyncIterator, Callable, Optional, Tuple

import redis.asyncio
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from qag_client import AsyncLimiter, QagError, Quota
from qag_client.asgi import (
    LIMITS,
    KeyLimits,
    RateLimitMiddleware,
    RequestParts,
    WindowLimit,
    query_parameter,
)
from qag_client.fastapi import Admitted, admitted

app = FastAPI()


@app.get("/v1/query")
async def query(
    work_ms: int = 0, chunks: int = 0, rows: int = 0, limits: Admitted = Depends(admitted)
) -> Response:
    limits.rows.add(rows)  # the rows the query returned, for the key's rows quota
    if chunks <= 0:
        await asyncio.sleep(work_ms / 1000)
        return JSONResponse({"request_id": limits.request_id})

    async def pieces() -> AsyncIterator[bytes]:
        for sent in range(chunks):
            await asyncio.sleep(work_ms / 1000 / chunks)
            yield f"row {sent}\n".encode()

    return StreamingResponse(pieces(), media_type="text/plain")


@app.get("/v1/complete")
async def complete(
    request: Request,
    tokens: int,
    parts: int = 1,
    work_ms: int = 0,
    limits: Admitted = Depends(admitted),
) -> Response:
    # The middleware held the estimate on the key's window (see model_window); the call
    # charges what it streams as it goes and commits its count at the end.
    hold = limits.window  # None for a refusal a window in shadow let through
    parts = max(parts, 1)
    for _ in range(parts):
        await asyncio.sleep(work_ms / 1000 / parts)  # the model streams a part
        if await request.is_disconnected():
            # Left without a commit: the middleware commits what was charged.
            return Response(status_code=499)
        if hold is not None:
            with contextlib.suppress(QagError):  # Redis failed: the commit settles it
                await hold.charge(tokens // parts)
    if hold is not None:
        with contextlib.suppress(QagError):  # Redis failed: sent again in the background
            await hold.commit(tokens)
    return JSONResponse({"request_id": limits.request_id, "tokens": tokens})


def model_window(
    rpm: int, tpm: int
) -> Callable[[RequestParts, Optional[str]], Optional[WindowLimit]]:
    """A model call's window chain: its key's requests and tokens a minute, the
    query's ``estimate`` (input + max_tokens) held until the handler commits."""

    def window(parts: RequestParts, key: Optional[str]) -> Optional[WindowLimit]:
        if parts.raw["path"] != "/v1/complete":
            return None
        scope = (f"qag:win:{{{key or 'anonymous'}}}:tokens", rpm, tpm)
        try:
            estimate = int(parts.query.get("estimate", "1000"))
        except ValueError:
            estimate = 1000
        return WindowLimit([scope], estimate)

    return window


def main() -> None:
    args = parse_args()
    # The limiter set-up: a policy for outages, the limits, where address and key come from.
    limiter = AsyncLimiter(
        redis.asyncio.Redis.from_url(args.redis),
        on_unavailable=args.policy,
        back_off=args.back_off,
        max_waiting=args.max_waiting,
    )
    quota = None
    if args.quota_calls is not None or args.quota_rows is not None:
        quota = Quota(args.quota_per, args.quota_tz, calls=args.quota_calls, rows=args.quota_rows)
    limited = RateLimitMiddleware(
        app,
        limiter,
        client_bucket=args.client_limit,  # the caller's address: the ASGI scope's client
        api_key=query_parameter("key"),
        key_limits=KeyLimits(
            bucket=args.key_limit, max_concurrent=args.max_concurrent, quota=quota
        ),
        window=model_window(args.rpm, args.tpm),
        shadow=args.shadow,  # limits tried on live traffic: their refusals let through
        # Waiting for a limit's turn instead of a 429, up to --wait ms.
        wait=(
            {limit: args.wait / 1000 for limit in ("client", "key", "concurrency")}
            if args.wait
            else None
        ),
    )

    async def served(scope: Any, receive: Any, send: Any) -> None:
        # /limits reports the counts, not limited; everything else goes through the limits.
        if scope["type"] == "http" and scope["path"] == "/limits":
            counts = {limit: vars(limited.limit_counts(limit)) for limit in LIMITS}
            await JSONResponse(counts)(scope, receive, send)
        else:
            await limited(scope, receive, send)

    host, port = args.listen.rsplit(":", 1)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Inherited by each accepted connection: without it, a response on a kept-alive
    # connection waits ~40 ms for the caller's delayed ACK (uvicorn sets it only on
    # sockets it makes itself).
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    listener.bind((host, int(port)))
    # Listening before saying so: a caller may connect at once, before uvicorn serves.
    listener.listen(2048)
    print(f"listening on {host}:{listener.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(served, log_level="warning", lifespan="off"))
    server.run(sockets=[listener])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A gateway limited by qag.")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/")
    parser.add_argument("--listen", default="127.0.0.1:8080")
    parser.add_argument("--client-limit", type=rate, metavar="COUNT/PERIOD")
    parser.add_argument("--key-limit", type=rate, metavar="COUNT/PERIOD")
    parser.add_argument("--max-concurrent", type=int)
    parser.add_argument("--quota-calls", type=int)
    parser.add_argument("--quota-rows", type=int)
    parser.add_argument("--quota-per", choices=("day", "month"), default="month")
    parser.add_argument("--quota-tz", default="UTC")
    parser.add_argument("--policy", choices=("raise", "forward", "local"), default="raise")
    parser.add_argument("--back-off", type=float, default=5.0, help="seconds Redis is left alone")
    parser.add_argument("--tpm", type=int, default=100_000, help="model tokens a minute a key")
    parser.add_argument("--rpm", type=int, default=0, help="model requests a minute a key")
    parser.add_argument(
        "--shadow", type=lambda text: text.split(","), default=[], help="limits in shadow"
    )
    parser.add_argument("--wait", type=int, default=0, help="ms a request may wait its turn")
    parser.add_argument("--max-waiting", type=int, default=100, help="requests waiting at once")
    return parser.parse_args()


def rate(text: str) -> Optional[Tuple[int, float]]:
    """``COUNT/PERIOD``, e.g. ``20/1``."""
    count, _, period = text.partition("/")
    try:
        return int(count), float(period)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a rate is COUNT/PERIOD, not {text}") from None


if __name__ == "__main__":
    main()

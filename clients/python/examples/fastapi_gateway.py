"""A gateway on FastAPI, limited by qag's ASGI middleware: the address's bucket, the
key's bucket, its calls quota and its concurrent queries, with the answers of ADR 0032.

python clients/python/examples/fastapi_gateway.py --redis redis://127.0.0.1:6379/ \
  --listen 127.0.0.1:8080 [--client-limit 20/1] [--key-limit 60/60] [--max-concurrent 4] \
  [--quota-calls 100000 --quota-per month --quota-tz Europe/Berlin] \
  [--policy raise|forward|local]

GET /v1/query?key=K[&work_ms=N][&chunks=N]: a small JSON body after work_ms, or a body
streamed in `chunks` pieces over work_ms.
"""

import argparse
import asyncio
import socket
from typing import AsyncIterator, Optional, Tuple

import redis.asyncio
import uvicorn
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from qag_client import AsyncLimiter, Quota
from qag_client.asgi import KeyLimits, RateLimitMiddleware, query_parameter
from qag_client.fastapi import Admitted, admitted

app = FastAPI()


@app.get("/v1/query")
async def query(
    work_ms: int = 0, chunks: int = 0, limits: Admitted = Depends(admitted)
) -> Response:
    if chunks <= 0:
        await asyncio.sleep(work_ms / 1000)
        return JSONResponse({"request_id": limits.request_id})

    async def pieces() -> AsyncIterator[bytes]:
        for sent in range(chunks):
            await asyncio.sleep(work_ms / 1000 / chunks)
            yield f"row {sent}\n".encode()

    return StreamingResponse(pieces(), media_type="text/plain")


def main() -> None:
    args = parse_args()
    # The limiter set-up: a policy for outages, the limits, where address and key come from.
    limiter = AsyncLimiter(redis.asyncio.Redis.from_url(args.redis), on_unavailable=args.policy)
    quota = None
    if args.quota_calls is not None:
        quota = Quota(args.quota_per, args.quota_tz, calls=args.quota_calls)
    limited = RateLimitMiddleware(
        app,
        limiter,
        client_bucket=args.client_limit,  # the caller's address: the ASGI scope's client
        api_key=query_parameter("key"),
        key_limits=KeyLimits(
            bucket=args.key_limit, max_concurrent=args.max_concurrent, quota=quota
        ),
    )
    host, port = args.listen.rsplit(":", 1)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, int(port)))
    print(f"listening on {host}:{listener.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(limited, log_level="warning", lifespan="off"))
    server.run(sockets=[listener])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A gateway limited by qag.")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/")
    parser.add_argument("--listen", default="127.0.0.1:8080")
    parser.add_argument("--client-limit", type=rate, metavar="COUNT/PERIOD")
    parser.add_argument("--key-limit", type=rate, metavar="COUNT/PERIOD")
    parser.add_argument("--max-concurrent", type=int)
    parser.add_argument("--quota-calls", type=int)
    parser.add_argument("--quota-per", choices=("day", "month"), default="month")
    parser.add_argument("--quota-tz", default="UTC")
    parser.add_argument("--policy", choices=("raise", "forward", "local"), default="raise")
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

"""ASGI middleware that limits every HTTP request as ADR 0032 and ADR 0011 say, on an
``AsyncLimiter``: pure ASGI, so it works under Starlette, FastAPI or any ASGI app, and
imports no framework.

::

    app = RateLimitMiddleware(
        app,
        limiter,
        client_bucket=(20, 1),
        api_key=query_parameter("key"),
        key_limits=KeyLimits(bucket=(60, 60), max_concurrent=4, quota=Quota("month", calls=100_000)),
    )

Order, answers and headers are those of the Rust client's tower layer (see
``_gateway``). An admitted request finds its ``Admitted`` in ``scope["state"]["qag"]``
(Starlette and FastAPI: ``request.state.qag``; ``qag_client.fastapi.admitted`` as a
dependency). The call and the rows reported so far are added to the quota when the
response starts, and the header fields are added to it then; the slot is held until
the last ``http.response.body`` message, or until the app returns or raises (a client
gone mid-stream), and rows reported while streaming are added then. A request that may
wait for its turn (``wait=``) is watched while it waits: its client gone
(``http.disconnect``), the wait is cut short and nothing is answered.
"""

from __future__ import annotations

import asyncio
from typing import (
    Any,
    Awaitable,
    Callable,
    Dict,
    Iterable,
    List,
    MutableMapping,
    Optional,
    Tuple,
    Union,
)

from ._async import AsyncLimiter
from ._gateway import (
    LIMITS,
    Admitted,
    Config,
    Extract,
    KeyLimits,
    LimitCounts,
    Limiting,
    Rate,
    ReportRows,
    RequestParts,
    WindowLimit,
    WindowOf,
    drive_async,
    header,
    query_parameter,
)
from .answers import Refusal

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

STATE_KEY = "qag"

# A request's admission cut short: its client left while it waited.
_GONE = object()


async def _unless_gone(admission: Awaitable[Any], receive: Receive) -> Tuple[Any, Receive]:
    """Runs a request's admission, which may wait for its turn, watching its client: a
    client gone (``http.disconnect``) cancels it, and the waiting call's connection
    closes, so the server gives back what the wait charged (a slot the server may have
    given it is released in the background, what the request took before is its cost,
    as for any interrupted admission). What the watch read meanwhile (the request's
    body) is handed to the app first. Returns the outcome (``_GONE``: the client left)
    and the ``receive`` the app is to get."""
    admitting = asyncio.ensure_future(admission)
    early: List[Message] = []
    try:
        while not admitting.done():
            watch = asyncio.ensure_future(receive())
            try:
                await asyncio.wait((admitting, watch), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not watch.done():
                    # Nothing was read: a receive waiting is cancelled before it reads.
                    watch.cancel()
                    await asyncio.wait((watch,))
            if watch.cancelled():
                break
            message = watch.result()
            if message["type"] == "http.disconnect" and not admitting.done():
                admitting.cancel()
                await asyncio.wait((admitting,))
                return _GONE, receive
            # A client gone once admitted: the app sees it, and what was taken is
            # given back at its end, as for any request.
            early.append(message)
    except BaseException:
        admitting.cancel()
        raise
    outcome = await admitting
    if not early:
        return outcome, receive

    async def replaying() -> Message:
        return early.pop(0) if early else await receive()

    return outcome, replaying


def _parts(scope: Scope) -> RequestParts:
    client = scope.get("client")
    peer = str(client[0]) if client else None

    def header_fields() -> Dict[str, str]:
        fields: Dict[str, str] = {}
        for name, value in scope.get("headers", ()):
            fields.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        return fields

    query = scope.get("query_string", b"")
    return RequestParts(scope, peer, header_fields, query.decode("latin-1"))


class RateLimitMiddleware:
    """The middleware. ``client_bucket``: every address's bucket, ``(count, period)``;
    ``client_address``: where the caller's address comes from (default the scope's
    ``client``); ``trusted_proxy_header``: the address from the first entry of a header
    a proxy the gateway trusts sets (e.g. ``x-forwarded-for``), else as before;
    ``api_key``: the request's key, ``<workspace>~<name>`` (``query_parameter(name)``,
    ``header(name)`` or any function of ``RequestParts``; a request without one is
    limited by its address alone); ``key_limits``: a ``KeyLimits`` for every key, or a
    function returning each key's own; ``lease_ttl_ms``: how long a slot lives unless
    renewed; ``draft_headers=False`` leaves out ``ratelimit-policy`` and ``ratelimit``;
    ``shadow``: limits ("client", "key", "quota", "concurrency") asked and counted as
    usual whose refusals are let through, logged (a line a second at most) and counted
    in ``limit_counts``, never answered 429: to try a limit on live traffic first;
    ``wait``: seconds a request may wait for a limit's turn instead of a 429, by limit
    (``{"client": 0.5, "key": 0.5, "concurrency": 2.0}``; the quota never waits): held
    by the server in arrival order across every gateway instance (the limiter's
    ``wait=``), the 429 only when the wait cannot fit, and a request that waited says how
    long in ``server-timing`` (``qag-wait;dur=<ms>``); a request's two buckets, taken
    together, wait up to the longer of their waits; ``window``: a function of a
    request's ``RequestParts`` and API key giving its ``WindowLimit`` (None: it has
    none), for a model API: asked last, after its slot, so that a request another
    limit refuses never charges a request to the chain; its estimate is held on every
    scope until the handler commits the actual count through ``Admitted.window``
    (an ``AsyncReservation``; uncommitted, what it charged is committed when the
    response ends), a refusal answers 429 ``rate_limited`` naming ``requests`` or
    ``tokens`` (an estimate above a scope's tokens never fits: no ``retry-after``) and
    gives back the tokens and the slot taken, and every answer of a request that asked
    carries the chain's OpenAI-style ``x-ratelimit-*-requests`` and ``-tokens`` fields.
    An estimate that depends on the body: read it in a middleware before this one and
    put it in the scope, where ``RequestParts.raw`` finds it. The window never waits
    (QAG.ADMIT has no ``WAIT``)."""

    def __init__(
        self,
        app: ASGIApp,
        limiter: AsyncLimiter,
        *,
        client_bucket: Optional[Rate] = None,
        client_address: Optional[Extract] = None,
        trusted_proxy_header: Optional[str] = None,
        api_key: Optional[Extract] = None,
        key_limits: Union[KeyLimits, Callable[[str], KeyLimits], None] = None,
        lease_ttl_ms: int = 30_000,
        draft_headers: bool = True,
        shadow: Iterable[str] = (),
        wait: Optional[Dict[str, float]] = None,
        window: Optional[WindowOf] = None,
    ) -> None:
        self.app = app
        self.limiter = limiter
        self.config = Config.of(
            limiter,
            client_bucket,
            client_address,
            trusted_proxy_header,
            api_key,
            key_limits,
            lease_ttl_ms,
            draft_headers,
            shadow,
            wait,
            window,
        )

    def limit_counts(self, limit: str) -> LimitCounts:
        """How ``limit`` ("client", "key", "quota", "concurrency" or "window") answered since the
        middleware was made: for metrics, and to watch a limit in shadow."""
        return self.config.limit_counts(limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limiter = self.limiter
        request = Limiting(self.config, _parts(scope))
        admission = drive_async(limiter, request.admit(), request.budget)
        if self.config.waits:
            outcome, receive = await _unless_gone(admission, receive)
            if outcome is _GONE:
                return
        else:
            outcome = await admission
        if isinstance(outcome, Refusal):
            status, fields, body = request.refused(outcome)
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(n.encode("latin-1"), v.encode("latin-1")) for n, v in fields],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        state = scope.get("state")
        if state is None:
            state = scope["state"] = {}
        state[STATE_KEY] = outcome

        async def send_limited(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                fields = await drive_async(limiter, request.started(), request.budget)
                message = dict(message)
                message["headers"] = list(message.get("headers", ())) + [
                    (n.encode("latin-1"), v.encode("latin-1")) for n, v in fields
                ]
            elif kind == "http.response.body" and not message.get("more_body", False):
                # The last message: the slot is freed as it goes out (first, so that a
                # framework cancelling the app once the response is complete, as
                # Starlette's StreamingResponse does, cannot cut the release short).
                await drive_async(limiter, request.ended(), request.budget)
            await send(message)

        try:
            await self.app(scope, receive, send_limited)
        finally:
            # The app returned or raised (a client gone mid-stream): the slot is freed.
            await drive_async(limiter, request.ended(), request.budget)


__all__ = [
    "LIMITS",
    "Admitted",
    "KeyLimits",
    "LimitCounts",
    "RateLimitMiddleware",
    "ReportRows",
    "RequestParts",
    "WindowLimit",
    "STATE_KEY",
    "header",
    "query_parameter",
]

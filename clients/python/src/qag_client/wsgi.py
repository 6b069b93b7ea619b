"""WSGI middleware (Flask, or any WSGI app) on the blocking ``Limiter``: the same
configuration, order, answers and headers as ``qag_client.asgi`` (see ``_gateway``).
An admitted request finds its ``Admitted`` in ``environ["qag"]`` (Flask:
``request.environ["qag"]``). The call and the rows reported so far are added to the
quota when the app calls ``start_response``; the slot is held until the server closes
the response iterable (after its last item, or when the client went away), and rows
reported meanwhile are added then."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from ._gateway import (
    Admitted,
    Config,
    Extract,
    KeyLimits,
    LimitCounts,
    Limiting,
    Rate,
    RequestParts,
    WindowLimit,
    WindowOf,
    drive_sync,
    header,
    query_parameter,
)
from ._sync import Limiter
from .answers import Refusal

Environ = Dict[str, Any]
StartResponse = Callable[..., Any]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]

ENVIRON_KEY = "qag"

_REASONS = {200: "OK", 429: "Too Many Requests", 503: "Service Unavailable"}


def _parts(environ: Environ) -> RequestParts:
    def header_fields() -> Dict[str, str]:
        fields: Dict[str, str] = {}
        for name, value in environ.items():
            if name.startswith("HTTP_"):
                fields[name[5:].replace("_", "-").lower()] = str(value)
        for name in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            if environ.get(name):
                fields[name.replace("_", "-").lower()] = str(environ[name])
        return fields

    peer = environ.get("REMOTE_ADDR") or None
    return RequestParts(environ, peer, header_fields, str(environ.get("QUERY_STRING", "")))


class RateLimitWSGI:
    """The middleware; its options are ``qag_client.asgi.RateLimitMiddleware``'s
    (``Admitted.window`` is a ``Reservation``)."""

    def __init__(
        self,
        app: WSGIApp,
        limiter: Limiter,
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

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        limiter = self.limiter
        request = Limiting(self.config, _parts(environ))
        outcome = drive_sync(limiter, request.admit(), request.budget)
        if isinstance(outcome, Refusal):
            status, fields, body = request.refused(outcome)
            start_response(f"{status} {_REASONS.get(status, '')}".rstrip(), fields)
            return [body]
        environ[ENVIRON_KEY] = outcome

        def start_limited(
            status: str, response_headers: List[Tuple[str, str]], exc_info: Any = None
        ) -> Any:
            fields = drive_sync(limiter, request.started(), request.budget)
            return start_response(status, list(response_headers) + fields, exc_info)

        try:
            answer = self.app(environ, start_limited)
        except BaseException:
            drive_sync(limiter, request.ended(), request.budget)
            raise
        return _Closing(answer, lambda: drive_sync(limiter, request.ended(), request.budget))


class _Closing:
    """The app's response iterable, with ``close`` ending the request (after the
    app's own ``close``)."""

    def __init__(self, body: Iterable[bytes], ended: Callable[[], None]) -> None:
        self._body = body
        self._ended = ended

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._body)

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            self._ended()


__all__ = [
    "Admitted",
    "ENVIRON_KEY",
    "KeyLimits",
    "LimitCounts",
    "RateLimitWSGI",
    "RequestParts",
    "WindowLimit",
    "header",
    "query_parameter",
]

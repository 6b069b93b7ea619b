"""A FastAPI dependency for routes that want the middleware's decisions (install
``qag_client.asgi.RateLimitMiddleware`` with ``app.add_middleware``)::

    @app.get("/v1/query")
    async def query(admitted: Admitted = Depends(admitted)) -> dict:
        admitted.rows.add(250)
        return {"left": admitted.key.remaining if admitted.key else None}

Needs FastAPI (or Starlette) installed; the rest of the package does not.
"""

from __future__ import annotations

from starlette.requests import Request

from ._gateway import Admitted
from .asgi import STATE_KEY


def admitted(request: Request) -> Admitted:
    """The request's ``Admitted``, as ``RateLimitMiddleware`` left it in
    ``scope["state"]``."""
    found = request.scope.get("state", {}).get(STATE_KEY)
    if not isinstance(found, Admitted):
        raise RuntimeError("qag_client.asgi.RateLimitMiddleware does not wrap this app")
    return found


__all__ = ["Admitted", "admitted"]

"""Bucket names as the gateway writes them."""

from __future__ import annotations

from typing import Optional


def bucket_key(
    scope: str, count: int, period: float, client: str, hash_tag: Optional[str] = None
) -> str:
    """``qag:ratelimit:<scope>:<count>/<period>:<client>``, the period as
    ``format(period, 'g')``; with a hash tag, ``qag:ratelimit:{<tag>}:<scope>:...`` so
    that a request's two buckets share a cluster slot."""
    tag = "" if hash_tag is None else f"{{{hash_tag}}}:"
    return f"qag:ratelimit:{tag}{scope}:{count}/{format(period, 'g')}:{client}"

"""Bucket names as the gateway writes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def bucket_key(
    scope: str, count: int, period: float, client: str, hash_tag: Optional[str] = None
) -> str:
    """``qag:ratelimit:<scope>:<count>/<period>:<client>``, the period as
    ``format(period, 'g')``; with a hash tag, ``qag:ratelimit:{<tag>}:<scope>:...`` so
    that a request's two buckets share a cluster slot."""
    tag = "" if hash_tag is None else f"{{{hash_tag}}}:"
    return f"qag:ratelimit:{tag}{scope}:{count}/{format(period, 'g')}:{client}"


@dataclass(frozen=True)
class Bucket:
    """A token bucket described once: its key and its limit, ``count`` tokens refilled
    per ``period`` seconds, so that a key's name and its limit cannot drift apart.
    ``Bucket(key, count, period)`` for a key of the caller's choice;
    ``Bucket.named(...)`` for ADR 0032's name."""

    key: str
    count: int
    period: float

    @staticmethod
    def named(
        scope: str, count: int, period: float, name: str, hash_tag: Optional[str] = None
    ) -> "Bucket":
        """The bucket of ``name`` (an address, or ``<workspace>~<name>`` for a key):
        ``qag:ratelimit:<scope>:<count>/<period>:<name>``."""
        return Bucket(bucket_key(scope, count, period, name, hash_tag), count, period)

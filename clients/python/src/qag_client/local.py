"""Token buckets in this process's memory, for the back-off after Redis failed
(``on_unavailable="local"``): each bucket starts full and is counted with the
script's arithmetic, step for step in doubles (the Rust client uses qag-core's; both
are tested against ``clients/shared_cases.json``). Plain code: the clock is an argument."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

# Buckets tracked before full ones are dropped (a full bucket reads as a missing one).
PRUNE_ABOVE = 100_000


def _lua_max(a: float, b: float) -> float:
    return b if b > a else a


def _lua_min(a: float, b: float) -> float:
    return b if b < a else a


def take(
    count: int, period: float, cost: int, stored: Optional[Tuple[float, float]], now: float
) -> Tuple[List[int], Tuple[float, float]]:
    """The script on one bucket: the reply ``[allowed, left, retry]`` and the state
    ``(tokens, ts)`` to keep. ``stored`` is None for a missing bucket."""
    tokens, ts = stored if stored is not None else (float(count), now)
    rate = count / period
    elapsed = _lua_max(0.0, now - ts)
    tokens = _lua_min(float(count), tokens + elapsed * rate)
    if cost > count:
        allowed, retry = 0, -1
    elif tokens >= cost:
        tokens -= cost
        allowed, retry = 1, 0
    else:
        allowed, retry = 0, math.ceil((cost - tokens) / rate)
    return [allowed, math.floor(tokens), retry], (tokens, _lua_max(ts, now))


class LocalBuckets:
    def __init__(self) -> None:
        self._buckets: Dict[str, Tuple[Tuple[float, float], int, float]] = {}

    def take(self, key: str, count: int, period: float, cost: int, now: float) -> List[int]:
        stored = self._buckets.get(key)
        reply, state = take(count, period, cost, stored[0] if stored else None, now)
        if len(self._buckets) >= PRUNE_ABOVE and key not in self._buckets:
            self._prune(now)
        self._buckets[key] = (state, count, period)
        return reply

    def peek(self, key: str, count: int, period: float, cost: int, now: float) -> List[int]:
        stored = self._buckets.get(key)
        return take(count, period, cost, stored[0] if stored else None, now)[0]

    def clear(self) -> None:
        self._buckets.clear()

    def __len__(self) -> int:
        return len(self._buckets)

    def _prune(self, now: float) -> None:
        self._buckets = {
            key: entry
            for key, entry in self._buckets.items()
            if entry[0][0] + max(now - entry[0][1], 0.0) * entry[1] / entry[2] < entry[1]
        }

"""The gateway's own answers to a limited request (ADR 0032 and ADR 0011): which limit
refused, the status, the JSON body and its ``retry-after``. Plain code, the same
bodies as the Rust client's ``answers.rs`` (both checked against
``clients/shared_cases.json``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

KINDS = ("client", "key", "quota", "concurrency", "window", "unavailable")

_CODES = {
    "client": "rate_limited",
    "key": "rate_limited",
    "quota": "quota_exceeded",
    "concurrency": "too_many_concurrent",
    "window": "rate_limited",
    "unavailable": "limiter_unavailable",
}

_MESSAGES = {
    "client": "Rate limit exceeded",
    "key": "Rate limit exceeded for this API key",
    "quota": "Quota exceeded for this API key",
    "concurrency": "Too many concurrent requests for this API key",
    "window": "Token rate limit exceeded",
    "unavailable": "Rate limiting is unavailable",
}


@dataclass(frozen=True)
class Refusal:
    """What refused a request, in the order the limits are asked: ``"client"`` (the
    caller's address spent its bucket; the key's was not touched), ``"key"`` (the API
    key spent its bucket), ``"quota"`` (``exceeded`` is "calls" or "rows",
    ``resets_at`` the period's end in Unix seconds), ``"concurrency"`` (every slot of
    the key is held), ``"window"`` (a window chain, a model API's requests and tokens
    per window, has no room: ``exceeded`` is "requests" or "tokens"), ``"unavailable"``
    (Redis failed under the "raise" policy). ``retry_after``: the wait in seconds, None
    for a cost that never fits (a bucket's, or an estimate beyond a window's tokens)."""

    kind: str
    retry_after: Optional[int] = 0
    exceeded: str = ""
    resets_at: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}")

    @property
    def status(self) -> int:
        """429, or 503 when the limiter is unavailable."""
        return 503 if self.kind == "unavailable" else 429

    @property
    def code(self) -> str:
        return _CODES[self.kind]

    @property
    def message(self) -> str:
        if self.kind == "window" and self.exceeded == "requests":
            return "Request rate limit exceeded"
        return _MESSAGES[self.kind]

    @property
    def seconds(self) -> Optional[int]:
        """The ``retry-after`` seconds, at least 1; None for a cost that never fits."""
        if self.kind == "concurrency":
            return 1
        if self.retry_after is None:
            return None if self.kind in ("client", "key", "window") else 1
        return max(self.retry_after, 1)

    def body(self, request_id: str) -> str:
        """``{"error", "code", "retry_after", ["exceeded", ["resets_at",]] "request_id"}``
        in that order (``exceeded`` for a quota and a window, ``resets_at`` for a
        quota); ``retry_after`` null for a cost that never fits."""
        seconds = self.seconds
        body = (
            f'{{"error":"{self.message}","code":"{self.code}",'
            f'"retry_after":{"null" if seconds is None else seconds}'
        )
        if self.kind == "quota":
            body += f',"exceeded":"{self.exceeded}","resets_at":{self.resets_at}'
        elif self.kind == "window":
            body += f',"exceeded":"{self.exceeded}"'
        return body + f',"request_id":{json_string(request_id)}}}'


def json_string(text: str) -> str:
    """A JSON string as the Rust client writes it: quote, backslash and control
    characters escaped, everything else as it is."""
    out = ['"']
    for char in text:
        if char == '"':
            out.append('\\"')
        elif char == "\\":
            out.append("\\\\")
        elif ord(char) < 0x20:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)

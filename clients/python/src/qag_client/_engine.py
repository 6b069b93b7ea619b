"""What both limiters decide, free of I/O: which path a call takes (module or script),
what to do with each reply or error, and the back-off of the "local" policy.

A call is a generator (a "flow") that yields requests (a command, or the script on a
key) and receives their replies, or has the error thrown in, already sorted into this
package's exceptions. ``Limiter`` runs flows with blocking calls, ``AsyncLimiter``
with awaits; neither decides anything itself. Clocks are arguments.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, List, Optional, Tuple, TypeVar

from .decisions import (
    BucketCall,
    Decision,
    PairDecision,
    QagError,
    QagModuleRequired,
    QagPermissionError,
    QagServerError,
    QagUnavailable,
)
from .local import LocalBuckets

BACKENDS = ("auto", "module", "script")
POLICIES = ("raise", "local")


class UnknownCommand(QagError):
    """The server does not have the command: the module is missing there."""


@dataclass(frozen=True)
class Command:
    words: Tuple[Any, ...]
    # Asked of any node, unparsed by the client library (COMMAND INFO's nil entry
    # would break redis-py's parser).
    probe: bool = False


@dataclass(frozen=True)
class RunScript:
    key: str
    arguments: Tuple[Any, ...]


Request = Any  # Command | RunScript
T = TypeVar("T")
# A call: yields requests, receives their replies, returns its answer.
Flow = Generator[Request, Any, T]


def sort_error(error: BaseException) -> BaseException:
    """A redis-py error as this package's exception (other exceptions stay as they are)."""
    import redis.exceptions as errors

    text = str(error)
    if isinstance(error, QagError):
        return error
    if isinstance(error, errors.NoPermissionError) or text.startswith("NOPERM"):
        return QagPermissionError(text)
    if isinstance(
        error,
        (
            errors.ConnectionError,
            errors.TimeoutError,
            errors.ClusterDownError,
            errors.MasterDownError,
            errors.TryAgainError,
            errors.SlotNotCoveredError,
            TimeoutError,
            OSError,
        ),
    ):
        return QagUnavailable(text or type(error).__name__)
    lowered = text.lower()
    # The server's "unknown command", and redis-py's cluster client's own
    # "... command doesn't exist in Redis commands" for a command no node knows.
    if "unknown command" in lowered or "command doesn't exist" in lowered:
        return UnknownCommand(text)
    if isinstance(error, errors.RedisError):
        return QagServerError(text)
    return error


@dataclass
class Engine:
    backend: str = "auto"
    on_unavailable: str = "raise"
    back_off: float = 5.0
    recheck_missing_module: float = 10.0
    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    # "unknown", "present" or "missing".
    presence: str = "unknown"
    missing_since: float = 0.0
    backing_off_until: Optional[float] = None
    local: LocalBuckets = field(default_factory=LocalBuckets)
    local_decisions: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}")
        if self.on_unavailable not in POLICIES:
            raise ValueError(f"on_unavailable must be one of {', '.join(POLICIES)}")
        if not self.back_off > 0 or not self.recheck_missing_module >= 0:
            raise ValueError("back_off must be above 0 and recheck_missing_module at least 0")

    # The "local" policy.

    @property
    def counting_locally(self) -> bool:
        until = self.backing_off_until
        return until is not None and self.monotonic() < until

    def local_answer(self, locally: Callable[[LocalBuckets, float], T]) -> Optional[T]:
        """The local decision while a back-off runs, else None."""
        if self.on_unavailable == "local" and self.counting_locally:
            return self._decide_locally(locally)
        return None

    def after_failure(self, error: QagError, locally: Callable[[LocalBuckets, float], T]) -> T:
        """Redis failed a bucket call: a local decision under "local", else the error."""
        if isinstance(error, QagUnavailable):
            self.forget_presence()
            if self.on_unavailable == "local":
                self.backing_off_until = self.monotonic() + self.back_off
                return self._decide_locally(locally)
        raise error

    def after_answer(self) -> None:
        """Redis answered: the next outage starts every local bucket full."""
        if self.backing_off_until is not None:
            self.backing_off_until = None
            self.local.clear()

    def _decide_locally(self, locally: Callable[[LocalBuckets, float], T]) -> T:
        self.local_decisions += 1
        return locally(self.local, self.wall())

    # Which path: module or script.

    def path(self) -> Flow[str]:
        if self.backend != "auto":
            return self.backend
        if self.presence == "present":
            return "module"
        if (
            self.presence == "missing"
            and self.monotonic() - self.missing_since < self.recheck_missing_module
        ):
            return "script"
        try:
            entries = yield Command(("COMMAND", "INFO", "qag.take"), probe=True)
        except QagPermissionError:
            # A user without COMMAND: the module's command is tried; its answer tells.
            entries = [["qag.take"]]
        if not isinstance(entries, list):
            raise QagServerError(f"a COMMAND INFO reply, got {entries!r}")
        if any(entry is not None for entry in entries):
            self.presence = "present"
            return "module"
        self.note_missing()
        return "script"

    def forget_presence(self) -> None:
        """A new connection, or a failed one: the next call asks the server again."""
        self.presence = "unknown"

    def note_missing(self) -> None:
        self.presence = "missing"
        self.missing_since = self.monotonic()

    def _module_failed(self) -> None:
        """The module's command is unknown: "auto" goes on with the script."""
        self.note_missing()
        if self.backend != "auto":
            raise QagModuleRequired("the qag module is required and the server does not have it")

    # Flows.

    def take(self, call: BucketCall) -> Flow[Decision]:
        if (yield from self.path()) == "module":
            try:
                reply = yield Command(("QAG.TAKE", call.key, *call.arguments()))
                return call.decision(reply, "module")
            except UnknownCommand:
                self._module_failed()
        return (yield from self._script(call))

    def take_pair(self, client: BucketCall, key: BucketCall) -> Flow[PairDecision]:
        if (yield from self.path()) == "module":
            try:
                reply = yield Command(
                    (
                        "QAG.TAKE2",
                        client.key,
                        client.count,
                        client.period_text,
                        key.key,
                        *key.arguments(),
                    )
                )
                if not isinstance(reply, list) or len(reply) != 2:
                    raise QagServerError(f"a QAG.TAKE2 reply, got {reply!r}")
                key_decision = None if reply[1] is None else key.decision(reply[1], "module")
                return PairDecision(client.decision(reply[0], "module"), key_decision)
            except UnknownCommand:
                self._module_failed()
        client_decision = yield from self._script(client)
        key_decision = (yield from self._script(key)) if client_decision.allowed else None
        return PairDecision(client_decision, key_decision)

    def peek(self, call: BucketCall) -> Flow[Decision]:
        if (yield from self.path()) == "module":
            try:
                reply = yield Command(("QAG.PEEK", call.key, *call.arguments()))
                return call.decision(reply, "module")
            except UnknownCommand:
                self._module_failed()
        # Without the module: the hash and the server's clock, computed with the
        # script's arithmetic.
        from .local import take

        fields = yield Command(("HMGET", call.key, "tokens", "ts"))
        seconds, micros = yield Command(("TIME",))
        now = int(seconds) + int(micros) / 1e6
        reply, _ = take(call.count, call.period, call.cost, _stored(fields), now)
        return call.decision(reply, "script")

    def _script(self, call: BucketCall) -> Flow[Decision]:
        try:
            reply = yield RunScript(call.key, (call.count, call.period_text, call.cost))
        except UnknownCommand as error:
            raise QagServerError(str(error)) from error
        return call.decision(reply, "script")

    def module_only(self, words: List[Any]) -> Flow[Any]:
        """A command of a family without a script."""
        if self.backend == "script" or (yield from self.path()) == "script":
            raise QagModuleRequired("the qag module is required and the server does not have it")
        try:
            return (yield Command(tuple(words)))
        except UnknownCommand:
            self.note_missing()
            raise QagModuleRequired(
                "the qag module is required and the server does not have it"
            ) from None


def _stored(fields: Any) -> Optional[Tuple[float, float]]:
    """Both fields read as the script reads them (a finite number each), else None."""
    import math

    if not isinstance(fields, list) or len(fields) != 2:
        raise QagServerError(f"an HMGET reply, got {fields!r}")
    values = []
    for raw in fields:
        try:
            value = float(raw.strip()) if raw is not None else math.nan
        except (TypeError, ValueError):
            return None
        if not math.isfinite(value):
            return None
        values.append(value)
    return values[0], values[1]


def local_take(call: BucketCall) -> Callable[[LocalBuckets, float], Decision]:
    def decide(buckets: LocalBuckets, now: float) -> Decision:
        return call.decision(
            buckets.take(call.key, call.count, call.period, call.cost, now), "local"
        )

    return decide


def local_pair(
    client: BucketCall, key: BucketCall
) -> Callable[[LocalBuckets, float], PairDecision]:
    def decide(buckets: LocalBuckets, now: float) -> PairDecision:
        client_decision = local_take(client)(buckets, now)
        key_decision = local_take(key)(buckets, now) if client_decision.allowed else None
        return PairDecision(client_decision, key_decision)

    return decide


def local_peek(call: BucketCall) -> Callable[[LocalBuckets, float], Decision]:
    def decide(buckets: LocalBuckets, now: float) -> Decision:
        return call.decision(
            buckets.peek(call.key, call.count, call.period, call.cost, now), "local"
        )

    return decide

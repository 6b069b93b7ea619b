"""What a limiter does when Redis fails, in one place for every family: which calls go
to Redis (none during a back-off, while its prober probes Redis), and the counts of how
calls were answered. Plain code: the clock is an argument. (The Rust client's policy.rs
follows the same rules.)"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

from .decisions import Counts

POLICIES = ("raise", "forward", "local")
# The first probe after an outage comes this soon (or at ``back_off`` if sooner); each
# that fails doubles the wait, up to ``back_off``.
FIRST_PROBE = 0.1


class Route(enum.Enum):
    """Where a call goes now."""

    REDIS = "redis"
    # Answered by the policy; no prober runs (none started, or it was stopped): this
    # call starts one (in the background) and keeps to the policy.
    START_PROBER = "start prober"
    # Not to Redis: answered by the policy (a back-off runs, its prober probes).
    POLICY = "policy"


class Probe(enum.Enum):
    """What a back-off's prober does now (else it waits: ``prober_step`` says how long)."""

    NOW = "probe now"
    # The back-off is over: the prober ends.
    END = "end"


class Outage:
    """The back-off state of one limiter.

    An outage starts a back-off: every call keeps to the policy, and Redis is probed by
    a prober of its own in the background, first ``FIRST_PROBE`` after the outage
    (``back_off`` if sooner), then after twice as long each time a probe fails, never
    more than ``back_off`` apart, whether calls come or not: the first burst after a
    quiet period finds Redis answering if it is back. The probe that answers ends the
    back-off: a restart measured in milliseconds costs about ``FIRST_PROBE`` of answers
    by the policy, not ``back_off``. Only the probe ends a back-off (a call sent before
    it and answering during it does not). One prober a back-off: the outage that starts
    the back-off starts it, and if it is stopped before the back-off ends, the next call
    starts another. With ``back_off`` 0 there is no back-off: every call goes to Redis.
    """

    def __init__(self, back_off: float) -> None:
        self.back_off = back_off
        # When the next probe is due (None: no back-off), and the wait before it.
        self.until: Optional[float] = None
        self.wait = 0.0
        # A prober runs for this back-off.
        self.prober = False
        self.cause = ""
        # Outages so far, and how many of them an answer has cleared the local state of.
        self.generation = 0
        self._cleared = 0

    def route(self) -> Route:
        if self.until is None:
            return Route.REDIS
        if self.prober:
            return Route.POLICY
        self.prober = True
        return Route.START_PROBER

    def prober_step(self, now: float) -> Union[Probe, float]:
        """The prober's next step at ``now``: probe, end, or wait that many seconds."""
        if self.until is None:
            self.prober = False
            return Probe.END
        if now < self.until:
            return self.until - now
        return Probe.NOW

    def answered(self, probe: bool, generation: int) -> bool:
        """Redis answered (a reply or an error reply) a call routed at ``generation``:
        true when the local state is to be dropped (the probe answered: the back-off
        and its prober end; without back-off, the first call sent after the last
        outage answered)."""
        if probe:
            self.prober = False
            self.until = None
            self.cause = ""
            self._cleared = self.generation
            return True
        if self.until is None and generation == self.generation > self._cleared:
            self._cleared = generation
            return True
        return False

    def failed(self, probe: bool, now: float, cause: str) -> bool:
        """Redis failed a call (an outage): a back-off starts, or, its probe failed, the
        next probe is twice as far off (a call sent before the back-off and failing
        during it changes nothing). True when the caller is to start the prober."""
        self.generation += 1
        if self.back_off <= 0:
            return False
        if self.until is None:
            self.wait = min(FIRST_PROBE, self.back_off)
            self.until = now + self.wait
            self.cause = cause
            started, self.prober = not self.prober, True
            return started
        if probe:
            self.wait = min(self.wait * 2, self.back_off)
            self.until = now + self.wait
            self.cause = cause
        return False

    def deferred(self, now: float) -> None:
        """The probe found no free connection (the process's own load, not Redis's): the
        next one comes as after a failed probe, the cause kept."""
        if self.until is not None:
            self.wait = min(self.wait * 2, self.back_off)
            self.until = now + self.wait

    def forget(self) -> None:
        """The back-off is forgotten (the node it is of is no longer in the cluster's
        table: a table that names it again sends calls to it afresh)."""
        self.prober = False
        self.until = None
        self.cause = ""

    def prober_stopped(self) -> None:
        """The prober stopped before the back-off ended (cancelled, its limiter
        closed): the next call starts another."""
        self.prober = False

    @property
    def backing_off(self) -> bool:
        return self.until is not None

    def backing_off_message(self) -> str:
        return f"Redis left alone: backing off after: {self.cause or 'an outage'}"


@dataclass
class Tally:
    """The counts behind ``Counts``, mutable."""

    module: int = 0
    script: int = 0
    local: int = 0
    forwarded: int = 0
    errors: int = 0
    replays: int = 0

    def count(self, answered_by: str) -> None:
        setattr(self, answered_by, getattr(self, answered_by) + 1)

    def snapshot(self) -> Counts:
        return Counts(
            self.module, self.script, self.local, self.forwarded, self.errors, self.replays
        )


class LogEvery:
    """At most one log line per ``every`` seconds for an event that may repeat thousands
    of times a second (requests answered 503 in an outage): ``due(now)`` is None while
    it is too soon (the event counted), else how many it left out since the last line."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self._last: Optional[float] = None
        self._left_out = 0

    def due(self, now: float) -> Optional[int]:
        if self._last is not None and now - self._last < self.every:
            self._left_out += 1
            return None
        left_out, self._last, self._left_out = self._left_out, now, 0
        return left_out

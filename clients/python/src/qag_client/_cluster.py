"""Redis Cluster, free of I/O: the slot of a key, which node owns a slot (the table a
``CLUSTER SLOTS`` reply gives, patched by MOVED replies until the next refresh), when
to refresh it, redirections read from an error reply, and the check that a call's keys
share a slot. The limiters send each call to its slot's owner on connections of their
own, so redis-py's cluster client is used for its settings and start-up nodes only (no
``COMMAND GETKEYS``, no command-name parsing, no default node)."""

from __future__ import annotations

from dataclasses import dataclass
import threading
from typing import (
    Any,
    Callable,
    Dict,
    Generic,
    Iterable,
    List,
    Optional,
    Protocol,
    Sequence,
    Set,
    TypeVar,
)

from redis.crc import key_slot
from redis.exceptions import AskError, MovedError

from . import decisions as d
from .decisions import QagCrossSlot, QagServerError

SLOTS = 16384
# The least time between two refreshes of the slot table.
REFRESH_EVERY = 0.5
# Redirections one request follows before giving up (a slot moving twice at once).
MAX_REDIRECTIONS = 5
CROSS_SLOT_CHOICES = ("raise", "two_calls")
# On a cluster, the node of the calls whose slot the table names no owner for (the table
# not read yet, or the slot unserved): it sends none of them (each is an outage, answered
# by its policy), so its back-off keeps the next ones from reading the table on their
# own time. On a single server, the one node.
NO_OWNER = ""


def slot_of(key: str) -> int:
    return int(key_slot(key.encode()))


def common_slot(keys: Sequence[str]) -> int:
    """The slot every key is in, else QagCrossSlot (nothing was sent)."""
    slots = {slot_of(key) for key in keys}
    if len(slots) != 1:
        listed = ", ".join(keys)
        raise QagCrossSlot(
            f"the keys {listed} are in different cluster slots: give them a common hash tag"
        )
    return slots.pop()


def check_cross_slot(choice: str) -> None:
    if choice not in CROSS_SLOT_CHOICES:
        raise ValueError(f"cross_slot must be one of {', '.join(CROSS_SLOT_CHOICES)}")


def cross_slot_pair(client: str, key: str) -> QagCrossSlot:
    return QagCrossSlot(
        f"the buckets {client} and {key} are in different cluster slots: give both a "
        "common hash tag (bucket_key(..., hash_tag=...)), or make the limiter with "
        'cross_slot="two_calls"'
    )


def node_name(host: str, port: int) -> str:
    return f"{host}:{port}"


@dataclass(frozen=True)
class Redirection:
    """A MOVED or ASK error reply: the slot is served at ``node`` (for ASK: this one
    request, after ASKING)."""

    ask: bool
    slot: int
    node: str


def redirection(text: str) -> Optional[Redirection]:
    """``MOVED 3999 127.0.0.1:6381`` / ``ASK 3999 127.0.0.1:6381``, else None."""
    words = text.split()
    if len(words) != 3 or words[0] not in ("MOVED", "ASK") or not words[1].isdigit():
        return None
    host, _, port = words[2].rpartition(":")
    if not port.isdigit():
        return None
    return Redirection(words[0] == "ASK", int(words[1]), node_name(host, int(port)))


def redirection_of(error: BaseException) -> Optional[Redirection]:
    """A redirection error as redis-py raises it: MovedError/AskError where its parser
    knows them (redis-py 6 and later), a plain error reply with the text before."""
    if isinstance(error, AskError):  # MovedError is an AskError
        return Redirection(
            not isinstance(error, MovedError),
            int(error.slot_id),
            node_name(str(error.host), int(error.port)),
        )
    return redirection(str(error))


def try_again(error: BaseException) -> bool:
    """TRYAGAIN: a multi-key call on a slot being migrated, its keys split for now."""
    return type(error).__name__ == "TryAgainError" or str(error).startswith("TRYAGAIN")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_slots(reply: Any, asked: str) -> List[Optional[str]]:
    """A ``CLUSTER SLOTS`` reply as the owner (primary) of each slot, None where no node
    serves it. An empty host is the node asked (as redis-py reads it)."""
    if not isinstance(reply, list):
        raise QagServerError(f"a CLUSTER SLOTS reply, got {reply!r}")
    owners: List[Optional[str]] = [None] * SLOTS
    asked_host = asked.rpartition(":")[0]
    for entry in reply:
        try:
            start, end, primary = int(entry[0]), int(entry[1]), entry[2]
            host, port = _text(primary[0]), int(primary[1])
        except (TypeError, ValueError, IndexError) as error:
            raise QagServerError(f"a CLUSTER SLOTS entry, got {entry!r}") from error
        if host in ("", "?"):
            host = asked_host
        owner = node_name(host, port)
        for slot in range(max(start, 0), min(end, SLOTS - 1) + 1):
            owners[slot] = owner
    return owners


class Topology:
    """Which node owns each slot, as this limiter last learned it. A MOVED reply patches
    one slot at once and asks for a refresh; so does a node that failed (its replica may
    have taken over). Refreshes run one at a time, at most every ``REFRESH_EVERY``
    seconds; the clock is an argument."""

    def __init__(self) -> None:
        self.owners: List[Optional[str]] = []
        self.moved: Dict[int, str] = {}
        self.stale = True
        self.refreshing = False
        self.last_refresh = float("-inf")

    @property
    def known(self) -> bool:
        return bool(self.owners)

    def owner(self, slot: int) -> Optional[str]:
        moved = self.moved.get(slot)
        if moved is not None:
            return moved
        return self.owners[slot] if self.owners else None

    def nodes(self) -> Set[str]:
        """The primaries the table names."""
        return {owner for owner in self.owners if owner is not None} | set(self.moved.values())

    def moved_to(self, slot: int, node: str) -> None:
        self.moved[slot] = node
        self.stale = True

    def node_failed(self) -> None:
        self.stale = True

    def start_refresh(self, now: float) -> bool:
        """True when a refresh is to run now (the caller then reports how it went)."""
        if self.refreshing or not self.stale or now - self.last_refresh < REFRESH_EVERY:
            return False
        self.refreshing = True
        return True

    def learned(self, owners: List[Optional[str]], now: float) -> None:
        self.owners = owners
        self.moved.clear()
        self.stale = False
        self.refreshing = False
        self.last_refresh = now

    def refresh_failed(self, now: float) -> None:
        self.refreshing = False
        self.last_refresh = now


def seeds(known: Iterable[str], startup: Iterable[str], troubled: Set[str]) -> List[str]:
    """The nodes to ask for the slot table, in order: the table's and the start-up
    nodes, those not in trouble first."""
    ordered: List[str] = []
    for name in [*known, *startup]:
        if name not in ordered:
            ordered.append(name)
    return sorted(ordered, key=lambda name: name in troubled)


class HasEngine(Protocol):
    """What ``Shards`` needs of a node: its engine (the node's state)."""

    @property
    def engine(self) -> Any: ...


NodeT = TypeVar("NodeT", bound=HasEngine)


class Shards(Generic[NodeT]):
    """A limiter's nodes, made on first use, each with its engine: the module's
    presence, the back-off and the local counts of one server, so one shard's failure
    changes nothing for keys on the others. On a single server there is one node
    (named ""); on a cluster, the owner of the call's slot, or ``NO_OWNER``."""

    def __init__(self, make: Callable[[str], NodeT], cluster: bool) -> None:
        self._make = make
        self._nodes: Dict[str, NodeT] = {}
        self._lock = threading.Lock()
        self.topology: Optional[Topology] = Topology() if cluster else None

    def node(self, name: str) -> NodeT:
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                node = self._nodes[name] = self._make(name)
            return node

    def all(self) -> List[NodeT]:
        with self._lock:
            return list(self._nodes.values())

    def owner(self, keys: Sequence[str]) -> Optional[str]:
        """The name of the node for a call on ``keys`` ("" on a single server), None
        while the slot table does not know the slot (QagCrossSlot across slots)."""
        if self.topology is None:
            return ""
        slot = common_slot(keys)
        with self._lock:
            return self.topology.owner(slot)

    def names(self, name: str) -> bool:
        """Whether calls may be routed to node ``name``: a single server's, or one the
        slot table names (while the table is unknown, any)."""
        topology = self.topology
        if topology is None:
            return True
        with self._lock:
            return not topology.known or name in topology.nodes()

    def troubled(self) -> Set[str]:
        """Nodes whose engine is backing off."""
        return {name for name, node in self._snapshot() if node.engine.backing_off}

    def _snapshot(self) -> List[Any]:
        with self._lock:
            return list(self._nodes.items())

    def start_refresh(self, now: float) -> bool:
        """A refresh of the slot table is due (one at a time): after a MOVED reply, and
        while a node of the table fails or backs off (its replica may take over)."""
        topology = self.topology
        if topology is None:
            return False
        troubled = self.troubled()
        with self._lock:
            if troubled & topology.nodes():
                topology.node_failed()
            return topology.start_refresh(now)

    def seeds(self, startup: Iterable[str]) -> List[str]:
        assert self.topology is not None
        with self._lock:
            known = sorted(self.topology.nodes())
        return seeds(known, startup, self.troubled())

    def learned(self, owners: Optional[List[Optional[str]]], now: float) -> None:
        assert self.topology is not None
        with self._lock:
            if owners is None:
                self.topology.refresh_failed(now)
            else:
                self.topology.learned(owners, now)

    def moved(self, slot: int, node: str) -> None:
        if self.topology is not None:
            with self._lock:
                self.topology.moved_to(slot, node)

    def failed(self) -> None:
        """A node failed a call (an outage): the table is to be asked again."""
        if self.topology is not None:
            with self._lock:
                self.topology.node_failed()

    # What the limiter reports: its nodes' together.

    def counts(self) -> d.Counts:
        totals = [0, 0, 0, 0, 0, 0]
        for node in self.all():
            counts = node.engine.counts
            for n, value in enumerate(
                (
                    counts.module,
                    counts.script,
                    counts.local,
                    counts.forwarded,
                    counts.errors,
                    counts.replays,
                )
            ):
                totals[n] += value
        return d.Counts(*totals)

    def backing_off(self) -> bool:
        return any(node.engine.backing_off for node in self.all())

    def counting_locally(self) -> bool:
        return any(node.engine.counting_locally for node in self.all())


def admit_keys(scopes: Sequence[Any]) -> List[str]:
    """The keys of an admit's scopes (``Scope`` or ``(key, rpm, tpm)``)."""
    return [scope.key if isinstance(scope, d.Scope) else scope[0] for scope in scopes]

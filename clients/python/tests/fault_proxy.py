"""A TCP proxy of the tests' own between a client and a server, on a loopback port of its
own (so the server behind it can be restarted on its port), that does to the traffic what
a network and a failing server do, when told: replies delayed, a reply swallowed after
the command ran (the connection closed instead), every connection reset, new connections
refused. Threads, as the Rust tests' twin (tests/common/fault_proxy.rs), in a process of
their own, so that copying every byte never takes the tests' GIL from the calls they
time."""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time
from multiprocessing.connection import Connection
from types import TracebackType
from typing import List, Optional, Set, Type

# Long enough for any reply the tests ask for in one read.
CHUNK = 64 * 1024


class _Connection:
    """Both ends of one proxied connection; its sockets are closed once both of its
    directions have ended (never under a thread still reading one)."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self._ended = 0
        self._lock = threading.Lock()

    def shut(self) -> None:
        # shutdown, not close: it wakes the threads blocked reading, which then close.
        for end in (self.client, self.server):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def ended(self) -> bool:
        """One direction ended: True when it was the second (the sockets are closed)."""
        with self._lock:
            self._ended += 1
            if self._ended < 2:
                return False
        self.client.close()
        self.server.close()
        return True


class _Proxy:
    """The proxy's threads, in the proxy's process (see ``FaultProxy``)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        # Polled, so that closing needs no connection to wake the accepting thread.
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        # Seconds each reply is held before it is passed on.
        self._delay = 0.0
        # Replies still to swallow (each closes its connection: the client never learns
        # whether its command ran).
        self._swallow = 0
        self._swallowed = 0
        # New connections closed at once.
        self._refuse = False
        self._stopping = threading.Event()
        self._open: Set[_Connection] = set()
        self._threads: List[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._accepting.start()

    def delay(self, seconds: float) -> None:
        with self._lock:
            self._delay = seconds

    def swallow(self, replies: int) -> None:
        """The next ``replies`` replies (of any connection) are swallowed, each
        connection that had one closed."""
        with self._lock:
            self._swallow = replies

    def swallowed(self) -> int:
        with self._lock:
            return self._swallowed

    def reset_all(self) -> None:
        """Every open connection reset."""
        with self._lock:
            connections = list(self._open)
        for connection in connections:
            connection.shut()

    def refuse(self, on: bool) -> None:
        """New connections closed at once (and, when ``on``, the open ones reset)."""
        with self._lock:
            self._refuse = on
        if on:
            self.reset_all()

    def heal(self) -> None:
        """No fault from now on."""
        with self._lock:
            self._delay, self._swallow, self._refuse = 0.0, 0, False

    def close(self) -> None:
        self._stopping.set()
        self._accepting.join()
        self._listener.close()
        self.reset_all()
        for thread in self._threads:
            thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            with self._lock:
                refuse = self._refuse
            if refuse:
                _shut_and_close(client)
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:  # the server is down (restarting): the client sees it so
                _shut_and_close(client)
                continue
            server.settimeout(None)
            client.settimeout(None)
            for end in (client, server):
                end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._relay(_Connection(client, server))

    def _relay(self, connection: _Connection) -> None:
        """Copies each way in a thread of its own, the faults on the replies' way."""
        with self._lock:
            self._open.add(connection)
            # Threads of connections long closed are not kept.
            self._threads = [thread for thread in self._threads if thread.is_alive()]
        ways = (
            (connection.client, connection.server, False),
            (connection.server, connection.client, True),
        )
        for source, sink, replies in ways:
            thread = threading.Thread(
                target=self._copy,
                args=(connection, source, sink, replies),
                name="fault-proxy-copy",
                daemon=True,
            )
            with self._lock:
                self._threads.append(thread)
            thread.start()

    def _copy(
        self, connection: _Connection, source: socket.socket, sink: socket.socket, replies: bool
    ) -> None:
        """Copies ``source`` to ``sink`` until either closes; on the replies' way, each
        chunk (a reply, or a few) delayed or swallowed as the faults say."""
        try:
            while True:
                try:
                    chunk = source.recv(CHUNK)
                except OSError:
                    break
                if not chunk:
                    break
                if replies:
                    with self._lock:
                        delay = self._delay
                    if delay > 0:
                        time.sleep(delay)
                    with self._lock:
                        swallow = self._swallow > 0
                        if swallow:
                            self._swallow -= 1
                            self._swallowed += 1
                    if swallow:
                        break
                try:
                    sink.sendall(chunk)
                except OSError:
                    break
        finally:
            connection.shut()
            if connection.ended():
                with self._lock:
                    self._open.discard(connection)


def _shut_and_close(end: socket.socket) -> None:
    try:
        end.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    end.close()


def _serve(target: int, commands: Connection) -> None:
    """The proxy's process: a ``_Proxy``, told what to do over ``commands``."""
    proxy = _Proxy(target)
    commands.send(proxy.port)
    while True:
        try:
            name, arguments = commands.recv()
        except EOFError:
            name, arguments = "close", ()
        commands.send(getattr(proxy, name)(*arguments))
        if name == "close":
            return


class FaultProxy:
    """A proxy to the server on ``target`` (127.0.0.1); ``port`` is its own. A context
    manager: leaving it (or ``close``) resets every connection and stops the proxy's
    process."""

    def __init__(self, target: int) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a threaded process
        self._commands, theirs = context.Pipe()
        self._asking = threading.Lock()  # one command and its answer at a time
        self._process = context.Process(target=_serve, args=(target, theirs), daemon=True)
        self._process.start()
        self.port: int = self._commands.recv()

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(
        self,
        kind: Optional[Type[BaseException]],
        error: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        self.close()

    def _tell(self, name: str, *arguments: object) -> object:
        with self._asking:
            self._commands.send((name, arguments))
            return self._commands.recv()

    def delay(self, seconds: float) -> None:
        """Each reply held this long before it is passed on."""
        self._tell("delay", seconds)

    def swallow(self, replies: int) -> None:
        """The next ``replies`` replies (of any connection) are swallowed, each
        connection that had one closed."""
        self._tell("swallow", replies)

    @property
    def swallowed(self) -> int:
        """How many replies were swallowed so far."""
        return int(str(self._tell("swallowed")))

    def reset_all(self) -> None:
        """Every open connection reset."""
        self._tell("reset_all")

    def refuse(self, on: bool) -> None:
        """New connections closed at once (and, when ``on``, the open ones reset)."""
        self._tell("refuse", on)

    def heal(self) -> None:
        """No fault from now on."""
        self._tell("heal")

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._tell("close")
            except (EOFError, OSError):
                pass
        self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

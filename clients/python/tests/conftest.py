"""Real servers for the tests, started the way the Rust tests start them: the binary in
REDIS_SERVER (default redis-server), the module in QAG_MODULE (default the repository's
target/release/libqag.so), each on a free loopback port with a directory of its own,
killed and removed when the test ends, however it ends."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Union

import pytest
import redis
import redis.asyncio.retry
from redis.backoff import NoBackoff
from redis.retry import Retry

REPOSITORY = Path(__file__).resolve().parents[3]
MODULE = Path(os.environ.get("QAG_MODULE", REPOSITORY / "target/release/libqag.so"))
SERVER = os.environ.get("REDIS_SERVER", "redis-server")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples/fastapi_gateway.py"


def free_port() -> int:
    """A free loopback port whose cluster bus port (10000 higher) is free too."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port > 55535:
            continue
        try:
            with socket.socket() as bus:
                bus.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port


def retries(retry: Retry) -> int:
    """How often a Retry tries again (redis-py 5.0 has no ``get_retries``)."""
    return int(retry._retries)


def no_retry() -> Retry:
    """A client that fails within its timeout instead of retrying (the README's advice)."""
    return Retry(NoBackoff(), 0)


class Server:
    def __init__(
        self,
        with_module: bool = True,
        port: Optional[int] = None,
        directory: Optional[Path] = None,
        extra: Optional[List[str]] = None,
    ) -> None:
        assert not with_module or MODULE.exists(), f"{MODULE} is missing: cargo build --release"
        self.own_directory = directory is None
        self.directory = directory or Path(tempfile.mkdtemp(prefix="qag-py-"))
        # A port of our choosing may be taken between the probe and the server's bind
        # (an outgoing connection's ephemeral port, for one): then another is tried.
        for _attempt in range(5):
            self.port = port or free_port()
            if self.start(with_module, extra):
                return
            if port is not None:
                break
        raise AssertionError(f"{SERVER} could not listen on {self.port}: {self.log()}")

    def start(self, with_module: bool, extra: Optional[List[str]]) -> bool:
        """Starts the server on `self.port`; False when that port was taken."""
        args = [
            SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", "",
            "--logfile", str(self.directory / f"server-{self.port}.log"),
        ]  # fmt: skip
        if with_module:
            args += ["--loadmodule", str(MODULE)]
        args += extra or []
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                # Its own process, not another suite's server that took the port first,
                # and done loading its data (PING raises LOADING until then).
                client = redis.Redis(port=self.port)
                if client.info("server").get("process_id") == self.process.pid and client.ping():
                    return True
            except redis.exceptions.RedisError:
                pass
            if self.process.poll() is not None and "Address already in use" in self.log():
                return False
            assert self.process.poll() is None, f"{SERVER} exited: {self.log()}"
            assert time.monotonic() < deadline, f"{SERVER} did not start: {self.log()}"
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/"

    def client(self, **options: Any) -> "redis.Redis[bytes]":
        return redis.Redis(port=self.port, retry=no_retry(), **options)

    def async_client(self, **options: Any) -> "redis.asyncio.Redis[bytes]":
        retry = redis.asyncio.retry.Retry(NoBackoff(), 0)  # a blocking one makes redis-py 8 warn
        return redis.asyncio.Redis(port=self.port, retry=retry, **options)

    def log(self) -> str:
        path = self.directory / f"server-{self.port}.log"
        return path.read_text() if path.exists() else ""

    def shutdown(self) -> None:
        """SHUTDOWN, persisting what the configuration says, and wait for the exit."""
        try:
            redis.Redis(port=self.port).shutdown()
        except redis.exceptions.ConnectionError:
            pass
        self.process.wait(timeout=60)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture
def start_server() -> Iterator[Callable[..., Server]]:
    if os.environ.get("QAG_REDIS_URL"):
        pytest.skip("starts servers of its own (QAG_REDIS_URL is set)")
    started: List[Server] = []

    def start(**options: Any) -> Server:
        server = Server(**options)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


@pytest.fixture
def start_cluster(start_server: Callable[..., Server]) -> Callable[..., List[Server]]:
    """Three primaries (and a replica each with ``replicas=1``), the slots split among
    them in order; the primaries come first. ``with_module`` is one flag
    for every node or one per primary (its replica follows it)."""

    def start(
        with_module: Union[bool, List[bool]] = True,
        replicas: int = 0,
        node_timeout: int = 5000,
        extra: Optional[List[str]] = None,
    ) -> List[Server]:
        flags = with_module if isinstance(with_module, list) else [with_module] * 3
        nodes = [
            start_server(
                with_module=flags[n % 3],
                extra=["--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout),
                       "--cluster-config-file", f"nodes-{n}.conf", *(extra or [])],
            )  # fmt: skip
            for n in range(3 * (1 + replicas))
        ]
        form_cluster(nodes[:3], nodes[3:])
        deadline = time.monotonic() + 30
        for node in nodes:
            while not cluster_ready(node, len(nodes)):
                assert time.monotonic() < deadline, "the cluster never became ok"
                time.sleep(0.1)
        return nodes

    return start


def form_cluster(primaries: List[Server], replicas: List[Server]) -> None:
    """What ``redis-cli --cluster create`` and ``add-node --cluster-slave`` do, without
    their waits, which have no end: a handshake dropped on a loaded machine (it must
    finish within the node timeout) left ``add-node`` waiting forever. Here each node is
    introduced again until it knows every other, all within 30 s."""
    deadline = time.monotonic() + 30
    slots = 16384 // len(primaries)
    for n, primary in enumerate(primaries):
        last = 16383 if n + 1 == len(primaries) else (n + 1) * slots - 1
        primary.client().execute_command("CLUSTER", "ADDSLOTSRANGE", n * slots, last)
        primary.client().execute_command("CLUSTER", "SET-CONFIG-EPOCH", n + 1)
    nodes = primaries + replicas
    while True:
        strangers = [node for node in nodes[1:] if len(met(node)) < len(nodes)]
        if not strangers:
            break
        for node in strangers:
            node.client().execute_command("CLUSTER", "MEET", "127.0.0.1", primaries[0].port)
        assert time.monotonic() < deadline, "the nodes never met"
        time.sleep(0.5)
    for n, replica in enumerate(replicas):
        master = node_id(primaries[n % len(primaries)])
        while True:
            try:
                replica.client().execute_command("CLUSTER", "REPLICATE", master)
                break
            except redis.ResponseError:  # the primary not known to it yet
                assert time.monotonic() < deadline, "never a replica"
                time.sleep(0.1)


def met(node: Server) -> List[str]:
    """The nodes ``node`` knows, itself included (one still in handshake is not known
    yet: the handshake may be dropped)."""
    lines = node.client().execute_command("CLUSTER", "NODES").decode().splitlines()
    return [line for line in lines if "handshake" not in line]


def node_id(node: Server) -> str:
    return str(node.client().execute_command("CLUSTER", "MYID").decode())


def cluster_ready(node: Server, size: int) -> bool:
    """The cluster is ok, every node knows every other, and a replica is in sync."""
    client = node.client()
    if b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
        return False
    lines = met(node)
    if len(lines) != size or not all(" connected" in line for line in lines):
        return False
    role = client.info("replication")
    return role["role"] == "master" or role.get("master_link_status") == "up"


@contextmanager
def cores(exclusive: bool) -> Iterator[None]:
    """The machine's cores, shared by the suites CI runs side by side (the module's, the
    Rust client's, this one): a test that keeps every core busy on purpose holds them
    alone, a test that times the server holds them shared, so the two never run at once.
    A lock on the file the Rust harness's `Cores` locks."""
    path = os.path.join(tempfile.gettempdir(), "qag-test-cores.lock")
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def timing() -> Iterator[None]:
    """For a test that times the server: no test keeps the cores busy meanwhile."""
    with cores(exclusive=False):
        yield


@pytest.fixture
def failing_over() -> Iterator[None]:
    """For a test that fails a cluster's primary: its nodes must answer each other within
    their timeout, so no other failover (the Rust suite's too) runs meanwhile."""
    with cores(exclusive=True):
        yield


@pytest.fixture
def temp_directory() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="qag-py-data-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


class Blocking:
    """An AsyncLimiter seen through blocking calls (one event loop of its own), so a
    scenario is written once and run on both limiters."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self.limiter = self.loop.run_until_complete(self._make(make))

    @staticmethod
    async def _make(make: Callable[[], Any]) -> Any:
        return make()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.limiter, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.loop.run_until_complete(attribute(*args, **kwargs))

        return call

    def lease(self, *args: Any) -> "BlockingLease":
        return BlockingLease(self.loop, self.limiter.lease(*args))

    def reserve(self, *args: Any, **kwargs: Any) -> "BlockingReservation":
        return BlockingReservation(self.loop, self.limiter.reserve(*args, **kwargs))

    def idle(self, seconds: float) -> None:
        """Lets the limiter's tasks (renewals, background releases) run."""
        self.loop.run_until_complete(asyncio.sleep(seconds))

    def close(self) -> None:
        self.loop.run_until_complete(self.limiter.aclose())
        self.loop.close()


class BlockingLease:
    """An AsyncLease used with ``with``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, lease: Any) -> None:
        self.loop = loop
        self.lease = lease

    def __enter__(self) -> Any:
        return self.loop.run_until_complete(self.lease.__aenter__())

    def __exit__(self, *exc_info: Any) -> None:
        self.loop.run_until_complete(self.lease.__aexit__(*exc_info))


class BlockingReservation:
    """An AsyncReservation used with ``with``: its calls run on the limiter's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, hold: Any) -> None:
        self.loop = loop
        self.hold = hold

    def __enter__(self) -> "BlockingReservation":
        self.loop.run_until_complete(self.hold.__aenter__())
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.loop.run_until_complete(self.hold.__aexit__(*exc_info))

    def charge(self, tokens: int) -> int:
        return int(self.loop.run_until_complete(self.hold.charge(tokens)))

    def commit(self, actual: int) -> int:
        return int(self.loop.run_until_complete(self.hold.commit(actual)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hold, name)


def idle(limiter: Any, seconds: float) -> None:
    """Waits, letting an AsyncLimiter's tasks run meanwhile."""
    if isinstance(limiter, Blocking):
        limiter.idle(seconds)
    else:
        time.sleep(seconds)


@pytest.fixture
def stop() -> Iterator[Callable[[Server], None]]:
    """SIGSTOP for a server, continued (SIGCONT) when the test ends however it ends."""
    stopped: List[Server] = []

    def stop_server(server: Server) -> None:
        os.kill(server.process.pid, signal.SIGSTOP)
        stopped.append(server)

    yield stop_server
    for server in stopped:
        if server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGCONT)


@pytest.fixture(params=["sync", "async"])
def make_limiter(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """Builds a Limiter, or an AsyncLimiter behind Blocking, for a server."""
    from qag_client import AsyncLimiter, Limiter

    made: List[Blocking] = []

    def make(server: Server, client_options: Optional[dict] = None, **options: Any) -> Any:
        client_options = client_options or {}
        if request.param == "sync":
            return Limiter(server.client(**client_options), **options)
        blocking = Blocking(lambda: AsyncLimiter(server.async_client(**client_options), **options))
        made.append(blocking)
        return blocking

    yield make
    for blocking in made:
        blocking.close()


class Gateway:
    """examples/fastapi_gateway.py as a program (uvicorn inside) on ``server`` (or the
    Redis at a URL: a fault proxy's), its log (warnings: a 503, a quota add that failed)
    in ``log`` where given, killed by ``stop``."""

    def __init__(
        self, server: Union[Server, str], flags: List[str], log: Optional[Path] = None
    ) -> None:
        redis_url = server if isinstance(server, str) else server.url
        self.process = subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--redis", redis_url, "--listen", "127.0.0.1:0"] + flags,
            stdout=subprocess.PIPE,
            stderr=None if log is None else log.open("w"),
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.startswith("listening on "), f"the gateway said {line!r}"
        self.base = f"http://{line.strip().removeprefix('listening on ')}"

    def url(self, query: str) -> str:
        return f"{self.base}/v1/query?{query}"

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()

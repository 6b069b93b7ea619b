"""The Python example of docs/python-client.md is examples/gateway.py verbatim, it runs,
and its names limit one address across every key it uses by the address's own
bucket."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

from conftest import REPOSITORY, Server
from qag_client import Limiter

EXAMPLE = Path(__file__).resolve().parents[1] / "examples/gateway.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gateway_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_shows_the_example_verbatim() -> None:
    readme = (REPOSITORY / "docs" / "python-client.md").read_text()
    assert f"```python\n{EXAMPLE.read_text()}```\n" in readme


def test_the_example_runs(start_server: Callable[..., Server]) -> None:
    server = start_server()
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), server.url], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("200 [('x-ratelimit-limit', '20'), ('x-ratelimit-remaining', '19')")
    assert "('x-ratelimit-key-remaining', '99')" in lines[0]
    assert "('x-quota-remaining-calls', '99999')" in lines[0]
    assert lines[1].startswith("Counts(module=")
    raw = server.client()
    assert raw.hget("qag:quota:acme~partner", "rows") == b"250"
    assert raw.exists("qag:ratelimit:client:20/1:203.0.113.9")
    assert raw.exists("qag:ratelimit:key:100/60:acme~partner")


def test_one_address_across_several_keys_is_limited_by_its_own_bucket(
    start_server: Callable[..., Server],
) -> None:
    """The README's earlier names put the address's bucket under the key's hash tag: a
    bucket per (address, key), so 3 keys gave one address 3 times its limit."""
    gateway = load_example()
    server = start_server()
    limiter = Limiter(server.client())
    started = time.monotonic()
    statuses = [
        gateway.handle(limiter, "203.0.113.9", "acme", f"key{n % 3}", f"req-{n}")[0]
        for n in range(45)
    ]
    elapsed = time.monotonic() - started
    allowed = statuses.count(200)
    # 20 a second, and what refilled meanwhile.
    assert 20 <= allowed <= 20 + math.ceil(elapsed * 20), (allowed, elapsed)
    assert statuses.count(429) == 45 - allowed
    other = gateway.handle(limiter, "198.51.100.7", "acme", "key0", "req-other")
    assert other[0] == 200, "another address has a bucket of its own"
    limiter.close()


WAIT_DEMO = Path(__file__).resolve().parents[1] / "examples/wait_demo.py"


def test_the_wait_demo_shows_waiting_refuses_nothing(
    start_server: Callable[..., Server], timing: None
) -> None:
    """Forwarded as they come, the upstream refuses what is over its 10 a second; taken
    first, the gateway refuses instead and the upstream nothing; with a wait, nobody
    refuses and the upstream still serves its 10 a second."""
    server = start_server()
    run = subprocess.run(
        [
            sys.executable,
            str(WAIT_DEMO),
            "--redis",
            server.url,
            "--callers",
            "20",
            "--seconds",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    counts = {}
    for line in run.stdout.splitlines():
        found = re.match(
            r"(\w+): .* (\d+) served .* (\d+) refused by the gateway .* (\d+) refused by the "
            r"upstream",
            line,
        )
        assert found, line
        counts[found[1]] = tuple(int(n) for n in found.groups()[1:])
    served, gateway, upstream = counts["none"]
    assert served >= 30 and gateway == 0 and upstream > served, run.stdout
    served, gateway, upstream = counts["take"]
    assert served >= 1 and gateway > served and upstream == 0, run.stdout
    served, gateway, upstream = counts["wait"]
    assert served >= 25 and gateway == 0 and upstream == 0, run.stdout

"""The README's Python example is examples/gateway.py verbatim, and it runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

from conftest import REPOSITORY, Server

EXAMPLE = Path(__file__).resolve().parents[1] / "examples/gateway.py"


def test_the_readme_shows_the_example_verbatim() -> None:
    readme = (REPOSITORY / "README.md").read_text()
    assert f"```python\n{EXAMPLE.read_text()}```\n" in readme


def test_the_example_runs(start_server: Callable[..., Server]) -> None:
    server = start_server()
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), server.url], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == "200", run.stdout
    assert "'X-RateLimit-Key-Remaining': '59'" in lines[0]
    assert "'X-Quota-Remaining-Calls': '100000'" in lines[0]
    assert server.client().hget("qag:quota:acme", "rows") == b"250"

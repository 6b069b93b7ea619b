#!/usr/bin/env bash
# Installs what the tests need, builds the module, runs the unit tests once and the
# integration tests of the module, of the Rust client (qag-client) and of the Python
# client (qag_client, in .venv) on each server: Redis 7.0, Redis 8.2, Valkey 8.1 and
# Valkey 9.1 (scripts/servers.sh).
# With QAG_REDIS_URL set, the integration tests run once against that server instead.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh --servers
cargo build --release
# redis-cell, built from crates.io outside the tracked tree, for the differential tests.
QAG_CELL_MODULE=${QAG_CELL_MODULE:-$(scripts/redis-cell.sh)}
export QAG_CELL_MODULE
cargo test --package qag-core
python=$(scripts/python-env.sh)
python_oldest=$(scripts/python-env.sh redis==5.0.8)

failed=()
if [ -n "${QAG_REDIS_URL:-}" ]; then
  echo "== integration tests against $QAG_REDIS_URL"
  cargo test --no-fail-fast --package qag --package qag-client --features qag-client/tower --tests -- --show-output || failed+=("$QAG_REDIS_URL")
  "$python" -m pytest -q clients/python/tests || failed+=("$QAG_REDIS_URL (python)")
else
  while read -r name path; do
    echo "== integration tests on $name ($("$path" --version | cut -d' ' -f1-3))"
    REDIS_SERVER=$path cargo test --no-fail-fast --package qag --package qag-client --features qag-client/tower --tests -- --show-output || failed+=("$name")
    REDIS_SERVER=$path "$python" -m pytest -q clients/python/tests || failed+=("$name (python)")
  done < <(scripts/servers.sh)
  echo "== the Python client with the oldest redis-py it supports (5.0.8), on redis-7.0"
  "$python_oldest" -m pytest -q clients/python/tests || failed+=("redis-py 5.0.8")
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "test: FAILED on ${failed[*]}" >&2
  exit 1
fi
echo "test: all passed"

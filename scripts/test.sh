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

# The Rust suites (the module's and qag-client's) and the Python client's run side by
# side, each server after server: most of their time is spent waiting (failovers,
# expiries), not computing. Each line of output says which suite printed it.
cargo test --no-run --package qag --package qag-client --features qag-client/tower --tests
results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
rust_suites() {
  if [ -n "${QAG_REDIS_URL:-}" ]; then
    echo "== integration tests against $QAG_REDIS_URL"
    cargo test --no-fail-fast --package qag --package qag-client --features qag-client/tower --tests -- --show-output || echo "$QAG_REDIS_URL" >>"$results/failed"
    return
  fi
  while read -r name path; do
    echo "== integration tests on $name ($("$path" --version | cut -d' ' -f1-3))"
    REDIS_SERVER=$path cargo test --no-fail-fast --package qag --package qag-client --features qag-client/tower --tests -- --show-output || echo "$name" >>"$results/failed"
  done < <(scripts/servers.sh)
}
python_suites() {
  if [ -n "${QAG_REDIS_URL:-}" ]; then
    "$python" -m pytest -q -m "not cores" clients/python/tests || echo "$QAG_REDIS_URL (python)" >>"$results/failed"
    return
  fi
  while read -r name path; do
    echo "== the Python client on $name"
    REDIS_SERVER=$path "$python" -m pytest -q -m "not cores" clients/python/tests || echo "$name (python)" >>"$results/failed"
  done < <(scripts/servers.sh)
  echo "== the Python client with the oldest redis-py it supports (5.0.8), on redis-7.0"
  "$python_oldest" -m pytest -q -m "not cores" clients/python/tests || echo "redis-py 5.0.8" >>"$results/failed"
}
rust_suites 2>&1 | sed -u 's/^/[rust] /' &
rust=$!
python_suites 2>&1 | sed -u 's/^/[python] /' &
wait $rust
wait $!

# The tests that load the machine on purpose (a gateway's own load never read as an
# outage; hundreds of requests at once within every limit) run alone: beside the other
# suites the server itself would be starved, and their verdicts would be the machine's,
# not the clients'.
alone() {
  echo "== tests that load the machine, alone, on $1"
  cargo test --package qag-client --features qag-client/tower --test outages \
    -- --ignored --exact the_gateways_own_load_is_no_outage || echo "$1 (cores, rust)" >>"$results/failed"
  "$python" -m pytest -q -m cores clients/python/tests || echo "$1 (cores, python)" >>"$results/failed"
}
if [ -n "${QAG_REDIS_URL:-}" ]; then
  alone "$QAG_REDIS_URL"
else
  while read -r name path; do
    REDIS_SERVER=$path alone "$name"
  done < <(scripts/servers.sh)
  echo "== tests that load the machine, alone, with redis-py 5.0.8 on redis-7.0"
  "$python_oldest" -m pytest -q -m cores clients/python/tests || echo "redis-py 5.0.8 (cores)" >>"$results/failed"
fi

if [ -s "$results/failed" ]; then
  echo "test: FAILED on $(paste -sd, "$results/failed")" >&2
  exit 1
fi
echo "test: all passed"

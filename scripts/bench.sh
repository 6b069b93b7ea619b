#!/usr/bin/env bash
# The load benchmark: starts its own server with the module on loopback (Redis 8.2 by
# default; REDIS_SERVER picks another), measures every command beside INCR and the
# token-bucket script, prints a markdown table and writes it to target/bench/load.md.
# QAG_BENCH_RUNS (default 3) runs a row, the median reported; QAG_BENCH_CELL_MODULE
# adds a CL.THROTTLE row from a redis-cell module built elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --servers
cargo build --release
export REDIS_SERVER=${REDIS_SERVER:-$(scripts/servers.sh | awk '$1 == "redis-8.2" {print $2}')}
cargo bench --bench load

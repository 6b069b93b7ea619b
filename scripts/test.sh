#!/usr/bin/env bash
# Installs what the tests need, builds the module, runs the unit tests once and the
# integration tests of the module, of the Rust client (qag-client) and of the Python
# client (qag_client, in .venv) on each server: Redis 7.0, Redis 8.2, Valkey 8.1 and
# Valkey 9.1 (scripts/servers.sh); beside them, the module in containers
# (scripts/docker-test.sh: its images, their safe defaults, the suite against each,
# the topologies), where a Docker engine runs.
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

# The suites, one job a server: the Rust suites (the module's and qag-client's) and the
# Python client's (with the newest redis-py on each server, and with the oldest it
# supports, 5.0.8, on Redis 7.0), and the containers' (scripts/docker-test.sh). Most of
# their time is spent waiting (failovers, expiries), not computing: two jobs at once left
# the cores idle two thirds of the time, so QAG_TEST_JOBS (default 3) run at once (four
# kept them busy for minutes at a time: tests that time the server failed). Each line of
# output says which job printed it. Tests that time the server or load it on purpose
# coordinate across jobs through the cores' lock (tests/common/mod.rs, Cores).
cargo test --no-run --package qag --package qag-client --features qag-client/tower --tests
results=$(mktemp -d)
# The test servers' files (AOF, RDB, a cluster node's nodes.conf) in memory, where
# /dev/shm has room: a cluster node fsyncs nodes.conf on its main thread when a failover
# changes the cluster, and on a disk shared with the containers' builds (debootstrap's
# dpkg syncs every file) that can stall a healthy node past a client's deadline (one CI
# run saw a healthy shard's calls time out during a failover; beside a writing load,
# forming a cluster took 40 s longer). Both harnesses take TMPDIR, and lock the cores
# there. The containers' builds stay on the disk: a root file system needs exec and
# device files, which a tmpfs may forbid.
disk_tmp=${TMPDIR:-/tmp}
memory_tmp=
if [ -w /dev/shm ] && [ "$(df -Pk /dev/shm | awk 'NR == 2 { print $4 }')" -ge $((4 * 1024 * 1024)) ]; then
  memory_tmp=$(mktemp -d /dev/shm/qag-test.XXXXXX)
  export TMPDIR=$memory_tmp
fi
trap 'rm -rf "$results" ${memory_tmp:+"$memory_tmp"}' EXIT
run_job() { # kind name server
  case $1 in
  rust)
    if [ -n "${QAG_REDIS_URL:-}" ]; then
      echo "== integration tests against the server at QAG_REDIS_URL"
    else
      echo "== integration tests on $2 ($("$3" --version | cut -d' ' -f1-3))"
    fi
    REDIS_SERVER=$3 cargo test --no-fail-fast --package qag --package qag-client \
      --features qag-client/tower --tests -- --show-output
    ;;
  python)
    echo "== the Python client on $2"
    REDIS_SERVER=$3 "$python" -m pytest -q -m "not cores" clients/python/tests
    ;;
  python-oldest)
    echo "== the Python client with the oldest redis-py it supports (5.0.8), on $2"
    REDIS_SERVER=$3 "$python_oldest" -m pytest -q -m "not cores" clients/python/tests
    ;;
  docker)
    TMPDIR=$disk_tmp scripts/docker-test.sh
    ;;
  esac
}
jobs_list() { # the longest first, roughly
  if [ -n "${QAG_REDIS_URL:-}" ]; then
    # Named by the variable, not its value: a URL's password stays out of every line.
    echo "python QAG_REDIS_URL redis-server"
    echo "rust QAG_REDIS_URL redis-server"
    return
  fi
  local servers first
  servers=$(scripts/servers.sh)
  first=$(head -n1 <<<"$servers")
  echo "docker containers"
  echo "python-oldest $first"
  # A Python job and a Rust one by turns: each holds the cores alone for its failovers at
  # its own time (the Python suite early, the Rust one late), so jobs started together
  # wait less on each other than Python jobs started together would.
  while read -r name path; do
    echo "python $name $path"
    echo "rust $name $path"
  done <<<"$servers"
}
running=0
while read -r kind name path; do
  if [ "$running" -ge "${QAG_TEST_JOBS:-3}" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  { run_job "$kind" "$name" "$path" || echo "$kind $name" >>"$results/failed"; } 2>&1 |
    tee "$results/$kind-$name.log" | awk -v prefix="[$kind $name] " '{ print prefix $0; fflush() }' &
  running=$((running + 1))
done < <(jobs_list)
wait

# The tests that load the machine on purpose (a gateway's own load never read as an
# outage; hundreds of requests at once within every limit) run alone: beside the other
# suites the server itself would be starved, and their verdicts would be the machine's,
# not the clients'.
alone() {
  echo "== tests that load the machine, alone, on $1"
  cargo test --package qag-client --features qag-client/tower --test outages \
    -- --ignored --exact the_gateways_own_load_is_no_outage || echo "rust-alone $1" >>"$results/failed"
  "$python" -m pytest -q -m cores clients/python/tests || echo "python-alone $1" >>"$results/failed"
}
if [ -n "${QAG_REDIS_URL:-}" ]; then
  alone QAG_REDIS_URL
else
  while read -r name path; do
    REDIS_SERVER=$path alone "$name"
  done < <(scripts/servers.sh)
  echo "== tests that load the machine, alone, with redis-py 5.0.8 on redis-7.0"
  "$python_oldest" -m pytest -q -m cores clients/python/tests || echo "python-oldest-alone redis-7.0" >>"$results/failed"
fi

# What failed, again at the end: a CI log is often read from its tail, and the pool's
# lines are interleaved.
# Each failure's place and message, without tracebacks' code and backtraces' frames:
# one long backtrace pushed the other jobs' failures out of the tail CI shows.
what_failed() { # kind log
  case $1 in
  python | python-oldest)
    sed -n '/= \(ERRORS\|FAILURES\) =/,$p' "$2" | grep -E '^(_{3,} |E  |[^ ].*:[0-9]+: [A-Za-z]|FAILED |ERROR |[0-9]+ (passed|failed|error))' ;;
  rust)
    sed -n '/^failures:$/,/^test result: FAILED/p' "$2" | grep -vE '^ +([0-9]+: |at )' ;;
  *) tail -n 40 "$2" ;;
  esac | head -n 120
}
if [ -s "$results/failed" ]; then
  while read -r kind name; do
    if [ -f "$results/$kind-$name.log" ]; then
      echo "== what failed in $kind on $name"
      what_failed "$kind" "$results/$kind-$name.log"
    fi
  done <"$results/failed"
  echo "test: FAILED on $(paste -sd, "$results/failed")" >&2
  exit 1
fi
echo "test: all passed"

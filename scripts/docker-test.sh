#!/usr/bin/env bash
# The module in containers, on a machine with a Docker engine but no container registry.
#
#   scripts/docker-test.sh build   builds the base images without any registry (Debian 12
#                                  root file systems made with debootstrap, brought in
#                                  with docker import) and, from docker/Dockerfile, the
#                                  images qag:test-redis7, qag:test-redis8 and
#                                  qag:test-valkey8 (each listens on 6379 inside and
#                                  loads the module at start)
#   scripts/docker-test.sh suite   builds, then runs the integration tests against a
#                                  container of each image (published on 127.0.0.1 only)
#   scripts/docker-test.sh         the same as suite
#
# The root file systems are cached in QAG_DOCKER_CACHE (default ~/.cache/qag-docker);
# from nothing it takes a few minutes. The apt mirror is read from this machine's apt
# configuration. Containers, networks and volumes it makes carry the label qag-test and
# are removed when it ends, also on failure or Ctrl-C. On a machine without a Docker
# engine it says so in one line and does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v docker >/dev/null || ! docker info >/dev/null 2>&1; then
  echo "docker-test: no Docker engine on this machine; skipped"
  exit 0
fi

what=${1:-suite}
cache=${QAG_DOCKER_CACHE:-$HOME/.cache/qag-docker}
label=qag-test

cleanup() {
  local ids
  ids=$(docker ps -aq --filter "label=$label")
  [ -z "$ids" ] || docker rm -f $ids >/dev/null 2>&1 || true
  ids=$(docker network ls -q --filter "label=$label")
  [ -z "$ids" ] || docker network rm $ids >/dev/null 2>&1 || true
  ids=$(docker volume ls -q --filter "label=$label")
  [ -z "$ids" ] || docker volume rm $ids >/dev/null 2>&1 || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The Debian mirror this machine's apt uses for bookworm: deb822 sources first, then
# one-line ones.
debian_mirror() {
  local file
  for file in /etc/apt/sources.list.d/*.sources; do
    [ -f "$file" ] || continue
    awk '/^URIs:/ {uri = $2} /^Suites:/ && / bookworm( |$)/ {print uri; exit}' "$file"
  done | head -1 | grep . && return
  grep -hE '^deb .* bookworm( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
    awk '{print $2; exit}' | grep .
}

# A Debian 12 root file system with `packages` (comma-separated), as a cached tarball,
# imported as image `qag-base:$name`.
base_image() {
  local name=$1 packages=$2 tarball="$cache/$1.tar"
  if [ ! -f "$tarball" ]; then
    command -v debootstrap >/dev/null || {
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    }
    local mirror root
    mirror=$(debian_mirror) || { echo "docker-test: no bookworm mirror in the apt configuration" >&2; exit 1; }
    root=$(mktemp -d)
    echo "docker-test: debootstrap $name (bookworm${packages:+, $packages})"
    debootstrap --variant=minbase ${packages:+--include="$packages"} bookworm "$root" "$mirror" >"$cache/$name.log" 2>&1 ||
      { tail -20 "$cache/$name.log" >&2; rm -rf "$root"; exit 1; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    mkdir -p "$cache"
    tar -C "$root" -cf "$tarball.partial" . && mv "$tarball.partial" "$tarball"
    rm -rf "$root"
  fi
  docker image inspect "qag-base:$name" >/dev/null 2>&1 ||
    docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      "$tarball" "qag-base:$name" >/dev/null
}

# An image of `from` with one server binary added as /usr/local/bin/redis-server.
server_image() {
  local tag=$1 from=$2 binary=$3 dir
  dir=$(mktemp -d)
  cp "$binary" "$dir/server"
  printf 'FROM %s\nCOPY server /usr/local/bin/%s\n%s\n' "$from" "$(basename "$binary")" \
    "$([ "$(basename "$binary")" = redis-server ] || echo "RUN ln -s $(basename "$binary") /usr/local/bin/redis-server")" \
    >"$dir/Dockerfile"
  docker build -q -t "$tag" "$dir" >/dev/null
  rm -rf "$dir"
}

build() {
  mkdir -p "$cache"
  scripts/setup.sh --servers
  cargo build --release
  base_image redis7 redis-server,redis-tools,redis-sentinel
  base_image bookworm ""
  while read -r name path; do
    case $name in
      redis-8.2) server_image qag-base:redis8 qag-base:bookworm "$path" ;;
      valkey-8.1) server_image qag-base:valkey8 qag-base:bookworm "$path" ;;
    esac
  done < <(scripts/servers.sh)
  local image
  for image in redis7 redis8 valkey8; do
    echo "docker-test: building qag:test-$image from docker/Dockerfile"
    docker build -q -f docker/Dockerfile -t "qag:test-$image" --build-arg MODULE_SOURCE=host \
      --build-arg RUST_IMAGE=qag-base:bookworm --build-arg "REDIS_IMAGE=qag-base:$image" . >/dev/null
  done
  docker images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep '^qag:test-' | sed 's/^/docker-test: /'
}

# The integration tests against a container of each image, its port on 127.0.0.1.
suite() {
  local image failed=()
  for image in redis7 redis8 valkey8; do
    docker run -d --label "$label" --name "qag-test-$image-$$" -p 127.0.0.1::6379 "qag:test-$image" >/dev/null
    local port
    port=$(docker port "qag-test-$image-$$" 6379/tcp | head -1 | sed 's/.*://')
    for _ in $(seq 100); do
      redis-cli -p "$port" ping >/dev/null 2>&1 && break
      sleep 0.1
    done
    echo "== integration tests against qag:test-$image on 127.0.0.1:$port ($(redis-cli -p "$port" info server | grep -E '^(redis|valkey)_version' | tr -d '\r' | paste -sd ' '))"
    QAG_REDIS_URL="redis://127.0.0.1:$port/" cargo test --no-fail-fast --package qag --tests -- --show-output ||
      failed+=("$image")
    docker rm -f "qag-test-$image-$$" >/dev/null
  done
  if [ ${#failed[@]} -gt 0 ]; then
    echo "docker-test: FAILED against ${failed[*]}" >&2
    exit 1
  fi
}

case $what in
  build) build ;;
  suite) build && suite ;;
  *) echo "usage: scripts/docker-test.sh [build|suite]" >&2; exit 2 ;;
esac
echo "docker-test: all passed"

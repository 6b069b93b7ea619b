#!/usr/bin/env bash
# The module in containers, on a machine with a Docker engine but no container registry.
#
#   scripts/docker-test.sh build   builds the base images without any registry (Debian 12
#                                  root file systems made with debootstrap, brought in
#                                  with docker import) and, from docker/Dockerfile, the
#                                  images qag:test-redis7, qag:test-redis8,
#                                  qag:test-valkey8 and qag:test-valkey9 (each listens
#                                  on 6379 inside and loads the module at start)
#   scripts/docker-test.sh suite   builds, then checks each image's safe defaults (no
#                                  password: refused from outside the container's
#                                  loopback; a password or an ACL file: works; the
#                                  explicit opt-out; not root; healthy) and runs the
#                                  integration tests against a container of each with a
#                                  password (published on 127.0.0.1 only)
#   scripts/docker-test.sh topologies
#                                  builds, then runs the scenarios across containers on
#                                  private networks (Sentinel failover, cluster failover,
#                                  partition, AOF restart) with the client
#                                  examples/topology.rs inside the network, and prints
#                                  their numbers; QAG_TOPOLOGIES names a subset, e.g.
#                                  "partition redis7 1; aof_restart redis7"
#   scripts/docker-test.sh         all of it: build, suite, topologies
#
# The root file systems are cached in QAG_DOCKER_CACHE (default ~/.cache/qag-docker);
# from nothing it takes a few minutes. The apt mirror is read from this machine's apt
# configuration. Containers, networks and volumes it makes carry the label qag-test=<its
# pid> and are removed when it ends, also on failure or Ctrl-C. On a machine without a Docker
# engine it says so in one line and does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v docker >/dev/null || ! docker info >/dev/null 2>&1; then
  echo "docker-test: no Docker engine on this machine; skipped"
  exit 0
fi

what=${1:-all}
# The images built and tested: one per server of scripts/servers.sh.
images="redis7 redis8 valkey8 valkey9"
cache=${QAG_DOCKER_CACHE:-$HOME/.cache/qag-docker}
# Every container, network and volume of this run carries this label, so that it
# removes its own only (another run on the same machine keeps its).
label=qag-test=$$

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
  local name=$1 packages=$2
  # Named by its packages too, so a changed list makes a new one.
  local id
  id=$name-$(echo "$packages" | md5sum | cut -c1-8)
  local tarball="$cache/$id.tar"
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
  [ "$(docker image inspect -f '{{index .Config.Labels "qag.rootfs"}}' "qag-base:$name" 2>/dev/null)" = "$id" ] ||
    docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change "LABEL qag.rootfs=$id" "$tarball" "qag-base:$name" >/dev/null
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
  base_image bookworm redis-tools
  while read -r name path; do
    case $name in
      redis-8.2) server_image qag-base:redis8 qag-base:bookworm "$path" ;;
      valkey-8.1) server_image qag-base:valkey8 qag-base:bookworm "$path" ;;
      valkey-9.1) server_image qag-base:valkey9 qag-base:bookworm "$path" ;;
    esac
  done < <(scripts/servers.sh)
  local image
  for image in $images; do
    echo "docker-test: building qag:test-$image from docker/Dockerfile"
    docker build -q -f docker/Dockerfile -t "qag:test-$image" --build-arg MODULE_SOURCE=host \
      --build-arg RUST_IMAGE=qag-base:bookworm --build-arg "REDIS_IMAGE=qag-base:$image" . >/dev/null
  done
  # The topologies' client, run inside their networks.
  cargo build --release --example topology
  local dir
  dir=$(mktemp -d)
  cp target/release/examples/topology "$dir/topology"
  printf 'FROM qag-base:bookworm\nCOPY topology /usr/local/bin/topology\n' >"$dir/Dockerfile"
  docker build -q -t qag:test-client "$dir" >/dev/null
  rm -rf "$dir"
  docker images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep '^qag:test-' | sed 's/^/docker-test: /'
}

# Starts `name` from `image` with its port 6379 published on 127.0.0.1 and its health
# checked every second (the image's own check; its interval is 10 s); prints the port.
run_image() { # name image [docker run options...]
  local name=$1 image=$2
  shift 2
  docker run -d --label "$label" --name "$name" -p 127.0.0.1::6379 --health-interval 1s "$@" "$image" >/dev/null
  docker port "$name" 6379/tcp | head -1 | sed 's/.*://'
}

# Waits until the container's health check says healthy.
wait_healthy() { # name
  local status=""
  for _ in $(seq 300); do
    status=$(docker inspect -f '{{.State.Health.Status}}' "$1")
    [ "$status" = healthy ] && return 0
    [ "$(docker inspect -f '{{.State.Running}}' "$1")" = true ] || break
    sleep 0.1
  done
  echo "docker-test: $1 never turned healthy ($status):" >&2
  docker logs "$1" 2>&1 | tail -5 >&2
  return 1
}

# The image's safe defaults, each from the outside as a client would meet them.
defaults() { # image
  local image=$1 c port reply uid acl
  # No password: protected mode; outside the container's loopback (this host, through
  # the published port) every client is refused; inside (docker exec) it answers.
  c=qag-test-$image-open-$$
  port=$(run_image "$c" "qag:test-$image")
  wait_healthy "$c" || return 1
  reply=$(redis-cli -p "$port" ping 2>&1)
  case $reply in
    *DENIED*) ;;
    *) echo "docker-test: $image without a password answered from outside: $reply" >&2; return 1 ;;
  esac
  reply=$(docker exec "$c" redis-cli ping)
  [ "$reply" = PONG ] || { echo "docker-test: $image without a password, inside: $reply" >&2; return 1; }
  uid=$(docker exec "$c" grep '^Uid:' /proc/1/status | awk '{print $2}')
  [ "$uid" != 0 ] || { echo "docker-test: $image runs its server as root" >&2; return 1; }
  docker rm -f "$c" >/dev/null
  # The explicit opt-out: open to whoever reaches the port.
  c=qag-test-$image-optout-$$
  port=$(run_image "$c" "qag:test-$image" -e QAG_ALLOW_NO_PASSWORD=yes)
  wait_healthy "$c" || return 1
  reply=$(redis-cli -p "$port" QAG.TAKE qag:docker:optout 5 60 | paste -sd ' ')
  [ "$reply" = "1 4 0" ] || { echo "docker-test: $image with QAG_ALLOW_NO_PASSWORD=yes: $reply" >&2; return 1; }
  docker rm -f "$c" >/dev/null
  # A mounted ACL file: its users, and no one else.
  acl=$(mktemp)
  printf 'user default off\nuser gateway on >gateway-secret ~qag:* +@all\n' >"$acl"
  chmod 644 "$acl"
  c=qag-test-$image-acl-$$
  port=$(run_image "$c" "qag:test-$image" -v "$acl:/etc/qag/users.acl:ro")
  wait_healthy "$c" || { rm -f "$acl"; return 1; }
  reply=$(redis-cli -p "$port" QAG.TAKE qag:docker:acl 5 60 2>&1)
  case $reply in
    *NOAUTH*) ;;
    *) echo "docker-test: $image with an ACL file, no user: $reply" >&2; rm -f "$acl"; return 1 ;;
  esac
  reply=$(redis-cli -p "$port" --user gateway --pass gateway-secret --no-auth-warning QAG.TAKE qag:docker:acl 5 60 | paste -sd ' ')
  rm -f "$acl"
  [ "$reply" = "1 4 0" ] || { echo "docker-test: $image with an ACL file, its user: $reply" >&2; return 1; }
  docker rm -f "$c" >/dev/null
  echo "docker-test: $image: no password: DENIED from outside, PONG inside; opt-out: open; ACL file: its users only; server uid $uid; healthy each time"
}

# The integration tests against a container of each image, its port on 127.0.0.1, with a
# password; before them, the image's safe defaults.
suite() {
  local image failed=()
  for image in $images; do
    defaults "$image" || failed+=("$image (safe defaults)")
    local c=qag-test-$image-$$ port password reply
    password=qag-$RANDOM$RANDOM$RANDOM
    port=$(run_image "$c" "qag:test-$image" -e "QAG_PASSWORD=$password")
    wait_healthy "$c" || { failed+=("$image (health)"); continue; }
    reply=$(redis-cli -p "$port" ping 2>&1)
    case $reply in
      *NOAUTH*) ;;
      *) echo "docker-test: $image with a password answered without it: $reply" >&2; failed+=("$image (password)") ;;
    esac
    echo "== integration tests against qag:test-$image on 127.0.0.1:$port, with a password ($(REDISCLI_AUTH=$password redis-cli -p "$port" info server | grep -E '^(redis|valkey)_version' | tr -d '\r' | paste -sd ' '))"
    QAG_REDIS_URL="redis://:$password@127.0.0.1:$port/" cargo test --no-fail-fast --package qag --tests -- --show-output ||
      failed+=("$image")
    docker rm -f "$c" >/dev/null
  done
  if [ ${#failed[@]} -gt 0 ]; then
    echo "docker-test: FAILED against ${failed[*]}" >&2
    exit 1
  fi
}


# ---- Topologies: containers on a private network, the client inside it. ----

net=""
results=()

start() { # name image [server arguments...]
  local name=$1 image=$2
  shift 2
  # The qag images load the module themselves; on these private networks they are open
  # on purpose (the explicit opt-out), as the client and Sentinels use no password.
  docker run -d --label "$label" --network "$net" --network-alias "$name" --name "$net-$name" \
    -e QAG_ALLOW_NO_PASSWORD=yes "$image" "$@" >/dev/null
}
ip_of() { docker inspect -f "{{(index .NetworkSettings.Networks \"$net\").IPAddress}}" "$net-$1"; }
cli() { # name [port] -- redis-cli arguments, run inside that container
  local name=$1
  shift
  docker exec "$net-$name" redis-cli "$@"
}
wait_for() { # what seconds command...: polls until the command succeeds
  local what=$1 seconds=$2
  shift 2
  for _ in $(seq $((seconds * 10))); do
    "$@" >/dev/null 2>&1 && return
    sleep 0.1
  done
  echo "docker-test: timed out waiting for $what" >&2
  return 1
}
# Removes the last scenario's containers and networks, so that networks (and their
# address pools) do not pile up over a run.
end_scenario() {
  [ -n "$net" ] || return 0
  local ids
  ids=$(docker ps -aq --filter "label=$label" --filter "name=$net")
  [ -z "$ids" ] || docker rm -f $ids >/dev/null
  docker network ls -q --filter "label=$label" --filter "name=$net" | xargs -r docker network rm >/dev/null
  net=""
}
new_network() {
  end_scenario
  net=qag-topo-$$-$1
  docker network create --label "$label" "$net" >/dev/null
}
# Runs the client in the network with `args`; prints its result line.
client() {
  docker run --label "$label" --network "$net" --name "$net-client-$RANDOM" qag:test-client \
    topology "$@" | grep '^result:'
}

# Two replicas of `primary` and three Sentinels watching it; sets `sentinels` to their
# addresses.
replicas_and_sentinels() { # image
  local image=$1 primary_ip
  primary_ip=$(ip_of primary)
  for replica in replica1 replica2; do
    start "$replica" "qag:test-$image" --replicaof "$primary_ip" 6379
  done
  wait_for "two replicas" 30 sh -c "docker exec $net-primary redis-cli info replication | grep -q connected_slaves:2"
  sentinels=()
  for s in sentinel1 sentinel2 sentinel3; do
    start "$s" qag-base:redis7 sh -c "printf 'port 26379\nsentinel monitor qag $primary_ip 6379 2\nsentinel down-after-milliseconds qag 1000\nsentinel failover-timeout qag 10000\n' >/s.conf && exec redis-sentinel /s.conf"
    sentinels+=("$(ip_of "$s"):26379")
  done
  wait_for "the Sentinels to see each other and the replicas" 30 sh -c \
    "docker exec $net-sentinel1 redis-cli -p 26379 sentinel sentinels qag | grep -c '^name$' | grep -q 2 && docker exec $net-sentinel1 redis-cli -p 26379 sentinel replicas qag | grep -c '^name$' | grep -q 2"
}

# 1. Sentinel failover: a primary, two replicas, three Sentinels; the primary killed
#    under load. `wait`: replicas each call must reach before it counts.
sentinel_failover() { # image wait
  local image=$1 wait=$2
  new_network "sentinel-$image-$wait"
  start primary "qag:test-$image"
  wait_for "the primary" 20 cli primary ping
  replicas_and_sentinels "$image"
  local out
  out=$(mktemp)
  client --sentinels "$(IFS=,; echo "${sentinels[*]}")" --master qag --seconds 12 --wait-replicas "$wait" >"$out" &
  local load=$!
  sleep 4
  docker kill "$net-primary" >/dev/null
  finish "$load" "$out" "Sentinel failover, $image, WAIT $wait"
  [ "$wait" = 0 ] || expect_no_loss "${results[-1]}"
}

# 2. Cluster with replicas: 3 primaries and 3 replicas, one per container; the primary
#    serving the buckets' slot killed under load. Its replica takes over; the load goes
#    on from the replicated state, hash-tagged multi-key calls included, and a TAKE2 on
#    keys of two slots is still refused with CROSSSLOT.
cluster_failover() { # image
  local image=$1 n nodes=()
  new_network "cluster-$image"
  for n in 1 2 3 4 5 6; do
    start "node$n" "qag:test-$image" --cluster-enabled yes \
      --cluster-node-timeout 2000 --cluster-config-file /tmp/nodes.conf
  done
  for n in 1 2 3 4 5 6; do
    wait_for "node$n" 20 cli "node$n" ping
    nodes+=("$(ip_of "node$n"):6379")
  done
  timeout 60 docker exec "$net-node1" redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >/dev/null ||
    { echo "docker-test: FAILED: the cluster was not created in 60 s" >&2; exit 1; }
  wait_for "the cluster" 60 sh -c \
    "for n in 1 2 3 4 5 6; do docker exec $net-node\$n redis-cli cluster info | grep -q cluster_state:ok || exit 1; done"
  # A replica can take over only once it has synced with its primary.
  wait_for "the replicas to sync" 60 sh -c \
    "test \$(for n in 1 2 3 4 5 6; do docker exec $net-node\$n redis-cli info replication; done | grep -c master_link_status:up) = 3"
  local victim=""
  for n in 1 2 3 4 5 6; do
    if [ "$(cli "node$n" role | head -1)" = master ] && ! cli "node$n" get 'qag:topo:{b}:0' | grep -q MOVED; then
      victim=node$n
    fi
  done
  [ -n "$victim" ] || { echo "docker-test: no primary found for the buckets' slot" >&2; exit 1; }
  local out
  out=$(mktemp)
  client --cluster "$(IFS=,; echo "${nodes[*]}")" --seconds 14 >"$out" &
  local load=$!
  sleep 4
  docker kill "$net-$victim" >/dev/null
  finish "$load" "$out" "cluster, $image, the buckets' primary killed"
  case "${results[-1]} " in
    *" crossslot_refused=1 "*) ;;
    *) echo "docker-test: FAILED: a TAKE2 across slots was not refused with CROSSSLOT" >&2; exit 1 ;;
  esac
}

# 3. Partition: the primary cut off from its replicas and Sentinels, with a client
#    beside it on a second network, then joined again (Sentinel makes it a replica of
#    the new primary). `min_replicas`: its min-replicas-to-write, 0 for none.
partition() { # image min_replicas
  local image=$1 min=$2
  # A subnet of its own, so the primary rejoins with the address the Sentinels know:
  # the first free one of a few candidates (Docker refuses one that overlaps a pool).
  end_scenario
  net=qag-topo-$$-partition-$image-$min
  local second third created=""
  for second in 31 30 29 28 27; do
    for third in $(seq $(( $$ % 200 + 10 )) 8 250); do
      if docker network create --label "$label" --subnet "172.$second.$third.0/24" "$net" >/dev/null 2>&1; then
        created=yes
        break 2
      fi
    done
  done
  [ -n "$created" ] || { echo "docker-test: FAILED: no free subnet for the partition network" >&2; exit 1; }
  local side=$net-side
  docker network create --label "$label" "$side" >/dev/null
  local extra=()
  # A lag of 2 s: replicas acknowledge once a second, so 1 s refuses now and then even
  # with both replicas linked.
  [ "$min" = 0 ] || extra=(--min-replicas-to-write "$min" --min-replicas-max-lag 2)
  start primary "qag:test-$image" "${extra[@]}"
  docker network connect --alias primary-side "$side" "$net-primary"
  wait_for "the primary" 20 cli primary ping
  local primary_ip
  primary_ip=$(ip_of primary)
  replicas_and_sentinels "$image"
  local out name=$net-client-$RANDOM
  out=$(mktemp)
  docker create --label "$label" --network "$side" --name "$name" qag:test-client topology \
    --server primary-side:6379 --verify-sentinels "$(IFS=,; echo "${sentinels[*]}")" --master qag \
    --seconds 20 >/dev/null
  docker network connect "$net" "$name"
  docker start -a "$name" | grep '^result:' >"$out" &
  local load=$!
  # The quota's count on the primary itself (docker exec reaches it cut off or not)
  # tells how many rounds it accepted while isolated: one QUOTA.ADD a round.
  local quota='qag:topo:{q}:quota' at_cut at_join
  sleep 3
  at_cut=$(cli primary hget "$quota" calls)
  docker network disconnect "$net" "$net-primary"
  sleep 5
  at_join=$(cli primary hget "$quota" calls)
  docker network connect --ip "$primary_ip" --alias primary "$net" "$net-primary"
  finish "$load" "$out" "partition, $image, min-replicas-to-write $min"
  results[-1]+=" isolated_primary_accepted_rounds=$((at_join - at_cut)) then_rejoined_as=$(cli primary role | head -1)"
  [ "$(docker inspect -f '{{.State.Running}}' "$net-primary")" = true ] ||
    { echo "docker-test: FAILED: the isolated primary is not running" >&2; exit 1; }
  if [ "$min" != 0 ]; then
    case "${results[-1]}" in
      *" refused_noreplicas=0 "*) echo "docker-test: FAILED: no NOREPLICAS refusal while isolated" >&2; exit 1 ;;
    esac
  fi
}

# 4. Restart with persistence: AOF with appendfsync always on a volume, the server
#    killed with SIGKILL under load and started again.
aof_restart() { # image
  local image=$1
  new_network "aof-$image"
  local volume=$net-data
  docker volume create --label "$label" "$volume" >/dev/null
  docker run -d --label "$label" --network "$net" --network-alias primary --name "$net-primary" \
    -e QAG_ALLOW_NO_PASSWORD=yes -v "$volume:/data" "qag:test-$image" --appendonly yes --appendfsync always --dir /data >/dev/null
  wait_for "the server" 20 cli primary ping
  local out
  out=$(mktemp)
  client --server primary:6379 --seconds 10 >"$out" &
  local load=$!
  sleep 3
  docker kill --signal KILL "$net-primary" >/dev/null
  sleep 1
  docker start "$net-primary" >/dev/null
  finish "$load" "$out" "AOF always, SIGKILL and restart, $image"
  expect_no_loss "${results[-1]}"
}

finish() { # client-pid output-file scenario: waits for the client, records its result
  local load=$1 out=$2 scenario=$3
  if ! wait "$load" || ! grep -q '^result:' "$out"; then
    echo "docker-test: FAILED: $scenario: the client did not finish" >&2
    docker ps -a --filter "label=$label" --filter "name=$net-client" -q | xargs -r docker logs 2>&1 | tail -20 >&2
    exit 1
  fi
  report "$scenario" "$(grep '^result:' "$out")"
  rm -f "$out"
}

report() { # scenario result-line
  echo "docker-test: $1: ${2#result: }"
  results+=("$1: ${2#result: }")
}
expect_no_loss() { # result
  case "$1 " in
    *" lost_calls=0 "*) ;;
    *) echo "docker-test: FAILED: acknowledged calls lost: $1" >&2; exit 1 ;;
  esac
}

topologies() {
  local image
  if [ -n "${QAG_TOPOLOGIES:-}" ]; then
    # Only these scenarios, e.g. "partition redis7 1; aof_restart redis7".
    eval "$QAG_TOPOLOGIES"
    end_scenario
    printf 'docker-test:   %s\n' "${results[@]}"
    return
  fi
  for image in redis7 valkey8; do
    sentinel_failover "$image" 0
    sentinel_failover "$image" 1
    cluster_failover "$image"
  done
  partition redis7 0
  partition redis7 1
  aof_restart redis7
  end_scenario
  echo "docker-test: topology results"
  printf 'docker-test:   %s\n' "${results[@]}"
}

case $what in
  build) build ;;
  suite) build && suite ;;
  topologies) build && topologies ;;
  all) build && suite && topologies ;;
  *) echo "usage: scripts/docker-test.sh [build|suite|topologies|all]" >&2; exit 2 ;;
esac
echo "docker-test: all passed"

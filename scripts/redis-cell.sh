#!/usr/bin/env bash
# Builds redis-cell 0.2.2 (the only version on crates.io) from its crates.io source,
# under target/redis-cell/ (ignored by git: none of its code is in this repository), for
# the differential test of QAG.THROTTLE and the load benchmark's CL.THROTTLE rows.
# Prints the path of the module it built; builds once.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.2.2
dir=$PWD/target/redis-cell
module=$dir/build/target/release/libredis_cell.so
if [ ! -f "$module" ]; then
  mkdir -p "$dir/fetch/src"
  cat > "$dir/fetch/Cargo.toml" <<TOML
[package]
name = "fetch-redis-cell"
version = "0.0.0"
edition = "2021"
publish = false
[dependencies]
redis-cell = "=$VERSION"
[workspace]
TOML
  : > "$dir/fetch/src/lib.rs"
  # Where cargo unpacked the crate's source, from its own metadata.
  source=$(cargo metadata --quiet --format-version 1 --manifest-path "$dir/fetch/Cargo.toml" |
    python3 -c 'import json, sys
meta = json.load(sys.stdin)
print(next(p["manifest_path"] for p in meta["packages"] if p["name"] == "redis-cell"))')
  rm -rf "$dir/build" && cp -r "$(dirname "$source")" "$dir/build"
  # A workspace of its own: it sits below this repository's.
  printf '\n[workspace]\n' >> "$dir/build/Cargo.toml"
  echo "redis-cell.sh: building redis-cell $VERSION from crates.io" >&2
  if ! (cd "$dir/build" && CARGO_TARGET_DIR="$dir/build/target" cargo build --release) >"$dir/build.log" 2>&1; then
    tail -30 "$dir/build.log" >&2
    exit 1
  fi
fi
echo "$module"

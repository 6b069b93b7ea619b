#!/usr/bin/env bash
# Instructions per call, counted by callgrind on the whole server (issue 22): builds the
# module (release), then runs Redis 7.0 (Debian's redis-server) and Redis 8.2 (the binary
# of scripts/servers.sh) one after the other under valgrind --tool=callgrind on a free
# loopback port with the module loaded, and for every command family and the plain
# commands that do its data work (its floor) counts the whole server's instructions per
# call, serverCron subtracted, over 20,000 pipelined calls on random keys of 100,000
# warmed by the command itself, or over 20,000 calls that create keys.
# See scripts/instructions.py for the method, docs/instructions.md for the results.
#
# Environment:
#   QAG_CELL_MODULE  a redis-cell module (.so) to load beside qag for the CL.THROTTLE rows;
#                    unset: scripts/redis-cell.sh builds 0.2.2 from crates.io under
#                    target/redis-cell/ (never in the tracked tree); "none": no such rows.
#   QAG_CELL_LABEL   how its rows are labelled (default "redis-cell 0.2.2" when built here,
#                    else "redis-cell").
#   QAG_CELL_MODULE_2, QAG_CELL_LABEL_2  a second redis-cell build (e.g. 0.5.0): its
#                    CL.THROTTLE rows are added from a run of their own.
#   QAG_INSTR_SERVERS  which servers (default "redis-7.0 redis-8.2").
#   QAG_INSTR_ONLY   comma-separated command names: only those rows.
#   QAG_INSTR_OUT    output directory (default target/instructions).
# Writes $QAG_INSTR_OUT/instructions.csv (raw figures) and instructions.md (the table).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh --servers
cargo build --release
module=$PWD/target/release/libqag.so

out=${QAG_INSTR_OUT:-target/instructions}
mkdir -p "$out"
rm -f "$out/instructions.csv"
rm -rf "$out/work"

servers=()
for name in ${QAG_INSTR_SERVERS:-redis-7.0 redis-8.2}; do
  path=$(scripts/servers.sh | awk -v n="$name" '$1 == n {print $2}')
  [ -x "$path" ] || { echo "instructions.sh: no server $name" >&2; exit 1; }
  servers+=("$name=$path")
done

cell=${QAG_CELL_MODULE:-}
label=${QAG_CELL_LABEL:-redis-cell}
if [ -z "$cell" ]; then
  cell=$(scripts/redis-cell.sh)
  label=${QAG_CELL_LABEL:-redis-cell 0.2.2}
elif [ "$cell" = none ]; then
  cell=
fi

start=$(date +%s)
QAG_CELL_MODULE=$cell QAG_CELL_LABEL=$label \
  python3 scripts/instructions.py "$out/instructions.csv" "$module" "${servers[@]}"
if [ -n "${QAG_CELL_MODULE_2:-}" ]; then
  QAG_CELL_MODULE=$QAG_CELL_MODULE_2 QAG_CELL_LABEL=${QAG_CELL_LABEL_2:-redis-cell (2)} \
    QAG_INSTR_ONLY=CL.THROTTLE \
    python3 scripts/instructions.py "$out/instructions.csv" "$module" "${servers[@]}"
fi
echo
python3 scripts/instructions-table.py "$out/instructions.csv" "$out/instructions.md"
echo
echo "instructions.sh: $(( $(date +%s) - start )) s; $out/instructions.csv, $out/instructions.md"

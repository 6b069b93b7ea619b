#!/usr/bin/env bash
# Makes (or refreshes) .venv: the Python client (clients/python) installed from its
# directory as a user installs it (a built package, so its copy of the script is the
# one tested), with pytest, black and mypy. Prints the environment's python.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv >&2
fi
.venv/bin/python -m pip install --quiet --upgrade pip >&2
.venv/bin/python -m pip install --quiet "redis>=5" "pytest>=7" black mypy >&2
# setuptools keeps build/ between builds: a stale copy of a removed file would be packed.
rm -rf clients/python/build
.venv/bin/python -m pip install --quiet --force-reinstall --no-deps ./clients/python >&2
echo "$PWD/.venv/bin/python"
